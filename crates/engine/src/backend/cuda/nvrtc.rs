//! Kernels compiled at start by NVRTC, for the device's architecture, cached on disk.
//!
//! NVRTC is loaded at run time (cudarc's dynamic loading), so building lily needs no CUDA. When
//! the library is not on the loader's path, it is looked for in `LILY_CUDA_LIB_DIRS` (colon
//! separated), `$CUDA_HOME/lib64` and `/usr/local/cuda/lib64`, and loaded from there by absolute
//! path (RTLD_GLOBAL) so that cudarc's later load by name finds it. The `nvidia-cuda-nvrtc`
//! wheel from PyPI (folder `nvidia/cu13/lib`) is enough: the kernels include no CUDA headers.
//!
//! Compiled images (CUBIN) are cached under `LILY_KERNEL_CACHE` or `~/.cache/lily/kernels`,
//! keyed by the source, the options, the architecture and the NVRTC version; the key is stored
//! inside the file and checked on load, so a hash collision can never load the wrong image.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::{result, sys};

use crate::error::{Error, Result};

/// A kernel family's source as NVRTC compiles it: the shared helpers, then the family.
macro_rules! family {
    ($file:literal) => {
        concat!(
            include_str!("kernels/common.cuh"),
            "\n",
            include_str!($file)
        )
    };
}

/// Every kernel family of the CUDA backend: (name, source), each source preceded by the shared
/// helpers of kernels/common.cuh.
pub const KERNELS: &[(&str, &str)] = &[
    ("quant", family!("kernels/quant.cu")),
    ("qmma", family!("kernels/qmma.cu")),
    ("pointwise", family!("kernels/pointwise.cu")),
    ("gdn", family!("kernels/gdn.cu")),
    ("attention", family!("kernels/attention.cu")),
    ("sample", family!("kernels/sample.cu")),
];

/// Kernel family `family`'s source: the embedded one, or, when `LILY_CUDA_KERNEL_DIR` names a
/// folder, `family.cu` there after that folder's `common.cuh` (each file the folder lacks is the
/// embedded one). A developer's knob: a kernel experiment on the GPU machine then needs no
/// rebuild of lily, only the changed files. The cache key holds the source, so an edited file is
/// compiled afresh.
pub fn kernel_source(family: &str) -> Result<std::borrow::Cow<'static, str>> {
    let source = kernel_source_in(
        family,
        std::env::var_os("LILY_CUDA_KERNEL_DIR").map(PathBuf::from),
    )?;
    // The timeline's marks (timeline.rs) are compiled in only when asked for.
    Ok(match super::timeline::requested() {
        Some(_) => super::timeline::with_marks(&source)?.into(),
        None => source,
    })
}

fn kernel_source_in(family: &str, dir: Option<PathBuf>) -> Result<std::borrow::Cow<'static, str>> {
    let embedded = KERNELS
        .iter()
        .find(|(n, _)| *n == family)
        .map(|(_, s)| *s)
        .ok_or_else(|| Error::Backend(format!("no kernel family {family}")))?;
    let Some(dir) = dir else {
        return Ok(embedded.into());
    };
    let read = |file: &str| -> Result<Option<String>> {
        let path = dir.join(file);
        match std::fs::read_to_string(&path) {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::Backend(format!(
                "LILY_CUDA_KERNEL_DIR: reading {}: {e}",
                path.display()
            ))),
        }
    };
    let common = read("common.cuh")?;
    let body = read(&format!("{family}.cu"))?;
    if common.is_none() && body.is_none() {
        return Ok(embedded.into());
    }
    let common_embedded = include_str!("kernels/common.cuh");
    let body_embedded = &embedded[common_embedded.len() + 1..];
    Ok(format!(
        "{}\n{}",
        common.as_deref().unwrap_or(common_embedded),
        body.as_deref().unwrap_or(body_embedded)
    )
    .into())
}

/// The architectures CI compiles every kernel for: the oldest supported and Hopper.
pub const CI_ARCHS: &[&str] = &["sm_80", "sm_90a"];

const SONAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// Makes NVRTC loadable, searching the usual folders when it is not on the loader's path.
/// Returns its version.
pub fn load() -> Result<(i32, i32)> {
    static LOADED: OnceLock<std::result::Result<(i32, i32), String>> = OnceLock::new();
    LOADED
        .get_or_init(load_inner)
        .clone()
        .map_err(Error::Backend)
}

fn load_inner() -> std::result::Result<(i32, i32), String> {
    // SAFETY: probing with dlopen has no side effects beyond loading the library.
    if !unsafe { sys::is_culib_present() } {
        let dirs = search_dirs();
        let found = dirs
            .iter()
            .find_map(|d| SONAMES.iter().map(|n| d.join(n)).find(|p| p.exists()));
        let Some(lib) = found else {
            return Err(format!(
                "NVRTC not found: no {} on the loader path or in {}; set LILY_CUDA_LIB_DIRS to the folder holding it",
                SONAMES[0],
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        };
        let dir = lib.parent().unwrap_or(Path::new("."));
        // The builtins library is opened by NVRTC itself during compilation, by name.
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("libnvrtc-builtins.so") {
                    preload(&e.path())?;
                }
            }
        }
        preload(&lib)?;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loaded (checked above); nvrtcVersion only writes the two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion failed: {e:?}"))?;
    Ok((major, minor))
}

fn preload(path: &Path) -> std::result::Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading NVRTC runs only its initialisers; the handle is leaked on purpose so the
    // library stays loaded for the process, where cudarc will find it by name.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| format!("loading {}: {e}", path.display()))?;
    std::mem::forget(lib);
    Ok(())
}

fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("LILY_CUDA_LIB_DIRS")
        .map(|v| {
            v.split(':')
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default();
    if let Ok(home) = std::env::var("CUDA_HOME") {
        dirs.push(Path::new(&home).join("lib64"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs
}

/// Compile options: fast, deterministic math is not assumed (no --use_fast_math), so the
/// kernels keep IEEE f32 semantics apart from FMA contraction.
fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-default-device".into(),
    ]
}

/// Compiles one kernel source to a CUBIN for `arch` (e.g. `sm_90a`), or returns NVRTC's log.
pub fn compile(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    load()?;
    let src = CString::new(source)
        .map_err(|_| Error::Backend(format!("kernel {name} contains a NUL byte")))?;
    let cname =
        CString::new(format!("{name}.cu")).map_err(|_| Error::Backend("bad kernel name".into()))?;
    let prog = result::create_program(&src, Some(&cname))
        .map_err(|e| Error::Backend(format!("nvrtc create {name}: {e:?}")))?;
    let opts = options(arch);
    // SAFETY: `prog` was just created and is destroyed below, after its last use.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    let out = match compiled {
        Ok(()) => cubin(prog),
        Err(e) => {
            // SAFETY: as above.
            let log = unsafe { result::get_program_log(prog) }
                .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>())
                .unwrap_or_default();
            Err(Error::Backend(format!(
                "kernel {name}.cu does not compile for {arch} ({e:?}):\n{}",
                log.trim_end_matches('\0')
            )))
        }
    };
    // SAFETY: `prog` is valid and not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; the size query writes one usize.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| Error::Backend(format!("nvrtcGetCUBINSize: {e:?}")))?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds exactly the size NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char) }
        .result()
        .map_err(|e| Error::Backend(format!("nvrtcGetCUBIN: {e:?}")))?;
    Ok(buf)
}

/// The cache key of one compilation: everything that changes the image.
pub fn cache_key(name: &str, source: &str, arch: &str, version: (i32, i32)) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in source.bytes().chain(options(arch).join(" ").into_bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{name}-{arch}-nvrtc{}.{}-{h:016x}", version.0, version.1)
}

fn cache_dir() -> PathBuf {
    if let Ok(d) = std::env::var("LILY_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(|_| std::env::temp_dir());
    base.join("lily").join("kernels")
}

/// The CUBIN of kernel `name` for `arch`, from the disk cache or freshly compiled (and stored).
pub fn cubin_cached(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    cubin_cached_in(&cache_dir(), name, source, arch)
}

/// As `cubin_cached`, with the cache in `dir`.
pub fn cubin_cached_in(dir: &Path, name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    let version = load()?;
    let key = cache_key(name, source, arch, version);
    let path = dir.join(format!("{key}.cubin"));
    if let Ok(bytes) = std::fs::read(&path)
        && let Some(image) = bytes.strip_prefix(format!("{key}\n").as_bytes())
    {
        return Ok(image.to_vec());
    }
    let image = compile(name, source, arch)?;
    // The cache is an optimisation: failing to write it is not an error.
    if std::fs::create_dir_all(path.parent().unwrap_or(Path::new("."))).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let mut data = format!("{key}\n").into_bytes();
        data.extend_from_slice(&image);
        if std::fs::write(&tmp, &data).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_keys_change_with_every_input() {
        let base = cache_key("quant", "src", "sm_90a", (13, 0));
        assert_ne!(base, cache_key("quant", "src2", "sm_90a", (13, 0)));
        assert_ne!(base, cache_key("quant", "src", "sm_80", (13, 0)));
        assert_ne!(base, cache_key("quant", "src", "sm_90a", (13, 1)));
        assert_eq!(base, cache_key("quant", "src", "sm_90a", (13, 0)));
    }

    #[test]
    fn a_kernel_folder_replaces_the_files_it_holds() {
        let embedded = |f: &str| KERNELS.iter().find(|(n, _)| *n == f).unwrap().1;
        assert_eq!(kernel_source_in("gdn", None).unwrap(), embedded("gdn"));
        let dir = std::env::temp_dir().join(format!("lily-kernel-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A folder without the family's files leaves it embedded.
        assert_eq!(
            kernel_source_in("gdn", Some(dir.clone())).unwrap(),
            embedded("gdn")
        );
        std::fs::write(dir.join("gdn.cu"), "// edited gdn\n").unwrap();
        let edited = kernel_source_in("gdn", Some(dir.clone())).unwrap();
        let common = include_str!("kernels/common.cuh");
        assert_eq!(edited, format!("{common}\n// edited gdn\n"));
        std::fs::write(dir.join("common.cuh"), "// edited common").unwrap();
        let both = kernel_source_in("quant", Some(dir.clone())).unwrap();
        assert_eq!(
            both,
            format!(
                "// edited common\n{}",
                &embedded("quant")[common.len() + 1..]
            )
        );
        assert!(kernel_source_in("nonesuch", Some(dir.clone())).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
