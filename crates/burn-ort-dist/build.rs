//! With the `mpi` feature: compile `csrc/in_place.c` (MPI_IN_PLACE all-reduce) against the
//! MPI headers and libraries the system provides, found the same way rsmpi finds them.

fn main() {
    println!("cargo:rerun-if-changed=csrc/in_place.c");
    #[cfg(feature = "mpi")]
    {
        let lib = build_probe_mpi::probe()
            .unwrap_or_else(|errs| panic!("no MPI library found: {errs:?}"));
        let mut build = cc::Build::new();
        build.file("csrc/in_place.c");
        match lib.mpicc {
            Some(mpicc) => {
                build.compiler(mpicc);
            }
            None => {
                for inc in &lib.include_paths {
                    build.include(inc);
                }
            }
        }
        build.compile("burn_ort_in_place");
        for dir in &lib.lib_paths {
            println!("cargo:rustc-link-search=native={}", dir.display());
        }
        for l in &lib.libs {
            println!("cargo:rustc-link-lib={l}");
        }
    }
}
