//! A stretch of launches recorded once as a device graph and replayed: cubecl's capture
//! (a CUDA graph on CUDA, where a replay is one launch of the whole recording; on wgpu the
//! recorded dispatches, encoded again without the launch path). Between
//! [`prepare`] and the recording the allocator keeps every page it hands out, so the
//! recording allocates nothing; inside it nothing may be read, synced or written from the
//! host. A replay reads and writes the very buffers the recording did.

use burn::tensor::Device;

/// A recorded stretch of launches on one device.
pub struct DeviceGraph {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    graph: cubecl::client::Graph,
}

/// Why a device cannot record or replay.
fn unsupported(device: &Device) -> String {
    format!("{device:?} records no device graphs (CubeCL devices only)")
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn client(device: &Device) -> Result<cubecl::client::Client, String> {
    match device.clone().inner().as_dispatch() {
        burn::backend::DispatchDevice::Cube(cube) => Ok(cube.client()),
        _ => Err(unsupported(device)),
    }
}

/// Prepare `device`'s stream for a recording: call it before the last run of the
/// launches to record, so that the allocator keeps what that run takes.
pub fn prepare(device: &Device) -> Result<(), String> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        client(device)?
            .graph_prepare()
            .map_err(|e| format!("{e:?}"))
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    Err(unsupported(device))
}

/// Start recording the launches on `device` instead of running them.
pub fn start(device: &Device) -> Result<(), String> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        client(device)?
            .start_capture()
            .map_err(|e| format!("{e:?}"))
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    Err(unsupported(device))
}

/// Stop recording: the graph, or why the recording cannot replay (an operation in it
/// the recording refused: a host read or write, an allocation).
pub fn stop(device: &Device) -> Result<DeviceGraph, String> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        let graph = client(device)?
            .stop_capture()
            .map_err(|e| format!("{e:?}"))?;
        Ok(DeviceGraph { graph })
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    Err(unsupported(device))
}

/// Close a recording `device` was prepared for and will not make (the allocator keeps
/// its pages for a prepared recording until it is closed).
pub fn abandon(device: &Device) {
    if let Err(e) = stop(device) {
        tracing::debug!(error = %e, "closing a device graph never recorded");
    }
}

impl DeviceGraph {
    /// Run the recorded launches again, on the buffers they were recorded with.
    ///
    /// # Safety
    ///
    /// Every buffer the recording read or wrote is still alive (held by the caller), and
    /// none is in use by another stream while the replay runs.
    pub unsafe fn replay(&self) -> Result<(), String> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        {
            // Safety: the caller's, as stated above.
            unsafe { self.graph.replay() }.map_err(|e| format!("{e:?}"))
        }
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        Err("no device graph without a CubeCL device".into())
    }
}
