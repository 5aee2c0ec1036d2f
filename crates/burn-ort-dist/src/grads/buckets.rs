//! How gradients are grouped for averaging: consecutive tensors in buckets of a byte
//! budget (DDP's `bucket_cap_mb`), shared by the host path (`grad_sync`), the device path
//! (`device_buckets`) and the averaging during backward (`overlap`).

/// Consecutive tensors of `lens` elements grouped into buckets of at most `bucket_bytes`
/// of f32 (a larger tensor is a bucket of its own), in order.
pub fn bucket_ranges(lens: &[usize], bucket_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let cap = (bucket_bytes / 4).max(1);
    let mut ranges = Vec::new();
    let mut start = 0;
    while start < lens.len() {
        let (mut end, mut len) = (start + 1, lens[start]);
        while end < lens.len() && len + lens[end] <= cap {
            len += lens[end];
            end += 1;
        }
        ranges.push(start..end);
        start = end;
    }
    ranges
}
