//! An analytic (roofline) profile: per-layer compute and slack windows from a model config and a
//! GPU spec, for machines where nothing can be measured (no GPU here).
//!
//! # Assumptions — these numbers are modelled, not measured
//!
//! - A prefill layer is the kernel sequence of a Llama-style decoder (Tutti §3.3 names the same
//!   operators): input RMSNorm, fused QKV projection, RoPE (+ writing new K/V into the paged
//!   cache), causal attention over prefix + new tokens, output projection, post-attention RMSNorm,
//!   fused gate/up projection, SiLU·mul, down projection. Small per-head norms (Qwen3's q/k norm)
//!   and the embedding/LM head are ignored.
//! - Each kernel takes `max(flops / achieved FLOP/s, bytes / achieved HBM bandwidth)` plus a fixed
//!   launch overhead. Achieved rates are the GPU's dense peak × an efficiency factor: GEMMs
//!   ([`GpuSpec::gemm_efficiency`]), attention ([`GpuSpec::attention_efficiency`]) and memory
//!   traffic ([`GpuSpec::memory_efficiency`]) each have their own. The defaults are assumptions
//!   about well-tuned kernels, not measurements; pass others, or import a measured timeline.
//! - With prefix caching only the `input − prefix` new tokens are computed, but attention reads
//!   the whole context: attention FLOPs = `4 · heads · head_dim · (new · prefix + new²/2)`.
//! - Compute runs on a green-context partition of `sm_count − io_sms` SMs (Tutti §3.2); FLOP rates
//!   scale with that share. The `io_sms` reserved SMs are free during every kernel; a memory-bound
//!   kernel additionally leaves idle the share of SMs its roofline does not need
//!   (`1 − t_flops / t_bytes`). Each kernel is one slack window with that many free SMs.
//! - Attention is the first kernel that needs the layer's cached KV: `kv_needed_offset_us` is the
//!   sum of the kernels before it.
//! - Decode (batch of one) is the same kernel list with one new token; every step is memory-bound.

use serde::{Deserialize, Serialize};

use crate::error::{check_positive, Result, SchedulerError};
use crate::table::{
    Bucket, DecodeStep, GpuIdentity, IoCostEntry, LayerProfile, ModelIdentity, ProfileTable, SlackWindow, PROFILE_FORMAT_VERSION,
};

/// Configs come from files: a limit keeps a typo from allocating gigabytes.
pub const LAYER_COUNT_MAX: u32 = 1024;
/// Largest grid an analytic table may have (buckets × layers), for the same reason. An entry
/// (one layer of one bucket, nine windows) takes ~285 bytes in memory and ~800 bytes of JSON,
/// so 2.2M entries are ~0.6 GB in memory and ~1.8 GB of JSON. The cap was 50M (~14 GB in memory,
/// ~40 GB of JSON): `--input-step 64 --input-count 1760 --prefix-step 64` (49.6M) was accepted
/// and then ran out of memory. The default grid is 18,688 entries, the presets' at most 147,968;
/// the largest table `tutti-bench --workload=serve` builds for a model of 32 layers (a
/// 1,048,576-token prompt, every 16-token block a prefix) is 2,097,184, just inside.
pub const GRID_ENTRIES_MAX: u64 = 2_200_000;

/// Shape of a decoder-only transformer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    pub layer_count: u32,
    pub hidden_size: u32,
    pub head_count: u32,
    pub kv_head_count: u32,
    pub head_dim: u32,
    pub intermediate_size: u32,
    /// 2 for bf16/fp16.
    pub dtype_bytes: u32,
}

impl ModelConfig {
    /// Llama-3.1-8B: 128 KiB of KV per token in bf16.
    pub fn llama3_8b() -> Self {
        Self {
            name: "llama3-8b".into(),
            layer_count: 32,
            hidden_size: 4096,
            head_count: 32,
            kv_head_count: 8,
            head_dim: 128,
            intermediate_size: 14336,
            dtype_bytes: 2,
        }
    }

