//! The in-process communicator: collectives, failure behaviour, Adasum against its formula,
//! and data-parallel gradient averaging of a Burn module.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use burn_ort_dist::{
    Communicator, DataParallel, DistError, ReduceOp, Reduction, ThreadCommunicator,
    check_collectives, run_threads,
};

fn on_threads<T: Send>(
    world: usize,
    f: impl Fn(Arc<dyn Communicator>) -> Result<T, String> + Sync,
) -> Vec<Result<T, String>> {
    run_threads(world, Duration::from_secs(20), f)
}

#[test]
fn collectives_on_four_threads() {
    let results = on_threads(4, |c| {
        let r = c.rank() as f32;
        let mut sum = vec![r, 10.0 * r];
        c.all_reduce(&mut sum, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let mut mean = vec![r, 1.0];
        c.all_reduce(&mut mean, ReduceOp::Mean)
            .map_err(|e| e.to_string())?;
        let mut b = vec![r; 3];
        c.broadcast(&mut b, 2).map_err(|e| e.to_string())?;
        let mut g = vec![0.0; 8];
        c.all_gather(&[r, -r], &mut g).map_err(|e| e.to_string())?;
        let mut rs = vec![0.0; 2];
        c.reduce_scatter(
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
            &mut rs,
            ReduceOp::Sum,
        )
        .map_err(|e| e.to_string())?;
        c.barrier().map_err(|e| e.to_string())?;
        Ok((sum, mean, b, g, rs))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (sum, mean, b, g, rs) = r.unwrap();
        assert_eq!(sum, vec![6.0, 60.0]);
        assert_eq!(mean, vec![1.5, 1.0]);
        assert_eq!(b, vec![2.0; 3]);
        assert_eq!(g, vec![0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0]);
        let k = 2 * rank;
        assert_eq!(rs, vec![4.0 * (k + 1) as f32, 4.0 * (k + 2) as f32]);
    }
}

#[test]
fn mismatched_buffers_are_an_error_on_every_rank() {
    let results = on_threads(2, |c| {
        let mut buf = vec![0.0; 3 + c.rank()];
        c.all_reduce(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string())
    });
    assert!(results.iter().all(Result::is_err), "{results:?}");
}

#[test]
fn a_failing_rank_ends_the_others_quickly() {
    let start = Instant::now();
    let results = on_threads::<()>(3, |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(100));
            panic!("rank 1 dies");
        }
        let mut buf = vec![1.0; 4];
        loop {
            c.all_reduce(&mut buf, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
        }
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    assert!(results[1].as_ref().unwrap_err().contains("panicked"));
    for r in [&results[0], &results[2]] {
        let e = r.as_ref().unwrap_err();
        assert!(e.contains("rank 1"), "{e}");
    }
}

#[test]
fn a_silent_rank_times_out_naming_the_operation_the_group_and_the_rank() {
    let mut comms = ThreadCommunicator::group(3, Duration::from_millis(200));
    let silent = comms.pop().unwrap();
    let start = Instant::now();
    let errors: Vec<DistError> = std::thread::scope(|s| {
        let waits: Vec<_> = comms
            .iter()
            .map(|c| s.spawn(move || c.all_reduce(&mut [1.0; 4], ReduceOp::Sum).unwrap_err()))
            .collect();
        waits.into_iter().map(|w| w.join().unwrap()).collect()
    });
    // The first rank to give up names the operation and the absent rank; the other learns
    // of it through the broken group.
    let timed_out: Vec<_> = errors
        .iter()
        .filter(|e| matches!(e, DistError::Timeout { .. }))
        .collect();
    assert!(!timed_out.is_empty(), "{errors:?}");
    for e in &errors {
        let msg = e.to_string();
        assert!(
            msg.contains(
                "all_reduce of 16 B in the group of world ranks [0, 1, 2]: no answer within"
            ),
            "{msg}"
        );
        assert!(msg.contains("never arrived: world rank(s) [2]"), "{msg}");
    }
    assert!(
        start.elapsed() >= Duration::from_millis(200) && start.elapsed() < Duration::from_secs(5)
    );
    drop(silent);
}

#[test]
fn a_receive_from_a_silent_rank_names_it() {
    let mut comms = ThreadCommunicator::group(2, Duration::from_millis(100));
    let silent = comms.pop().unwrap();
    let c = comms.pop().unwrap();
    let err = c.recv(&mut [0.0; 3], 1).unwrap_err();
    assert!(
        err.to_string()
            .contains("receive from world rank 1 of 12 B")
            && err.to_string().contains("never arrived: world rank(s) [1]"),
        "{err}"
    );
    drop(silent);
}

/// Adasum of two ranks against the formula of Maleki et al., written out here.
#[test]
fn adasum_on_two_ranks_matches_the_formula() {
    let g = [vec![1.0f32, 2.0, -1.0, 0.5], vec![0.5f32, -1.0, 3.0, 2.0]];
    let (a, b) = (&g[0], &g[1]);
    let dot = 1.0 * 0.5 + 2.0 * -1.0 + -1.0 * 3.0 + 0.5 * 2.0; // -3.5
    let (aa, bb) = (1.0 + 4.0 + 1.0 + 0.25, 0.25 + 1.0 + 9.0 + 4.0); // 6.25, 14.25
    let want: Vec<f32> = (0..4)
        .map(|i| {
            ((1.0 - dot / (2.0 * aa)) * a[i] as f64 + (1.0 - dot / (2.0 * bb)) * b[i] as f64) as f32
        })
        .collect();

    let device = Device::flex().autodiff();
    let results = on_threads(2, |c| {
        let w: Param<Tensor<1>> = Param::from_tensor(Tensor::from_data(
            TensorData::new(vec![0f32; 4], vec![4]),
            &device,
        ));
        let mut grads = GradientsParams::new();
        grads.register(
            w.id,
            Tensor::<1>::from_data(TensorData::new(g[c.rank()].clone(), vec![4]), &device),
        );
        let module = vec![w];
        DataParallel::new(c)
            .with_reduction(Reduction::Adasum)
            .sync(&module, &mut grads)
            .map_err(|e| e.to_string())?;
        let t: Tensor<1> = grads.get(module[0].id).unwrap();
        Ok(t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap())
    });
    for r in results {
        let got = r.unwrap();
        for (x, y) in got.iter().zip(&want) {
            assert!((x - y).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }
}

/// Averaging a real Burn module's gradients: each rank's gradient of `sum(w * x_rank)` is
/// `x_rank`, so the synchronised gradient must be the mean of the ranks' inputs, also with
/// buckets smaller than one tensor. Parameters are first broadcast from rank 0.
#[test]
fn data_parallel_averages_module_gradients_and_broadcasts_parameters() {
    #[derive(Module, Debug)]
    struct Net {
        w: Param<Tensor<2>>,
        b: Param<Tensor<1>>,
    }
    let device = Device::flex().autodiff();
    let results = on_threads(3, |c| {
        let r = c.rank() as f32;
        let net = Net {
            w: Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![r; 6], vec![2, 3]),
                &device,
            )),
            b: Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![r; 2], vec![2]),
                &device,
            )),
        };
        let ddp = DataParallel::new(c).with_bucket_bytes(16);
        let net = ddp.broadcast_parameters(net).map_err(|e| e.to_string())?;
        let x: Tensor<2> = Tensor::from_data(
            TensorData::new(
                (0..6).map(|i| i as f32 * (r + 1.0)).collect::<Vec<_>>(),
                vec![2, 3],
            ),
            &device,
        );
        let loss = (net.w.val() * x).sum() + net.b.val().sum().mul_scalar(r);
        let mut grads = GradientsParams::from_grads(loss.backward(), &net);
        ddp.sync(&net, &mut grads).map_err(|e| e.to_string())?;
        let gw: Tensor<2> = grads.get(net.w.id).unwrap();
        let gb: Tensor<1> = grads.get(net.b.id).unwrap();
        let wv = net
            .w
            .val()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap();
        Ok((
            gw.into_data().convert::<f32>().try_to_vec::<f32>().unwrap(),
            gb.into_data().convert::<f32>().try_to_vec::<f32>().unwrap(),
            wv,
        ))
    });
    for r in results {
        let (gw, gb, w) = r.unwrap();
        let want_w: Vec<f32> = (0..6).map(|i| i as f32 * (1.0 + 2.0 + 3.0) / 3.0).collect();
        assert_eq!(gw, want_w);
        assert_eq!(gb, vec![1.0, 1.0]); // mean of ranks 0, 1, 2
        assert_eq!(w, vec![0.0; 6], "rank 0's weights everywhere");
    }
}

