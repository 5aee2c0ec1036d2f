//! Sliding-window attributes shared by `Conv` and the pooling ops: kernel, strides,
//! dilations and padding (explicit `pads` or `auto_pad`), normalised to two spatial dims.

use crate::error::OpResult;
use crate::graph::attributes::Attributes;
use crate::op_bail;

/// Window geometry for a 2-D op (1-D inputs are treated as height 1).
#[derive(Debug, Clone, PartialEq)]
pub struct Window2d {
    /// Kernel size `[kh, kw]`.
    pub kernel: [usize; 2],
    /// Strides.
    pub strides: [usize; 2],
    /// Dilations.
    pub dilations: [usize; 2],
    /// `(begin, end)` padding per spatial dim.
    pub pads: [(usize, usize); 2],
}

fn to_usize(v: &[i64], what: &str) -> OpResult<Vec<usize>> {
    v.iter()
        .map(|&x| {
            usize::try_from(x)
                .map_err(|_| format!("attribute `{what}` has a negative entry: {v:?}").into())
        })
        .collect()
}

/// Lift a 1-D spatial list to 2-D by prepending the neutral value.
fn lift(v: Vec<usize>, spatial: usize, neutral: usize) -> [usize; 2] {
    if spatial == 1 {
        [neutral, v[0]]
    } else {
        [v[0], v[1]]
    }
}

impl Window2d {
    /// Read the window attributes for an input with spatial dims `input` (1 or 2 of them)
    /// and a kernel of spatial size `kernel` (from the weight for Conv, attributes for pools).
    pub fn from_attrs(attrs: &Attributes, input: &[usize], kernel: &[usize]) -> OpResult<Self> {
        let spatial = input.len();
        if !(1..=2).contains(&spatial) || kernel.len() != spatial {
            op_bail!(
                "only 1-D and 2-D windows are supported (input spatial dims {input:?}, kernel {kernel:?})"
            );
        }
        let list = |name: &str, default: usize| -> OpResult<Vec<usize>> {
            match attrs.ints(name)? {
                Some(v) if v.len() == spatial => to_usize(&v, name),
                Some(v) => op_bail!(
                    "attribute `{name}` has {} entries, expected {spatial}",
                    v.len()
                ),
                None => Ok(vec![default; spatial]),
            }
        };
        let strides = list("strides", 1)?;
        let dilations = list("dilations", 1)?;
        let mut pads = vec![(0usize, 0usize); spatial];
        match attrs.string("auto_pad", "NOTSET")?.as_str() {
            "NOTSET" => {
                if let Some(p) = attrs.ints("pads")? {
                    if p.len() != 2 * spatial {
                        op_bail!(
                            "attribute `pads` has {} entries, expected {}",
                            p.len(),
                            2 * spatial
                        );
                    }
                    let p = to_usize(&p, "pads")?;
                    for i in 0..spatial {
                        pads[i] = (p[i], p[i + spatial]);
                    }
                }
            }
            "VALID" => {}
            mode @ ("SAME_UPPER" | "SAME_LOWER") => {
                for i in 0..spatial {
                    let out = input[i].div_ceil(strides[i]);
                    let needed = (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1;
                    let total = needed.saturating_sub(input[i]);
                    let small = total / 2;
                    pads[i] = if mode == "SAME_UPPER" {
                        (small, total - small)
                    } else {
                        (total - small, small)
                    };
                }
            }
            other => op_bail!("attribute `auto_pad` has unknown value {other:?}"),
        }
        if strides.contains(&0) || dilations.contains(&0) {
            op_bail!("strides and dilations must be positive");
        }
        let pads2 = if spatial == 1 {
            [(0, 0), pads[0]]
        } else {
            [pads[0], pads[1]]
        };
        Ok(Window2d {
            kernel: lift(kernel.to_vec(), spatial, 1),
            strides: lift(strides, spatial, 1),
            dilations: lift(dilations, spatial, 1),
            pads: pads2,
        })
    }
}
