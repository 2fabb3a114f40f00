//! A small hand-made table whose every number is chosen so a test can work out the expected
//! decision by hand.
#![allow(dead_code)]

use scheduler::table::{
    Bucket, DecodeStep, GpuIdentity, IoCostEntry, IoKind, LayerProfile, ModelIdentity, ProfileTable, SlackWindow, PROFILE_FORMAT_VERSION,
};

pub const LAYERS: u32 = 4;

pub fn model() -> ModelIdentity {
    ModelIdentity { name: "toy".into(), layer_count: LAYERS, kv_bytes_per_token_per_layer: 1024 }
}

pub fn gpu() -> GpuIdentity {
    GpuIdentity { name: "toy-gpu".into(), sm_count: 16 }
}

/// Every layer: 1000 µs, attention at 100 µs, windows [0,100) 4 SMs, [100,600) 2 SMs,
/// [600,1000) 4 SMs.
pub fn layer() -> LayerProfile {
    LayerProfile {
        compute_duration_us: 1000.0,
        kv_needed_offset_us: 100.0,
        slack_windows: vec![
            SlackWindow { offset_us: 0.0, duration_us: 100.0, free_sms: 4 },
            SlackWindow { offset_us: 100.0, duration_us: 500.0, free_sms: 2 },
            SlackWindow { offset_us: 600.0, duration_us: 400.0, free_sms: 4 },
        ],
    }
}

/// Reads: 150 µs per IOCB on 2 SMs, 100 µs on 4. Writes: 300 µs per IOCB on 2 SMs, 200 on 4.
/// Counts 1, 2, 4, 8.
pub fn io_costs() -> Vec<IoCostEntry> {
    let mut rows = Vec::new();
    for (kind, per_iocb_2, per_iocb_4) in [(IoKind::Read, 150.0, 100.0), (IoKind::Write, 300.0, 200.0)] {
        for (budget, per_iocb) in [(2, per_iocb_2), (4, per_iocb_4)] {
            for count in [1u32, 2, 4, 8] {
                rows.push(IoCostEntry {
                    kind,
                    iocb_count: count,
                    sm_budget: budget,
                    duration_us: per_iocb * f64::from(count),
                    bytes: 1024 * 1024 * u64::from(count),
                });
            }
        }
    }
    rows
}

/// Grid: inputs 1024 and 2048, prefixes every 1024.
pub fn table() -> ProfileTable {
    let mut buckets = Vec::new();
    for input in [1024u32, 2048] {
        let mut prefix = 0;
        while prefix <= input {
            buckets.push(Bucket { input_tokens: input, prefix_tokens: prefix, layers: vec![layer(); LAYERS as usize] });
            prefix += 1024;
        }
    }
    ProfileTable {
        format_version: PROFILE_FORMAT_VERSION,
        model: model(),
        gpu: gpu(),
        compute_source: "hand-made test table".into(),
        io_cost_source: "hand-made test table".into(),
        input_step_tokens: 1024,
        input_step_count: 2,
        prefix_step_tokens: 1024,
        buckets,
        io_costs: io_costs(),
        decode_steps: vec![
            DecodeStep { context_tokens: 1024, duration_us: 1000.0, free_sms: 4 },
            DecodeStep { context_tokens: 2048, duration_us: 2000.0, free_sms: 4 },
        ],
    }
}
