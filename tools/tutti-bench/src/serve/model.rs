//! What stands in for the GPU and the SSD, and how the two are slowed down together.
//!
//! - The device: one software controller running the timing model of `--emu-timing`, which for
//!   serve must be the `tutti-ssd` preset (`tutti-ssd:xN`, default N = 32): one SSD of the
//!   scheduler's `SsdModel::tutti_two_ssds` with bandwidth / N and latency × N. Explicit
//!   figures (`read=…,write=…`) are accepted only when they equal such a preset for some N:
//!   arbitrary figures say nothing about the per-SM rate the cost table needs, nor about the
//!   factor by which compute must be slowed, so they are refused rather than guessed.
//! - The simulator's SSD: the same model, undilated, with one device (the live pool has one).
//! - Compute: the analytic roofline table of `--model` on `--gpu`, with its I/O cost rows from
//!   that undilated SSD model. The live run sleeps N × each layer's table duration, so every
//!   ratio of slack to I/O is that of the real GPU and SSD; live times are reported ÷ N.

use nvme_emu::TimingModel;
use scheduler::analytic::{build_table, AnalyticGrid, GpuSpec, ModelConfig};
use scheduler::ssd::SsdModel;
use scheduler::table::Profile;
use tutti_cli::ModelChoice;

use crate::args::Cli;
use crate::{usage, Unusable};

/// SMs the table reserves for I/O kernels (the analytic presets' choice).
pub const IO_SMS: u32 = 4;
/// One IOCB of the table: 32 KV objects (16 blocks' K and V of one layer for Llama-3.1-8B),
/// small enough that a layer's reads split into several and windows can be filled.
pub const IOCB_OBJECTS: u64 = 32;
pub const IOCB_COUNT_MAX: u32 = 4096;

#[derive(Debug, Clone)]
pub struct ServeModel {
    pub choice: ModelChoice,
    pub compute: ModelConfig,
    pub gpu: GpuSpec,
    /// Undilated, one device: what the simulator and the cost rows use.
    pub ssd: SsdModel,
    pub dilation: u32,
    pub timing: TimingModel,
    pub iocb_bytes: u64,
}

/// The slow-motion factor N for which `timing` is `tutti-ssd:xN`, if any.
pub fn preset_dilation(timing: &TimingModel) -> Option<u32> {
    let one = SsdModel::tutti_two_ssds();
    let guess = (one.read_bytes_per_s_per_device / timing.read_bytes_per_s as f64).round();
    if !(1.0..=1024.0).contains(&guess) {
        return None;
    }
    let dilation = guess as u32;
    (tutti_devices::timing::dilated(&one, dilation).ok()? == *timing).then_some(dilation)
}

impl ServeModel {
    pub fn from_cli(cli: &Cli) -> anyhow::Result<Self> {
        let choice = cli.geometry.resolve(Some(tutti_cli::geometry::DEFAULT_MODEL)).map_err(|error| Unusable(error.to_string()))?;
        let timing = match cli.emu_timing {
            Some(timing) => timing,
            None => tutti_devices::parse_timing("tutti-ssd").map_err(|error| anyhow::anyhow!("the tutti-ssd preset: {error}"))?,
        };
        let Some(dilation) = preset_dilation(&timing) else {
            return usage(format!(
                "--emu-timing={timing}: serve needs the tutti-ssd preset (tutti-ssd or tutti-ssd:xN): its slow-motion factor dilates \
                 compute and its undilated SSD model predicts; explicit figures give neither"
            ));
        };
        let base = choice.base.as_deref().and_then(ModelConfig::preset);
        let Some(mut compute) = base else {
            return usage(format!(
                "--model {}: serve stands compute in with the analytic roofline, which knows llama3-8b and qwen3-32b; accepted: --model llama3-8b|qwen3-32b (geometry flags may change the KV shape)",
                choice.name
            ));
        };
        compute.name = choice.name.clone();
        compute.layer_count = choice.geometry.layers;
        compute.kv_head_count = choice.geometry.kv_heads;
        compute.head_dim = choice.geometry.head_dim;
        compute.dtype_bytes = choice.geometry.dtype_bytes;
        let Some(gpu) = GpuSpec::preset(&cli.serve.gpu) else {
            return usage(format!("--gpu={}: unknown GPU; accepted: h100, h200", cli.serve.gpu));
        };
        let ssd = SsdModel { device_count: 1, ..SsdModel::tutti_two_ssds() };
        let iocb_bytes = IOCB_OBJECTS * choice.geometry.object_bytes();
        Ok(Self { choice, compute, gpu, ssd, dilation, timing, iocb_bytes })
    }

