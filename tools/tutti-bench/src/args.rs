//! Command line: fio's vocabulary for raw workloads, KV-cache vocabulary for the layer workload,
//! and the parsers for sizes, durations and device strings.
//!
//! Every parser returns a one-line message that says what was wrong and what is accepted; the
//! binary turns it into exit status 2.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

/// fio-like benchmark of the raw NVMe path and of layer-wise KV store/retrieve.
///
/// With no arguments: a temporary pool file on the local disk, the software NVMe controller and
/// the CPU executor run the embedded default workload, then the file is removed.
#[derive(Debug, Parser, Clone)]
#[command(name = "tutti-bench", version, about, long_about = None)]
pub struct Cli {
    /// What to run: raw device I/O (fio-like) or KV store/retrieve through the object store.
    #[arg(long, value_enum)]
    pub workload: Option<Workload>,

    /// I/O pattern (raw workload).
    #[arg(long, value_enum, default_value_t = Pattern::Read)]
    pub rw: Pattern,

    /// Block size per I/O: 4k, 128KiB, 1m (k/m/g/t are powers of 1024, like fio).
    #[arg(long, value_parser = parse_size_arg, default_value = "4k")]
    pub bs: u64,

    /// I/Os in flight per job.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub iodepth: u32,

    /// Jobs: one thread and one I/O queue pair per device each.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub numjobs: u32,

    /// Bytes each job covers, from --offset (default: the device from --offset to its end).
    #[arg(long, value_parser = parse_size_arg)]
    pub size: Option<u64>,

    /// Stop after this long (10, 10s, 500ms, 2m). Without --time_based a job also stops after
    /// one pass over --size.
    #[arg(long, value_parser = parse_duration_arg)]
    pub runtime: Option<Duration>,

    /// Keep going over the region until --runtime expires.
    #[arg(long = "time_based", alias = "time-based")]
    pub time_based: bool,

    /// Percentage of reads in a randrw mix.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub rwmixread: u8,

    /// Byte offset where the region starts (a multiple of --bs).
    #[arg(long, value_parser = parse_size_arg, default_value = "0")]
    pub offset: u64,

    /// Write a known pattern, read it back and compare (names the first mismatch).
    #[arg(long)]
    pub verify: bool,

    #[arg(long = "output-format", value_enum, default_value_t = OutputFormat::Normal)]
    pub output_format: OutputFormat,

    /// emu:PATH (software controller over a file, created when missing), emu:mem:SIZE,
    /// emu:null:SIZE (no-storage mode: commands complete without moving data),
    /// vfio:BDF (e.g. vfio:0000:00:04.0), uring:PATH (io_uring + O_DIRECT). Repeat to stripe.
    #[arg(long = "device", value_parser = parse_device_arg)]
    pub devices: Vec<DeviceSpec>,

    /// Who issues the NVMe commands.
    #[arg(long, value_enum, default_value_t = Executor::Cpu)]
    pub executor: Executor,

    /// Model whose KV geometry the kv workload uses: llama3-8b (default), qwen3-32b, llama3-70b.
    #[arg(long, value_parser = parse_model_arg)]
    pub model: Option<Model>,

    /// Prompt length in tokens (kv workload).
    #[arg(long = "prompt-tokens", default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub prompt_tokens: u64,

    /// Fraction of the prompt found in the cache (kv workload), 0..=1.
    #[arg(long = "hit-rate", default_value_t = 1.0, value_parser = parse_fraction_arg)]
    pub hit_rate: f64,

    /// Tokens per KV block (kv workload).
    #[arg(long = "block-tokens", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub block_tokens: u64,

    /// Keep the temporary pool file of the default run.
    #[arg(long)]
    pub keep: bool,

    /// Where the default run puts its temporary pool file (default: the system temp directory).
    #[arg(long)]
    pub directory: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    Raw,
    Kv,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Pattern {
    Read,
    Write,
    Randread,
    Randwrite,
    Randrw,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Read => "read",
            Pattern::Write => "write",
            Pattern::Randread => "randread",
            Pattern::Randwrite => "randwrite",
            Pattern::Randrw => "randrw",
        }
    }

    pub fn is_random(self) -> bool {
        matches!(self, Pattern::Randread | Pattern::Randwrite | Pattern::Randrw)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Normal,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Executor {
    Cpu,
    Cuda,
}

/// A device string as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The software controller over a file or block device.
    EmuFile(PathBuf),
    /// The software controller over process memory of this many bytes.
    EmuMemory(u64),
    /// The software controller in no-storage mode: commands are validated and completed without
    /// moving data (measures the driver and controller, not a medium).
    EmuNull(u64),
    /// An NVMe function bound to vfio-pci, by PCI address.
    Vfio(String),
    /// The kernel path: io_uring with O_DIRECT.
    Uring(PathBuf),
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::EmuFile(path) => write!(f, "emu:{}", path.display()),
            DeviceSpec::EmuMemory(bytes) => write!(f, "emu:mem:{}", format_size(*bytes)),
            DeviceSpec::EmuNull(bytes) => write!(f, "emu:null:{}", format_size(*bytes)),
            DeviceSpec::Vfio(address) => write!(f, "vfio:{address}"),
            DeviceSpec::Uring(path) => write!(f, "uring:{}", path.display()),
        }
    }
}

