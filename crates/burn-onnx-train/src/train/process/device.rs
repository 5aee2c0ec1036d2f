//! Where a run computes (config `device`, `--device`): the CPU through Burn's Flex backend,
//! a GPU through Burn's wgpu backend (Vulkan, Metal, DX12; feature `wgpu`), or a CUDA GPU
//! (feature `cuda`). Every rank of a multi-GPU job takes its node-local GPU unless the
//! config names one.

use std::fmt;
use std::str::FromStr;

use burn::tensor::Device;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{OnnxError, Result};

/// A device as the user writes it: `cpu`, `wgpu`, `wgpu:N`, `cuda` or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The CPU (Flex: SIMD kernels on the host, threads through rayon).
    #[default]
    Cpu,
    /// A wgpu adapter: `None` is wgpu's default choice (a high-power GPU first, else any
    /// adapter, e.g. Mesa's software Vulkan), `Some(n)` the n-th discrete GPU.
    Wgpu(Option<usize>),
    /// A CUDA GPU: `None` is the rank's node-local GPU, `Some(n)` GPU n.
    Cuda(Option<usize>),
}

impl DeviceSpec {
    /// The Burn device of a rank whose index among the ranks of its node is `local_rank`.
    pub fn device(self, local_rank: usize) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::flex()),
            DeviceSpec::Wgpu(index) => wgpu_device(index),
            DeviceSpec::Cuda(index) => cuda_device(index.unwrap_or(local_rank)),
        }
    }

    /// Whether kernels run on the host (the CPU) rather than on a GPU.
    pub fn is_host(self) -> bool {
        self == DeviceSpec::Cpu
    }
}

#[cfg(feature = "wgpu")]
fn wgpu_device(index: Option<usize>) -> Result<Device> {
    use burn::tensor::DeviceKind;
    Ok(Device::wgpu(index.map_or(
        DeviceKind::DefaultDevice,
        DeviceKind::DiscreteGpu,
    )))
}

#[cfg(not(feature = "wgpu"))]
fn wgpu_device(_: Option<usize>) -> Result<Device> {
    Err(OnnxError::field(
        "device",
        "wgpu: this binary was built without the `wgpu` feature (rebuild with --features wgpu)",
    ))
}

#[cfg(feature = "cuda")]
fn cuda_device(index: usize) -> Result<Device> {
    burn_ort_dist::check_cuda_device(index)
        .map_err(|why| OnnxError::field("device", format!("cuda:{index}: {why}")))?;
    Ok(Device::cuda(index))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_: usize) -> Result<Device> {
    Err(OnnxError::field(
        "device",
        "cuda: this binary was built without the `cuda` feature (rebuild with --features cuda)",
    ))
}

pub use burn_ort_dist::local_rank;

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (kind, index) = match s.split_once(':') {
            Some((kind, n)) => (
                kind,
                Some(
                    n.parse::<usize>()
                        .map_err(|_| format!("device `{s}`: `{n}` is not a device index"))?,
                ),
            ),
            None => (s, None),
        };
        match (kind, index) {
            ("cpu", None) => Ok(DeviceSpec::Cpu),
            ("wgpu", index) => Ok(DeviceSpec::Wgpu(index)),
            ("cuda", index) => Ok(DeviceSpec::Cuda(index)),
            _ => Err(format!(
                "device `{s}`: expected cpu, wgpu, wgpu:N, cuda or cuda:N"
            )),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kind, index) = match self {
            DeviceSpec::Cpu => ("cpu", None),
            DeviceSpec::Wgpu(i) => ("wgpu", *i),
            DeviceSpec::Cuda(i) => ("cuda", *i),
        };
        match index {
            Some(i) => write!(f, "{kind}:{i}"),
            None => f.write_str(kind),
        }
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_every_form() {
        for (text, spec) in [
            ("cpu", DeviceSpec::Cpu),
            ("wgpu", DeviceSpec::Wgpu(None)),
            ("wgpu:1", DeviceSpec::Wgpu(Some(1))),
            ("cuda", DeviceSpec::Cuda(None)),
            ("cuda:3", DeviceSpec::Cuda(Some(3))),
        ] {
            assert_eq!(text.parse::<DeviceSpec>().unwrap(), spec);
            assert_eq!(spec.to_string(), text);
        }
        for bad in ["gpu", "cpu:0", "cuda:x", ""] {
            assert!(
                bad.parse::<DeviceSpec>().unwrap_err().contains("device"),
                "{bad}"
            );
        }
    }
}