    /// Refuses prompts whose table would have more IOCBs per layer than the cost rows cover, with
    /// this model's limit (an IOCB is [`IOCB_OBJECTS`] objects of its geometry, so the limit in
    /// tokens is the same for every KV shape at one block size: 65536 × tokens per block).
    pub fn check_prompt(&self, prompt_tokens: u64) -> anyhow::Result<()> {
        let token_bytes = self.compute.kv_bytes_per_token_per_layer().max(1);
        let layer_bytes = prompt_tokens.saturating_mul(token_bytes);
        if layer_bytes.div_ceil(self.iocb_bytes.max(1)) > u64::from(IOCB_COUNT_MAX) {
            let tokens_max = u64::from(IOCB_COUNT_MAX).saturating_mul(self.iocb_bytes) / token_bytes;
            return usage(format!(
                "--prompt-tokens={prompt_tokens} is too long for serve's cost table ({IOCB_COUNT_MAX} IOCBs of {} per layer); accepted: up to {tokens_max} tokens of {}",
                crate::args::format_size(self.iocb_bytes),
                self.choice.name
            ));
        }
        Ok(())
    }

    /// The table for prompts of `prompt_tokens`: one input length, every block-aligned prefix.
    pub fn profile(&self, prompt_tokens: u64) -> anyhow::Result<Profile> {
        let prompt = u32::try_from(prompt_tokens).map_err(|_| Unusable(format!("--prompt-tokens={prompt_tokens} is too long")))?;
        let grid = AnalyticGrid {
            input_step_tokens: prompt,
            input_step_count: 1,
            prefix_step_tokens: self.choice.geometry.block_tokens,
            io_sms: IO_SMS,
            decode_step_tokens: (prompt / 8).max(1),
        };
        let io_costs = self.ssd.cost_table(self.iocb_bytes, IOCB_COUNT_MAX, &[IO_SMS])?;
        let source = format!(
            "analytic-ssd-model (not measured): one SSD of SsdModel::tutti_two_ssds, undilated; the live device runs it {}x slower",
            self.dilation
        );
        let table = build_table(&self.compute, &self.gpu, &grid, io_costs, &source)?;
        Ok(Profile::from_table(table)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_preset_maps_back_to_an_ssd_model() {
        // Goal: --emu-timing figures are accepted for serve exactly when they are tutti-ssd:xN.
        for (text, expected) in [("tutti-ssd", Some(32)), ("tutti-ssd:x1", Some(1)), ("tutti-ssd:x7", Some(7))] {
            assert_eq!(preset_dilation(&tutti_devices::parse_timing(text).unwrap()), expected, "{text}");
        }
        let explicit = tutti_devices::parse_timing("read=453125000,write=187500000,mixed=0.4,latency=1600us").unwrap();
        assert_eq!(preset_dilation(&explicit), Some(32));
        let other = tutti_devices::parse_timing("read=900m,write=375m,mixed=0.4,latency=800us").unwrap();
        assert_eq!(preset_dilation(&other), None);
    }

    #[test]
    fn a_prompt_past_the_cost_table_is_refused_with_this_models_limit() {
        // Goal: the refusal names the model run and its own limit (65536 × tokens per block),
        // not llama3-8b's at 16-token blocks whatever the model.
        use clap::Parser;
        let cli = Cli::try_parse_from(["tutti-bench", "--workload=serve", "--model=qwen3-32b", "--tokens-per-block=8"]).unwrap();
        let model = ServeModel::from_cli(&cli).unwrap();
        assert!(model.check_prompt(65_536 * 8).is_ok());
        let error = model.check_prompt(65_536 * 8 + 1).unwrap_err().to_string();
        assert!(error.contains("accepted: up to 524288 tokens of qwen3-32b"), "{error}");
    }
}