    /// Qwen3-32B: 256 KiB of KV per token in bf16.
    pub fn qwen3_32b() -> Self {
        Self {
            name: "qwen3-32b".into(),
            layer_count: 64,
            hidden_size: 5120,
            head_count: 64,
            kv_head_count: 8,
            head_dim: 128,
            intermediate_size: 25600,
            dtype_bytes: 2,
        }
    }

    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "llama3-8b" => Some(Self::llama3_8b()),
            "qwen3-32b" => Some(Self::qwen3_32b()),
            _ => None,
        }
    }

    pub fn validate(&self) -> Result<()> {
        for (field, value) in [
            ("model.layer_count", self.layer_count),
            ("model.hidden_size", self.hidden_size),
            ("model.head_count", self.head_count),
            ("model.kv_head_count", self.kv_head_count),
            ("model.head_dim", self.head_dim),
            ("model.intermediate_size", self.intermediate_size),
            ("model.dtype_bytes", self.dtype_bytes),
        ] {
            if value == 0 {
                return Err(SchedulerError::InvalidConfig { field: field.into(), reason: "must be > 0".into() });
            }
        }
        if self.layer_count > LAYER_COUNT_MAX {
            return Err(SchedulerError::InvalidConfig {
                field: "model.layer_count".into(),
                reason: format!("{} exceeds the limit of {LAYER_COUNT_MAX}", self.layer_count),
            });
        }
        if self.name.is_empty() {
            return Err(SchedulerError::InvalidConfig { field: "model.name".into(), reason: "empty".into() });
        }
        Ok(())
    }

    /// K and V for one token in one layer.
    pub fn kv_bytes_per_token_per_layer(&self) -> u64 {
        2 * u64::from(self.kv_head_count) * u64::from(self.head_dim) * u64::from(self.dtype_bytes)
    }

    pub fn identity(&self) -> ModelIdentity {
        ModelIdentity {
            name: self.name.clone(),
            layer_count: self.layer_count,
            kv_bytes_per_token_per_layer: self.kv_bytes_per_token_per_layer(),
        }
    }
}

/// What the roofline needs to know about a GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    pub name: String,
    pub sm_count: u32,
    /// Dense bf16 peak, all SMs.
    pub dense_flops_per_s: f64,
    pub hbm_bytes_per_s: f64,
    /// Share of peak a large GEMM sustains (assumption).
    pub gemm_efficiency: f64,
    /// Share of peak a flash-attention kernel sustains (assumption).
    pub attention_efficiency: f64,
    /// Share of HBM bandwidth a streaming kernel sustains (assumption).
    pub memory_efficiency: f64,
    /// Fixed cost per kernel (launch and tail), in µs.
    pub kernel_overhead_us: f64,
}

impl GpuSpec {
    /// The most SMs a spec may claim (today's largest GPUs have under 200).
    pub const SM_COUNT_MAX: u32 = 1 << 16;

    /// H100 SXM: 132 SMs, ~989 TFLOP/s dense bf16, 3.35 TB/s HBM3.
    pub fn h100() -> Self {
        Self {
            name: "h100".into(),
            sm_count: 132,
            dense_flops_per_s: 989e12,
            hbm_bytes_per_s: 3.35e12,
            gemm_efficiency: 0.7,
            attention_efficiency: 0.5,
            memory_efficiency: 0.8,
            kernel_overhead_us: 4.0,
        }
    }

    /// H200: same compute as H100, 4.8 TB/s HBM3e.
    pub fn h200() -> Self {
        Self { name: "h200".into(), hbm_bytes_per_s: 4.8e12, ..Self::h100() }
    }

    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "h100" => Some(Self::h100()),
            "h200" => Some(Self::h200()),
            _ => None,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.sm_count == 0 || self.name.is_empty() {
            return Err(SchedulerError::InvalidConfig {
                field: "gpu.sm_count/gpu.name".into(),
                reason: "must be non-zero/non-empty".into(),
            });
        }
        if self.sm_count > Self::SM_COUNT_MAX {
            return Err(SchedulerError::InvalidConfig {
                field: "gpu.sm_count".into(),
                reason: format!("{} is past {} (no GPU has that many SMs)", self.sm_count, Self::SM_COUNT_MAX),
            });
        }
        check_positive(self.dense_flops_per_s, "gpu.dense_flops_per_s")?;
        check_positive(self.hbm_bytes_per_s, "gpu.hbm_bytes_per_s")?;
        for (field, value) in [
            ("gpu.gemm_efficiency", self.gemm_efficiency),
            ("gpu.attention_efficiency", self.attention_efficiency),
            ("gpu.memory_efficiency", self.memory_efficiency),
        ] {
            if !(value.is_finite() && value > 0.0 && value <= 1.0) {
                return Err(SchedulerError::InvalidConfig { field: field.into(), reason: format!("{value} must be in (0, 1]") });
            }
        }
        if !(self.kernel_overhead_us.is_finite() && self.kernel_overhead_us >= 0.0) {
            return Err(SchedulerError::InvalidConfig { field: "gpu.kernel_overhead_us".into(), reason: "must be finite and >= 0".into() });
        }
        Ok(())
    }

    pub fn identity(&self) -> GpuIdentity {
        GpuIdentity { name: self.name.clone(), sm_count: self.sm_count }
    }
}

