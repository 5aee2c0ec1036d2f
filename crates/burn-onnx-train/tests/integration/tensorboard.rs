//! TensorBoard event files.
//!
//! * Scalars and a histogram written by `EventWriter` read back with their tags, steps and
//!   values; histogram buckets are recounted from the values.
//! * CRC-32C matches the standard check value, and the masked CRC the value computed by
//!   TensorBoard's own Python implementation.
//! * Any flipped byte and any truncation of the file is an error naming the file.
//! * When `TENSORBOARD_PYTHON` names a Python with the `tensorboard` package, TensorBoard's
//!   `EventAccumulator` loads the file written here and must see the same data.

use super::common;

use common::{python_for, tempdir};

use std::path::{Path, PathBuf};
use std::process::Command;

use burn_onnx_train::train::report::tensorboard::{
    EventKind, EventWriter, FILE_VERSION, HistogramProto, ValueKind, crc32c, masked_crc32c,
    read_events, scalars,
};

const LOSS: [f32; 5] = [2.5, 1.75, 1.125, 0.8, 0.6125];
const HISTO_VALUES: [f32; 7] = [-2.0, -0.5, 0.0, 0.25, 0.95, 1.0, 3.0];

/// Writes `loss` at steps 0, 10, ..., `lr` at step 0 and a histogram `weights` at step 7.
fn write_run(dir: &Path) -> PathBuf {
    let mut w = EventWriter::create(dir).unwrap();
    w.add_scalar("train/lr", 0.01, 0).unwrap();
    for (i, loss) in LOSS.iter().enumerate() {
        w.add_scalar("loss", *loss, 10 * i as i64).unwrap();
    }
    w.add_histogram("weights", &HISTO_VALUES, 7).unwrap();
    w.flush().unwrap();
    w.path().to_path_buf()
}

fn histograms(
    events: &[burn_onnx_train::train::report::tensorboard::Event],
) -> Vec<(String, i64, HistogramProto)> {
    let mut out = Vec::new();
    for e in events {
        if let Some(EventKind::Summary(s)) = &e.what {
            for v in &s.value {
                if let Some(ValueKind::Histo(h)) = &v.value {
                    out.push((v.tag.clone(), e.step, h.clone()));
                }
            }
        }
    }
    out
}

