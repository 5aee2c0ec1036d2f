//! The library without its front ends (`default-features = false`) pulls in none of the
//! CLI's dependencies: no clap, no indicatif, no log subscriber, no mimalloc C build
//! (issue 28). Read from `cargo tree` over the workspace's lock file.

use std::path::Path;
use std::process::Command;

fn normal_dependencies(features: &[&str]) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut cmd = Command::new(env!("CARGO"));
    cmd.current_dir(&root).args([
        "tree",
        "--offline",
        "-p",
        "burn-onnx-train",
        "-e",
        "normal",
        "--prefix",
        "none",
        "--no-default-features",
    ]);
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    let out = cmd.output().expect("cargo tree runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn crates_in(tree: &str, names: &[&str]) -> Vec<String> {
    let mut found: Vec<String> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| names.contains(c))
        .map(str::to_string)
        .collect();
    found.sort();
    found.dedup();
    found
}

const CLI_ONLY: &[&str] = &[
    "clap",
    "indicatif",
    "tracing-subscriber",
    "mimalloc",
    "libmimalloc-sys",
    "tokenizers",
];

#[test]
fn the_library_alone_builds_without_the_cli_dependencies() {
    let lib = normal_dependencies(&[]);
    assert!(
        lib.contains("burn "),
        "cargo tree lists the crate's dependencies: {lib}"
    );
    assert_eq!(crates_in(&lib, CLI_ONLY), Vec::<String>::new());
    // The check sees them where they are: the `cli` feature brings every one in.
    assert_eq!(
        crates_in(&normal_dependencies(&["cli"]), CLI_ONLY).len(),
        CLI_ONLY.len()
    );
}