#[test]
fn mismatched_configs_are_detected() {
    let results = on_threads(2, |c| {
        let ddp = DataParallel::new(c.clone());
        ddp.check_consistent(b"same").map_err(|e| e.to_string())?;
        ddp.check_consistent(if c.rank() == 0 {
            b"batch=4"
        } else {
            b"batch=8"
        })
        .map_err(|e| e.to_string())
    });
    for r in &results {
        assert!(
            r.as_ref()
                .unwrap_err()
                .contains("rank 1 runs a different configuration"),
            "{results:?}"
        );
    }
}

#[test]
fn every_operation_checks_out_on_one_to_five_threads() {
    for world in 1..=5 {
        for r in on_threads(world, |c| check_collectives(c.as_ref())) {
            r.unwrap_or_else(|e| panic!("{world} ranks: {e}"));
        }
    }
}

#[test]
fn a_finished_rank_fails_only_what_needs_it() {
    let results = on_threads(3, |c| match c.rank() {
        // Finishes at once.
        0 => Ok(()),
        1 => {
            std::thread::sleep(Duration::from_millis(100));
            c.send(&[1.0], 2).map_err(|e| e.to_string())?;
            match c.recv(&mut [0.0], 0) {
                Err(e) if e.to_string().contains("rank 0 left the group") => Ok(()),
                other => Err(format!("a receive from the finished rank 0 gave {other:?}")),
            }
        }
        _ => {
            let mut b = [0.0];
            c.recv(&mut b, 1).map_err(|e| e.to_string())?;
            assert_eq!(b, [1.0]);
            Ok(())
        }
    });
    for (r, result) in results.iter().enumerate() {
        assert!(result.is_ok(), "rank {r}: {result:?}");
    }
}