#[test]
fn scalars_and_histogram_round_trip() {
    let dir = tempdir("tensorboard-roundtrip");
    let path = write_run(&dir);
    eprintln!("event file: {}", path.display());
    assert_eq!(path.parent(), Some(dir.as_path()));
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");

    let events = read_events(&path).unwrap();
    assert_eq!(events.len(), 1 + 1 + LOSS.len() + 1);
    assert_eq!(
        events[0].what,
        Some(EventKind::FileVersion(FILE_VERSION.into()))
    );
    assert_eq!(FILE_VERSION, "brain.Event:2");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    for e in &events {
        assert!(
            e.wall_time > now - 600.0 && e.wall_time <= now + 1.0,
            "wall_time {}",
            e.wall_time
        );
    }

    let mut expected = vec![("train/lr".to_string(), 0, 0.01f32)];
    expected.extend(
        LOSS.iter()
            .enumerate()
            .map(|(i, &l)| ("loss".to_string(), 10 * i as i64, l)),
    );
    assert_eq!(scalars(&events), expected);

    let histos = histograms(&events);
    assert_eq!(histos.len(), 1);
    let (tag, step, h) = &histos[0];
    assert_eq!((tag.as_str(), *step), ("weights", 7));
    assert_eq!(h.num, 7.0);
    assert_eq!(h.min, -2.0);
    assert_eq!(h.max, 3.0);
    let sum: f64 = HISTO_VALUES.iter().map(|&v| f64::from(v)).sum();
    let sum_squares: f64 = HISTO_VALUES
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum();
    assert_eq!(h.sum, sum);
    assert!((h.sum - 2.7).abs() < 1e-6, "sum {}", h.sum);
    assert_eq!(h.sum_squares, sum_squares);

    // Buckets: aligned, increasing, covering everything up to f64::MAX, and each count equal
    // to the number of values in [previous limit, limit).
    assert_eq!(h.bucket_limit.len(), h.bucket.len());
    assert!(
        h.bucket_limit.windows(2).all(|w| w[0] < w[1]),
        "{:?}",
        h.bucket_limit
    );
    assert_eq!(h.bucket_limit.last(), Some(&f64::MAX));
    assert_eq!(h.bucket.iter().sum::<f64>(), 7.0);
    let mut left = -f64::MAX;
    for (&limit, &count) in h.bucket_limit.iter().zip(&h.bucket) {
        let inside = HISTO_VALUES
            .iter()
            .filter(|&&v| f64::from(v) >= left && f64::from(v) < limit)
            .count();
        assert_eq!(count, inside as f64, "bucket [{left}, {limit})");
        left = limit;
    }
    // Seven values, each alone in a bucket of relative width 10% except 0.95 and 1.0, which
    // share [1e-12 * 1.1^289, 1e-12 * 1.1^290) = [0.917, 1.0086); 0 lands in [0, 1e-12).
    let nonempty: Vec<(f64, f64)> = h
        .bucket_limit
        .iter()
        .zip(&h.bucket)
        .filter(|(_, c)| **c > 0.0)
        .map(|(l, c)| (*l, *c))
        .collect();
    assert_eq!(nonempty.len(), 6, "{nonempty:?}");
    assert!(
        nonempty.iter().any(|&(l, c)| l == 1e-12 && c == 1.0),
        "{nonempty:?}"
    );
    assert!(
        nonempty
            .iter()
            .any(|&(l, c)| l > 1.0 && l < 1.01 && c == 2.0),
        "{nonempty:?}"
    );
    for (l, _) in &nonempty {
        let i = h.bucket_limit.iter().position(|x| x == l).unwrap();
        let prev = if i == 0 {
            -f64::MAX
        } else {
            h.bucket_limit[i - 1]
        };
        if *l != 1e-12 {
            let ratio = if *l > 0.0 { l / prev } else { prev / l };
            assert!(
                (ratio - 1.1).abs() < 1e-9,
                "bucket [{prev}, {l}) is not one 10% step"
            );
        }
    }

    // TensorBoard itself, when available.
    let Some(python) = python_for("TENSORBOARD_PYTHON", "TensorBoard EventAccumulator") else {
        return;
    };
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0, 'histograms': 0})
ea.Reload()
tags = ea.Tags()
out = {
    'scalars': sorted(tags['scalars']),
    'histograms': tags['histograms'],
    'loss': [[s.step, s.value] for s in ea.Scalars('loss')],
    'weights': [[h.step, h.histogram_value.num, h.histogram_value.min, h.histogram_value.max,
                 h.histogram_value.sum, sum(h.histogram_value.bucket)] for h in ea.Histograms('weights')],
}
print(json.dumps(out))
"#;
    let output = Command::new(python)
        .arg("-c")
        .arg(script)
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "EventAccumulator failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    eprintln!("EventAccumulator: {stdout}");
    let seen: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(seen["scalars"], serde_json::json!(["loss", "train/lr"]));
    assert_eq!(seen["histograms"], serde_json::json!(["weights"]));
    let loss = seen["loss"].as_array().unwrap();
    assert_eq!(loss.len(), LOSS.len());
    for (i, (s, l)) in loss.iter().zip(LOSS).enumerate() {
        assert_eq!(s[0].as_i64(), Some(10 * i as i64));
        assert_eq!(s[1].as_f64(), Some(f64::from(l)));
    }
    assert_eq!(
        seen["weights"],
        serde_json::json!([[7, 7.0, -2.0, 3.0, sum, 7.0]])
    );
}

#[test]
fn crc32c_matches_independent_values() {
    // The standard CRC-32C check value.
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(b""), 0);
    // Computed by tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c.
    assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    assert_eq!(masked_crc32c(&0u64.to_le_bytes()), 0x0798_0329);
}

