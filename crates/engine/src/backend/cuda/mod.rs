//! The CUDA backend (issue 4, in progress): kernels in `kernels/*.cu`, one family per file,
//! embedded in the binary and compiled at start by NVRTC for the device's architecture. So far
//! this holds the NVRTC loader, compiler and on-disk image cache, the device handle that loads
//! compiled modules, and the first kernel family (tested on an H200 by tests/cuda_parity.rs);
//! the device buffers and the `Backend` implementation come next.

pub mod device;
pub mod nvrtc;
