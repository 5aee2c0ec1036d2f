//! The MPI communicator under `mpirun` (feature `mpi`): `ort-dist-check` runs every
//! operation on 2, 3 and 4 ranks and checks the results.
#![cfg(feature = "mpi")]

use std::process::Command;

/// `ort-dist-check ARGS` on `np` ranks under mpirun (as root, oversubscribed), with an
/// outer limit of 120 s.
fn ort_dist_check(np: usize, args: &[&str]) -> std::process::Output {
    Command::new("timeout")
        .args([
            "-k",
            "10",
            "120",
            "mpirun",
            "--oversubscribe",
            "-np",
            &np.to_string(),
        ])
        .arg(env!("CARGO_BIN_EXE_ort-dist-check"))
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .unwrap()
}

#[test]
fn every_operation_checks_out_under_mpirun() {
    for np in [2, 3, 4] {
        let out = ort_dist_check(np, &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "np {np}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(&format!("{np} of {np} ranks OK")),
            "{stdout}"
        );
    }
}

/// `ort-dist-check --stall-rank` on 3 ranks with a 2-second timeout: `stall_in` "nothing"
/// (rank 2 hangs outside any communication) or "receive" (rank 2 waits in another
/// operation). Returns the job's stderr; asserts it ended, non-zero, well before the
/// outer limit.
fn stalled_job(stall_in: &str) -> String {
    let start = std::time::Instant::now();
    let args = [
        "--timeout",
        "2",
        "--stall-rank",
        "2",
        "--stall-in",
        stall_in,
    ];
    let out = ort_dist_check(3, &args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "a hung rank must end the job: {stderr}"
    );
    assert_ne!(
        out.status.code(),
        Some(124),
        "the job hung until the outer timeout: {stderr}"
    );
    assert!(
        start.elapsed().as_secs() < 60,
        "took {:?}: {stderr}",
        start.elapsed()
    );
    stderr
}

#[test]
fn a_hung_rank_ends_the_job_with_an_error_naming_it() {
    let stderr = stalled_job("nothing");
    assert!(
        stderr.contains(
            "collective timed out: all_reduce of 4 B in the group of world ranks [0, 1, 2]"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("never arrived: world rank(s) [2]"),
        "{stderr}"
    );
}

#[test]
fn a_rank_waiting_in_another_operation_is_named_with_it() {
    let stderr = stalled_job("receive");
    assert!(stderr.contains("all_reduce of 4 B"), "{stderr}");
    assert!(
        stderr.contains("world rank 2 waits in receive #") && stderr.contains("of 16 B instead"),
        "{stderr}"
    );
    assert!(!stderr.contains("never arrived"), "{stderr}");
}

/// `ort-dist-check --bandwidth` on 2 ranks: rank 0 prints nccl-tests' table, a row per
/// collective and size, whose bus bandwidth is the algorithm bandwidth times nccl-tests'
/// factor for 2 ranks (1 for an all-reduce and a broadcast, 1/2 for the gathers).
#[test]
fn the_bandwidth_table_has_a_row_per_collective_and_size() {
    let args = [
        "--bandwidth",
        "--min-bytes",
        "1K",
        "--max-bytes",
        "64K",
        "--iters",
        "3",
    ];
    let out = ort_dist_check(2, &args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() == 6 && w[0].parse::<usize>().is_ok())
        .collect();
    let sizes = [1024, 2048, 4096, 8192, 16384, 32768, 65536];
    let collectives = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"];
    assert_eq!(rows.len(), sizes.len() * collectives.len(), "{stdout}");
    for (i, w) in rows.iter().enumerate() {
        let (name, bytes) = (collectives[i / sizes.len()], sizes[i % sizes.len()]);
        assert_eq!(
            (w[2], w[0], w[1]),
            (name, &*bytes.to_string(), &*(bytes / 4).to_string())
        );
        let num = |k: usize| w[k].parse::<f64>().unwrap();
        let (us, alg, bus) = (num(3), num(4), num(5));
        // Algorithm bandwidth is bytes over time, to the table's rounding (0.01 GB/s, and
        // 0.1 us of the time; a loaded machine can take milliseconds for 1 KB: 0.00 GB/s).
        assert!(us > 0.0, "{w:?}");
        // The time printed t stands for one in [t - 0.05, t + 0.05].
        let alg_at = |t: f64| bytes as f64 / (t.max(1e-3) * 1e3);
        let (low, high) = (alg_at(us + 0.05) - 0.0051, alg_at(us - 0.05) + 0.0051);
        assert!(low <= alg && alg <= high, "{w:?}");
        let factor = if matches!(name, "all_gather" | "reduce_scatter") {
            0.5
        } else {
            1.0
        };
        // The table rounds to 0.01 GB/s.
        assert!((bus - alg * factor).abs() <= 0.011, "{w:?}");
    }
}
