//! TensorBoard event files, written from Rust without TensorFlow or `protoc`.
//!
//! [`EventWriter`] creates `events.out.tfevents.<unix_secs>.<hostname>` in a log directory and
//! appends scalars and histograms to it; point `tensorboard --logdir` at the directory.
//! [`read_events`] reads such a file back (for tests and tooling), verifying every checksum.
//!
//! The file is a sequence of TFRecords, each holding one serialized `tensorflow.Event`:
//!
//! | bytes | content |
//! | --- | --- |
//! | 8 | payload length `n`, `u64` little-endian |
//! | 4 | masked CRC-32C of those 8 bytes, `u32` little-endian |
//! | `n` | the `Event` protobuf |
//! | 4 | masked CRC-32C of the payload, `u32` little-endian |
//!
//! The protobuf messages below are the subset of TensorFlow's `event.proto` and
//! `summary.proto` needed for scalars and histograms, with the same field numbers, so any
//! TensorBoard reader decodes them; fields they do not declare are skipped when reading.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

use crate::error::{OnnxError, Result};

/// The `file_version` of the first event of every file, as written by TensorFlow 2.
pub const FILE_VERSION: &str = "brain.Event:2";

/// `tensorflow.Event`: one record of an event file.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch when the event was written.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// Training step the event belongs to (the x axis in TensorBoard).
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// What the event carries (`oneof what`).
    #[prost(oneof = "EventKind", tags = "3, 5")]
    pub what: Option<EventKind>,
}

/// The `oneof what` of [`Event`] (only the members this module writes).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum EventKind {
    /// `file_version = 3`: the first event of a file, e.g. [`FILE_VERSION`].
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// `summary = 5`: a set of tagged values.
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`: the tagged values of one event.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// `repeated Value value = 1`.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`: one tagged value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    /// The tag, e.g. `loss` or `train/lr`; TensorBoard groups charts by it.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// The value (`oneof value`).
    #[prost(oneof = "ValueKind", tags = "2, 5")]
    pub value: Option<ValueKind>,
}

/// The `oneof value` of [`SummaryValue`] (only the members this module writes).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum ValueKind {
    /// `simple_value = 2`: a scalar.
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    /// `histo = 5`: a histogram.
    #[prost(message, tag = "5")]
    Histo(HistogramProto),
}

/// `tensorflow.HistogramProto`.
///
/// `bucket[i]` counts the values in `[bucket_limit[i - 1], bucket_limit[i])`, the first
/// bucket starting at `-f64::MAX`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HistogramProto {
    /// Smallest value.
    #[prost(double, tag = "1")]
    pub min: f64,
    /// Largest value.
    #[prost(double, tag = "2")]
    pub max: f64,
    /// Number of values.
    #[prost(double, tag = "3")]
    pub num: f64,
    /// Sum of the values.
    #[prost(double, tag = "4")]
    pub sum: f64,
    /// Sum of the squared values.
    #[prost(double, tag = "5")]
    pub sum_squares: f64,
    /// Right (exclusive) edge of each bucket, increasing.
    #[prost(double, repeated, packed = "true", tag = "6")]
    pub bucket_limit: Vec<f64>,
    /// Number of values in each bucket; same length as `bucket_limit`.
    #[prost(double, repeated, packed = "true", tag = "7")]
    pub bucket: Vec<f64>,
}

/// CRC-32C (Castagnoli), the checksum of TFRecord framing.
pub fn crc32c(data: &[u8]) -> u32 {
    const CRC32C: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
    CRC32C.checksum(data)
}

/// The masked CRC-32C stored in TFRecord files: `rotr(crc, 15) + 0xa282ead8`.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    ((c >> 15) | (c << 17)).wrapping_add(0xa282_ead8)
}

