//! Replacing a module's parameters without holding two copies of them: [`Release`] drops
//! the old values first (each parameter becomes an empty tensor on its device, still taking
//! gradients if it did), and [`Place`] puts new flat values in, reshaped. Between the two
//! the new values are made one by one (gathered from ZeRO shards, written back from a host
//! update), so memory holds the model once.

use std::collections::{HashMap, HashSet};

use burn::module::{ModuleMapper, Param, ParamId};
use burn::tensor::{Device, Tensor};

/// Releases the parameters in `only` (all when `None`), recording each one's device.
pub struct Release {
    only: Option<HashSet<ParamId>>,
    /// The device of each released parameter.
    pub devices: HashMap<ParamId, Device>,
}

impl Release {
    /// Release every parameter.
    pub fn all() -> Self {
        Release {
            only: None,
            devices: HashMap::new(),
        }
    }

    /// Release the parameters in `ids`.
    pub fn only(ids: impl IntoIterator<Item = ParamId>) -> Self {
        Release {
            only: Some(ids.into_iter().collect()),
            devices: HashMap::new(),
        }
    }
}

impl ModuleMapper for Release {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.only.as_ref().is_some_and(|o| !o.contains(&param.id)) {
            return param;
        }
        let id = param.id;
        param.map(|t| {
            let (device, require) = (t.device(), t.is_require_grad());
            drop(t);
            let empty = Tensor::<D>::empty([0; D], &device).set_require_grad(require);
            self.devices.insert(id, device);
            empty
        })
    }
}

/// Puts new values (flat tensors on the parameters' devices, with their shapes) in place
/// of the parameters they name; the others stay.
pub struct Place(pub HashMap<ParamId, (Tensor<1>, Vec<usize>)>);

impl ModuleMapper for Place {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some((flat, shape)) = self.0.remove(&param.id) else {
            return param;
        };
        param.map(|t| {
            let require = t.is_require_grad();
            let shape: [usize; D] = shape.try_into().expect("a shape of the parameter's rank");
            flat.reshape(shape).set_require_grad(require)
        })
    }
}
