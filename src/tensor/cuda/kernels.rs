//! The CUDA kernels: kernels/*.cu embedded in the binary, compiled by NVRTC for the device's
//! architecture at first use (machine code where NVRTC knows the architecture, see `Target`),
//! and cached on disk (keyed by source hash, architecture and NVRTC version) so later starts
//! skip compilation.

use crate::error::{Error, Result};
use cudarc::nvrtc::{result, sys, Ptx};
use std::ffi::CString;
use std::path::PathBuf;

/// Every kernel file, in the order they are concatenated after common.cuh: the shared ones,
/// then those of ops that keep their kernels in their own folder.
pub const SOURCES: [(&str, &str); 21] = [
    ("cast.cu", include_str!("../../../kernels/cast.cu")),
    ("graph.cu", include_str!("../../../kernels/graph.cu")),
    (
        "elementwise.cu",
        include_str!("../../../kernels/elementwise.cu"),
    ),
    ("loss.cu", include_str!("../../../kernels/loss.cu")),
    ("optim.cu", include_str!("../../../kernels/optim.cu")),
    ("spatial.cu", include_str!("../../../kernels/spatial.cu")),
    (
        "ops/batchnorm/batchnorm.cu",
        include_str!("../../ops/batchnorm/batchnorm.cu"),
    ),
    (
        "ops/layernorm/layernorm.cu",
        include_str!("../../ops/layernorm/layernorm.cu"),
    ),
    (
        "ops/rmsnorm/rmsnorm.cu",
        include_str!("../../ops/rmsnorm/rmsnorm.cu"),
    ),
    (
        "ops/softmax/softmax.cu",
        include_str!("../../ops/softmax/softmax.cu"),
    ),
    (
        "ops/embedding/embedding.cu",
        include_str!("../../ops/embedding/embedding.cu"),
    ),
    (
        "ops/dropout/dropout.cu",
        include_str!("../../ops/dropout/dropout.cu"),
    ),
    ("ops/pool/pool.cu", include_str!("../../ops/pool/pool.cu")),
    (
        "ops/rotary/rotary.cu",
        include_str!("../../ops/rotary/rotary.cu"),
    ),
    (
        "ops/multiply/multiply.cu",
        include_str!("../../ops/multiply/multiply.cu"),
    ),
    (
        "ops/activation/activation.cu",
        include_str!("../../ops/activation/activation.cu"),
    ),
    (
        "ops/attention/attention.cu",
        include_str!("../../ops/attention/attention.cu"),
    ),
    (
        "ops/attention/flash.cu",
        include_str!("../../ops/attention/flash.cu"),
    ),
    (
        "ops/attention/flash_mma.cu",
        include_str!("../../ops/attention/flash_mma.cu"),
    ),
    (
        "ops/position_embedding/position_embedding.cu",
        include_str!("../../ops/position_embedding/position_embedding.cu"),
    ),
    (
        "ops/conv2d/conv2d.cu",
        include_str!("../../ops/conv2d/conv2d.cu"),
    ),
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

/// The name of every `extern "C" __global__` kernel in SOURCES.
pub fn kernel_names() -> impl Iterator<Item = &'static str> {
    const MARK: &str = "extern \"C\" __global__ void ";
    SOURCES.iter().flat_map(|(_, text)| {
        text.match_indices(MARK).map(|(at, _)| {
            let rest = &text[at + MARK.len()..];
            rest[..rest.find('(').unwrap_or(rest.len())].trim()
        })
    })
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

/// What NVRTC compiles the kernels into for a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Machine code (cubin) for `sm_XY`, which runs on devices of compute capability X.Y and
    /// later minor versions of X. Preferred: the driver loads it as it is, whatever its own
    /// version, where PTX from an NVRTC newer than the driver would be refused.
    Cubin(i32),
    /// PTX for `compute_XY`, which the driver compiles when loading it: for a device newer
    /// than every architecture this NVRTC knows.
    Ptx(i32),
}

impl Target {
    /// The best target for a device of compute capability `major`.`minor` among the
    /// architectures NVRTC supports (`supported`, as 75, 80, 90...): machine code for the
    /// newest of the device's major version not above it, else PTX for the newest below it.
    pub fn for_device(major: i32, minor: i32, supported: &[i32]) -> Option<Target> {
        let cc = major * 10 + minor;
        let below = supported.iter().copied().filter(|&a| a <= cc);
        match below.clone().filter(|a| a / 10 == major).max() {
            Some(arch) => Some(Target::Cubin(arch)),
            None => below.max().map(Target::Ptx),
        }
    }

    /// NVRTC's --gpu-architecture value.
    pub fn arch(self) -> String {
        match self {
            Target::Cubin(a) => format!("sm_{a}"),
            Target::Ptx(a) => format!("compute_{a}"),
        }
    }
}

