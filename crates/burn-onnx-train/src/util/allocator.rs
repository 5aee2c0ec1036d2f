//! How the training processes (the `onnx-train` binary, the examples) set up their global
//! allocator, mimalloc: memory a step frees stays mapped for the next step.
//!
//! mimalloc returns freed memory to the kernel ("purges" it) after a delay of 1 s by default
//! (its arenas). A step longer than that (GPT-2 124M here: ~1.5 s) frees its activations
//! and gradients, mimalloc purges them, and the next step page-faults every page back in,
//! each zeroed by the kernel: `clear_page_erms` was 36% of a 124M run's samples, 1.76-1.95 s
//! per update against 1.40 s with purging delayed (BENCHMARKS.md). PyTorch's caching
//! allocators keep memory the same way.

use libmimalloc_sys::{mi_option_set_default, mi_option_t};

/// `mi_option_purge_delay` of mimalloc 2.x and 3.x's `mi_option_e` (`include/mimalloc.h`;
/// `libmimalloc-sys` names no constant for it).
const MI_OPTION_PURGE_DELAY: mi_option_t = 15;

/// Freed memory goes back to the kernel only after this long unused.
pub const PURGE_DELAY_MS: i64 = 60_000;

/// Keep freed memory mapped for [`PURGE_DELAY_MS`]; `MIMALLOC_PURGE_DELAY` in the
/// environment still decides when set. Call at the start of `main`.
pub fn keep_freed_memory() {
    // SAFETY: setting a mimalloc option is allowed at any time, from any thread.
    unsafe { mi_option_set_default(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS as _) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use libmimalloc_sys::mi_option_get;

    #[test]
    fn the_option_set_is_mimallocs_purge_delay() {
        // Its default (1000 ms, unless the environment sets it) identifies the option.
        let env: Option<i64> = std::env::var("MIMALLOC_PURGE_DELAY")
            .ok()
            .and_then(|v| v.parse().ok());
        // SAFETY: reading a mimalloc option is allowed at any time.
        let get = || i64::from(unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) });
        assert_eq!(get(), env.unwrap_or(1000));
        keep_freed_memory();
        assert_eq!(get(), env.unwrap_or(PURGE_DELAY_MS));
    }
}
