//! The decode step's timeline, for finding where a step's time goes between and inside its
//! kernels (`LILY_CUDA_TIMELINE=path`; tools/timeline.py reads what it writes). The kernels are
//! then compiled with `LILY_TIMELINE` defined (kernels/common.cuh): thread 0 of every block
//! stores the GPU's global time when it reaches its wait for the previous kernel, when the wait
//! returns and when it lets the next kernel launch, in a slot of this buffer chosen by the
//! launch's id (`%gridid`), the block and the mark. A replayed graph's kernels keep the ids they
//! got when it was recorded (seen on the H200's driver, run42), so the buffer ends up holding the
//! recorded step's last replay. When the device is dropped the buffer goes to `path`
//! (little-endian u64 pairs: launch id, nanoseconds; zero where nothing was stored) and the last
//! recorded decode step's launches, in order, to `path.json`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaModule, CudaSlice, CudaStream, DevicePtr};

use super::device::driver;
use crate::error::{Error, Result};

/// Launch slots of the buffer and blocks a launch (the kernels get them from `with_marks`).
const LAUNCHES: usize = 4096;
const BLOCKS: usize = 1024;
/// Marks a block: the three of kernels/common.cuh, or up to 16 with
/// `LILY_CUDA_TIMELINE_MARKS`, for a probe that adds marks inside a kernel through
/// `LILY_CUDA_KERNEL_DIR` (no rebuild).
const MARKS: usize = 3;
const MAX_MARKS: usize = 16;

/// The marks a block, as asked for.
pub fn marks() -> Result<usize> {
    let Ok(v) = std::env::var("LILY_CUDA_TIMELINE_MARKS") else {
        return Ok(MARKS);
    };
    match v.parse::<usize>() {
        Ok(n) if (MARKS..=MAX_MARKS).contains(&n) => Ok(n),
        _ => Err(Error::Backend(format!(
            "LILY_CUDA_TIMELINE_MARKS={v}: expected a count of marks from {MARKS} to {MAX_MARKS}"
        ))),
    }
}

/// A kernel source as it is compiled when the timeline is asked for: behind the switch of
/// kernels/common.cuh's marks and the buffer's layout.
pub fn with_marks(source: &str) -> Result<String> {
    let marks = marks()?;
    Ok(format!(
        "#define LILY_TIMELINE\n#define TIMELINE_LAUNCHES {LAUNCHES}\n\
         #define TIMELINE_BLOCKS {BLOCKS}\n#define TIMELINE_MARKS {marks}\n{source}"
    ))
}

/// Where the timeline goes, when one was asked for.
pub fn requested() -> Option<PathBuf> {
    std::env::var_os("LILY_CUDA_TIMELINE")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

pub struct Timeline {
    path: PathBuf,
    records: CudaSlice<u64>,
    marks: usize,
    /// The recorded decode step's launches: label and blocks.
    step: Mutex<Vec<(&'static str, u32)>>,
}

impl Timeline {
    pub fn new(stream: &Arc<CudaStream>, path: PathBuf) -> Result<Timeline> {
        let marks = marks()?;
        let records = stream
            .alloc_zeros::<u64>(2 * LAUNCHES * BLOCKS * marks)
            .map_err(driver("allocating the timeline"))?;
        Ok(Timeline {
            path,
            records,
            marks,
            step: Mutex::new(Vec::new()),
        })
    }

    /// Points a freshly loaded module's `lily_timeline` at the buffer.
    pub fn attach(&self, module: &Arc<CudaModule>, stream: &Arc<CudaStream>) -> Result<()> {
        let mut global = module.get_global("lily_timeline", stream).map_err(driver(
            "finding lily_timeline (a kernel family without common.cuh?)",
        ))?;
        let (ptr, _sync) = self.records.device_ptr(stream);
        stream
            .memcpy_htod(&ptr.to_le_bytes(), &mut global)
            .map_err(driver("setting lily_timeline"))
    }

    /// A decode step's recording begins: its launches replace the last one's.
    pub fn begin_step(&self) {
        if let Ok(mut s) = self.step.lock() {
            s.clear();
        }
    }

    pub fn launched(&self, label: &'static str, blocks: u32) {
        if let Ok(mut s) = self.step.lock() {
            s.push((label, blocks));
        }
    }

    /// Writes the buffer and the step's launches (the stream must be idle).
    pub fn write(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let records = stream
            .clone_dtoh(&self.records)
            .map_err(driver("reading the timeline"))?;
        let bytes: Vec<u8> = records.iter().flat_map(|r| r.to_le_bytes()).collect();
        let io = |e: std::io::Error| Error::Backend(format!("{}: {e}", self.path.display()));
        std::fs::write(&self.path, bytes).map_err(io)?;
        let step = self
            .step
            .lock()
            .map_err(|_| Error::Backend("timeline lock poisoned".into()))?;
        let launches: Vec<_> = step
            .iter()
            .map(|(label, blocks)| serde_json::json!({"label": label, "blocks": blocks}))
            .collect();
        let meta = serde_json::json!({
            "launch_slots": LAUNCHES, "blocks_per_launch": BLOCKS, "marks": self.marks,
            "step": launches,
        });
        let mut json = self.path.clone().into_os_string();
        json.push(".json");
        std::fs::write(PathBuf::from(json), meta.to_string()).map_err(io)
    }
}