#[test]
fn corrupted_or_truncated_file_is_an_error() {
    let dir = tempdir("tensorboard-corrupt");
    let path = write_run(&dir);
    let good = std::fs::read(&path).unwrap();
    assert_eq!(read_events(&path).unwrap().len(), 8);
    let first_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let second = 8 + 4 + first_len + 4;
    let positions = [
        0,               // length of the first record
        9,               // its length checksum
        14,              // its payload
        second - 1,      // its payload checksum
        second + 3,      // length of the second record
        second + 12 + 2, // its payload
        good.len() / 2,  // somewhere in the middle
        good.len() - 1,  // last checksum byte
    ];
    for pos in positions {
        let mut bad = good.clone();
        bad[pos] ^= 0x20;
        std::fs::write(&path, &bad).unwrap();
        let err = read_events(&path)
            .expect_err(&format!("flipped byte {pos} not detected"))
            .to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert!(err.contains("record at byte"), "{err}");
    }
    // A flip in the second record names the second record's offset.
    let mut bad = good.clone();
    bad[second + 12 + 2] ^= 1;
    std::fs::write(&path, &bad).unwrap();
    let err = read_events(&path).unwrap_err().to_string();
    assert!(
        err.contains(&format!("record at byte {second}: data checksum mismatch")),
        "{err}"
    );

    for cut in [1, 4, 12, good.len() - 3] {
        std::fs::write(&path, &good[..good.len() - cut]).unwrap();
        let err = read_events(&path)
            .expect_err(&format!("truncation by {cut} not detected"))
            .to_string();
        assert!(err.contains("truncated"), "{err}");
    }
    // A huge declared length with a valid checksum is a truncation, not an allocation.
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(&masked_crc32c(&u64::MAX.to_le_bytes()).to_le_bytes());
    std::fs::write(&path, &huge).unwrap();
    assert!(
        read_events(&path)
            .unwrap_err()
            .to_string()
            .contains("truncated")
    );

    std::fs::write(&path, &good).unwrap();
    assert_eq!(read_events(&path).unwrap().len(), 8);
    assert!(
        read_events(&dir.join("missing"))
            .unwrap_err()
            .to_string()
            .contains("missing")
    );
}

#[test]
fn non_finite_histogram_is_an_error_and_writes_nothing() {
    let dir = tempdir("tensorboard-nonfinite");
    let mut w = EventWriter::create(&dir).unwrap();
    let err = w
        .add_histogram("w", &[1.0, f32::NAN, f32::INFINITY], 3)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("histogram 'w' at step 3") && err.contains("2 of 3"),
        "{err}"
    );
    w.add_histogram("empty", &[], 4).unwrap();
    w.add_scalar("after", 1.5, 5).unwrap();
    w.flush().unwrap();
    let events = read_events(w.path()).unwrap();
    assert_eq!(events.len(), 3);
    assert_eq!(scalars(&events), vec![("after".to_string(), 5, 1.5)]);
    let histos = histograms(&events);
    assert_eq!(histos.len(), 1);
    assert_eq!(
        (
            histos[0].0.as_str(),
            histos[0].2.num,
            histos[0].2.bucket.iter().sum::<f64>()
        ),
        ("empty", 0.0, 0.0)
    );
}

#[test]
fn two_writers_in_one_directory_never_clobber() {
    let dir = tempdir("tensorboard-two");
    let mut a = EventWriter::create(&dir).unwrap();
    let mut b = EventWriter::create(&dir).unwrap();
    assert_ne!(a.path(), b.path());
    a.add_scalar("a", 1.0, 1).unwrap();
    b.add_scalar("b", 2.0, 2).unwrap();
    let (pa, pb) = (a.path().to_path_buf(), b.path().to_path_buf());
    drop(a);
    drop(b); // Drop flushes.
    assert_eq!(
        scalars(&read_events(&pa).unwrap()),
        vec![("a".to_string(), 1, 1.0)]
    );
    assert_eq!(
        scalars(&read_events(&pb).unwrap()),
        vec![("b".to_string(), 2, 2.0)]
    );
}
