//! Shard loading and distributed sampling semantics.

use std::collections::HashSet;

use super::common;

use burn_onnx_train::Value;
use burn_onnx_train::train::data::npy::write_npy;
use burn_onnx_train::train::data::{
    Dataset, DistributedSampler, ImageDataset, Prefetcher, Target, TokenDataset,
};
use burn_onnx_train::value::host_tensor::HostTensor;
use ndarray::{ArrayD, IxDyn};

fn sampler(len: usize, rank: usize, world: usize) -> DistributedSampler {
    DistributedSampler {
        len,
        batch_size: 2,
        rank,
        world,
        seed: 7,
        shuffle: true,
        balance: None,
        last_order: Default::default(),
    }
}

#[test]
fn ranks_get_disjoint_shares_padded_from_the_head() {
    // 10 samples over 4 ranks: 12 slots, the first 2 shuffled indices are repeated.
    let shares: Vec<Vec<usize>> = (0..4).map(|r| sampler(10, r, 4).epoch_indices(0)).collect();
    assert!(shares.iter().all(|s| s.len() == 3));
    let all: Vec<usize> = shares.iter().flatten().copied().collect();
    let distinct: HashSet<usize> = all.iter().copied().collect();
    assert_eq!(distinct.len(), 10, "every sample is seen");
    let whole = sampler(10, 0, 1).epoch_indices(0);
    assert_eq!(all.len() - distinct.len(), 2);
    for (r, share) in shares.iter().enumerate() {
        for (k, &i) in share.iter().enumerate() {
            let pos = r + 4 * k;
            assert_eq!(
                i,
                whole[pos % 10],
                "rank {r} slot {k} is padded from the head of the same permutation"
            );
        }
    }
    // Same epoch, same order on every call; another epoch reshuffles.
    assert_eq!(sampler(10, 1, 4).epoch_indices(0), shares[1]);
    assert_ne!(sampler(10, 0, 1).epoch_indices(1), whole);
}

#[test]
fn batches_continue_across_epochs() {
    let s = sampler(10, 0, 1);
    assert_eq!(s.batches_per_epoch(), 5);
    assert_eq!(
        s.batch_indices(5).unwrap(),
        s.epoch_indices(1)[0..2].to_vec()
    );
    let too_big = DistributedSampler {
        batch_size: 20,
        ..s
    };
    assert!(
        too_big
            .batch_indices(0)
            .unwrap_err()
            .to_string()
            .contains("config.data.batch_size")
    );
}

#[test]
fn shards_load_from_directories() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("onnx-train-data");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("tok")).unwrap();
    std::fs::create_dir_all(dir.join("img")).unwrap();
    let ids = |v: Vec<i64>| Value::Int(ArrayD::from_shape_vec(IxDyn(&[v.len()]), v).unwrap());
    write_npy(dir.join("tok/a.npy"), &ids((0..10).collect())).unwrap();
    write_npy(dir.join("tok/b.npy"), &ids((10..17).collect())).unwrap();
    let tokens = TokenDataset::load(&dir.join("tok"), 4).unwrap();
    assert_eq!(tokens.len(), 4);
    let b = tokens.batch(&[3, 0]).unwrap();
    assert_eq!(
        b.input,
        HostTensor::Int(
            ArrayD::from_shape_vec(IxDyn(&[2, 4]), vec![12, 13, 14, 15, 0, 1, 2, 3]).unwrap()
        )
    );
    assert_eq!((b.target, b.items), (Target::NextToken, 8));

    let device = burn::tensor::Device::flex();
    let imgs = ArrayD::from_shape_fn(IxDyn(&[3, 1, 2, 2]), |i| i[0] as f32);
    let imgs = Value::Float(burn_onnx_train::FloatValue::from_array(&imgs, &device).unwrap());
    write_npy(dir.join("img/images_0.npy"), &imgs).unwrap();
    write_npy(dir.join("img/labels_0.npy"), &ids(vec![5, 6, 7])).unwrap();
    let images = ImageDataset::load(&dir.join("img")).unwrap();
    let b = images.batch(&[2]).unwrap();
    assert_eq!(
        b.target,
        Target::Classes(ArrayD::from_shape_vec(IxDyn(&[1]), vec![7]).unwrap())
    );
    let HostTensor::Float(x) = b.input else {
        panic!()
    };
    assert!(x.iter().all(|&v| v == 2.0));

    let err = TokenDataset::load(&dir.join("img"), 4)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("images_0.npy") && err.contains("1-D"), "{err}");
    let err = ImageDataset::load(&dir.join("tok"))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no images_"), "{err}");
}

