//! [`AxisSplit`]: how one axis of a tensor is divided among the tensor-parallel ranks, how
//! that division travels through a reshape, and slicing and reassembling host arrays by it.
//! The blocks of Megatron split weights and activations by it, sequence parallelism the
//! token axis.
//!
//! An axis of full size `F` is split with a `period` `P` (dividing `F`, a multiple of the
//! rank count): rank `r` holds the indices whose position within each period block falls
//! in its `r`-th chunk of `P / tp`. A plain column split has `P = F`; the output of a fused
//! Q/K/V projection has `P = F / 3`, so every rank holds its heads of Q, of K and of V.
//! A vocabulary split (see `crate::parallel::tensor_parallel::vocab`) may pad: `pad` zero rows are appended to
//! the axis so that `F + pad` divides by the rank count (Megatron pads its vocabulary
//! too), and every rank holds an equal part; reassembling drops them again.

use ndarray::{ArrayD, Axis, IxDyn};

/// A split of one axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AxisSplit {
    /// The axis (non-negative).
    pub axis: usize,
    /// Block length `P`: rank `r` holds positions `r*P/tp .. (r+1)*P/tp` of every block.
    pub period: usize,
    /// Zero entries appended to the axis before it is split (the last rank holds them);
    /// only with `period` = the padded size (one block).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pad: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Group the axes of a reshape `input -> output` into runs with equal products:
/// `(input axes, output axes)` ranges. `None` when the element counts differ.
fn reshape_groups(
    input: &[usize],
    output: &[usize],
) -> Option<Vec<(std::ops::Range<usize>, std::ops::Range<usize>)>> {
    let (mut i, mut j, mut groups) = (0, 0, Vec::new());
    while i < input.len() || j < output.len() {
        let (i0, j0) = (i, j);
        let (mut pi, mut pj) = (1usize, 1usize);
        if i < input.len() {
            pi *= input[i];
            i += 1;
        }
        if j < output.len() {
            pj *= output[j];
            j += 1;
        }
        while pi != pj {
            if pi < pj && i < input.len() {
                pi *= input[i];
                i += 1;
            } else if pj < pi && j < output.len() {
                pj *= output[j];
                j += 1;
            } else {
                return None;
            }
        }
        groups.push((i0..i, j0..j));
    }
    Some(groups)
}

impl AxisSplit {
    /// The split of a reshape's output given this split of its input (shapes are full
    /// sizes), or `None` when the ranks' parts would not be whole slices of one output
    /// axis (a head split with heads not divisible by `tp`, say).
    pub fn through_reshape(
        self,
        input: &[usize],
        output: &[usize],
        tp: usize,
    ) -> Option<AxisSplit> {
        if self.pad > 0 {
            return None;
        }
        let groups = reshape_groups(input, output)?;
        let (ins, outs) = groups
            .into_iter()
            .find(|(ins, _)| ins.contains(&self.axis))?;
        // Within the group's flattened index, ownership repeats every `period * inner` and
        // changes every `unit` elements.
        let inner: usize = input[self.axis + 1..ins.end].iter().product();
        let cycle = self.period * inner;
        if cycle % tp != 0 {
            return None;
        }
        let unit = cycle / tp;
        for j in outs.clone() {
            let stride: usize = output[j + 1..outs.end].iter().product();
            if unit % stride == 0 && (stride * output[j]) % cycle == 0 {
                return Some(AxisSplit::new(j, cycle / stride));
            }
        }
        None
    }

    /// A split without padding.
    pub fn new(axis: usize, period: usize) -> AxisSplit {
        AxisSplit {
            axis,
            period,
            pad: 0,
        }
    }

    /// The same split on another axis.
    pub fn on(self, axis: usize) -> AxisSplit {
        AxisSplit { axis, ..self }
    }

    /// Rank `rank`'s part of `full` (of `tp` ranks).
    pub fn slice(self, full: &ArrayD<f32>, rank: usize, tp: usize) -> ArrayD<f32> {
        if self.pad > 0 {
            let mut zeros = full.shape().to_vec();
            zeros[self.axis] = self.pad;
            let padded = ndarray::concatenate(
                Axis(self.axis),
                &[full.view(), ArrayD::zeros(IxDyn(&zeros)).view()],
            )
            .expect("padding of the same rank");
            return AxisSplit { pad: 0, ..self }.slice(&padded, rank, tp);
        }
        let full = full.as_standard_layout();
        let values = full.as_slice().expect("a standard-layout array");
        let mut local = full.shape().to_vec();
        local[self.axis] /= tp;
        let part = self.slice_flat(values, full.shape(), rank, tp);
        ArrayD::from_shape_vec(IxDyn(&local), part).expect("this rank's part")
    }

    /// The full array from every rank's part, in rank order (padding dropped).
    pub fn assemble(self, parts: &[ArrayD<f32>]) -> ArrayD<f32> {
        if self.pad > 0 {
            let padded = AxisSplit { pad: 0, ..self }.assemble(parts);
            let keep = padded.shape()[self.axis] - self.pad;
            return padded
                .slice_axis(Axis(self.axis), ndarray::Slice::from(..keep))
                .to_owned();
        }
        let standard: Vec<_> = parts.iter().map(|p| p.as_standard_layout()).collect();
        let flat: Vec<&[f32]> = standard
            .iter()
            .map(|p| p.as_slice().expect("a standard-layout array"))
            .collect();
        let mut full = parts[0].shape().to_vec();
        let values = self.assemble_flat(&flat, &full);
        full[self.axis] *= parts.len();
        ArrayD::from_shape_vec(IxDyn(&full), values).expect("the whole array")
    }

