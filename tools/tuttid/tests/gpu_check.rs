//! `tuttid-gpu-check` (the `ipc` step of tools/gpu/run-all.sh) checked where there is no GPU:
//! `--memory memfd` runs its processes and steps (daemon, store process, retrieve process,
//! drain) with the memfd stand-in, so that on a GPU machine only the CUDA calls are new; and
//! without a CUDA driver, the default (`--memory cuda`) fails with a FAIL line naming it.
//! Built with the `cuda` feature only (the binary is).

use std::process::Command;

const CHECK: &str = env!("CARGO_BIN_EXE_tuttid-gpu-check");
const TUTTID: &str = env!("CARGO_BIN_EXE_tuttid");

#[test]
fn the_gpu_check_passes_with_the_memfd_stand_in() {
    // Goal: the check's own orchestration works end to end and its last line says PASS.
    let output = Command::new(CHECK)
        .args(["--memory", "memfd", "--tuttid", TUTTID, "--blocks", "6", "--layers", "4", "--timeout-seconds", "60"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "exit {}: {stdout}\n{}", output.status, String::from_utf8_lossy(&output.stderr));
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("PASS ") && last.contains("wrong 0 of"), "{stdout}");
}

#[test]
fn without_a_driver_the_gpu_check_fails_naming_it() {
    // Goal: on a machine without CUDA the check exits 1 with one FAIL line that says why.
    if tutti_cuda_ipc::driver_available() {
        eprintln!("a CUDA driver is present: the no-driver answer is not checked here");
        return;
    }
    let output = Command::new(CHECK).args(["--tuttid", TUTTID]).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.trim_end().ends_with("no CUDA driver could be loaded (libcuda.so): GPU memory cannot be exported or imported here"),
        "{stdout}"
    );
    assert!(stdout.starts_with("FAIL gpu ipc: opening the GPU"), "{stdout}");
}
