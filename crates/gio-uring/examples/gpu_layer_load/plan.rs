//! The parts of examples/gpu_layer_load.rs that need no GPU: options, the size plan, IOCB
//! chunking, the pattern, the comparison, statistics, the budget and the JSON output.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gio_uring::{Descriptor, DeviceIndex, IoctxSpec, Iova, Lba};

/// Llama-3.1-8B: 8 KV heads × 128 dims × K and V × 2 bytes (bf16) per token and layer.
pub const KV_BYTES_PER_TOKEN: u64 = 4096;
/// The largest layer: 32768 tokens. The memory backing and both staging buffers are sized
/// to the largest layer asked for, so this caps the host and GPU memory the run takes.
pub const LAYER_BYTES_MAX: u64 = 128 << 20;
/// The namespace's LBA size.
pub const BLOCK_BYTES: u64 = 4096;
/// The gio ABI's most IOCTXs per IOCB.
pub const IOCTX_PER_IOCB_MAX: u32 = gio_uring::abi::MAX_IOCTX_PER_IOCB;
/// The byte the target buffers are filled with before every read.
pub const POISON: u8 = 0xA5;

pub const USAGE: &str = "usage: gpu_layer_load [--tokens N,N,...] [--ioctx-kib K] [--repetitions R] [--budget-s S] \
    [--io-sms M] [--json PATH]\n  defaults: --tokens 256,512,1024,2048,4096,8192,16384,32768 --ioctx-kib 32 \
    --repetitions 20 --budget-s 150 --io-sms 8\n  environment: GIO_KERNEL_DIR (default target/kernels), GIO_DMA_MODE \
    (staged only)";

#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Layer sizes in tokens, ascending, without repeats.
    pub tokens: Vec<u32>,
    pub ioctx_bytes: u64,
    pub repetitions: u32,
    pub budget: Duration,
    pub io_sms: u32,
    pub json_path: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            tokens: (8..=15).map(|shift| 1u32 << shift).collect(),
            ioctx_bytes: 32 << 10,
            repetitions: 20,
            budget: Duration::from_secs(150),
            io_sms: 8,
            json_path: None,
        }
    }
}

fn number<T: std::str::FromStr>(flag: &str, text: &str) -> Result<T, String> {
    text.parse().map_err(|_| format!("{flag}: {text:?} is not a number"))
}

impl Options {
    /// `Ok(None)` for --help.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Option<Self>, String> {
        let mut options = Self::default();
        let mut args = args.into_iter();
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Ok(None);
            }
            const FLAGS: [&str; 6] = ["--tokens", "--ioctx-kib", "--repetitions", "--budget-s", "--io-sms", "--json"];
            if !FLAGS.contains(&flag.as_str()) {
                return Err(format!("unknown option {flag:?}"));
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            match flag.as_str() {
                "--tokens" => {
                    options.tokens = value.split(',').map(|text| number(&flag, text.trim())).collect::<Result<_, _>>()?;
                }
                "--ioctx-kib" => {
                    // Checked: a shift would drop a huge value's high bits and pass the range check.
                    options.ioctx_bytes =
                        number::<u64>(&flag, &value)?.checked_mul(1024).ok_or_else(|| format!("--ioctx-kib {value}: too large"))?
                }
                "--repetitions" => options.repetitions = number(&flag, &value)?,
                "--budget-s" => options.budget = Duration::from_secs(number(&flag, &value)?),
                "--io-sms" => options.io_sms = number(&flag, &value)?,
                "--json" => options.json_path = Some(PathBuf::from(value)),
                _ => unreachable!("checked against FLAGS above"),
            }
        }
        options.tokens.sort_unstable();
        options.tokens.dedup();
        if options.tokens.is_empty() || options.tokens[0] == 0 {
            return Err("--tokens: every size must be at least 1 token".into());
        }
        let kib = options.ioctx_bytes >> 10;
        if !kib.is_power_of_two() || !(4..=128).contains(&kib) {
            return Err(format!("--ioctx-kib {kib}: a power of two from 4 to 128"));
        }
        layer_plan(&options.tokens, options.ioctx_bytes).map_err(|error| format!("--tokens: {error}"))?;
        if options.repetitions == 0 {
            return Err("--repetitions must be at least 1".into());
        }
        if options.budget.is_zero() {
            return Err("--budget-s must be at least 1".into());
        }
        if options.io_sms == 0 {
            return Err("--io-sms must be at least 1".into());
        }
        Ok(Some(options))
    }
}

