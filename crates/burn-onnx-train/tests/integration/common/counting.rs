//! A communicator that counts the collectives it carries (and their sizes), and the
//! forward + backward pass the collective tests count them over.

use std::sync::{Arc, Mutex};

use burn_onnx_train::OnnxModel;
use burn_onnx_train::model::loss::lm_cross_entropy;
use burn_ort_dist::{Communicator, DistResult, Forwarding, ReduceOp};
use ndarray::ArrayD;

/// Wraps a group and records the length of every all-reduce, all-gather (send side) and
/// reduce-scatter (receive side).
pub struct Counting {
    pub inner: Arc<dyn Communicator>,
    pub all_reduces: Mutex<Vec<usize>>,
    pub all_gathers: Mutex<Vec<usize>>,
    pub reduce_scatters: Mutex<Vec<usize>>,
}

impl Counting {
    pub fn new(inner: Arc<dyn Communicator>) -> Self {
        Counting {
            inner,
            all_reduces: Default::default(),
            all_gathers: Default::default(),
            reduce_scatters: Default::default(),
        }
    }
}

impl Forwarding for Counting {
    fn inner(&self) -> &dyn Communicator {
        self.inner.as_ref()
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> DistResult<()> {
        self.all_reduces.lock().unwrap().push(buf.len());
        self.inner.all_reduce(buf, op)
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> DistResult<()> {
        self.all_gathers.lock().unwrap().push(send.len());
        self.inner.all_gather(send, recv)
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> DistResult<()> {
        self.reduce_scatters.lock().unwrap().push(recv.len());
        self.inner.reduce_scatter(send, recv, op)
    }
}

/// Logits of a training-mode forward pass on token `ids` and `(name, gradient)` of every
/// trainable parameter under the LM loss (a tensor-parallel rank's slice of the logits,
/// and the parallel loss, when its head is split along the vocabulary).
pub fn logits_and_grads(
    model: &OnnxModel,
    ids: &ArrayD<i64>,
) -> (ArrayD<f32>, Vec<(String, ArrayD<f32>)>) {
    let logits = super::lm_logits(model, ids);
    let value = logits.value.written().expect("written logits").clone();
    let loss = lm_cross_entropy(logits, ids).unwrap();
    let grads = loss.backward();
    let named = model
        .param_grads(&grads)
        .into_iter()
        .map(|(n, g)| (n, g.to_array().unwrap()))
        .collect();
    (value.to_array().unwrap(), named)
}
