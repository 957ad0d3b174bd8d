//! The CUDA kernels run on the host, without a GPU: tests/kernels_on_host/harness.cpp builds
//! the kernel program (kernels/*.cu, exactly as NVRTC gets it) with the host's C++ compiler,
//! against a stand-in for CUDA's built-ins that runs a block's threads as fibers, waiting at
//! `__syncthreads` and at warp shuffles (tests/kernels_on_host/cuda_on_host.h). That checks
//! what the GPU parity tests check only where a GPU is lent: the indexing, the vectorised paths
//! and their tails, the packing of half-width buffers, and the block-wide reductions (their
//! barriers too: each block runs in two thread orders). Skips, with the reason, without a
//! compiler ($CXX, else c++); fails then when TRAINER_REQUIRE_HOST_CXX=1 (CI).

use crate::common;

use std::process::Command;
use trainer::tensor::cuda::kernels;

#[test]
fn kernels_on_the_host_match_their_definitions() {
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kernels.cu"), kernels::program_source()).unwrap();
    let harness = common::root().join("tests/kernels_on_host/harness.cpp");
    let exe = dir.path().join("harness");
    let build = Command::new(&compiler)
        .args(["-std=c++17", "-O1", "-w", "-I"])
        .arg(dir.path())
        .arg(&harness)
        .arg("-o")
        .arg(&exe)
        .output();
    let build = match build {
        Ok(out) => out,
        Err(e) => {
            let required = std::env::var("TRAINER_REQUIRE_HOST_CXX").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "TRAINER_REQUIRE_HOST_CXX=1 but {compiler} cannot run: {e}"
            );
            eprintln!("skipped: no C++ compiler ({compiler}: {e})");
            return;
        }
    };
    assert!(
        build.status.success(),
        "{compiler} could not build the kernels for the host:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{report}");
    assert!(report.contains("0 failures"), "{report}");
}
