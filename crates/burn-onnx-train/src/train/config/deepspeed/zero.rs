//! `zero_optimization`: the ZeRO stage, the optimizer and parameter offloads, their one
//! directory (`nvme_path`) and the deprecated `cpu_offload` flags.

use std::path::PathBuf;

use serde::Serialize;

use super::key::{Key, find};
use super::kind::{COUNT, FLAG, TEXT};
use super::reader::Ds;
use crate::train::config::{OffloadTarget, ParamOffload, TrainingConfig};

impl Ds {
    /// `zero_optimization`: the stage and the offloads.
    pub(super) fn zero(&mut self, key: &Key) {
        for k in &self.entries(key) {
            match k.name {
                "stage" => {
                    if let Some(s) = self.given(k, &COUNT, "parallel.zero_stage") {
                        self.c.parallel.zero_stage = s;
                    }
                }
                "offload_optimizer" => self.offload(
                    k,
                    "offload.offload_optimizer",
                    [OffloadTarget::None, OffloadTarget::Cpu, OffloadTarget::Disk],
                    |c, t| c.offload.offload_optimizer = t,
                ),
                "offload_param" => self.offload(
                    k,
                    "offload.offload_params",
                    [ParamOffload::None, ParamOffload::Cpu, ParamOffload::Disk],
                    |c, t| c.offload.offload_params = t,
                ),
                "cpu_offload" => self.cpu_offload(
                    k,
                    "offload.offload_optimizer",
                    OffloadTarget::Cpu,
                    |c, t| c.offload.offload_optimizer = t,
                ),
                "cpu_offload_param" => {
                    self.cpu_offload(k, "offload.offload_params", ParamOffload::Cpu, |c, t| {
                        c.offload.offload_params = t
                    })
                }
                _ => self.other(k),
            }
        }
    }

    /// An offload section: `device` "none", "cpu" or "nvme" picks among `targets`, set as
    /// our `field` with `set`; `nvme_path` is the offload directory (read with "nvme" only);
    /// the other keys tune DeepSpeed's transfers.
    fn offload<T: Serialize + Copy>(
        &mut self,
        key: &Key,
        field: &str,
        targets: [T; 3],
        set: impl FnOnce(&mut TrainingConfig, T),
    ) {
        const DEVICES: [&str; 3] = ["none", "cpu", "nvme"];
        let keys = self.entries(key);
        let Some(device) = find(&keys, "device") else {
            return self.fail(format!(
                "{}.device: missing (\"none\", \"cpu\" or \"nvme\")",
                key.path
            ));
        };
        let name = self.ok(device.read(&TEXT));
        let chosen = name
            .as_deref()
            .and_then(|n| DEVICES.iter().position(|d| *d == n));
        match chosen {
            Some(i) => {
                self.mapped(&device.shown(), field, targets[i]);
                set(&mut self.c, targets[i]);
            }
            None if name.is_some() => {
                self.fail(device.expected(&["\"none\"", "\"cpu\"", "\"nvme\""]));
            }
            None => {}
        }
        let nvme = chosen == Some(2);
        for k in &keys {
            match k.name {
                "device" => {}
                "nvme_path" if nvme => self.nvme_path(k),
                "nvme_path" => self.no_ops.push((
                    k.path.clone(),
                    "read by DeepSpeed only with device \"nvme\"",
                )),
                _ => self.other(k),
            }
        }
    }

    /// An `nvme_path`: the offload directory, the same for every offload of the file.
    fn nvme_path(&mut self, key: &Key) {
        let Some(dir) = self.ok(key.read(&TEXT)).map(PathBuf::from) else {
            return;
        };
        let clash = self.nvme_path.as_ref().filter(|(_, d)| *d != dir).map(|(other, d)| {
            format!(
                "{} {dir:?} differs from {other} {d:?}: this trainer keeps every offload file in one directory",
                key.path
            )
        });
        if let Some(message) = clash {
            return self.fail(message);
        }
        self.mapped(&key.shown(), "offload.offload_dir", &dir);
        self.nvme_path = Some((key.path.clone(), dir.clone()));
        self.c.offload.offload_dir = Some(dir);
    }

    /// The deprecated `cpu_offload` / `cpu_offload_param`: true offloads to `cpu`, set as our
    /// `field` with `set`.
    fn cpu_offload<T: Serialize + Copy>(
        &mut self,
        key: &Key,
        field: &str,
        cpu: T,
        set: impl FnOnce(&mut TrainingConfig, T),
    ) {
        if self.ok(key.read(&FLAG)) == Some(true) {
            self.mapped(&key.shown(), field, cpu);
            set(&mut self.c, cpu);
        }
    }
}