    /// The runs of one rank's part in the whole row-major tensor of `shape` (no padding):
    /// `(count, run length, stride between runs, offset of rank r's first run per rank)`.
    /// Rank `r`'s part is runs `k` at `k * stride + r * step`, each `len` values long.
    /// How rank parts lie in a row-major tensor of `shape`: `(count, len, stride, step)`,
    /// rank `r`'s part the `count` runs of `len` values at `k * stride + r * step`.
    pub(crate) fn runs(self, shape: &[usize], tp: usize) -> (usize, usize, usize, usize) {
        let inner: usize = shape[self.axis + 1..].iter().product();
        let outer: usize = shape[..self.axis].iter().product();
        let blocks = shape[self.axis] / self.period;
        let len = self.period / tp * inner;
        (outer * blocks, len, self.period * inner, len)
    }

    /// Rank `rank`'s part of the row-major `full` of `shape` (of `tp` ranks; no padding).
    pub fn slice_flat(self, full: &[f32], shape: &[usize], rank: usize, tp: usize) -> Vec<f32> {
        let (count, len, stride, step) = self.runs(shape, tp);
        let mut out = Vec::with_capacity(count * len);
        for k in 0..count {
            let at = k * stride + rank * step;
            out.extend_from_slice(&full[at..at + len]);
        }
        out
    }

    /// The whole row-major tensor from every rank's part (row-major, of `local` shape), in
    /// rank order (no padding).
    pub fn assemble_flat(self, parts: &[&[f32]], local: &[usize]) -> Vec<f32> {
        let tp = parts.len();
        let mut shape = local.to_vec();
        shape[self.axis] *= tp;
        let (count, len, stride, step) = self.runs(&shape, tp);
        let mut full = vec![0f32; count * stride];
        for (r, part) in parts.iter().enumerate() {
            for k in 0..count {
                let at = k * stride + r * step;
                full[at..at + len].copy_from_slice(&part[k * len..(k + 1) * len]);
            }
        }
        full
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_split_and_merge() {
        // [B, T, d=8] -> [B, T, H=4, hd=2]: column split of d lands on the heads.
        let s = AxisSplit::new(2, 8);
        assert_eq!(
            s.through_reshape(&[2, 3, 8], &[2, 3, 4, 2], 2),
            Some(AxisSplit::new(2, 4))
        );
        // 3 heads cannot be split in 2.
        assert_eq!(
            AxisSplit::new(2, 6).through_reshape(&[2, 3, 6], &[2, 3, 3, 2], 2),
            None
        );
        // Merge back.
        let h = AxisSplit::new(2, 4);
        assert_eq!(
            h.through_reshape(&[2, 3, 4, 2], &[2, 3, 8], 2),
            Some(AxisSplit::new(2, 8))
        );
        // Fused q/k/v, [B, T, 3d] -> [B, T, 3, H, hd]: the heads, in every one of the three.
        let qkv = AxisSplit::new(2, 8);
        assert_eq!(
            qkv.through_reshape(&[2, 3, 24], &[2, 3, 3, 4, 2], 2),
            Some(AxisSplit::new(3, 4))
        );
        // Flattening the batch keeps the column axis.
        assert_eq!(
            AxisSplit::new(2, 8).through_reshape(&[2, 3, 8], &[6, 8], 2),
            Some(AxisSplit::new(1, 8))
        );
    }

    #[test]
    fn slice_and_assemble_fused_columns() {
        // 2 x 6 with period 3 (q|k of width 3 each... here two blocks), over 3 ranks? use tp 3.
        let full =
            ArrayD::from_shape_vec(IxDyn(&[2, 6]), (0..12).map(|x| x as f32).collect()).unwrap();
        let s = AxisSplit::new(1, 3);
        let parts: Vec<_> = (0..3).map(|r| s.slice(&full, r, 3)).collect();
        assert_eq!(parts[1].as_slice().unwrap(), &[1.0, 4.0, 7.0, 10.0]);
        assert_eq!(s.assemble(&parts), full);
        let rows = AxisSplit::new(0, 2);
        let parts: Vec<_> = (0..2).map(|r| rows.slice(&full, r, 2)).collect();
        assert_eq!(
            parts[1].as_slice().unwrap(),
            &[6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
        );
        assert_eq!(rows.assemble(&parts), full);
    }

    #[test]
    fn a_padded_split_appends_zero_rows_to_the_last_rank_and_drops_them_again() {
        // 5 rows over 2 ranks: 3 each, the last rank's third row is padding.
        let full =
            ArrayD::from_shape_vec(IxDyn(&[5, 2]), (0..10).map(|x| x as f32).collect()).unwrap();
        let s = AxisSplit {
            axis: 0,
            period: 6,
            pad: 1,
        };
        let parts: Vec<_> = (0..2).map(|r| s.slice(&full, r, 2)).collect();
        assert_eq!(
            parts[0].as_slice().unwrap(),
            &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        );
        assert_eq!(
            parts[1].as_slice().unwrap(),
            &[6.0, 7.0, 8.0, 9.0, 0.0, 0.0]
        );
        assert_eq!(s.assemble(&parts), full);
        assert_eq!(s.through_reshape(&[5, 2], &[10], 2), None);
    }
}