#[test]
fn prefetcher_yields_the_sampler_batches_in_order() {
    let data = std::sync::Arc::new(TokenDataset::from_tokens((0..64).collect(), 4).unwrap());
    let s = DistributedSampler {
        len: 16,
        batch_size: 4,
        rank: 0,
        world: 1,
        seed: 3,
        shuffle: true,
        balance: None,
        last_order: Default::default(),
    };
    let p = Prefetcher::start(data.clone(), s.clone(), 2, 2, 1);
    for k in 2..9 {
        assert_eq!(
            p.next_batch().unwrap(),
            data.batch(&s.batch_indices(k).unwrap()).unwrap()
        );
    }
}

/// Token shards as NumPy, nanoGPT and llm.c write them (numpy writes each file here), read
/// in place: uint16 / int32 / uint8 `.npy`, nanoGPT's raw uint16 `.bin`, llm.c's headed
/// `.bin` (u16 and u32), windows that span shards, one file named directly; big-endian
/// arrays, a wrong llm.c version and a truncated file are errors naming the file.
#[test]
fn token_shards_of_numpy_nanogpt_and_llmc_are_read_in_place() {
    let Some(python) = common::python_for("ONNX_TRAIN_PYTHON", "numpy token shard") else {
        return;
    };
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("onnx-train-token-shards");
    let _ = std::fs::remove_dir_all(&dir);
    for sub in ["mixed", "bad_endian", "bad_version", "truncated"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let script = r#"
import sys, numpy as np
d = sys.argv[1]
def llmc(path, toks, version):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, version, len(toks)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(toks.tobytes())
np.save(f"{d}/mixed/a.npy", np.arange(0, 5, dtype=np.uint16) + 60000)
np.save(f"{d}/mixed/b.npy", np.arange(5, 9, dtype=np.int32) - 7)
np.save(f"{d}/mixed/c.npy", np.arange(9, 12, dtype=np.uint8))
np.arange(12, 15, dtype=np.uint16).tofile(f"{d}/mixed/d.bin")
llmc(f"{d}/mixed/e.bin", np.arange(15, 18, dtype=np.uint16), 1)
llmc(f"{d}/mixed/f.bin", np.arange(18, 20, dtype=np.uint32) + 100000, 2)
np.save(f"{d}/bad_endian/a.npy", np.arange(8, dtype=">u2"))
llmc(f"{d}/bad_version/a.bin", np.arange(8, dtype=np.uint16), 7)
llmc(f"{d}/truncated/a.bin", np.arange(8, dtype=np.uint16), 1)
with open(f"{d}/truncated/a.bin", "r+b") as f:
    f.truncate(1024 + 10)
"#;
    let status = std::process::Command::new(&python)
        .args(["-c", script, dir.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success(), "numpy could not write the shards");

    // The stream numpy wrote: 60000..60004, -2..1, 9..11, 12..14, 15..17, 100018, 100019.
    let mut want: Vec<i64> = (0..5).map(|i| 60000 + i).collect();
    want.extend((5..9).map(|i| i - 7));
    want.extend(9..18);
    want.extend([100018, 100019]);
    let data = TokenDataset::load(&dir.join("mixed"), 3).unwrap();
    assert_eq!(data.len(), want.len() / 3);
    let all: Vec<usize> = (0..data.len()).collect();
    let HostTensor::Int(got) = data.batch(&all).unwrap().input else {
        panic!("integer batch")
    };
    assert_eq!(got.iter().copied().collect::<Vec<_>>(), want[..18]);
    // Window 1 (tokens 3..6) spans a.npy and b.npy; window 5 (15..18) is e.bin whole.
    let HostTensor::Int(w) = data.batch(&[1]).unwrap().input else {
        panic!("integer batch")
    };
    assert_eq!(w.iter().copied().collect::<Vec<_>>(), [60003, 60004, -2]);
    let (lo, hi) = data.id_range().unwrap();
    assert_eq!((lo.value, lo.index), (-2, 0));
    assert!(lo.source.ends_with("b.npy"), "{lo}");
    assert_eq!((hi.value, hi.index), (100019, 1));
    assert!(hi.source.ends_with("f.bin"), "{hi}");

    // One file named directly (nanoGPT's `train.bin` beside its `val.bin`).
    let one = TokenDataset::load(&dir.join("mixed/d.bin"), 3).unwrap();
    let HostTensor::Int(w) = one.batch(&[0]).unwrap().input else {
        panic!("integer batch")
    };
    assert_eq!(w.iter().copied().collect::<Vec<_>>(), [12, 13, 14]);

    for (sub, says) in [
        ("bad_endian", "big-endian"),
        ("bad_version", "version"),
        ("truncated", "bytes"),
    ] {
        let err = TokenDataset::load(&dir.join(sub), 2)
            .err()
            .unwrap_or_else(|| panic!("{sub}: loaded"))
            .to_string();
        assert!(err.contains("a.") && err.contains(says), "{sub}: {err}");
    }
}
