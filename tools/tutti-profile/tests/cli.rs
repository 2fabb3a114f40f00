//! The `tutti-profile` binary end to end: simulate prints the crossover figures and writes its
//! files; analytic writes a table that check accepts; io refuses to invent numbers; bad tables
//! and bad arguments fail with a message, not a panic.

use std::path::PathBuf;
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tutti-profile"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tutti-profile-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("binary runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn simulate_json_prints_crossovers_and_writes_files() {
    let out = scratch("simulate");
    let output = run(bin().args(["simulate", "--preset", "llama3-8b-h100-32k", "--json", "--out"]).arg(&out));
    assert!(output.status.success(), "{}", stderr(&output));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    let bound = report["analytic_bound_hit_rate"].as_f64().expect("bound present");
    let policies = report["policies"].as_array().expect("policies");
    let names: Vec<&str> = policies.iter().map(|p| p["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["slack-aware", "naive-pipeline", "no-overlap"]);
    for policy in policies {
        assert!(policy["crossover_hit_rate"].as_f64().is_some(), "{policy}");
    }
    let slack = policies[0]["crossover_hit_rate"].as_f64().unwrap();
    assert!((slack - bound).abs() <= 0.01, "slack {slack} bound {bound}");
    assert!(report["note"].as_str().unwrap().contains("not measured"));
    for file in ["hit_rate_sweep.csv", "prefix_length_sweep.csv", "hit_rate.svg", "summary.json"] {
        let path = out.join(file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(!text.is_empty());
    }
    let csv = std::fs::read_to_string(out.join("hit_rate_sweep.csv")).unwrap();
    // Header + 3 policies × 513 prefix lengths.
    assert_eq!(csv.lines().count(), 1 + 3 * 513);
    let svg = std::fs::read_to_string(out.join("hit_rate.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("★") && svg.contains("bound"));
}

#[test]
fn analytic_then_check_then_simulate_with_the_table() {
    let dir = scratch("analytic");
    let table = dir.join("llama.json");
    let output = run(bin()
        .args(["analytic", "--model", "llama3-8b", "--gpu", "h100", "--input-step", "4096"])
        .args(["--input-count", "8", "--prefix-step", "512", "--out"])
        .arg(&table));
    assert!(output.status.success(), "{}", stderr(&output));
    let output = run(bin().arg("check").arg(&table).args(["--against-target", "--model", "llama3-8b"]));
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("not measured"));
    // The table belongs to llama3-8b: checking it against qwen3-32b must fail and say why.
    let output = run(bin().arg("check").arg(&table).args(["--against-target", "--model", "qwen3-32b"]));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("model.name"), "{}", stderr(&output));
    let output = run(bin().args(["simulate", "--preset", "llama3-8b-h100-32k", "--out"]).arg(dir.join("sim")).arg("--table").arg(&table));
    assert!(output.status.success(), "{}", stderr(&output));
    let output = run(bin().args(["simulate", "--preset", "qwen3-32b-h100-32k", "--out"]).arg(dir.join("sim2")).arg("--table").arg(&table));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("does not fit preset"), "{}", stderr(&output));
}

#[test]
fn io_refuses_without_a_backend() {
    let dir = scratch("io");
    let out = dir.join("io.json");
    let output = run(bin().args(["io", "--out"]).arg(&out));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("no I/O backend available in this build"), "{}", stderr(&output));
    assert!(!out.exists(), "io must not write a table it did not measure");
}

#[test]
fn bad_tables_and_arguments_fail_cleanly() {
    let dir = scratch("bad");
    let table = dir.join("bad.json");
    std::fs::write(&table, r#"{"format_version": 7, "anything": true}"#).unwrap();
    let output = run(bin().arg("check").arg(&table));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("format_version 7"), "{}", stderr(&output));
    assert!(!stderr(&output).contains("panicked"));

    std::fs::write(&table, "not json").unwrap();
    let output = run(bin().arg("check").arg(&table));
    assert!(!output.status.success() && !stderr(&output).contains("panicked"));

    let output = run(bin().args(["simulate", "--preset", "llama3-70b-b200-1m"]));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("unknown preset"), "{}", stderr(&output));

    let output = run(bin().args(["analytic", "--model", "gpt-9", "--out"]).arg(dir.join("x.json")));
    assert!(!output.status.success());
    assert!(stderr(&output).contains("unknown model preset"), "{}", stderr(&output));

    let output = run(bin().args(["analytic", "--io-sms", "500", "--out"]).arg(dir.join("y.json")));
    assert!(!output.status.success() && stderr(&output).contains("io_sms"), "{}", stderr(&output));

    let output = run(bin().args(["simulate", "--prefix-sweep-hit-rate", "1.5", "--out"]).arg(dir.join("z")));
    assert!(!output.status.success() && stderr(&output).contains("hit_rate"), "{}", stderr(&output));
}

#[test]
fn import_builds_a_table_from_a_timeline() {
    let dir = scratch("import");
    let timeline = dir.join("timeline.csv");
    let mut csv = String::from("phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used\n");
    for (input, prefix) in [(4096, 0), (4096, 4096)] {
        for layer in 0..32 {
            let t = f64::from(layer) * 1000.0;
            csv.push_str(&format!("prefill,{input},{prefix},{layer},qkv,{t},{},128\n", t + 100.0));
            csv.push_str(&format!("prefill,{input},{prefix},{layer},attn,{},{},120\n", t + 100.0, t + 900.0));
        }
    }
    csv.push_str("decode,4096,,,step,0,3000,60\n");
    std::fs::write(&timeline, csv).unwrap();
    let table = dir.join("imported.json");
    let output =
        run(bin().arg("import").arg("--timeline").arg(&timeline).args(["--model", "llama3-8b", "--gpu", "h100", "--out"]).arg(&table));
    assert!(output.status.success(), "{}", stderr(&output));
    let output = run(bin().arg("check").arg(&table));
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("imported-timeline"));
}
