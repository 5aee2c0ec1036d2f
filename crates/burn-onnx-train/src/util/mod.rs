//! Small utilities the layers above share: files written atomically, progress bars, seeds,
//! the CLI's allocator. Nothing here knows about ONNX or training.

#[cfg(feature = "cli")]
pub mod allocator;
pub mod atomic_file;
pub mod progress;
pub mod seeds;