/// KV geometry of the models the kv workload knows (bf16, grouped-query attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Model {
    pub name: &'static str,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
}

impl Model {
    /// Bytes of K (or of V) per token in one layer: heads × head dim × 2 bytes (bf16).
    pub fn bytes_per_token_per_layer_half(&self) -> u64 {
        u64::from(self.kv_heads) * u64::from(self.head_dim) * 2
    }

    /// Bytes of K and V per token across all layers (the brief's "KV bytes per token").
    pub fn bytes_per_token(&self) -> u64 {
        2 * self.bytes_per_token_per_layer_half() * u64::from(self.layers)
    }
}

pub const MODELS: [Model; 3] = [
    Model { name: "llama3-8b", layers: 32, kv_heads: 8, head_dim: 128 },
    Model { name: "qwen3-32b", layers: 64, kv_heads: 8, head_dim: 128 },
    Model { name: "llama3-70b", layers: 80, kv_heads: 8, head_dim: 128 },
];

pub fn model_names() -> String {
    MODELS.iter().map(|model| model.name).collect::<Vec<_>>().join(", ")
}

fn parse_model_arg(text: &str) -> Result<Model, String> {
    MODELS
        .iter()
        .copied()
        .find(|model| model.name.eq_ignore_ascii_case(text))
        .ok_or_else(|| format!("unknown model '{text}'; accepted: {}", model_names()))
}

/// Parses a size like fio: plain bytes, or a number with k/m/g/t (optionally followed by `b` or
/// `ib`), all powers of 1024, any case: `4k` = `4KiB` = 4096.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let accepted = "accepted: a whole number of bytes with an optional k/m/g/t suffix (powers of 1024), e.g. 4k, 128KiB, 1m, 2G";
    let trimmed = text.trim();
    let digits_end = trimmed.find(|c: char| !c.is_ascii_digit()).unwrap_or(trimmed.len());
    let (digits, suffix) = trimmed.split_at(digits_end);
    if digits.is_empty() {
        return Err(format!("malformed size '{text}'; {accepted}"));
    }
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("malformed size '{text}' (unknown suffix '{suffix}'); {accepted}")),
    };
    let number: u64 = digits.parse().map_err(|_| format!("size '{text}' is too large; {accepted}"))?;
    number.checked_mul(1u64 << shift).ok_or_else(|| format!("size '{text}' is too large (over 2^64 bytes)"))
}

fn parse_size_arg(text: &str) -> Result<u64, String> {
    parse_size(text)
}

/// Parses a duration like fio's runtime: plain seconds, or with us/ms/s/m/h.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let accepted = "accepted: a whole number with an optional unit us/ms/s/m/h (default seconds), e.g. 10, 500ms, 2m";
    let trimmed = text.trim();
    let digits_end = trimmed.find(|c: char| !c.is_ascii_digit()).unwrap_or(trimmed.len());
    let (digits, unit) = trimmed.split_at(digits_end);
    let number: u64 = digits.parse().map_err(|_| format!("malformed duration '{text}'; {accepted}"))?;
    let duration = match unit.to_ascii_lowercase().as_str() {
        "us" => Duration::from_micros(number),
        "ms" => Duration::from_millis(number),
        "" | "s" => Duration::from_secs(number),
        "m" => Duration::from_secs(number.saturating_mul(60)),
        "h" => Duration::from_secs(number.saturating_mul(3600)),
        _ => return Err(format!("malformed duration '{text}' (unknown unit '{unit}'); {accepted}")),
    };
    if duration.is_zero() {
        return Err(format!("duration '{text}' is zero; {accepted}"));
    }
    Ok(duration)
}

fn parse_duration_arg(text: &str) -> Result<Duration, String> {
    parse_duration(text)
}

fn parse_fraction_arg(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(value) if (0.0..=1.0).contains(&value) => Ok(value),
        _ => Err(format!("'{text}' is not a fraction; accepted: a number in 0..=1, e.g. 0.9")),
    }
}