/// The bucket grid and the SM split of an analytic table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AnalyticGrid {
    pub input_step_tokens: u32,
    pub input_step_count: u32,
    pub prefix_step_tokens: u32,
    /// SMs reserved for the I/O green context.
    pub io_sms: u32,
    /// Decode rows every this many tokens of context, up to the longest input.
    pub decode_step_tokens: u32,
}

/// The roofline estimate of one kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelEstimate {
    pub name: &'static str,
    pub duration_us: f64,
    pub free_sms: u32,
}

enum Rate {
    Gemm,
    Attention,
}

/// Kernels of one layer with `new_tokens` computed over a cache of `prefix_tokens`.
pub fn layer_kernels(model: &ModelConfig, gpu: &GpuSpec, io_sms: u32, new_tokens: u64, prefix_tokens: u64) -> Vec<KernelEstimate> {
    let n = new_tokens as f64;
    let p = prefix_tokens as f64;
    let b = f64::from(model.dtype_bytes);
    let h = f64::from(model.hidden_size);
    let q_dim = f64::from(model.head_count) * f64::from(model.head_dim);
    let kv_dim = f64::from(model.kv_head_count) * f64::from(model.head_dim);
    let i = f64::from(model.intermediate_size);

    let compute_sms = gpu.sm_count.saturating_sub(io_sms).max(1);
    let sm_share = f64::from(compute_sms) / f64::from(gpu.sm_count);
    let bytes_per_us = gpu.hbm_bytes_per_s * gpu.memory_efficiency / 1e6;

    // (name, flops, bytes, which achieved FLOP rate)
    let ops: [(&'static str, f64, f64, Rate); 9] = [
        ("input_norm", 4.0 * n * h, 2.0 * n * h * b, Rate::Gemm),
        (
            "qkv_proj",
            2.0 * n * h * (q_dim + 2.0 * kv_dim),
            b * (h * (q_dim + 2.0 * kv_dim) + n * h + n * (q_dim + 2.0 * kv_dim)),
            Rate::Gemm,
        ),
        ("rope_kv_store", 6.0 * n * (q_dim + kv_dim), 2.0 * b * n * (q_dim + 2.0 * kv_dim), Rate::Gemm),
        ("attention", 4.0 * q_dim * (n * p + n * n / 2.0), b * (2.0 * n * q_dim + 2.0 * (p + n) * kv_dim), Rate::Attention),
        ("o_proj", 2.0 * n * q_dim * h, b * (q_dim * h + n * q_dim + n * h), Rate::Gemm),
        ("post_norm", 4.0 * n * h, 2.0 * n * h * b, Rate::Gemm),
        ("gate_up_proj", 4.0 * n * h * i, b * (2.0 * h * i + n * h + 2.0 * n * i), Rate::Gemm),
        ("silu_mul", 3.0 * n * i, 3.0 * n * i * b, Rate::Gemm),
        ("down_proj", 2.0 * n * i * h, b * (i * h + n * i + n * h), Rate::Gemm),
    ];
    ops.into_iter()
        .map(|(name, flops, bytes, rate)| {
            let efficiency = match rate {
                Rate::Gemm => gpu.gemm_efficiency,
                Rate::Attention => gpu.attention_efficiency,
            };
            let flops_per_us = gpu.dense_flops_per_s * efficiency * sm_share / 1e6;
            let flops_us = flops / flops_per_us;
            let bytes_us = bytes / bytes_per_us;
            // A memory-bound kernel only needs the SMs that keep HBM busy; the rest idle.
            let headroom = if bytes_us > flops_us && bytes_us > 0.0 {
                (f64::from(compute_sms) * (1.0 - flops_us / bytes_us)).floor() as u32
            } else {
                0
            };
            KernelEstimate {
                name,
                duration_us: flops_us.max(bytes_us) + gpu.kernel_overhead_us,
                free_sms: (io_sms + headroom).min(gpu.sm_count),
            }
        })
        .collect()
}

/// One layer's profile entry from its kernels.
pub fn layer_profile(kernels: &[KernelEstimate]) -> LayerProfile {
    let mut offset_us = 0.0;
    let mut kv_needed_offset_us = 0.0;
    let mut slack_windows = Vec::with_capacity(kernels.len());
    for kernel in kernels {
        if kernel.name == "attention" {
            kv_needed_offset_us = offset_us;
        }
        slack_windows.push(SlackWindow { offset_us, duration_us: kernel.duration_us, free_sms: kernel.free_sms });
        offset_us += kernel.duration_us;
    }
    LayerProfile { compute_duration_us: offset_us, kv_needed_offset_us, slack_windows }
}

/// Builds a complete table; `io_costs` come from a measurement or from
/// [`crate::ssd::SsdModel::cost_table`], and `io_cost_source` says which.
pub fn build_table(
    model: &ModelConfig,
    gpu: &GpuSpec,
    grid: &AnalyticGrid,
    io_costs: Vec<IoCostEntry>,
    io_cost_source: &str,
) -> Result<ProfileTable> {
    model.validate()?;
    gpu.validate()?;
    if grid.io_sms == 0 {
        return Err(SchedulerError::InvalidConfig {
            field: "io_sms".into(),
            reason: "0 SMs reserved for I/O: the I/O kernels need at least 1 (tutti-profile: --io-sms)".into(),
        });
    }
    if grid.io_sms >= gpu.sm_count {
        return Err(SchedulerError::InvalidConfig {
            field: "io_sms".into(),
            reason: format!("{} leaves no SMs for compute on {} SMs", grid.io_sms, gpu.sm_count),
        });
    }
    if grid.input_step_tokens == 0 || grid.input_step_count == 0 || grid.prefix_step_tokens == 0 {
        return Err(SchedulerError::InvalidConfig { field: "grid".into(), reason: "steps and counts must be > 0".into() });
    }
    if grid.decode_step_tokens == 0 {
        return Err(SchedulerError::InvalidConfig { field: "decode_step_tokens".into(), reason: "must be > 0".into() });
    }
    let input_max = grid
        .input_step_tokens
        .checked_mul(grid.input_step_count)
        .ok_or_else(|| SchedulerError::InvalidConfig { field: "input_step_count".into(), reason: "input range overflows u32".into() })?;
    let layer_count = model.layer_count as usize;
    // Upper bound of sum over k of (k · input_step / prefix_step + 1), without looping.
    let n = u128::from(grid.input_step_count);
    let bucket_count =
        (n + n * (n + 1) / 2 * u128::from(grid.input_step_tokens) / u128::from(grid.prefix_step_tokens)).min(u128::from(u64::MAX)) as u64;
    if bucket_count.saturating_mul(u64::from(model.layer_count)) > GRID_ENTRIES_MAX {
        return Err(SchedulerError::InvalidConfig {
            field: "grid".into(),
            reason: format!(
                "{bucket_count} buckets × {} layers = {} entries exceeds {GRID_ENTRIES_MAX} (~1.8 GB of JSON): use a coarser \
                 prefix_step_tokens or input_step_tokens, or a smaller input_step_count (tutti-profile analytic: --prefix-step, \
                 --input-step, --input-count)",
                model.layer_count,
                bucket_count.saturating_mul(u64::from(model.layer_count))
            ),
        });
    }

    let mut buckets = Vec::new();
    for k in 1..=grid.input_step_count {
        let input_tokens = k * grid.input_step_tokens;
        for j in 0..=input_tokens / grid.prefix_step_tokens {
            let prefix_tokens = j * grid.prefix_step_tokens;
            let new_tokens = u64::from(input_tokens - prefix_tokens);
            let kernels = layer_kernels(model, gpu, grid.io_sms, new_tokens, u64::from(prefix_tokens));
            // The roofline gives every layer of a bucket the same profile.
            let layer = layer_profile(&kernels);
            buckets.push(Bucket { input_tokens, prefix_tokens, layers: vec![layer; layer_count] });
        }
    }

    let mut decode_steps = Vec::new();
    let mut context_tokens = grid.decode_step_tokens;
    while context_tokens <= input_max.saturating_add(grid.decode_step_tokens) {
        let kernels = layer_kernels(model, gpu, grid.io_sms, 1, u64::from(context_tokens));
        let per_layer_us: f64 = kernels.iter().map(|k| k.duration_us).sum();
        let free_sms = kernels.iter().map(|k| k.free_sms).min().unwrap_or(grid.io_sms);
        decode_steps.push(DecodeStep { context_tokens, duration_us: per_layer_us * f64::from(model.layer_count), free_sms });
        let Some(next) = context_tokens.checked_add(grid.decode_step_tokens) else {
            break;
        };
        context_tokens = next;
    }

    Ok(ProfileTable {
        format_version: PROFILE_FORMAT_VERSION,
        model: model.identity(),
        gpu: gpu.identity(),
        compute_source: format!(
            "analytic-roofline (not measured): gemm_efficiency={}, attention_efficiency={}, \
             memory_efficiency={}, kernel_overhead_us={}, io_sms={}",
            gpu.gemm_efficiency, gpu.attention_efficiency, gpu.memory_efficiency, gpu.kernel_overhead_us, grid.io_sms
        ),
        io_cost_source: io_cost_source.to_string(),
        input_step_tokens: grid.input_step_tokens,
        input_step_count: grid.input_step_count,
        prefix_step_tokens: grid.prefix_step_tokens,
        buckets,
        io_costs,
        decode_steps,
    })
}