#[test]
fn bandwidth_rows_cover_every_collective_and_size_with_nccl_tests_factors() {
    use burn_ort_dist::comm::bandwidth::{Collective, measure, sizes};
    // Sizes divide among 3 ranks (multiples of 12 bytes), doubling from 8 to 4 KiB.
    let wanted = sizes(8, 4096, 3);
    assert_eq!(wanted[..3], [12, 24, 36]);
    assert!(wanted.iter().all(|b| b % 12 == 0) && *wanted.last().unwrap() == 4104);
    let results = on_threads(3, |comm| {
        measure(comm.as_ref(), &wanted, 3).map_err(|e| e.to_string())
    });
    let rows = results[0].as_ref().unwrap();
    assert_eq!(rows.len(), 4 * wanted.len());
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r.collective, Collective::HOST[i / wanted.len()]);
        assert_eq!((r.bytes, r.ranks), (wanted[i % wanted.len()], 3));
        assert!(r.seconds > 0.0 && r.alg_bw() > 0.0);
        // nccl-tests' bus factors over 3 ranks: 4/3 all-reduce, 2/3 gathers, 1 broadcast.
        let factor = [4.0 / 3.0, 2.0 / 3.0, 2.0 / 3.0, 1.0][i / wanted.len()];
        assert!((r.bus_bw() / r.alg_bw() - factor).abs() < 1e-12);
    }
}
