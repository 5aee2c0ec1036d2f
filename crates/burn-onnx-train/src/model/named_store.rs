//! Burn's stores (burn-store: `SafetensorsStore`, `BurnpackStore`) for an [`OnnxModel`]
//! keyed by ONNX initializer names with their logical shapes. Burn's own module paths for
//! the model are `params.<k>` with the interpreter's physical rank-8 shapes; these
//! adapters rename and reshape on the way out and back, so `model.save_into(&mut store)`
//! writes a file any safetensors tool reads as the ONNX initializers, and
//! `model.load_from(&mut store)` takes such a file (from PyTorch, Hugging Face or an earlier
//! save) back.
//!
//! ```no_run
//! # use burn_onnx_train::model::named_store::{loading_by_onnx_names, saving_by_onnx_names};
//! # use burn::store::{ModuleSnapshot, SafetensorsStore};
//! # fn f(mut model: burn_onnx_train::OnnxModel) -> burn_onnx_train::error::Result<()> {
//! let mut out = saving_by_onnx_names(&model, SafetensorsStore::from_file("weights.safetensors"));
//! model.save_into(&mut out).unwrap();
//! let mut back = loading_by_onnx_names(&model, SafetensorsStore::from_file("weights.safetensors"))?;
//! model.load_from(&mut back).unwrap();
//! # Ok(()) }
//! ```

use std::collections::HashMap;

use burn::store::bridge::map_data;
use burn::store::{KeyRemapper, ModuleAdapter, ModuleContext, SafetensorsStore};
use burn::tensor::TensorData;
use burn_pack::Tensor as PackTensor;

use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::value::padded;

/// Which way [`OnnxNames`] converts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Module path and physical shape to ONNX name and logical shape.
    Save,
    /// Back: the tensor found for a module path gets the physical shape.
    Load,
}

/// The adapter: each parameter's module path with its ONNX name and logical shape.
#[derive(Debug, Clone)]
pub struct OnnxNames {
    by_path: HashMap<String, (String, Vec<usize>)>,
    direction: Direction,
}

impl OnnxNames {
    fn new(model: &OnnxModel, direction: Direction) -> Self {
        let by_path = model
            .param_infos()
            .iter()
            .enumerate()
            .map(|(k, info)| {
                (
                    format!("params.{k}"),
                    (info.name.clone(), info.shape.clone()),
                )
            })
            .collect();
        OnnxNames { by_path, direction }
    }
}

/// `data` with `shape` (same element count, same bytes).
fn reshaped(data: TensorData, shape: Vec<usize>) -> TensorData {
    let dtype = data.dtype();
    TensorData::from_bytes_vec(data.into_bytes().to_vec(), shape, dtype)
}

impl ModuleAdapter for OnnxNames {
    fn adapt(&self, tensor: PackTensor, _ctx: ModuleContext<'_>) -> PackTensor {
        let Some((name, logical)) = self.by_path.get(&tensor.name) else {
            return tensor;
        };
        let (name, shape) = match self.direction {
            Direction::Save => (name.clone(), logical.clone()),
            Direction::Load => match padded(logical) {
                Ok(p) => (tensor.name.clone(), p.to_vec()),
                Err(_) => return tensor,
            },
        };
        let dtype = tensor.dtype;
        let target = shape.clone();
        map_data(tensor, name, dtype, shape.into(), move |d| {
            reshaped(d, target.clone())
        })
    }

    fn clone_box(&self) -> Box<dyn ModuleAdapter> {
        Box::new(self.clone())
    }
}

/// `store` set to save `model` under ONNX names with logical shapes.
pub fn saving_by_onnx_names(model: &OnnxModel, store: SafetensorsStore) -> SafetensorsStore {
    store.with_to_adapter(OnnxNames::new(model, Direction::Save))
}

/// `store` set to load a file keyed by `model`'s ONNX names (logical shapes) into it.
pub fn loading_by_onnx_names(
    model: &OnnxModel,
    store: SafetensorsStore,
) -> Result<SafetensorsStore> {
    let patterns: Vec<(String, String)> = model
        .param_infos()
        .iter()
        .enumerate()
        .map(|(k, info)| {
            (
                format!("^{}$", regex::escape(&info.name)),
                format!("params.{k}"),
            )
        })
        .collect();
    let remapper = KeyRemapper::from_patterns(patterns)
        .map_err(|e| OnnxError::field("store", format!("cannot match the ONNX names: {e}")))?;
    Ok(store
        .remap(remapper)
        .with_from_adapter(OnnxNames::new(model, Direction::Load)))
}