/// Appends events to one TensorBoard event file.
///
/// Events are buffered; call [`EventWriter::flush`] to make them visible to a running
/// TensorBoard. Dropping the writer flushes it, ignoring errors.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Create `log_dir` (and its parents) if needed and start a new event file in it,
    /// `events.out.tfevents.<unix_secs>.<hostname>`, whose first event is the file version.
    ///
    /// An existing file is never overwritten: if the name is taken (two writers started in
    /// the same second), a numeric suffix `.1`, `.2`, ... is appended.
    pub fn create(log_dir: &Path) -> Result<Self> {
        fs::create_dir_all(log_dir).map_err(|e| OnnxError::io(log_dir, e))?;
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let base = format!("events.out.tfevents.{secs}.{}", hostname());
        let mut n = 0u32;
        let (path, file) = loop {
            let name = if n == 0 {
                base.clone()
            } else {
                format!("{base}.{n}")
            };
            let path = log_dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(OnnxError::io(path, e)),
            }
        };
        let mut writer = EventWriter {
            path,
            out: BufWriter::new(file),
        };
        writer.write_event(Event {
            wall_time: wall_time(),
            step: 0,
            what: Some(EventKind::FileVersion(FILE_VERSION.into())),
        })?;
        Ok(writer)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append a scalar `value` for `tag` at `step`.
    pub fn add_scalar(&mut self, tag: &str, value: f32, step: i64) -> Result<()> {
        self.write_summary(tag, ValueKind::SimpleValue(value), step)
    }

    /// Append a histogram of `values` for `tag` at `step`.
    ///
    /// Buckets follow TensorFlow's default histogram: edges `±1e-12 * 1.1^k` below `1e20`,
    /// `0` and `±f64::MAX`; runs of empty buckets are merged into one empty bucket, so the
    /// edges of every non-empty bucket are exact. Non-finite values are an error (as in
    /// TensorFlow's `HistogramSummary`) and nothing is written.
    pub fn add_histogram(&mut self, tag: &str, values: &[f32], step: i64) -> Result<()> {
        let histo = histogram(values).map_err(|bad| {
            OnnxError::field(
                format!("histogram '{tag}' at step {step}"),
                format!("{bad} of {} values are NaN or infinite", values.len()),
            )
        })?;
        self.write_summary(tag, ValueKind::Histo(histo), step)
    }

    /// Write buffered events to the file.
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|e| OnnxError::io(&self.path, e))
    }

    fn write_summary(&mut self, tag: &str, value: ValueKind, step: i64) -> Result<()> {
        let summary = Summary {
            value: vec![SummaryValue {
                tag: tag.into(),
                value: Some(value),
            }],
        };
        self.write_event(Event {
            wall_time: wall_time(),
            step,
            what: Some(EventKind::Summary(summary)),
        })
    }

    fn write_event(&mut self, event: Event) -> Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc32c(&data).to_le_bytes());
        self.out
            .write_all(&record)
            .map_err(|e| OnnxError::io(&self.path, e))
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// Read every event of an event file, checking both checksums of every record.
///
/// A truncated record, a checksum mismatch or an undecodable payload is an error naming
/// the file and the byte offset of the record.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let bytes = fs::read(path).map_err(|e| OnnxError::io(path, e))?;
    let mut events = Vec::new();
    let mut offset = 0;
    while offset < bytes.len() {
        let bad = |what: String| {
            OnnxError::io(
                path,
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("record at byte {offset}: {what}"),
                ),
            )
        };
        let truncated = || bad(format!("truncated ({} bytes left)", bytes.len() - offset));
        let rest = &bytes[offset..];
        let (len_bytes, rest) = rest.split_first_chunk::<8>().ok_or_else(truncated)?;
        let (len_crc, rest) = rest.split_first_chunk::<4>().ok_or_else(truncated)?;
        if masked_crc32c(len_bytes) != u32::from_le_bytes(*len_crc) {
            return Err(bad("length checksum mismatch".into()));
        }
        let len = usize::try_from(u64::from_le_bytes(*len_bytes))
            .ok()
            .filter(|&len| len <= rest.len())
            .ok_or_else(truncated)?;
        let (data, rest) = rest.split_at(len);
        let (data_crc, _) = rest.split_first_chunk::<4>().ok_or_else(truncated)?;
        if masked_crc32c(data) != u32::from_le_bytes(*data_crc) {
            return Err(bad("data checksum mismatch".into()));
        }
        events.push(Event::decode(data).map_err(|e| bad(format!("not an Event: {e}")))?);
        offset += 8 + 4 + len + 4;
    }
    Ok(events)
}

