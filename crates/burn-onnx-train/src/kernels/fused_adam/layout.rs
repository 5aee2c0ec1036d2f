//! Where each parameter lies in the fused optimizer's flat buffers: a [`Slot`] per
//! parameter, padded to whole chunks, and the [`Group`]s of consecutive slots that share
//! one device buffer. A device caps the size of one allocation (wgpu without 64-bit
//! indexing: 128 MiB, which GPT-2 124M's 496 MB of f32 parameters pass), and an update
//! lays its gradients out a group at a time, so it holds one group's copy of them beside
//! the gradients instead of a second copy of them all: groups of at most [`GROUP_BYTES`]
//! on CubeCL devices, one group on the CPU, whose update works in place.

use std::ops::Range;

use burn::module::ParamId;

use crate::kernels::FLAT_CHUNK as CHUNK;

/// The most bytes one group's buffers hold on a CubeCL device (less where the device
/// allocates less at once): GPT-2 124M's 496 MB of parameters lie in about four groups.
pub(super) const GROUP_BYTES: usize = 128 << 20;

/// One parameter in the flat buffers.
#[derive(Debug, Clone)]
pub(super) struct Slot {
    pub(super) id: ParamId,
    pub(super) shape: Vec<usize>,
    pub(super) len: usize,
    /// First chunk in the whole layout.
    pub(super) chunk: usize,
    pub(super) decay: f32,
}

impl Slot {
    /// First value in the whole layout (the host moments' index).
    pub(super) fn offset(&self) -> usize {
        self.chunk * CHUNK
    }

    /// Values with the padding to a whole number of chunks (at least one).
    pub(super) fn padded(&self) -> usize {
        self.len.div_ceil(CHUNK).max(1) * CHUNK
    }
}

/// Consecutive slots whose values share one device buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Group {
    /// Its slots, as indices into the layout's.
    pub(super) slots: Range<usize>,
    /// Its first chunk in the whole layout.
    pub(super) chunk: usize,
    /// Its chunks.
    pub(super) chunks: usize,
}

impl Group {
    /// Values in its buffers.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub(super) fn len(&self) -> usize {
        self.chunks * CHUNK
    }

    /// Its values' range in the whole layout.
    pub(super) fn range(&self) -> Range<usize> {
        self.chunk * CHUNK..(self.chunk + self.chunks) * CHUNK
    }

    /// Where `slot` (one of its own) starts in the group's buffers.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub(super) fn offset_of(&self, slot: &Slot) -> usize {
        (slot.chunk - self.chunk) * CHUNK
    }
}

/// `slots` (laid end to end, in order) cut into groups of at most `max_values` values
/// each; a slot longer than that is a group of its own.
pub(super) fn groups(slots: &[Slot], max_values: usize) -> Vec<Group> {
    let mut out: Vec<Group> = Vec::new();
    for (k, slot) in slots.iter().enumerate() {
        let chunks = slot.padded() / CHUNK;
        match out.last_mut() {
            Some(g) if (g.chunks + chunks) * CHUNK <= max_values => {
                g.slots.end = k + 1;
                g.chunks += chunks;
            }
            _ => out.push(Group {
                slots: k..k + 1,
                chunk: slot.chunk,
                chunks,
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(lens: &[usize]) -> Vec<Slot> {
        let mut chunk = 0;
        lens.iter()
            .map(|&len| {
                let s = Slot {
                    id: ParamId::new(),
                    shape: vec![len],
                    len,
                    chunk,
                    decay: 0.0,
                };
                chunk += s.padded() / CHUNK;
                s
            })
            .collect()
    }

    #[test]
    fn groups_fill_up_to_the_cap_and_a_longer_slot_stands_alone() {
        // Padded: 1, 2, 1, 5 and 1 chunks.
        let s = slots(&[10, CHUNK + 1, CHUNK, 5 * CHUNK - 3, 0]);
        let g = groups(&s, 3 * CHUNK);
        assert_eq!(
            g,
            vec![
                Group {
                    slots: 0..2,
                    chunk: 0,
                    chunks: 3
                },
                Group {
                    slots: 2..3,
                    chunk: 3,
                    chunks: 1
                },
                Group {
                    slots: 3..4,
                    chunk: 4,
                    chunks: 5
                },
                Group {
                    slots: 4..5,
                    chunk: 9,
                    chunks: 1
                },
            ]
        );
        assert_eq!(g[2].offset_of(&s[3]), 0);
        assert_eq!(g[0].offset_of(&s[1]), CHUNK);
        assert_eq!(g[3].range(), 9 * CHUNK..10 * CHUNK);
        assert_eq!(groups(&s, usize::MAX).len(), 1);
    }
}
