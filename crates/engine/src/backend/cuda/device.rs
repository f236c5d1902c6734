//! One CUDA device: its context and stream, and the kernel modules compiled for its
//! architecture (through nvrtc.rs's disk cache).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use super::nvrtc;
use super::timeline::{self, Timeline};
use crate::error::{Error, Result};

pub struct CudaDevice {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// NVRTC target, e.g. `sm_90a`.
    pub arch: String,
    pub name: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// The decode step's timeline, when `LILY_CUDA_TIMELINE` asks for one (timeline.rs).
    pub timeline: Option<Timeline>,
}

/// Maps a driver error to lily's, saying what was being done.
pub(super) fn driver(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Backend(format!("CUDA {what}: {e:?}"))
}

impl CudaDevice {
    /// Opens device `ordinal`, or says why no GPU is usable (no driver, no device, no NVRTC).
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        // SAFETY: probing with dlopen has no side effects beyond loading the library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::Backend("no CUDA driver (libcuda.so) found".into()));
        }
        nvrtc::load()?;
        let ctx = CudaContext::new(ordinal).map_err(driver("context creation"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        if major < 8 {
            return Err(Error::Backend(format!(
                "GPU compute capability {major}.{minor} is below 8.0, the oldest lily supports"
            )));
        }
        // Hopper's own instructions (wgmma, setmaxnreg) need the arch-specific target.
        let arch = if (major, minor) == (9, 0) {
            "sm_90a".to_string()
        } else {
            format!("sm_{major}{minor}")
        };
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        // One stream orders all of lily's work, so cudarc's per-buffer event tracking (for
        // multi-stream use) is pure overhead. Must precede the first allocation.
        // SAFETY: every buffer is used on this context's single stream only.
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory(&ctx)?;
        // A stream of its own (not the legacy default stream), so that it can be captured.
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let timeline = match timeline::requested() {
            Some(path) => Some(Timeline::new(&stream, path)?),
            None => None,
        };
        Ok(CudaDevice {
            ctx,
            stream,
            arch,
            name,
            modules: Mutex::new(HashMap::new()),
            timeline,
        })
    }

    /// Waits for every queued operation.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver("synchronizing the stream"))
    }

    /// Kernel `function` of family `family` (a file in kernels/), compiled on first use.
    pub fn function(&self, family: &'static str, function: &str) -> Result<CudaFunction> {
        let module = {
            let mut modules = self
                .modules
                .lock()
                .map_err(|_| Error::Backend("module cache lock poisoned".into()))?;
            match modules.get(family) {
                Some(m) => m.clone(),
                None => {
                    let source = nvrtc::kernel_source(family)?;
                    let image = nvrtc::cubin_cached(family, &source, &self.arch)?;
                    let m = self
                        .ctx
                        .load_module(Ptx::from_binary(image))
                        .map_err(driver("loading a kernel module"))?;
                    if let Some(t) = &self.timeline {
                        t.attach(&m, &self.stream)?;
                    }
                    modules.insert(family, m.clone());
                    m
                }
            }
        };
        module
            .load_function(function)
            .map_err(driver("finding a kernel"))
    }
}

impl Drop for CudaDevice {
    /// Writes the timeline, if one was asked for (nothing else to do: cudarc frees the rest).
    fn drop(&mut self) {
        if let Some(t) = &self.timeline {
            let written = self.synchronize().and_then(|()| t.write(&self.stream));
            if let Err(e) = written {
                tracing::warn!("LILY_CUDA_TIMELINE: {e}");
            }
        }
    }
}

/// Buffers come from the device's stream-ordered memory pool. By default the pool returns freed
/// memory to the driver at every synchronisation, which turns each decode step's temporaries
/// into fresh driver allocations; keeping it makes a freed buffer's reuse a pool lookup.
fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut keep = u64::MAX;
    // SAFETY: the pool handle is written by the driver for this context's device; the attribute
    // value is a u64, as CU_MEMPOOL_ATTR_RELEASE_THRESHOLD requires.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(driver("reading the memory pool"))?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut keep as *mut u64 as *mut std::ffi::c_void,
        )
        .result()
        .map_err(driver("configuring the memory pool"))?;
    }
    Ok(())
}
