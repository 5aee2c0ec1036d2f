//! The flat layouts ZeRO cuts parameters with: every rank's shard, cut from whole tensors
//! and joined back, gives the tensors again, and each rank's pieces cover exactly the
//! elements it holds (checked element by element against a direct computation).

use burn::module::ParamId;
use burn_ort_dist::update::zero::layout::{FlatLayout, Partitioning, Slot};

fn layout(lens: &[usize], world: usize, partitioning: Partitioning) -> FlatLayout {
    let slots = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| Slot {
            id: ParamId::from(i as u64),
            shape: vec![len],
            offset: 0,
            len,
            trainable: true,
        })
        .collect();
    FlatLayout::from_slots(slots, world, partitioning)
}

/// Tensor `i`'s element `j` is `1000 i + j`, so every value names its origin.
fn tensors(lens: &[usize]) -> Vec<Vec<f32>> {
    lens.iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| (1000 * i + j) as f32).collect())
        .collect()
}

#[test]
fn cut_then_join_is_the_identity_and_pieces_match_the_values() {
    let lens = [7, 1, 12, 3, 0, 5];
    let whole = tensors(&lens);
    for partitioning in [Partitioning::Contiguous, Partitioning::PerTensor] {
        for world in 1..=5 {
            let l = layout(&lens, world, partitioning);
            let refs: Vec<&[f32]> = whole.iter().map(Vec::as_slice).collect();
            let shards: Vec<Vec<f32>> = (0..world).map(|r| l.cut(r, &refs)).collect();
            assert!(
                shards.iter().all(|s| s.len() == l.shard_len()),
                "{partitioning:?} x {world}: equal shards"
            );
            assert_eq!(l.join(&shards), whole, "{partitioning:?} x {world}");
            let mut seen = vec![0usize; lens.len()];
            for (r, shard) in shards.iter().enumerate() {
                for p in l.pieces(r) {
                    for &v in &shard[p.local.clone()] {
                        assert_eq!(
                            (v as usize) / 1000,
                            p.slot,
                            "{partitioning:?} x {world}: rank {r} piece of slot {}",
                            p.slot
                        );
                    }
                    seen[p.slot] += p.local.len();
                }
            }
            assert_eq!(
                seen, lens,
                "{partitioning:?} x {world}: every element in exactly one piece"
            );
        }
    }
}

#[test]
fn per_tensor_shards_hold_chunk_r_of_every_tensor() {
    let lens = [5, 2];
    let l = layout(&lens, 2, Partitioning::PerTensor);
    let whole = tensors(&lens);
    let refs: Vec<&[f32]> = whole.iter().map(Vec::as_slice).collect();
    // Chunks of 3 and 1: rank 0 holds 0..3 of tensor 0 and 0..1 of tensor 1.
    assert_eq!(l.cut(0, &refs), vec![0.0, 1.0, 2.0, 1000.0]);
    assert_eq!(l.cut(1, &refs), vec![3.0, 4.0, 0.0, 1001.0]);
}
