//! Gradients as f16 on the wire (`fp16_wire`) on 1 to 5 thread ranks, against sums in f64:
//! within f16's rounding (one rounding per ring hop, relative to the largest value),
//! bit-identical on every rank, exact where f16 holds the sums exactly, inf/NaN passed
//! through, and half the values of the f32 ring on the wire.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use burn_ort_dist::comm::fp16_wire::{self, Fp16ReduceScatter};
use burn_ort_dist::{Communicator, DistResult, Forwarding, ReduceOp, run_threads};

fn on_threads<T: Send>(
    world: usize,
    f: impl Fn(Arc<dyn Communicator>) -> Result<T, String> + Sync,
) -> Vec<T> {
    let results = run_threads(world, Duration::from_secs(20), f);
    let errors: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(errors.is_empty(), "{errors:?}");
    results.into_iter().map(|r| r.unwrap()).collect()
}

/// Rank `r`'s values: magnitudes spread over 2^-12..2^4 with both signs.
fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let k = (i * 7 + rank * 13) % 17;
            let sign = if (i + rank).is_multiple_of(3) {
                -1.0
            } else {
                1.0
            };
            sign * 2f32.powi(k as i32 - 12) * (1.0 + ((i * 31 + rank) % 97) as f32 / 97.0)
        })
        .collect()
}

fn mean_f64(world: usize, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| (0..world).map(|r| f64::from(values(r, n)[i])).sum::<f64>() / world as f64)
        .collect()
}

/// f16 rounds to 2^-11 relative: each value once as it enters the ring (`world * max` in
/// all) and each of the `world - 1` partial sums (at most `world * max` each) once per hop,
/// so the sum errs by at most `2^-11 * world^2 * max`, the mean by `2^-11 * world * max`.
fn bound(world: usize, max: f64) -> f64 {
    2f64.powi(-11) * world as f64 * max
}

#[test]
fn all_reduce_mean_is_within_f16_rounding_and_identical_on_every_rank() {
    for world in 1..=5 {
        for n in [1, 2, 7, 1000, 4099] {
            let got = on_threads(world, |c| {
                let mut buf = values(c.rank(), n);
                fp16_wire::all_reduce(c.as_ref(), &mut buf, ReduceOp::Mean)
                    .map_err(|e| e.to_string())?;
                Ok(buf)
            });
            let want = mean_f64(world, n);
            let max = (0..world)
                .flat_map(|r| values(r, n))
                .fold(0.0f64, |m, x| m.max(f64::from(x.abs())));
            for r in 1..world {
                assert_eq!(
                    got[r], got[0],
                    "world {world}, n {n}: rank {r} differs from rank 0"
                );
            }
            for (i, (g, w)) in got[0].iter().zip(&want).enumerate() {
                let err = (f64::from(*g) - w).abs();
                assert!(
                    err <= bound(world, max),
                    "world {world}, n {n}, [{i}]: {g} against {w} (error {err}, bound {})",
                    bound(world, max)
                );
            }
            if world > 1 {
                let exact = got[0].iter().zip(&want).all(|(g, w)| f64::from(*g) == *w);
                assert!(!exact || n < 7, "world {world}, n {n}: no rounding at all?");
            }
        }
    }
}

#[test]
fn sums_that_f16_holds_exactly_are_exact() {
    for world in 2..=5 {
        let got = on_threads(world, |c| {
            let r = c.rank() as f32;
            let mut buf: Vec<f32> = (0..100).map(|i| (i % 9) as f32 - 4.0 + r).collect();
            fp16_wire::all_reduce(c.as_ref(), &mut buf, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            Ok(buf)
        });
        let want: Vec<f32> = (0..100)
            .map(|i| (0..world).map(|r| (i % 9) as f32 - 4.0 + r as f32).sum())
            .collect();
        assert_eq!(got[0], want, "world {world}");
    }
}

#[test]
fn reduce_scatter_leaves_each_rank_its_chunk_of_the_mean() {
    for world in 1..=5 {
        let c = 37;
        let got = on_threads(world, |comm| {
            let send = values(comm.rank(), c * world);
            let mut recv = vec![0.0; c];
            let wire: &dyn Communicator = &Fp16ReduceScatter(comm.clone());
            wire.reduce_scatter(&send, &mut recv, ReduceOp::Mean)
                .map_err(|e| e.to_string())?;
            Ok(recv)
        });
        let want = mean_f64(world, c * world);
        let max = (0..world)
            .flat_map(|r| values(r, c * world))
            .fold(0.0f64, |m, x| m.max(f64::from(x.abs())));
        for (r, chunk) in got.iter().enumerate() {
            for (i, g) in chunk.iter().enumerate() {
                let w = want[r * c + i];
                assert!(
                    (f64::from(*g) - w).abs() <= bound(world, max),
                    "world {world}, rank {r} [{i}]: {g} against {w}"
                );
            }
        }
    }
}

#[test]
fn inf_and_nan_reach_the_result_as_in_f32() {
    let got = on_threads(3, |c| {
        let mut buf = vec![1.0f32; 10];
        if c.rank() == 1 {
            buf[3] = f32::INFINITY;
            buf[5] = f32::NAN;
        }
        fp16_wire::all_reduce(c.as_ref(), &mut buf, ReduceOp::Mean).map_err(|e| e.to_string())?;
        Ok(buf)
    });
    for buf in got {
        assert_eq!(buf[3], f32::INFINITY);
        assert!(buf[5].is_nan());
        assert_eq!(buf[0], 1.0);
    }
}

/// Counts the values a rank sends point to point.
struct Counting(Arc<dyn Communicator>, Arc<AtomicUsize>);

impl Forwarding for Counting {
    fn inner(&self) -> &dyn Communicator {
        self.0.as_ref()
    }

    fn send(&self, buf: &[f32], dest: usize) -> DistResult<()> {
        self.1.fetch_add(buf.len(), Ordering::SeqCst);
        self.0.send(buf, dest)
    }
}

#[test]
fn the_wire_carries_half_the_values_of_an_f32_ring() {
    let (world, n) = (4, 100_000);
    let sent = on_threads(world, |c| {
        let count = Arc::new(AtomicUsize::new(0));
        let counting = Counting(c.clone(), count.clone());
        let mut buf = values(c.rank(), n);
        fp16_wire::all_reduce(&counting, &mut buf, ReduceOp::Mean).map_err(|e| e.to_string())?;
        Ok(count.load(Ordering::SeqCst))
    });
    // An f32 ring sends 2 (world - 1) chunks of n / world values.
    let f32_ring = 2 * (world - 1) * n / world;
    for (r, s) in sent.iter().enumerate() {
        assert_eq!(*s, f32_ring / 2, "rank {r}");
    }
}