/// One layer size and its IOCBs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPlan {
    pub tokens: u32,
    pub layer_bytes: u64,
    pub ioctx_bytes: u64,
    pub ioctx_count: u32,
    /// The IOCTX indices of each IOCB.
    pub iocb_ranges: Vec<Range<u32>>,
}

/// The layers of `tokens` (ascending) in IOCTXs of `ioctx_bytes`: each a whole number of
/// IOCTXs, none above [`LAYER_BYTES_MAX`].
pub fn layer_plan(tokens: &[u32], ioctx_bytes: u64) -> Result<Vec<LayerPlan>, String> {
    if ioctx_bytes == 0 || !ioctx_bytes.is_multiple_of(BLOCK_BYTES) {
        return Err(format!("an IOCTX of {ioctx_bytes} bytes is not a whole number of {BLOCK_BYTES}-byte blocks"));
    }
    tokens
        .iter()
        .map(|&tokens| {
            let layer_bytes = u64::from(tokens) * KV_BYTES_PER_TOKEN;
            if layer_bytes > LAYER_BYTES_MAX {
                return Err(format!(
                    "{tokens} tokens: a layer of {layer_bytes} bytes is above the {LAYER_BYTES_MAX}-byte cap (the memory \
                     backing and both staging buffers are sized to the largest layer)"
                ));
            }
            if !layer_bytes.is_multiple_of(ioctx_bytes) {
                return Err(format!("{tokens} tokens: a layer of {layer_bytes} bytes is not a whole number of {ioctx_bytes}-byte IOCTXs"));
            }
            let ioctx_count = u32::try_from(layer_bytes / ioctx_bytes).map_err(|_| "too many IOCTXs".to_string())?;
            Ok(LayerPlan { tokens, layer_bytes, ioctx_bytes, ioctx_count, iocb_ranges: iocb_ranges(ioctx_count, IOCTX_PER_IOCB_MAX) })
        })
        .collect()
}

/// `ioctx_count` IOCTXs cut into IOCBs of at most `per_iocb_max`, in order.
pub fn iocb_ranges(ioctx_count: u32, per_iocb_max: u32) -> Vec<Range<u32>> {
    (0..ioctx_count.div_ceil(per_iocb_max)).map(|k| k * per_iocb_max..((k + 1) * per_iocb_max).min(ioctx_count)).collect()
}

/// The gio queue's depth: room for a layer's write IOCBs and read IOCBs (a power of two).
pub fn queue_depth(iocbs_per_layer_max: usize) -> u32 {
    (2 * iocbs_per_layer_max as u32).next_power_of_two().max(2)
}

/// IOCTX `i` of `range`: LBA `i × ioctx_bytes / BLOCK_BYTES`, memory `base + i × ioctx_bytes`,
/// one SGL data block (the memory is contiguous, and staged mode copies it in one run).
pub fn ioctx_specs(range: Range<u32>, base: Iova, ioctx_bytes: u64, nsid: u32) -> Result<Vec<IoctxSpec>, String> {
    let block_count = u32::try_from(ioctx_bytes / BLOCK_BYTES).map_err(|_| "IOCTX too large".to_string())?;
    range
        .map(|index| {
            let offset = u64::from(index) * ioctx_bytes;
            Ok(IoctxSpec {
                device: DeviceIndex(0),
                nsid,
                start_lba: Lba(offset / BLOCK_BYTES),
                block_count,
                data: base.checked_add(offset).ok_or_else(|| format!("IOCTX {index} overflows the IOVA space"))?,
                descriptor: Descriptor::SglInline,
                force_unit_access: false,
            })
        })
        .collect()
}

