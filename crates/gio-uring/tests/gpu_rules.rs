//! The rules the CUDA I/O kernel shares with the Rust side, checked without a GPU: the plain C
//! functions of `kernels/gio_abi.h` (and `kernels/gio_kernel_rules.h`) are compiled with the
//! system C compiler (`$CC`, else `cc`, which every Rust toolchain on Linux links with) into
//! `kernels/tests/rules_check.c`, which checks them against their specification; for the
//! descriptor-kind rule, its verdict on every value 0..=255 is compared with the Rust rule, so the
//! two sides cannot drift apart.

use std::path::{Path, PathBuf};
use std::process::Command;

use gio_uring::abi::{descriptor_kind_is_valid, DescriptorKind};

fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels")
}

/// Compiles rules_check.c once per call into this test's scratch directory and returns its path.
fn build_rules_check(name: &str) -> PathBuf {
    let compiler = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let kernels = kernels_dir();
    let output = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let status = Command::new(&compiler)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O1", "-I"])
        .arg(&kernels)
        .arg(kernels.join("tests/rules_check.c"))
        .arg("-o")
        .arg(&output)
        .status()
        .unwrap_or_else(|error| panic!("cannot run the C compiler {compiler:?}: {error}"));
    assert!(status.success(), "compiling kernels/tests/rules_check.c failed: {status}");
    output
}

fn run(program: &Path, args: &[&str]) -> String {
    let output = Command::new(program).args(args).output().expect("run rules_check");
    let stdout = String::from_utf8(output.stdout).expect("rules_check prints ASCII");
    assert!(output.status.success(), "rules_check failed: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
    stdout
}

#[test]
fn the_c_rules_meet_their_specification() {
    // Goal: every rule the kernel uses holds on the host, over its whole input domain where that
    // is small and at the wrap-around edges where it is not (see rules_check.c).
    let program = build_rules_check("rules_check_spec");
    assert_eq!(run(&program, &[]).trim(), "rules_check: OK");
}

#[test]
fn c_and_rust_agree_on_every_descriptor_kind() {
    // Goal: one descriptor-kind rule: for each of the 256 values, the kernel's C rule and the
    // Rust rule (used by validation, the CPU executor and staged planning) give the same verdict,
    // and only SGL and PRP are valid.
    let program = build_rules_check("rules_check_kinds");
    let table = run(&program, &["descriptor-kinds"]);
    let mut seen = 0;
    for line in table.lines() {
        let (kind, valid) = line.split_once(' ').unwrap_or_else(|| panic!("malformed line {line:?}"));
        let kind: u8 = kind.parse().unwrap_or_else(|_| panic!("malformed kind in {line:?}"));
        let c_valid = match valid {
            "1" => true,
            "0" => false,
            other => panic!("malformed verdict {other:?}"),
        };
        assert_eq!(u32::from(kind), seen, "kinds in order");
        assert_eq!(descriptor_kind_is_valid(kind), c_valid, "descriptor kind {kind}: Rust and C disagree");
        assert_eq!(DescriptorKind::from_abi(kind).is_some(), c_valid, "descriptor kind {kind}: typed view");
        seen += 1;
    }
    assert_eq!(seen, 256, "one line per kind");
    let valid: Vec<u8> = (0..=u8::MAX).filter(|&kind| descriptor_kind_is_valid(kind)).collect();
    assert_eq!(valid, vec![DescriptorKind::Sgl.to_abi(), DescriptorKind::Prp.to_abi()]);
}