/// The scalars of `events`, in file order, as `(tag, step, value)`.
pub fn scalars(events: &[Event]) -> Vec<(String, i64, f32)> {
    let mut out = Vec::new();
    for event in events {
        if let Some(EventKind::Summary(summary)) = &event.what {
            for value in &summary.value {
                if let Some(ValueKind::SimpleValue(v)) = value.value {
                    out.push((value.tag.clone(), event.step, v));
                }
            }
        }
    }
    out
}

/// Seconds since the Unix epoch (0 if the clock is before it).
fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The host name from `/etc/hostname`, restricted to file-name-safe characters, or
/// `localhost`.
fn hostname() -> String {
    let name: String = fs::read_to_string("/etc/hostname")
        .unwrap_or_default()
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// TensorFlow's default histogram edges: `-f64::MAX`, `-1e-12 * 1.1^k` (decreasing `k`),
/// `0`, `1e-12 * 1.1^k` for every `k` with the edge below `1e20`, `f64::MAX`.
fn bucket_limits() -> &'static [f64] {
    static LIMITS: OnceLock<Vec<f64>> = OnceLock::new();
    LIMITS.get_or_init(|| {
        let mut positive = Vec::new();
        let mut v = 1e-12;
        while v < 1e20 {
            positive.push(v);
            v *= 1.1;
        }
        positive.push(f64::MAX);
        let mut limits: Vec<f64> = positive.iter().rev().map(|v| -v).collect();
        limits.push(0.0);
        limits.extend(positive);
        limits
    })
}

/// The histogram of `values`, or the number of non-finite values if there are any.
fn histogram(values: &[f32]) -> std::result::Result<HistogramProto, usize> {
    let non_finite = values.iter().filter(|v| !v.is_finite()).count();
    if non_finite > 0 {
        return Err(non_finite);
    }
    let limits = bucket_limits();
    let mut counts = vec![0u64; limits.len()];
    let (mut min, mut max, mut sum, mut sum_squares) = (f64::INFINITY, f64::NEG_INFINITY, 0.0, 0.0);
    for &v in values {
        let v = f64::from(v);
        min = min.min(v);
        max = max.max(v);
        sum += v;
        sum_squares += v * v;
        // The bucket is the first whose (exclusive) right edge is above v; finite f32 values
        // are below f64::MAX, so it always exists, the `min` is belt and braces.
        let bucket = limits
            .partition_point(|&limit| limit <= v)
            .min(limits.len() - 1);
        counts[bucket] += 1;
    }
    let mut histo = HistogramProto {
        min: if values.is_empty() { 0.0 } else { min },
        max: if values.is_empty() { 0.0 } else { max },
        num: values.len() as f64,
        sum,
        sum_squares,
        bucket_limit: Vec::new(),
        bucket: Vec::new(),
    };
    // Emit non-empty buckets as they are; merge each run of empty buckets into one empty
    // bucket ending where the run ends, so every bucket keeps its true left edge.
    let mut i = 0;
    while i < counts.len() {
        let mut end = i;
        if counts[i] == 0 {
            while end + 1 < counts.len() && counts[end + 1] == 0 {
                end += 1;
            }
        }
        histo.bucket_limit.push(limits[end]);
        histo.bucket.push(counts[end] as f64);
        i = end + 1;
    }
    Ok(histo)
}
