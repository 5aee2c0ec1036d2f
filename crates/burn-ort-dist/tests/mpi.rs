//! The MPI communicator under `mpirun` (feature `mpi`): `ort-dist-check` runs every
//! operation on 2, 3 and 4 ranks and checks the results.
#![cfg(feature = "mpi")]

use std::process::Command;

#[test]
fn every_operation_checks_out_under_mpirun() {
    for np in [2, 3, 4] {
        let out = Command::new("timeout")
            .args([
                "-k",
                "10",
                "120",
                "mpirun",
                "--oversubscribe",
                "-np",
                &np.to_string(),
                env!("CARGO_BIN_EXE_ort-dist-check"),
            ])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .output()
            .unwrap();
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