/// Parses `emu:PATH`, `emu:mem:SIZE`, `vfio:BDF` or `uring:PATH`.
pub fn parse_device(text: &str) -> Result<DeviceSpec, String> {
    let accepted = "accepted: emu:PATH, emu:mem:SIZE, emu:null:SIZE, vfio:BDF (e.g. vfio:0000:00:04.0), uring:PATH";
    let Some((kind, rest)) = text.split_once(':') else {
        return Err(format!("device '{text}' has no type prefix; {accepted}"));
    };
    if rest.is_empty() {
        return Err(format!("device '{text}' names no path or address; {accepted}"));
    }
    match kind {
        "emu" => {
            let (memory, size) = match (rest.strip_prefix("mem:"), rest.strip_prefix("null:")) {
                (Some(size), _) => (true, size),
                (None, Some(size)) => (false, size),
                (None, None) => return Ok(DeviceSpec::EmuFile(PathBuf::from(rest))),
            };
            let bytes = parse_size(size).map_err(|error| format!("device '{text}': {error}"))?;
            if bytes < 1 << 20 {
                return Err(format!("device '{text}': memory devices need at least 1 MiB"));
            }
            Ok(if memory { DeviceSpec::EmuMemory(bytes) } else { DeviceSpec::EmuNull(bytes) })
        }
        "uring" => Ok(DeviceSpec::Uring(PathBuf::from(rest))),
        "vfio" => {
            if !is_pci_address(rest) {
                return Err(format!("device '{text}': '{rest}' is not a PCI address like 0000:00:04.0; {accepted}"));
            }
            Ok(DeviceSpec::Vfio(rest.to_string()))
        }
        _ => Err(format!("device '{text}' has unknown type '{kind}'; {accepted}")),
    }
}

fn parse_device_arg(text: &str) -> Result<DeviceSpec, String> {
    parse_device(text)
}

/// `DDDD:BB:DD.F` (hex, domain optional).
fn is_pci_address(text: &str) -> bool {
    let hex = |part: &str, len: usize| part.len() == len && part.chars().all(|c| c.is_ascii_hexdigit());
    let parts: Vec<&str> = text.split(':').collect();
    let (domain_ok, bus, rest) = match parts.as_slice() {
        [domain, bus, rest] => (hex(domain, 4), *bus, *rest),
        [bus, rest] => (true, *bus, *rest),
        _ => return false,
    };
    let Some((device, function)) = rest.split_once('.') else { return false };
    domain_ok && hex(bus, 2) && hex(device, 2) && function.len() == 1 && function.chars().all(|c| ('0'..='7').contains(&c))
}

/// Human size with binary units, like fio's output (`4KiB`, `1.5GiB`).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0}{}", UNITS[unit])
    } else {
        format!("{value:.2}{}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_fio() {
        // Goal: fio's suffixes, all binary, any case; junk is refused with what is accepted.
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("128kb"), Ok(128 << 10));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("512"), Ok(512));
        assert!(parse_size("4q").unwrap_err().contains("accepted"));
        assert!(parse_size("").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("99999999999t").is_err());
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("ten").is_err());
    }

    #[test]
    fn devices_parse() {
        assert_eq!(parse_device("emu:/tmp/x"), Ok(DeviceSpec::EmuFile("/tmp/x".into())));
        assert_eq!(parse_device("emu:mem:64m"), Ok(DeviceSpec::EmuMemory(64 << 20)));
        assert_eq!(parse_device("emu:null:1g"), Ok(DeviceSpec::EmuNull(1 << 30)));
        assert_eq!(parse_device("uring:/dev/nvme0n1"), Ok(DeviceSpec::Uring("/dev/nvme0n1".into())));
        assert_eq!(parse_device("vfio:0000:00:04.0"), Ok(DeviceSpec::Vfio("0000:00:04.0".into())));
        assert_eq!(parse_device("vfio:00:04.0"), Ok(DeviceSpec::Vfio("00:04.0".into())));
        assert!(parse_device("vfio:banana").is_err());
        assert!(parse_device("nvme:/dev/x").is_err());
        assert!(parse_device("/dev/x").is_err());
        assert!(parse_device("emu:").is_err());
        assert!(parse_device("emu:mem:4q").is_err());
    }

    #[test]
    fn models_have_the_briefs_bytes_per_token() {
        // Design brief §6: 128 KiB (8B), 256 KiB (32B), 320 KiB (70B) per token.
        let find = |name| parse_model_arg(name).unwrap().bytes_per_token();
        assert_eq!(find("llama3-8b"), 128 << 10);
        assert_eq!(find("qwen3-32b"), 256 << 10);
        assert_eq!(find("llama3-70b"), 320 << 10);
        assert!(parse_model_arg("gpt-5").unwrap_err().contains("llama3-8b"));
    }

    #[test]
    fn sizes_format() {
        assert_eq!(format_size(4096), "4KiB");
        assert_eq!(format_size(1536 << 20), "1.50GiB");
    }
}
