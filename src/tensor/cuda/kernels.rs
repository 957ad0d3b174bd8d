//! The CUDA kernels: kernels/*.cu embedded in the binary, compiled by NVRTC for the device's
//! architecture at first use, and cached on disk (keyed by source hash, architecture and NVRTC
//! version) so later starts skip compilation.

use crate::error::{Error, Result};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::path::PathBuf;

/// Every kernel file, in the order they are concatenated after common.cuh.
pub const SOURCES: [(&str, &str); 6] = [
    ("cast.cu", include_str!("../../../kernels/cast.cu")),
    ("graph.cu", include_str!("../../../kernels/graph.cu")),
    (
        "elementwise.cu",
        include_str!("../../../kernels/elementwise.cu"),
    ),
    ("loss.cu", include_str!("../../../kernels/loss.cu")),
    ("optim.cu", include_str!("../../../kernels/optim.cu")),
    ("spatial.cu", include_str!("../../../kernels/spatial.cu")),
];
const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// The whole program: NVRTC has no include path here, so the shared header is prepended.
pub fn program_source() -> String {
    let mut src = String::from(COMMON);
    for (name, text) in SOURCES {
        src += &format!("\n// ---- {name}\n{text}");
    }
    src
}

/// Whether libnvrtc can be loaded (checked before any call that would otherwise panic).
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes the dynamic loader.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::Runtime(format!("nvrtcVersion failed: {e:?}")))?;
    Ok((major, minor))
}

/// `compute_XY` for a compute capability, as NVRTC's --gpu-architecture wants it.
fn arch_name(major: i32, minor: i32) -> &'static str {
    // NVRTC options need a 'static str; the set of architectures is small and fixed.
    match (major, minor) {
        (7, 0) => "compute_70",
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        (m, _) if m >= 12 => "compute_120",
        (m, _) if m >= 10 => "compute_100",
        (9, _) => "compute_90",
        (8, _) => "compute_80",
        _ => "compute_70",
    }
}

/// Compiles the program for a compute capability. Errors carry NVRTC's log.
pub fn compile(major: i32, minor: i32) -> Result<Ptx> {
    let opts = CompileOptions {
        arch: Some(arch_name(major, minor)),
        // No contraction into FMA: elementwise results then match the CPU backend's rounding.
        // These kernels are memory-bound, so it costs nothing measurable.
        fmad: Some(false),
        name: Some("trainer_kernels.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(program_source(), opts).map_err(|e| {
        let log = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        Error::Runtime(format!(
            "NVRTC could not compile the kernels for {}:\n{log}",
            arch_name(major, minor)
        ))
    })
}

/// The compiled kernels for a device, from the disk cache or freshly compiled (then cached).
/// A cache that cannot be read or written is only a slower start, never an error.
pub fn load_or_compile(major: i32, minor: i32) -> Result<(Ptx, bool)> {
    let (nv_major, nv_minor) = nvrtc_version()?;
    let key = fnv1a(
        format!(
            "{}|{}|{nv_major}.{nv_minor}",
            program_source(),
            arch_name(major, minor)
        )
        .as_bytes(),
    );
    let path = cache_dir().map(|d| d.join(format!("kernels-{key:016x}.ptx")));
    if let Some(text) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok((Ptx::from_src(text), true));
    }
    let ptx = compile(major, minor)?;
    if let Some(path) = path {
        let text = ptx.to_src();
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, text.as_bytes()))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::warn!("cannot cache compiled kernels at {}: {e}", path.display());
        }
    }
    Ok((ptx, false))
}

/// $TRAINER_CACHE_DIR, else $XDG_CACHE_HOME/trainer, else ~/.cache/trainer.
fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("TRAINER_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("trainer"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/trainer"))
}

/// FNV-1a: a hash that is the same in every build, for cache keys.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}