/// The architectures this NVRTC can compile for, as 75, 80, 90...
pub fn supported_archs() -> Result<Vec<i32>> {
    let nvrtc_err = |e: cudarc::nvrtc::result::NvrtcError| {
        Error::Runtime(format!("NVRTC: listing its architectures failed: {e:?}"))
    };
    let mut count = 0;
    // SAFETY: NVRTC writes one int, then that many ints.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) }
        .result()
        .map_err(nvrtc_err)?;
    let mut archs = vec![0; count.max(0) as usize];
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(nvrtc_err)?;
    Ok(archs)
}

/// The kernels for a device of compute capability `major`.`minor`: the target NVRTC compiles
/// them into, or an error saying that this NVRTC knows no architecture for it.
pub fn target(major: i32, minor: i32) -> Result<Target> {
    let supported = supported_archs()?;
    Target::for_device(major, minor, &supported).ok_or_else(|| {
        Error::Runtime(format!(
            "this NVRTC cannot compile for compute capability {major}.{minor} (it supports {supported:?})"
        ))
    })
}

/// Compiles the program for `target`: cubin bytes or PTX text. Errors carry NVRTC's log.
pub fn compile(target: Target) -> Result<Vec<u8>> {
    let failed = |what: &str, e: &dyn std::fmt::Debug| {
        Error::Runtime(format!(
            "NVRTC could not compile the kernels for {}: {what}: {e:?}",
            target.arch()
        ))
    };
    let source = CString::new(program_source()).expect("kernel sources hold no NUL");
    let name = CString::new("trainer_kernels.cu").expect("no NUL");
    let prog = result::create_program(&source, Some(&name)).map_err(|e| failed("create", &e))?;
    let options = [
        format!("--gpu-architecture={}", target.arch()),
        // No contraction into FMA: elementwise results then match the CPU backend's rounding.
        // These kernels are memory-bound, so it costs nothing measurable.
        "--fmad=false".to_string(),
    ];
    // SAFETY: `prog` was created above and is destroyed once, below.
    let out = match unsafe { result::compile_program(prog, &options) } {
        Ok(()) => unsafe { compiled_image(prog, target) }.map_err(|e| failed("output", &e)),
        Err(e) => {
            let log = unsafe { result::get_program_log(prog) }.unwrap_or_default();
            let log: Vec<u8> = log
                .iter()
                .map(|&c| c as u8)
                .take_while(|&c| c != 0)
                .collect();
            Err(Error::Runtime(format!(
                "NVRTC could not compile the kernels for {} ({e:?}):\n{}",
                target.arch(),
                String::from_utf8_lossy(&log)
            )))
        }
    };
    // SAFETY: as above; nothing uses `prog` after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// The compiled program's cubin or PTX (without its terminating NUL).
///
/// # Safety
/// `prog` must be a compiled NVRTC program.
unsafe fn compiled_image(
    prog: sys::nvrtcProgram,
    target: Target,
) -> std::result::Result<Vec<u8>, cudarc::nvrtc::result::NvrtcError> {
    let mut size = 0usize;
    let mut image;
    match target {
        Target::Cubin(_) => {
            sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
            image = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast()).result()?;
        }
        Target::Ptx(_) => {
            sys::nvrtcGetPTXSize(prog, &mut size).result()?;
            image = vec![0u8; size];
            sys::nvrtcGetPTX(prog, image.as_mut_ptr().cast()).result()?;
            while image.last() == Some(&0) {
                image.pop();
            }
        }
    }
    Ok(image)
}

/// A compiled image as the driver loads it.
pub fn module_image(target: Target, image: Vec<u8>) -> Ptx {
    match target {
        Target::Cubin(_) => Ptx::from_binary(image),
        Target::Ptx(_) => Ptx::from_src(String::from_utf8_lossy(&image).into_owned()),
    }
}

/// The compiled kernels for a device, from the disk cache or freshly compiled (then cached),
/// and whether they came from the cache. A cache that cannot be read or written is only a
/// slower start, never an error.
pub fn load_or_compile(major: i32, minor: i32) -> Result<(Ptx, bool)> {
    let (nv_major, nv_minor) = nvrtc_version()?;
    let target = target(major, minor)?;
    let key = fnv1a(
        format!(
            "{}|{}|{nv_major}.{nv_minor}",
            program_source(),
            target.arch()
        )
        .as_bytes(),
    );
    let path = cache_dir().map(|d| d.join(format!("kernels-{key:016x}-{}", target.arch())));
    if let Some(image) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok((module_image(target, image), true));
    }
    let image = compile(target)?;
    if let Some(path) = path {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, &image))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::warn!("cannot cache compiled kernels at {}: {e}", path.display());
        }
    }
    Ok((module_image(target, image), false))
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