/// SplitMix64's finaliser: a bijection on u64 that scatters neighbouring inputs.
fn mix(mut value: u64) -> u64 {
    value = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    value = (value ^ (value >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    value ^ (value >> 31)
}

/// `len` bytes whose every 8-byte word depends on `seed` and on its position, so that data
/// from another offset or from another size's run cannot pass for the right data.
pub fn layer_pattern(seed: u64, len: usize) -> Vec<u8> {
    let key = mix(seed);
    let mut bytes = vec![0u8; len];
    for (word, chunk) in bytes.chunks_mut(8).enumerate() {
        let value = mix(key ^ word as u64).to_le_bytes();
        chunk.copy_from_slice(&value[..chunk.len()]);
    }
    bytes
}

/// Where two buffers first differ, and by how much.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    pub offset: usize,
    pub expected: u8,
    pub actual: u8,
    /// Bytes that differ in all.
    pub differing: usize,
}

impl Mismatch {
    /// Names the IOCB and IOCTX of the first differing byte.
    pub fn describe(&self, ioctx_bytes: u64) -> String {
        let ioctx = self.offset as u64 / ioctx_bytes;
        let per_iocb = u64::from(IOCTX_PER_IOCB_MAX);
        format!(
            "byte {} (IOCB {} of the layer, its IOCTX {}, byte {} of it) is {:#04x}, expected {:#04x}; {} bytes differ{}",
            self.offset,
            ioctx / per_iocb,
            ioctx % per_iocb,
            self.offset as u64 % ioctx_bytes,
            self.actual,
            self.expected,
            self.differing,
            if self.actual == POISON { " (the poison: never written)" } else { "" }
        )
    }
}

/// `None` when `actual` equals `expected` (of the same length).
pub fn first_mismatch(expected: &[u8], actual: &[u8]) -> Option<Mismatch> {
    if expected == actual {
        return None;
    }
    if expected.len() != actual.len() {
        let offset = expected.len().min(actual.len());
        return Some(Mismatch { offset, expected: 0, actual: 0, differing: expected.len().abs_diff(actual.len()) });
    }
    let offset = expected.iter().zip(actual).position(|(a, b)| a != b)?;
    let differing = expected.iter().zip(actual).filter(|(a, b)| a != b).count();
    Some(Mismatch { offset, expected: expected[offset], actual: actual[offset], differing })
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub median_us: f64,
    pub p10_us: f64,
    pub p90_us: f64,
}

/// Median (mean of the middle two for an even count), 10th and 90th percentile (nearest
/// rank below), as tools/gpu/h2d-bandwidth.cu computes them.
pub fn summarize(samples_us: &[f64]) -> Option<Summary> {
    if samples_us.is_empty() {
        return None;
    }
    let mut sorted = samples_us.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median_us = if n % 2 == 1 { sorted[n / 2] } else { (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0 };
    Some(Summary { median_us, p10_us: sorted[n / 10], p90_us: sorted[(n * 9 / 10).min(n - 1)] })
}

/// One JSON point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub layer_bytes: u64,
    pub ioctx_bytes: u64,
    pub repetitions: u32,
    pub median_us: f64,
    /// 10^9 bytes per second at the median.
    pub gb_per_s: f64,
}

impl Point {
    pub fn new(layer_bytes: u64, ioctx_bytes: u64, repetitions: u32, median_us: f64) -> Self {
        let gb_per_s = if median_us > 0.0 { layer_bytes as f64 / (median_us * 1e-6) / 1e9 } else { 0.0 };
        Self { layer_bytes, ioctx_bytes, repetitions, median_us, gb_per_s }
    }
}

/// The points as a JSON array, one object per line.
pub fn points_json(points: &[Point]) -> String {
    let lines: Vec<String> = points
        .iter()
        .map(|point| {
            format!(
                "  {{\"layer_bytes\": {}, \"ioctx_bytes\": {}, \"repetitions\": {}, \"median_us\": {:.2}, \"gb_per_s\": {:.3}}}",
                point.layer_bytes, point.ioctx_bytes, point.repetitions, point.median_us, point.gb_per_s
            )
        })
        .collect();
    if lines.is_empty() {
        "[]\n".to_string()
    } else {
        format!("[\n{}\n]\n", lines.join(",\n"))
    }
}

/// Writes the points to `path` through a temporary file and a rename, so that the file is
/// always a whole array.
pub fn write_json(path: &Path, points: &[Point]) -> std::io::Result<()> {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".partial");
    std::fs::write(&temporary, points_json(points))?;
    std::fs::rename(&temporary, path)
}

/// The run's time limit.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub started: Instant,
    pub limit: Duration,
}

impl Budget {
    pub fn left(&self, now: Instant) -> Duration {
        self.limit.saturating_sub(now.saturating_duration_since(self.started))
    }

    /// Whether work expected to take `cost` still ends within the limit.
    pub fn fits(&self, now: Instant, cost: Duration) -> bool {
        cost <= self.left(now)
    }
}

