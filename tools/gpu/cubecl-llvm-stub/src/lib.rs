//! Stand-in for `cubecl-llvm` in the CUDA verification build (`tools/gpu/build.sh`).
//!
//! cubecl-cuda names a handful of cubecl-llvm items whether or not it uses its LLVM backend:
//! the PTX version of a driver (part of the kernel cache key), the feature restriction the
//! LLVM backend applies, and the LLVM compiler type in its backend enum. With cubecl-cuda's
//! `cpp` feature the default backend is CUDA C++ through NVRTC, so none of the LLVM paths
//! runs; if one did, [`PlironCompiler`] answers with a compilation error naming this crate.

use cubecl_core::Compiler;
use cubecl_core::prelude::KernelDefinition;
use cubecl_environment::backtrace::BackTrace;
use cubecl_runtime::compiler::CompilationError;
use cubecl_runtime::kernel::BufferIOAttr;

pub mod nvptx {
    //! The PTX ISA version a driver loads.
    pub mod ptx_version {
        use core::fmt;

        /// A PTX ISA version as the NVPTX target spells it (8.7 is `87`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct PtxVersion(u32);

        impl PtxVersion {
            /// The newest PTX version a driver of CUDA version `driver` (12.8 is `12080`)
            /// loads, as NVIDIA's PTX ISA release notes pair them; `None` before CUDA 10.
            pub fn for_driver(driver: i32) -> Option<Self> {
                let (major, minor) = (driver / 1000, (driver % 1000) / 10);
                let ptx = match (major, minor) {
                    (13, m) => 90 + m.min(3) as u32,
                    (12, m @ 0..=5) => 80 + m as u32,
                    (12, 6..=8) => 87,
                    (12, _) => 88,
                    (11, m) => 70 + m.min(8) as u32,
                    (10, m) => 63 + m.min(2) as u32,
                    (m, _) if m > 13 => 93,
                    _ => return None,
                };
                Some(Self(ptx))
            }
        }

        impl fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }
    }
}

pub mod shared {
    //! What the LLVM backend would narrow in the device's advertised features.
    pub mod lowered_features {
        use cubecl_core::ir::DeviceProperties;

        /// A GPU target of the LLVM backend.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            Nvptx,
        }

        /// cubecl-cuda calls this only when its LLVM backend compiles; with the `cpp`
        /// backend of this build the properties stay what the CUDA runtime read.
        pub fn restrict_features(_props: &mut DeviceProperties, _target: GpuTarget) {}
    }
}

/// The targets of the LLVM backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlvmTarget {
    #[default]
    Cpu,
    Nvptx,
}

/// The options cubecl-cuda fills in for the LLVM backend.
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    pub arch: Option<()>,
    pub sm_arch: Option<cubecl_core::ir::nvidia::SmArch>,
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    pub grid_constants: bool,
}

/// A compiled PTX module (never produced by this stand-in).
#[derive(Clone, Debug)]
pub struct NvptxModule {
    pub ptx: Vec<core::ffi::c_char>,
    pub entrypoint: String,
    pub ir: String,
    pub shared_memory_size: usize,
    pub io: Vec<BufferIOAttr>,
}

/// What the LLVM backend produces (never produced by this stand-in).
#[derive(Debug)]
pub enum PlironArtifact {
    NvptxCode(NvptxModule),
    Unavailable,
}

impl core::fmt::Display for PlironArtifact {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PlironArtifact::NvptxCode(module) => f.write_str(&module.ir),
            PlironArtifact::Unavailable => f.write_str("<no LLVM backend in this build>"),
        }
    }
}

/// The LLVM backend's compiler: here it refuses every kernel.
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    pub target: LlvmTarget,
}

impl Compiler for PlironCompiler {
    type Representation = PlironArtifact;
    type CompilationOptions = PlironOptions;

    fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &Self::CompilationOptions,
    ) -> Result<Self::Representation, CompilationError> {
        Err(CompilationError::Generic {
            reason: "this binary was built with tools/gpu's cubecl-llvm stand-in: only the CUDA C++ \
                     (NVRTC) backend compiles kernels"
                .into(),
            backtrace: BackTrace::capture(),
        })
    }

    fn extension(&self) -> &'static str {
        "ll"
    }

    fn lang_tag(&self) -> &'static str {
        "llvm"
    }
}
