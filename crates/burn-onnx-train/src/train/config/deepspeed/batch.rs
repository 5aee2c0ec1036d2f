//! The batch keys: `train_micro_batch_size_per_gpu`, and `train_batch_size` checked
//! against (or completing) micro-batch x accumulation x data-parallel ranks.

use super::key::Key;
use super::kind::{COUNT, Given};
use super::reader::{BatchKeys, Ds};

impl Ds {
    /// `train_micro_batch_size_per_gpu`: the batch size, for evaluation too.
    pub(super) fn micro_batch(&mut self, key: &Key) {
        let field = "data.batch_size, eval.eval_batch_size";
        if let Some(b) = self.given_or_auto(key, &COUNT, field, self.c.data.batch_size) {
            (self.c.data.batch_size, self.c.eval.eval_batch_size) = (b, b);
        }
    }

    /// `train_batch_size` against micro-batch x accumulation x data-parallel ranks: checked
    /// when the file gives all three, else the one it leaves out follows (DeepSpeed's rule;
    /// the run's accumulation stands in when both others are left out).
    pub(super) fn batch(&mut self, keys: BatchKeys) {
        let c = &self.c;
        let (micro, accum, dp) = (
            c.data.batch_size,
            c.train.gradient_accumulation_steps,
            c.parallel.data_parallel_size,
        );
        let product = micro.saturating_mul(accum).saturating_mul(dp);
        let total = match keys.total {
            Given::Absent => return,
            Given::Auto => {
                let line = format!(
                    "train_batch_size = \"auto\" → micro-batch {micro} x accumulation {accum} x data-parallel ranks {dp} = {product}"
                );
                return self.mapped.push(line);
            }
            Given::Value(total) => total,
        };
        match (keys.micro, keys.accum) {
            (true, true) if total != product => self.fail(format!(
                "train_batch_size {total} is not train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {accum} x data-parallel ranks {dp} = {product}"
            )),
            (true, true) => {}
            (true, false) => {
                let field = "train.gradient_accumulation_steps";
                if let Some(n) = self.divide(total, micro, "train_micro_batch_size_per_gpu", field) {
                    self.c.train.gradient_accumulation_steps = n;
                }
            }
            (false, _) => {
                let field = "data.batch_size, eval.eval_batch_size";
                if let Some(b) = self.divide(total, accum, "gradient_accumulation_steps", field) {
                    (self.c.data.batch_size, self.c.eval.eval_batch_size) = (b, b);
                }
            }
        }
    }

    /// `train_batch_size` `total` / (`other`, the value of key `name`, x data-parallel
    /// ranks): the value of our `field` (logged), or `None` where it does not divide (noted).
    fn divide(&mut self, total: usize, other: usize, name: &str, field: &str) -> Option<usize> {
        let dp = self.c.parallel.data_parallel_size;
        let divisor = other.saturating_mul(dp);
        if divisor == 0 || !total.is_multiple_of(divisor) {
            self.fail(format!(
                "train_batch_size {total} is not a multiple of {name} {other} x data-parallel ranks {dp}"
            ));
            return None;
        }
        let n = total / divisor;
        self.mapped(
            &format!("train_batch_size / ({name} x data-parallel ranks)"),
            field,
            n,
        );
        Some(n)
    }
}
