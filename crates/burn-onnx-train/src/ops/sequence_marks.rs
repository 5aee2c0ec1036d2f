//! The attributes a sequence-parallel rewrite (`crate::parallel::tensor_parallel::sequence_parallel`) puts on
//! a node that runs on token slices: the split of its sequence axis and the rank count.
//! Ops that must see whole sequences read them (Dropout draws the whole sequence's mask,
//! `Shape` reports the whole shape).

use crate::collective::axis_split::AxisSplit;
use crate::error::OpResult;
use crate::graph::attributes::{Attr, Attributes};

/// Attribute of a node on sequence slices: the split (sequence) axis.
pub const AXIS: &str = "burn.sp.axis";
/// Attribute of a node on sequence slices: the split's period on `AXIS`.
pub const PERIOD: &str = "burn.sp.period";
/// Attribute of a node on sequence slices: the rank count.
pub const PARTS: &str = "burn.sp.parts";

/// Mark `attrs` as a node's on sequence slices split by `split` over `parts` ranks.
pub fn mark(attrs: &mut Attributes, split: AxisSplit, parts: usize) {
    attrs.set(AXIS, Attr::Int(split.axis as i64));
    attrs.set(PERIOD, Attr::Int(split.period as i64));
    attrs.set(PARTS, Attr::Int(parts as i64));
}

/// The split (logical axis) and rank count of a node marked by [`mark`], if it is.
pub fn marked(attrs: &Attributes) -> OpResult<Option<(AxisSplit, usize)>> {
    if !attrs.has(PERIOD) {
        return Ok(None);
    }
    let split = AxisSplit::new(attrs.int(AXIS, 0)? as usize, attrs.int(PERIOD, 1)? as usize);
    Ok(Some((split, attrs.int(PARTS, 1)? as usize)))
}
