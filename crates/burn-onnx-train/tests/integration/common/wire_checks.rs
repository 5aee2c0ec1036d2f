//! The pipeline's wire between two thread ranks, shared by the CPU tests (`pipeline.rs`)
//! and the GPU tests (`gpu.rs`): float, integer and boolean values cross in their shapes,
//! out of order by tag, over the plain thread group (through host memory on the CPU; on a
//! GPU the thread group hands the tensors over itself) and over a group that sends device
//! tensors through its own channel (`ThroughHost` here, as NCCL does on CUDA).

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use burn_onnx_train::Value;
use burn_onnx_train::parallel::pipeline::wire::{Flow, Mailbox, Tag, send_values};
use burn_onnx_train::value::FloatValue;
use burn_ort_dist::{Communicator, ThroughHost, run_threads};
use ndarray::{ArrayD, IxDyn};

/// A tag of `flow` for stage 1, micro-batch `micro`.
fn tag(flow: Flow, micro: usize) -> Tag {
    Tag {
        flow,
        stage: 1,
        micro,
    }
}

/// The values rank 0 sends: an activation group (a float of rank 3, integers, booleans)
/// and a gradient group (a float of rank 1).
fn sent(device: &Device) -> (Vec<Value>, Vec<Value>) {
    let floats = |shape: &[usize], from: f32| {
        let n: usize = shape.iter().product();
        let a = ArrayD::from_shape_vec(
            IxDyn(shape),
            (0..n).map(|i| from + i as f32 * 0.25).collect(),
        )
        .unwrap();
        Value::Float(FloatValue::from_array(&a, device).unwrap())
    };
    let ints = ArrayD::from_shape_vec(IxDyn(&[2, 2]), vec![1i64 << 40, -3, 0, 7]).unwrap();
    let bools = ArrayD::from_shape_vec(IxDyn(&[3]), vec![true, false, true]).unwrap();
    (
        vec![
            floats(&[2, 1, 3], -1.0),
            Value::Int(ints),
            Value::Bool(bools),
        ],
        vec![floats(&[5], 2.0)],
    )
}

/// A value's kind, shape and contents as host numbers.
fn described(v: &Value) -> (String, Vec<usize>, Vec<f64>) {
    let values = match v {
        Value::Float(f) => burn_ort_dist::collective_host_values(f.tensor.clone())
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        Value::Int(a) => a.iter().map(|&x| x as f64).collect(),
        Value::Bool(a) => a.iter().map(|&b| f64::from(u8::from(b))).collect(),
        other => panic!("a {} value", other.kind()),
    };
    (v.kind().to_string(), v.shape(), values)
}

/// Rank 0 sends the gradient group, then the activation group; rank 1 asks for the
/// activations first. Over `group(comm)`: what rank 1 received, in the order it asked.
fn exchange(
    device: &Device,
    group: &(dyn Fn(Arc<dyn Communicator>) -> Arc<dyn Communicator> + Sync),
) -> Vec<(String, Vec<usize>, Vec<f64>)> {
    let results = run_threads(2, Duration::from_secs(60), |comm| -> Result<_, String> {
        let comm = group(comm);
        let (activations, gradients) = sent(device);
        if comm.rank() == 0 {
            send_values(
                comm.as_ref(),
                1,
                tag(Flow::Gradient, 3),
                &gradients.iter().collect::<Vec<_>>(),
            )
            .map_err(|e| e.to_string())?;
            send_values(
                comm.as_ref(),
                1,
                tag(Flow::Activation, 3),
                &activations.iter().collect::<Vec<_>>(),
            )
            .map_err(|e| e.to_string())?;
            return Ok(Vec::new());
        }
        let mailbox = Mailbox::default();
        let mut got = mailbox
            .recv(comm.as_ref(), 0, tag(Flow::Activation, 3), 3, device)
            .map_err(|e| e.to_string())?;
        got.extend(
            mailbox
                .recv(comm.as_ref(), 0, tag(Flow::Gradient, 3), 1, device)
                .map_err(|e| e.to_string())?,
        );
        mailbox.check_empty().map_err(|e| e.to_string())?;
        Ok(got.iter().map(described).collect())
    });
    results.into_iter().map(Result::unwrap).nth(1).unwrap()
}

/// Both groups deliver rank 0's values, in their shapes, to rank 1 on `device`, and
/// `ThroughHost`'s device channel carries the float values (one send and one receive
/// each).
pub fn values_cross_the_pipeline_wire_on_both_paths(device: &Device) {
    let (activations, gradients) = sent(device);
    let want: Vec<_> = activations
        .iter()
        .chain(&gradients)
        .map(described)
        .collect();
    let on_host = exchange(device, &|comm| comm);
    assert_eq!(on_host, want, "over the plain thread group");
    let counters = std::sync::Mutex::new(Vec::new());
    let on_device = exchange(device, &|comm| {
        let through = Arc::new(ThroughHost::over(comm));
        counters.lock().unwrap().push(through.clone());
        through
    });
    assert_eq!(on_device, want, "device to device");
    let mut calls: Vec<usize> = counters.lock().unwrap().iter().map(|t| t.calls()).collect();
    calls.sort();
    assert_eq!(
        calls,
        [2, 2],
        "each float value sent and received on the device"
    );
}
