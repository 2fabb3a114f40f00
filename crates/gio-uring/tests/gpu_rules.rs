//! The rules the CUDA I/O kernel shares with the Rust side, checked without a GPU: the plain C
//! functions of `kernels/gio_abi.h` (and `kernels/gio_kernel_rules.h`) are compiled with the
//! system C compiler (`$CC`, else `cc`, which every Rust toolchain on Linux links with) into
//! `kernels/tests/rules_check.c`, which checks them against their specification; for the
//! descriptor-kind rule, its verdict on every value 0..=255 is compared with the Rust rule, and
//! for the IOCTX command rule (opcode, block count, descriptor kind, per-layer addresses without
//! wrapping) its verdict on a grid of cases, so the two sides cannot drift apart.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use gio_uring::abi::{descriptor_kind_is_valid, ioctx_command, DescriptorKind, IocbLayer};

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

/// One case of the IOCTX command rule, in the order `rules_check ioctx-commands` reads it.
#[derive(Debug, Clone, Copy)]
struct CommandCase {
    layer: IocbLayer,
    start_lba: u64,
    data_iova: u64,
    desc_iova: u64,
    block_count: u32,
    descriptor_kind: u8,
}

fn command_cases() -> Vec<CommandCase> {
    let plain = |opcode: u8| IocbLayer { opcode, layer: 3, lba_stride_blocks: 100, mem_stride_bytes: 0x1000, desc_stride_bytes: 0x20 };
    let mut cases = Vec::new();
    for opcode in 0..=u8::MAX {
        for block_count in [0, 1, 8, 65535, 65536, 65537, u32::MAX] {
            for descriptor_kind in [0, 1, 2, u8::MAX] {
                for desc_iova in [0, 0x8000] {
                    cases.push(CommandCase {
                        layer: plain(opcode),
                        start_lba: 5,
                        data_iova: 0x10000,
                        desc_iova,
                        block_count,
                        descriptor_kind,
                    });
                }
            }
        }
    }
    // Overflow, and its edge, on each address: layer x stride, then base + offset.
    let max = u64::MAX;
    for opcode in [0x01, 0x02, 0x08, 0x09] {
        let valid = |layer: IocbLayer, start_lba: u64, data_iova: u64, desc_iova: u64| CommandCase {
            layer,
            start_lba,
            data_iova,
            desc_iova,
            block_count: 8,
            descriptor_kind: 1,
        };
        let strides = |layer: u32, lba: u64, mem: u64, desc: u64| IocbLayer {
            opcode,
            layer,
            lba_stride_blocks: lba,
            mem_stride_bytes: mem,
            desc_stride_bytes: desc,
        };
        for layer in [0, 1, 2, u32::MAX] {
            for stride in [0, 1, max / 2, max / 2 + 1, max / u64::from(u32::MAX), max / u64::from(u32::MAX) + 1, max] {
                cases.push(valid(strides(layer, stride, 0, 0), 5, 0x10000, 0x8000));
                cases.push(valid(strides(layer, 0, stride, 0), 5, 0x10000, 0x8000));
                cases.push(valid(strides(layer, 0, 0, stride), 5, 0x10000, 0x8000));
                cases.push(valid(strides(layer, 0, 0, stride), 5, 0x10000, 0));
            }
            for base in [max - 1, max] {
                cases.push(valid(strides(layer, 1, 0, 0), base, 0x10000, 0x8000));
                cases.push(valid(strides(layer, 0, 1, 0), 5, base, 0x8000));
                cases.push(valid(strides(layer, 0, 0, 1), 5, 0x10000, base));
            }
        }
    }
    cases
}

#[test]
fn c_and_rust_agree_on_every_ioctx_command() {
    // Goal: one IOCTX command rule: for a grid over every opcode, the block counts at and past
    // the edges of 1..=65536, every kind of descriptor and overflowing per-layer addresses, the
    // kernel's C rule and the Rust rule (the one CpuExecutor::command applies) accept the same
    // IOCTXs and compute the same LBA and addresses; only Read and Write are ever accepted.
    let program = build_rules_check("rules_check_commands");
    let cases = command_cases();
    let mut input = String::new();
    for case in &cases {
        let layer = case.layer;
        input.push_str(&format!(
            "{} {} {} {} {} {} {} {} {} {}\n",
            layer.opcode,
            layer.layer,
            layer.lba_stride_blocks,
            layer.mem_stride_bytes,
            layer.desc_stride_bytes,
            case.start_lba,
            case.data_iova,
            case.desc_iova,
            case.block_count,
            case.descriptor_kind
        ));
    }
    let mut child =
        Command::new(&program).arg("ioctx-commands").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("run rules_check");
    // The table is far below a pipe's buffer on the way back only if read concurrently: write
    // from a thread, read here.
    let mut stdin = child.stdin.take().expect("stdin piped");
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()).expect("write cases"));
    let output = child.wait_with_output().expect("rules_check output");
    writer.join().expect("writer thread");
    assert!(output.status.success(), "rules_check ioctx-commands failed: {}", output.status);
    let table = String::from_utf8(output.stdout).expect("rules_check prints ASCII");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), cases.len(), "one verdict per case");
    let mut accepted = 0;
    for (case, line) in cases.iter().zip(lines) {
        let ioctx = gio_uring::abi::gio_ioctx {
            desc_iova: case.desc_iova,
            data_iova: case.data_iova,
            start_lba: case.start_lba,
            nsid: 1,
            block_count: case.block_count,
            data_bytes: 4096,
            desc_bytes: 0,
            device_index: 0,
            descriptor_kind: case.descriptor_kind,
            flags: 0,
            reserved0: 0,
        };
        let rust =
            ioctx_command(&case.layer, &ioctx).map(|command| format!("1 {} {} {}", command.lba, command.data_iova, command.desc_iova));
        assert_eq!(rust.as_deref().unwrap_or("0"), line, "{case:?}: Rust and C disagree");
        if rust.is_some() {
            accepted += 1;
            assert!(matches!(case.layer.opcode, 0x01 | 0x02), "{case:?}: only Read and Write");
            assert!((1..=65536).contains(&case.block_count), "{case:?}: 1..=65536 blocks");
        }
    }
    assert!(accepted > 100, "the grid has valid cases too ({accepted})");
}
