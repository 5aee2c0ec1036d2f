//! The device-bucket path of gradient averaging (taken when the group reduces device
//! buffers, as NCCL does on CUDA) on 3 thread ranks, with a stand-in `DeviceCollectives` that
//! averages through the host: the gradients come back averaged, in their shapes, from
//! buckets of the host path's sizes. NCCL itself never ran here (no GPU).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use burn_ort_dist::{
    Communicator, DataParallel, DeviceCollectives, DistResult, Forwarding, ReduceOp, run_threads,
};

/// A thread rank that also "reduces on the device", recording each bucket's length.
struct StandIn(Arc<dyn Communicator>, Mutex<Vec<usize>>);

impl DeviceCollectives for StandIn {
    fn works_on(&self, _device: &Device) -> bool {
        true
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce(&self, bucket: Tensor<1>, op: ReduceOp) -> DistResult<Tensor<1>> {
        let device = bucket.device();
        let mut v = bucket
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap();
        self.1.lock().unwrap().push(v.len());
        self.0.all_reduce(&mut v, op)?;
        let n = v.len();
        Ok(Tensor::from_data(TensorData::new(v, [n]), &device))
    }
}

impl Forwarding for StandIn {
    fn inner(&self) -> &dyn Communicator {
        self.0.as_ref()
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }
}

#[derive(Module, Debug)]
struct Net {
    w: Param<Tensor<2>>,
    b: Param<Tensor<1>>,
    c: Param<Tensor<3>>,
}

#[test]
fn device_buckets_average_gradients_in_their_shapes() {
    let device = Device::flex().autodiff();
    let results = run_threads(3, Duration::from_secs(20), |comm| {
        let r = comm.rank() as f32;
        let stand_in = Arc::new(StandIn(comm, Mutex::new(Vec::new())));
        let data = |n: usize, shape: Vec<usize>| TensorData::new(vec![1.0f32; n], shape);
        let net = Net {
            w: Param::from_tensor(Tensor::from_data(data(6, vec![2, 3]), &device)),
            b: Param::from_tensor(Tensor::from_data(data(2, vec![2]), &device)),
            c: Param::from_tensor(Tensor::from_data(data(2, vec![1, 2, 1]), &device)),
        };
        let x: Tensor<2> = Tensor::from_data(
            TensorData::new(
                (0..6).map(|i| i as f32 * (r + 1.0)).collect::<Vec<_>>(),
                vec![2, 3],
            ),
            &device,
        );
        let loss = (net.w.val() * x).sum()
            + net.b.val().sum().mul_scalar(r)
            + net.c.val().sum().mul_scalar(2.0 * r);
        let mut grads = GradientsParams::from_grads(loss.backward(), &net);
        // 16 bytes: the 6-value w alone, then b and c together.
        DataParallel::new(stand_in.clone())
            .with_bucket_bytes(16)
            .sync(&net, &mut grads)
            .map_err(|e| e.to_string())?;
        let host = |v: Tensor<1>| v.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        let gw: Tensor<2> = grads.get(net.w.id).unwrap();
        let gc: Tensor<3> = grads.get(net.c.id).unwrap();
        assert_eq!(gc.dims(), [1, 2, 1]);
        let buckets = stand_in.1.lock().unwrap().clone();
        Ok::<_, String>((
            host(gw.reshape([6])),
            host(grads.get::<1>(net.b.id).unwrap()),
            host(gc.reshape([2])),
            buckets,
        ))
    });
    for r in results {
        let (gw, gb, gc, buckets) = r.unwrap();
        let want_w: Vec<f32> = (0..6).map(|i| i as f32 * (1.0 + 2.0 + 3.0) / 3.0).collect();
        assert_eq!(gw, want_w);
        assert_eq!(gb, vec![1.0, 1.0], "mean of 0, 1, 2");
        assert_eq!(gc, vec![2.0, 2.0], "mean of 0, 2, 4");
        assert_eq!(buckets, vec![6, 4]);
    }
}

#[test]
fn gathers_and_scatters_made_of_all_reduces_match_the_host_collectives() {
    // A runtime whose devices only all-reduce (the CUDA runtime's for thread ranks) gets
    // `all_gather` and `reduce_scatter` from `DeviceCollectives`' provided methods.
    let device = Device::flex();
    let results = run_threads(3, Duration::from_secs(20), |comm| {
        let r = comm.rank() as f32;
        let stand_in = StandIn(comm.clone(), Mutex::new(Vec::new()));
        let on_device: &dyn DeviceCollectives = &stand_in;
        let values: Vec<f32> = (0..6).map(|i| 10.0 * r + i as f32 + 0.25).collect();
        let tensor = || Tensor::<1>::from_data(TensorData::new(values.clone(), [6]), &device);
        let host = |v: Tensor<1>| v.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        let gathered = host(on_device.all_gather(tensor()).map_err(|e| e.to_string())?);
        let mut want_gathered = vec![0.0; 18];
        comm.all_gather(&values, &mut want_gathered)
            .map_err(|e| e.to_string())?;
        let scattered = host(
            on_device
                .reduce_scatter(tensor(), ReduceOp::Mean)
                .map_err(|e| e.to_string())?,
        );
        let mut want_scattered = vec![0.0; 2];
        comm.reduce_scatter(&values, &mut want_scattered, ReduceOp::Mean)
            .map_err(|e| e.to_string())?;
        let calls = stand_in.1.lock().unwrap().clone();
        Ok::<_, String>((gathered, want_gathered, scattered, want_scattered, calls))
    });
    for r in results {
        let (gathered, want_gathered, scattered, want_scattered, calls) = r.unwrap();
        assert_eq!(gathered, want_gathered);
        assert_eq!(scattered, want_scattered);
        assert_eq!(calls, [18, 6], "one all-reduce each");
    }
}
