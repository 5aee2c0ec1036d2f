//! `tensorboard`: whether it is on and where it writes, as the run's log directory.

use std::path::PathBuf;

use super::key::Key;
use super::kind::{FLAG, TEXT};
use super::reader::Ds;

impl Ds {
    /// `tensorboard`: enabled, the log directory is `output_path/job_name`; disabled, none.
    pub(super) fn tensorboard(&mut self, key: &Key) {
        let (mut enabled, mut output, mut job) = (false, None, None);
        for k in &self.entries(key) {
            match k.name {
                "enabled" => enabled = self.ok(k.read(&FLAG)).unwrap_or(false),
                "output_path" => output = self.ok(k.read(&TEXT)).map(PathBuf::from),
                "job_name" => job = self.ok(k.read(&TEXT)),
                _ => self.other(k),
            }
        }
        let dir = if enabled {
            let dir = output.unwrap_or_else(|| self.c.checkpoint.output_dir.join("tensorboard"));
            match job {
                Some(j) => dir.join(j),
                None => dir,
            }
        } else {
            PathBuf::new()
        };
        self.mapped(&key.path, "logging.log_dir", &dir);
        self.c.logging.log_dir = Some(dir);
    }
}
