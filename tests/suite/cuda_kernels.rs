//! Every CUDA kernel compiles with NVRTC, without a GPU: CI installs the nvidia-cuda-nvrtc
//! wheel and sets TRAINER_REQUIRE_NVRTC=1, so a broken kernel fails CI instead of waiting for
//! a GPU session. Elsewhere the test skips, with the reason, when libnvrtc is not loadable.

use trainer::tensor::cuda::kernels;

fn required() -> bool {
    ["TRAINER_REQUIRE_NVRTC", "TRAINER_REQUIRE_CUDA"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|v| v == "1"))
}

#[test]
fn every_kernel_compiles_for_ampere_and_hopper() {
    if !kernels::nvrtc_available() {
        assert!(
            !required(),
            "libnvrtc is required here (TRAINER_REQUIRE_NVRTC/CUDA=1) but cannot be loaded"
        );
        eprintln!("skipped: libnvrtc not found (pip install nvidia-cuda-nvrtc; add its lib dir to LD_LIBRARY_PATH)");
        return;
    }
    let (major, minor) = kernels::nvrtc_version().unwrap();
    let archs = kernels::supported_archs().unwrap();
    eprintln!("NVRTC {major}.{minor}, architectures {archs:?}");
    // Every `extern "C" __global__ void name(` of the sources, by name.
    let source = kernels::program_source();
    let names: Vec<&str> = source
        .split("__global__ void ")
        .skip(1)
        .map(|rest| rest.split('(').next().unwrap().trim())
        .collect();
    assert!(names.len() >= 40, "kernels found: {names:?}");
    // Ampere and Hopper get machine code; PTX is what a device newer than NVRTC gets.
    for target in [
        kernels::Target::Cubin(80),
        kernels::Target::Cubin(90),
        kernels::Target::Ptx(90),
    ] {
        let image = kernels::compile(target).unwrap_or_else(|e| panic!("{e}"));
        match target {
            kernels::Target::Cubin(_) => assert_eq!(&image[..4], b"\x7fELF", "{target:?}"),
            kernels::Target::Ptx(_) => assert!(image.starts_with(b"//"), "{target:?}"),
        }
        for name in &names {
            let found = image
                .windows(name.len() + 1)
                .any(|w| &w[..name.len()] == name.as_bytes() && matches!(w[name.len()], 0 | b'('));
            assert!(found, "{target:?}: kernel {name} missing");
        }
    }
}

#[test]
fn a_device_gets_machine_code_for_its_major_version_else_ptx() {
    use kernels::Target;
    let nvrtc_13 = [75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121];
    assert_eq!(Target::for_device(9, 0, &nvrtc_13), Some(Target::Cubin(90)));
    assert_eq!(Target::for_device(8, 6, &nvrtc_13), Some(Target::Cubin(86)));
    // sm_87 code runs on an 8.8 device; a 13.0 device, newer than NVRTC, gets PTX to JIT.
    assert_eq!(Target::for_device(8, 8, &nvrtc_13), Some(Target::Cubin(87)));
    assert_eq!(Target::for_device(13, 0, &nvrtc_13), Some(Target::Ptx(121)));
    // Older than anything this NVRTC supports.
    assert_eq!(Target::for_device(7, 0, &nvrtc_13), None);
}