/// The time of a size of `next_bytes` from that of `previous_bytes`: proportional to the
/// bytes (pessimistic for sizes whose fixed costs dominate, which is the safe side).
pub fn scale_estimate(previous: Duration, previous_bytes: u64, next_bytes: u64) -> Duration {
    if previous_bytes == 0 {
        return previous;
    }
    previous.mul_f64(next_bytes as f64 / previous_bytes as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn defaults_are_the_kv_layers_of_256_to_32768_tokens_in_32_kib_ioctxs() {
        let options = Options::parse(args("")).unwrap().unwrap();
        assert_eq!(options.tokens, vec![256, 512, 1024, 2048, 4096, 8192, 16384, 32768]);
        let layers = layer_plan(&options.tokens, options.ioctx_bytes).unwrap();
        assert_eq!(layers[0].layer_bytes, 1 << 20);
        assert_eq!(layers[0].ioctx_count, 32);
        assert_eq!(layers[0].iocb_ranges, vec![0..32]);
        let largest = layers.last().unwrap();
        assert_eq!(largest.layer_bytes, 128 << 20);
        assert_eq!(largest.ioctx_count, 4096);
        assert_eq!(largest.iocb_ranges, vec![0..2048, 2048..4096]);
        assert_eq!(queue_depth(2), 4);
    }

    #[test]
    fn options_parse_sort_and_refuse_what_cannot_run() {
        let options =
            Options::parse(args("--tokens 1024,256,1024 --ioctx-kib 4 --repetitions 3 --budget-s 60 --io-sms 16 --json out.json"))
                .unwrap()
                .unwrap();
        assert_eq!(options.tokens, vec![256, 1024]);
        assert_eq!(options.ioctx_bytes, 4096);
        assert_eq!((options.repetitions, options.budget, options.io_sms), (3, Duration::from_secs(60), 16));
        assert_eq!(options.json_path, Some(PathBuf::from("out.json")));
        assert_eq!(Options::parse(args("--help")).unwrap(), None);
        for bad in [
            "--tokens 0",
            "--tokens x",
            "--ioctx-kib 48",
            "--ioctx-kib 256",
            "--repetitions 0",
            "--budget-s 0",
            "--io-sms 0",
            "--frob 1",
            "--json",
            // 2^54 + 4 KiB: shifted into bytes it wrapped to 4 KiB, a valid size.
            "--ioctx-kib 18014398509481988",
        ] {
            assert!(Options::parse(args(bad)).is_err(), "{bad} must be refused");
        }
    }

    #[test]
    fn layer_plan_caps_the_size_and_wants_whole_ioctxs() {
        assert!(layer_plan(&[65536], 32 << 10).unwrap_err().contains("cap"));
        assert!(layer_plan(&[1], 32 << 10).unwrap_err().contains("whole number"));
        assert!(layer_plan(&[256], 1000).is_err());
        let four_kib = layer_plan(&[32768], 4096).unwrap();
        assert_eq!(four_kib[0].iocb_ranges.len(), 16);
        assert_eq!(queue_depth(16), 32);
    }

    #[test]
    fn iocb_ranges_cover_every_ioctx_once_in_order_with_at_most_the_maximum_each() {
        for count in [1u32, 31, 2047, 2048, 2049, 4096, 5000] {
            let ranges = iocb_ranges(count, 2048);
            assert_eq!(ranges.first().unwrap().start, 0);
            assert_eq!(ranges.last().unwrap().end, count);
            for pair in ranges.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
            }
            assert!(ranges.iter().all(|range| !range.is_empty() && range.len() <= 2048));
        }
    }

    #[test]
    fn ioctxs_map_index_to_lba_and_memory_alike() {
        let specs = ioctx_specs(2048..2050, Iova(1 << 32), 32 << 10, 1).unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].start_lba, Lba(2048 * 8));
        assert_eq!(specs[0].data, Iova((1 << 32) + 2048 * (32 << 10)));
        assert_eq!(specs[1].start_lba, Lba(2049 * 8));
        assert_eq!(specs[1].block_count, 8);
        assert_eq!(specs[1].descriptor, Descriptor::SglInline);
        assert!(ioctx_specs(0..2, Iova(u64::MAX - 4096), 32 << 10, 1).is_err());
    }

    #[test]
    fn the_pattern_differs_between_positions_and_sizes() {
        let one = layer_pattern(1 << 20, 1 << 20);
        let two = layer_pattern(2 << 20, 2 << 20);
        assert_eq!(one, layer_pattern(1 << 20, 1 << 20));
        assert_ne!(one[..], two[..1 << 20]);
        // No two 32 KiB IOCTXs of a layer are alike: a misplaced one cannot pass.
        let mut ioctxs: Vec<&[u8]> = two.chunks(32 << 10).collect();
        ioctxs.sort();
        ioctxs.dedup();
        assert_eq!(ioctxs.len(), (2 << 20) / (32 << 10));
        assert_eq!(layer_pattern(7, 13).len(), 13);
    }

    #[test]
    fn a_single_wrong_byte_is_found_and_named() {
        let expected = layer_pattern(1, 100_000);
        assert_eq!(first_mismatch(&expected, &expected), None);
        let mut actual = expected.clone();
        actual[70_000] ^= 1;
        let mismatch = first_mismatch(&expected, &actual).unwrap();
        assert_eq!((mismatch.offset, mismatch.differing), (70_000, 1));
        assert_eq!(mismatch.actual, expected[70_000] ^ 1);
        let text = mismatch.describe(32 << 10);
        assert!(text.contains("IOCB 0 of the layer, its IOCTX 2, byte 4464"), "{text}");
        let poisoned = vec![POISON; 100_000];
        assert!(first_mismatch(&expected, &poisoned).unwrap().describe(32 << 10).contains("never written"));
        assert!(first_mismatch(&expected, &expected[..10]).is_some());
    }

    #[test]
    fn summary_takes_the_median_and_percentiles() {
        assert_eq!(summarize(&[]), None);
        let odd = summarize(&[5.0, 1.0, 3.0]).unwrap();
        assert_eq!(odd.median_us, 3.0);
        let even = summarize(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(even.median_us, 2.5);
        let many: Vec<f64> = (1..=20).map(f64::from).collect();
        let summary = summarize(&many).unwrap();
        assert_eq!((summary.median_us, summary.p10_us, summary.p90_us), (10.5, 3.0, 19.0));
    }

    #[test]
    fn json_is_an_array_of_the_documented_points() {
        assert_eq!(points_json(&[]), "[]\n");
        let point = Point::new(1 << 20, 32 << 10, 20, 250.0);
        assert!((point.gb_per_s - 4.194_304).abs() < 1e-9);
        let text = points_json(&[point, Point::new(2 << 20, 32 << 10, 3, 400.0)]);
        assert_eq!(
            text.lines().nth(1).unwrap(),
            "  {\"layer_bytes\": 1048576, \"ioctx_bytes\": 32768, \"repetitions\": 20, \"median_us\": 250.00, \"gb_per_s\": 4.194},"
        );
        assert!(text.starts_with("[\n") && text.ends_with("\n]\n"));
        let path = std::env::temp_dir().join(format!("gpu-layer-load-test-{}.json", std::process::id()));
        write_json(&path, &[point]).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), points_json(&[point]));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn the_budget_admits_work_only_while_it_fits() {
        let started = Instant::now();
        let budget = Budget { started, limit: Duration::from_secs(10) };
        assert!(budget.fits(started, Duration::from_secs(10)));
        assert!(!budget.fits(started + Duration::from_secs(4), Duration::from_secs(7)));
        assert_eq!(budget.left(started + Duration::from_secs(20)), Duration::ZERO);
        assert_eq!(scale_estimate(Duration::from_secs(2), 1 << 20, 4 << 20), Duration::from_secs(8));
        assert_eq!(scale_estimate(Duration::from_secs(2), 0, 4 << 20), Duration::from_secs(2));
    }

    /// The plan's IOCBs as the GPU run fills them, run by the CPU executor on the software
    /// controller: the queue accepts them (SGL data blocks, registered memory, two IOCBs of
    /// 2048 IOCTXs in one issue), they land at the LBAs they name, and a read that leaves part
    /// of the target poisoned is caught and named.
    #[test]
    fn the_plans_iocbs_round_trip_through_the_cpu_executor_and_a_missing_read_is_caught() {
        use std::sync::Arc;

        use gio_uring::abi::Opcode;
        use gio_uring::{CpuExecutor, Dependency, DeviceInfo, DeviceTable, GioQueue, IocbSpec, IovaRange, LayerIndex, QueueConfig};
        use gio_uring::{RegisteredMemory, SmBudget};
        use nvme_driver::hw::DeviceBackend;
        use nvme_driver::{Controller, ControllerConfig};
        use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};

        // 4096 tokens in 4 KiB IOCTXs: 16 MiB, 4096 IOCTXs, two full IOCBs.
        let layer = layer_plan(&[4096], 4096).unwrap().remove(0);
        assert_eq!(layer.iocb_ranges.len(), 2);
        let bytes = layer.layer_bytes as usize;
        let emu = EmuConfig::default()
            .with_backing(Backing::Memory { bytes: layer.layer_bytes })
            .with_namespaces(vec![NamespaceConfig::new(BLOCK_BYTES as u32, Some(layer.layer_bytes))]);
        let device = EmuDevice::start(emu).unwrap();
        let backend: Arc<dyn DeviceBackend> = device.clone();
        let controller = Controller::init(backend, ControllerConfig::default()).unwrap();
        let namespace = controller.namespaces()[0];
        let info = DeviceInfo {
            nsid: namespace.id.0,
            capacity_blocks: namespace.size_blocks,
            block_bytes: namespace.block_size_bytes,
            sgl_supported: controller.identify().sgl_support.supported(),
        };
        let source = controller.dma().allocate(bytes).unwrap();
        let target = controller.dma().allocate(bytes).unwrap();
        let registered =
            RegisteredMemory::new(vec![IovaRange::new(source.iova(), bytes as u64), IovaRange::new(target.iova(), bytes as u64)]).unwrap();
        let depth = queue_depth(layer.iocb_ranges.len());
        let executor = CpuExecutor::new(vec![controller.create_io_queue_pair(1024).unwrap()], depth);
        let config = QueueConfig { depth, ioctx_per_iocb_max: IOCTX_PER_IOCB_MAX };
        let mut queue = GioQueue::init_queue(config, DeviceTable::new(vec![info]), registered, executor).unwrap();
        let writes = queue.get_iocb(2, Dependency::None).unwrap();
        let reads = queue.get_iocb(2, Dependency::None).unwrap();
        let mut run = |ids: &[gio_uring::IocbId], opcode: Opcode, base: Iova| {
            for (&id, range) in ids.iter().zip(&layer.iocb_ranges) {
                let ioctxs = ioctx_specs(range.clone(), base, layer.ioctx_bytes, namespace.id.0).unwrap();
                queue.fill_iocb(id, &IocbSpec::single(opcode, 0), &ioctxs).unwrap();
            }
            queue.issue_io(ids, LayerIndex(0), SmBudget(1)).unwrap();
            for &id in ids {
                let deadline = Instant::now() + Duration::from_secs(30);
                assert_eq!(queue.wait_cqe(id, deadline).unwrap().result, Ok(()));
            }
        };

        let expected = layer_pattern(layer.layer_bytes, bytes);
        source.write(0, &expected).unwrap();
        run(&writes, Opcode::Write, source.iova());
        // IOCTX i sits at LBA i × 1 (4 KiB blocks): spot-check one in the second IOCB.
        let mut queue_pair = controller.create_io_queue_pair(16).unwrap();
        let scratch = controller.dma().allocate(4096).unwrap();
        let segment = nvme_driver::DataSegment::new(scratch.iova(), 4096);
        queue_pair.read(namespace.id, Lba(3000), &[segment], Duration::from_secs(5)).unwrap();
        let mut block = vec![0u8; 4096];
        scratch.read(0, &mut block).unwrap();
        assert!(block[..] == expected[3000 * 4096..3001 * 4096], "IOCTX 3000 is not at LBA 3000");

        target.fill(0, bytes, POISON).unwrap();
        run(&reads, Opcode::Read, target.iova());
        let mut back = vec![0u8; bytes];
        target.read(0, &mut back).unwrap();
        assert_eq!(first_mismatch(&expected, &back), None);

        // Only the first IOCB read: the second's IOCTXs keep the poison, and the report says so.
        target.fill(0, bytes, POISON).unwrap();
        run(&reads[..1], Opcode::Read, target.iova());
        target.read(0, &mut back).unwrap();
        let mismatch = first_mismatch(&expected, &back).unwrap();
        assert_eq!(mismatch.offset, 2048 * 4096);
        let text = mismatch.describe(layer.ioctx_bytes);
        assert!(text.contains("IOCB 1 of the layer, its IOCTX 0, byte 0") && text.contains("never written"), "{text}");
    }
}
