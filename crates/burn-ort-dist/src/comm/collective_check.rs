//! A self-test of a communicator: every collective and point-to-point operation on known
//! values, each result checked. `ort-dist-check` runs it under `mpirun` to test a
//! distributed set-up; the tests run it on threads.

use crate::comm::communicator::{Communicator, ReduceOp};

fn expect(what: &str, got: &[f32], want: &[f32]) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, want {want:?}"))
    }
}

/// Run every operation of `comm` once and compare with the values it must produce.
pub fn check_collectives(comm: &dyn Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let rf = r as f32;
    let tri = (n * (n - 1) / 2) as f32;
    let err = |e: crate::DistError| e.to_string();

    let mut sum = vec![rf, 1.0];
    comm.all_reduce(&mut sum, ReduceOp::Sum).map_err(err)?;
    expect("all_reduce sum", &sum, &[tri, n as f32])?;
    let mut mean = vec![2.0 * rf];
    comm.all_reduce(&mut mean, ReduceOp::Mean).map_err(err)?;
    expect("all_reduce mean", &mean, &[2.0 * tri / n as f32])?;
    let mut b = vec![rf; 2];
    comm.broadcast(&mut b, n - 1).map_err(err)?;
    expect("broadcast", &b, &[(n - 1) as f32; 2])?;
    let mut g = vec![0.0; n];
    comm.all_gather(&[rf], &mut g).map_err(err)?;
    expect(
        "all_gather",
        &g,
        &(0..n).map(|i| i as f32).collect::<Vec<_>>(),
    )?;
    let mut rs = vec![0.0];
    comm.reduce_scatter(
        &(0..n).map(|i| i as f32).collect::<Vec<_>>(),
        &mut rs,
        ReduceOp::Sum,
    )
    .map_err(err)?;
    expect("reduce_scatter", &rs, &[rf * n as f32])?;
    // Chunks of two, averaged: every rank sends (k + rank) at position k.
    let mut rs2 = vec![0.0; 2];
    comm.reduce_scatter(
        &(0..2 * n).map(|k| (k + r) as f32).collect::<Vec<_>>(),
        &mut rs2,
        ReduceOp::Mean,
    )
    .map_err(err)?;
    let base = (2 * r) as f32 + tri / n as f32;
    expect("reduce_scatter mean", &rs2, &[base, base + 1.0])?;
    if n > 1 {
        // A ring: everyone sends right, receives from the left.
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let mut got = vec![0.0; 3];
        if r % 2 == 0 {
            comm.send(&[rf; 3], right).map_err(err)?;
            comm.recv(&mut got, left).map_err(err)?;
        } else {
            comm.recv(&mut got, left).map_err(err)?;
            comm.send(&[rf; 3], right).map_err(err)?;
        }
        expect("send/recv ring", &got, &[left as f32; 3])?;
    }
    // Two sub-groups by parity, ranked in reverse order of the old ranks.
    let sub = comm.split(r % 2, n - r).map_err(err)?;
    let members: Vec<usize> = (0..n).filter(|i| i % 2 == r % 2).collect();
    if sub.world_size() != members.len()
        || sub.rank() != members.len() - 1 - members.iter().position(|&m| m == r).unwrap_or(0)
    {
        return Err(format!(
            "split: rank {} of {} in the sub-group",
            sub.rank(),
            sub.world_size()
        ));
    }
    let mut s = vec![rf];
    sub.all_reduce(&mut s, ReduceOp::Sum).map_err(err)?;
    expect(
        "sub-group all_reduce",
        &s,
        &[members.iter().sum::<usize>() as f32],
    )?;
    comm.barrier().map_err(err)
}
