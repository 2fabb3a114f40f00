//! Bad tables are rejected with the field and the bucket named; lookups outside the table give a
//! typed error or the documented conservative fallback; nothing panics on untrusted input.

mod common;

use scheduler::table::{IoKind, Profile, ProfileTable};
use scheduler::SchedulerError;

fn load(table: ProfileTable) -> Result<Profile, SchedulerError> {
    Profile::from_table(table)
}

fn message(result: Result<Profile, SchedulerError>) -> (SchedulerError, String) {
    let error = result.expect_err("table must be rejected");
    let text = error.to_string();
    (error, text)
}

/// Goal: the test table is valid and round-trips through JSON unchanged.
#[test]
fn valid_table_round_trips() {
    let profile = load(common::table()).unwrap();
    for json in [profile.to_json_pretty().unwrap(), profile.to_json().unwrap()] {
        let again = Profile::from_json(&json).unwrap();
        assert_eq!(again.table(), profile.table());
    }
}

#[test]
fn missing_bucket_is_named() {
    let mut t = common::table();
    t.buckets.remove(3); // (2048, 1024)
    let (error, text) = message(load(t));
    assert!(matches!(error, SchedulerError::MissingBucket { input_tokens: 2048, prefix_tokens: 1024 }), "{text}");
    // Truncated at the end as well.
    let mut t = common::table();
    t.buckets.pop();
    let (error, _) = message(load(t));
    assert!(matches!(error, SchedulerError::MissingBucket { input_tokens: 2048, prefix_tokens: 2048 }));
}

#[test]
fn negative_duration_names_field_bucket_and_layer() {
    let mut t = common::table();
    t.buckets[1].layers[2].compute_duration_us = -5.0;
    let (_, text) = message(load(t));
    assert!(text.contains("compute_duration_us"), "{text}");
    assert!(text.contains("bucket(input_tokens=1024, prefix_tokens=1024) layer 2"), "{text}");
    assert!(text.contains("negative"), "{text}");
}

#[test]
fn nan_and_infinite_durations_are_rejected() {
    for bad in [f64::NAN, f64::INFINITY] {
        let mut t = common::table();
        t.buckets[0].layers[0].slack_windows[1].duration_us = bad;
        let (_, text) = message(load(t));
        assert!(text.contains("slack_windows.duration_us"), "{text}");
        assert!(text.contains("layer 0 window 1"), "{text}");
        assert!(text.contains("not a finite number"), "{text}");
    }
    // JSON itself has no NaN: a table written with one fails to parse, typed.
    let json = Profile::from_table(common::table()).unwrap().to_json_pretty().unwrap();
    let broken = json.replacen("\"compute_duration_us\": 1000.0", "\"compute_duration_us\": NaN", 1);
    assert!(matches!(Profile::from_json(&broken), Err(SchedulerError::Parse(_))));
    let null = json.replacen("\"compute_duration_us\": 1000.0", "\"compute_duration_us\": null", 1);
    assert!(matches!(Profile::from_json(&null), Err(SchedulerError::Parse(_))));
}

#[test]
fn non_monotonic_entries_are_rejected() {
    // Buckets out of order.
    let mut t = common::table();
    t.buckets.swap(0, 1);
    let (error, text) = message(load(t));
    assert!(matches!(error, SchedulerError::MissingBucket { .. } | SchedulerError::NonMonotonic { .. }), "{text}");
    // A bucket listed twice.
    let mut t = common::table();
    let duplicate = t.buckets[0].clone();
    t.buckets.insert(1, duplicate);
    let (error, text) = message(load(t));
    assert!(matches!(error, SchedulerError::NonMonotonic { .. }), "{text}");
    assert!(text.contains("bucket(input_tokens=1024, prefix_tokens=0)"), "{text}");
    // Overlapping windows.
    let mut t = common::table();
    t.buckets[2].layers[1].slack_windows[1].offset_us = 50.0;
    let (error, text) = message(load(t));
    assert!(matches!(error, SchedulerError::NonMonotonic { .. }), "{text}");
    assert!(text.contains("slack_windows.offset_us") && text.contains("layer 1 window 1"), "{text}");
    // I/O cost rows out of order, and a larger count that is faster.
    let mut t = common::table();
    t.io_costs.swap(0, 1);
    let (_, text) = message(load(t));
    assert!(text.contains("io_costs") && text.contains("iocb_count=1"), "{text}");
    let mut t = common::table();
    t.io_costs[1].duration_us = 1.0;
    let (_, text) = message(load(t));
    assert!(text.contains("io_costs.duration_us"), "{text}");
    // Decode steps out of order.
    let mut t = common::table();
    t.decode_steps.reverse();
    let (_, text) = message(load(t));
    assert!(text.contains("decode_steps.context_tokens"), "{text}");
}

/// Goal: a bucket whose prefix is longer than its input is named as such, wherever it is listed:
/// it is neither listed twice nor out of order, but "not strictly increasing" is what the grid
/// walk said of one among the grid's buckets.
#[test]
fn a_bucket_whose_prefix_is_longer_than_its_input_is_named_as_such() {
    let stray = |at: usize| {
        let mut t = common::table();
        let mut bucket = t.buckets[1].clone();
        bucket.prefix_tokens = 2048;
        t.buckets.insert(at, bucket);
        message(load(t))
    };
    // Among the grid's buckets (after (1024, 1024)), and past the grid's last one.
    for at in [2, 5] {
        let (error, text) = stray(at);
        assert!(
            matches!(&error, SchedulerError::InvalidField { field, location, .. }
                if field == "buckets.prefix_tokens" && location == "bucket(input_tokens=1024, prefix_tokens=2048)"),
            "{text}"
        );
        assert!(text.contains("longer than the input"), "{text}");
    }
}

#[test]
fn zero_steps_and_impossible_values_are_rejected() {
    let mut t = common::table();
    t.prefix_step_tokens = 0;
    assert!(message(load(t)).1.contains("prefix_step_tokens"));
    let mut t = common::table();
    t.buckets[0].layers[0].slack_windows[0].free_sms = 17;
    assert!(message(load(t)).1.contains("free_sms"));
    let mut t = common::table();
    t.buckets[0].layers[0].kv_needed_offset_us = 2000.0;
    assert!(message(load(t)).1.contains("kv_needed_offset_us"));
    let mut t = common::table();
    t.buckets[0].layers[0].slack_windows[2].duration_us = 500.0;
    assert!(message(load(t)).1.contains("window ends after the layer"));
    let mut t = common::table();
    t.buckets[0].layers.pop();
    assert!(message(load(t)).1.contains("3 layers listed, model has 4"));
    let mut t = common::table();
    t.io_costs.retain(|r| r.kind == IoKind::Read);
    assert!(message(load(t)).1.contains("no rows for this kind"));
}

#[test]
fn wrong_model_or_gpu_is_rejected() {
    let profile = load(common::table()).unwrap();
    let mut model = common::model();
    model.name = "llama3-8b".into();
    let error = profile.check_identity(&model, &common::gpu()).unwrap_err();
    assert!(matches!(error, SchedulerError::IdentityMismatch { field: "model.name", .. }));
    let mut model = common::model();
    model.kv_bytes_per_token_per_layer = 4096;
    let error = profile.check_identity(&model, &common::gpu()).unwrap_err();
    assert!(error.to_string().contains("kv_bytes_per_token_per_layer"), "{error}");
    let mut gpu = common::gpu();
    gpu.sm_count = 132;
    let error = profile.check_identity(&common::model(), &gpu).unwrap_err();
    assert!(matches!(error, SchedulerError::IdentityMismatch { field: "gpu.sm_count", .. }));
    profile.check_identity(&common::model(), &common::gpu()).unwrap();
}

#[test]
fn future_version_is_rejected_before_its_shape_is_parsed() {
    let json = Profile::from_table(common::table()).unwrap().to_json_pretty().unwrap();
    // A future format may add fields we do not know: the version is what must be reported.
    let future = json.replacen("\"format_version\": 1", "\"format_version\": 2, \"new_field\": [1]", 1);
    match Profile::from_json(&future) {
        Err(SchedulerError::UnsupportedVersion { found: 2, supported: 1 }) => {}
        other => panic!("expected UnsupportedVersion, got {other:?}"),
    }
    let mut t = common::table();
    t.format_version = 0;
    assert!(matches!(load(t), Err(SchedulerError::UnsupportedVersion { found: 0, .. })));
    let missing = json.replacen("\"format_version\": 1,", "", 1);
    assert!(Profile::from_json(&missing).unwrap_err().to_string().contains("format_version"));
}

#[test]
fn lookups_round_conservatively_or_fail_typed() {
    let profile = load(common::table()).unwrap();
    // Between buckets: input rounds down, prefix rounds up (the cheaper bucket).
    let b = profile.bucket(1500, 100).unwrap();
    assert_eq!((b.input_tokens, b.prefix_tokens), (1024, 1024));
    let b = profile.bucket(2047, 1025).unwrap();
    assert_eq!((b.input_tokens, b.prefix_tokens), (1024, 1024));
    let b = profile.bucket(2048, 1).unwrap();
    assert_eq!((b.input_tokens, b.prefix_tokens), (2048, 1024));
    // Longer than profiled: clamp to the longest input (cheaper side).
    let b = profile.bucket(100_000, 0).unwrap();
    assert_eq!((b.input_tokens, b.prefix_tokens), (2048, 0));
    // Shorter than the first step, or a prefix longer than the input: typed errors.
    assert!(matches!(profile.bucket(1000, 0), Err(SchedulerError::OutOfRange { what: "input_tokens", .. })));
    assert!(matches!(profile.bucket(1024, 2048), Err(SchedulerError::OutOfRange { what: "prefix_tokens", .. })));
    assert!(matches!(profile.bucket(0, 0), Err(SchedulerError::OutOfRange { .. })));
    assert!(profile.bucket(u32::MAX, u32::MAX).is_ok());

    // I/O: count rounds up, budget rounds down, beyond the table = back-to-back largest kernels.
    assert_eq!(profile.io_duration_us(IoKind::Read, 3, 4).unwrap(), 400.0);
    assert_eq!(profile.io_duration_us(IoKind::Read, 3, 3).unwrap(), 600.0);
    assert_eq!(profile.io_duration_us(IoKind::Read, 20, 4).unwrap(), 800.0 * 2.0 + 400.0);
    assert_eq!(profile.io_duration_us(IoKind::Read, 0, 4).unwrap(), 0.0);
    assert!(matches!(profile.io_duration_us(IoKind::Write, 1, 1), Err(SchedulerError::OutOfRange { what: "sm_budget", .. })));
    assert!(profile.io_duration_us(IoKind::Read, u32::MAX, u32::MAX).unwrap().is_finite());

    // Decode: context rounds down, clamps above, errors below.
    assert_eq!(profile.decode_step(2047).unwrap().context_tokens, 1024);
    assert_eq!(profile.decode_step(1 << 30).unwrap().context_tokens, 2048);
    assert!(matches!(profile.decode_step(5), Err(SchedulerError::OutOfRange { what: "context_tokens", .. })));
}

/// Goal: a budget between profiled ones is priced by the slowest budget below it, so a table in
/// which more SMs are slower (as measured: 4 write IOCBs take 134 ms on 1 SM and 264 ms on 2,
/// docs/scheduler.md) never prices a kernel below what a smaller budget measured. A profiled
/// budget keeps its own rows. Before, 3 SMs took the 2-SM row alone: 1 IOCB at 16.1 ms, below the
/// 59.4 ms measured on 1 SM.
#[test]
fn a_budget_between_rows_is_priced_by_the_slowest_budget_below() {
    let mut table = common::table();
    table.io_costs.retain(|row| row.kind == IoKind::Read);
    for (sm_budget, iocb_count, duration_us) in [(1, 1, 59_400.0), (1, 4, 134_000.0), (2, 1, 16_100.0), (2, 4, 264_000.0)] {
        table.io_costs.push(scheduler::table::IoCostEntry {
            kind: IoKind::Write,
            iocb_count,
            sm_budget,
            duration_us,
            bytes: u64::from(iocb_count) << 20,
        });
    }
    let profile = load(table).unwrap();
    assert_eq!(profile.io_duration_us(IoKind::Write, 1, 2).unwrap(), 16_100.0, "a profiled budget: its own row");
    assert_eq!(profile.io_duration_us(IoKind::Write, 4, 1).unwrap(), 134_000.0);
    assert_eq!(profile.io_duration_us(IoKind::Write, 1, 3).unwrap(), 59_400.0);
    assert_eq!(profile.io_duration_us(IoKind::Write, 4, 3).unwrap(), 264_000.0);
    // Past the largest count: back-to-back kernels per budget (1 SM: 134 + 59.4 ms; 2 SMs: 264 +
    // 16.1 ms), the slower of the two.
    assert_eq!(profile.io_duration_us(IoKind::Write, 5, 8).unwrap(), 264_000.0 + 16_100.0);
}

/// Goal: no corruption of a table file makes the loader panic. Deterministic byte mutations
/// (a small LCG, no external crates) over the JSON of a valid table.
#[test]
fn corrupted_json_never_panics() {
    let json = Profile::from_table(common::table()).unwrap().to_json_pretty().unwrap();
    let bytes = json.as_bytes();
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as usize
    };
    let replacements = b"-0123456789.,:{}[]\" aeE";
    let mut rejected = 0;
    for _ in 0..3000 {
        let mut mutated = bytes.to_vec();
        for _ in 0..(1 + next() % 3) {
            let at = next() % mutated.len();
            mutated[at] = replacements[next() % replacements.len()];
        }
        let text = String::from_utf8_lossy(&mutated);
        if Profile::from_json(&text).is_err() {
            rejected += 1;
        }
    }
    // Most mutations must be caught (some only change a digit and stay valid).
    assert!(rejected > 1000, "only {rejected} of 3000 mutations rejected");
}

#[test]
fn between_grid_points_the_windows_are_the_corners_intersection() {
    // Goal: a request between grid points plans with the windows of every corner of its grid
    // cell intersected — at each offset the fewest SMs any corner has free — not the cheapest
    // corner's alone, which can show more SMs free than the real layer has. On a grid point the
    // bucket's own windows; past the longest input, that row's corners only.
    use scheduler::table::SlackWindow;
    let w = |offset_us: f64, duration_us: f64, free_sms: u32| SlackWindow { offset_us, duration_us, free_sms };
    let mut t = common::table();
    for bucket in &mut t.buckets {
        let windows = match (bucket.input_tokens, bucket.prefix_tokens) {
            (2048, 1024) => vec![w(0.0, 300.0, 1), w(300.0, 700.0, 3)],
            (1024, 0) => vec![w(50.0, 650.0, 2)],
            _ => continue,
        };
        for layer in &mut bucket.layers {
            layer.slack_windows = windows.clone();
        }
    }
    let profile = load(t).unwrap();
    let mut out = Vec::new();

    // Corners (1024, 1024) (the cheapest, the default windows), (1024, 0), (2048, 0), (2048, 1024).
    profile.slack_windows_between(1500, 100, 2, &mut out).unwrap();
    assert_eq!(out, vec![w(50.0, 50.0, 1), w(100.0, 200.0, 1), w(300.0, 300.0, 2), w(600.0, 100.0, 2)]);
    // The cheapest corner alone, as `bucket` rounds, would have said 4 SMs free over [0, 100).
    assert_eq!(profile.bucket(1500, 100).unwrap().layers[2].slack_windows[0], w(0.0, 100.0, 4));

    // On the input grid, between prefixes: (2048, 1024) and (2048, 0).
    profile.slack_windows_between(2048, 1, 0, &mut out).unwrap();
    assert_eq!(out, vec![w(0.0, 100.0, 1), w(100.0, 200.0, 1), w(300.0, 300.0, 2), w(600.0, 400.0, 3)]);

    // A grid point: the bucket's own windows.
    profile.slack_windows_between(2048, 1024, 3, &mut out).unwrap();
    assert_eq!(out, vec![w(0.0, 300.0, 1), w(300.0, 700.0, 3)]);
    profile.slack_windows_between(1024, 0, 3, &mut out).unwrap();
    assert_eq!(out, vec![w(50.0, 650.0, 2)]);

    // Past the longest input: its row only ((2048, 0), the default windows).
    profile.slack_windows_between(100_000, 0, 1, &mut out).unwrap();
    assert_eq!(out, common::layer().slack_windows);

    // Out of range, as `bucket`; a layer past the model's.
    assert!(matches!(profile.slack_windows_between(1000, 0, 0, &mut out), Err(SchedulerError::OutOfRange { what: "input_tokens", .. })));
    assert!(matches!(profile.slack_windows_between(1024, 0, 4, &mut out), Err(SchedulerError::OutOfRange { what: "layer", .. })));
}

#[test]
fn between_windows_never_show_more_free_sms_than_a_corner_on_an_analytic_table() {
    // Goal: on a real-sized analytic table with a coarse prefix grid (so most requests fall
    // between grid points), the windows a request plans with, sampled at many offsets, are
    // inside the cheapest corner's windows and never show more SMs free than any corner.
    let mut preset = scheduler::sweep::preset("llama3-8b-h100-32k").unwrap();
    preset.grid.prefix_step_tokens = 1024;
    let profile = preset.build_profile().unwrap();
    let free_at = |windows: &[scheduler::table::SlackWindow], t: f64| {
        windows.iter().find(|w| w.offset_us <= t && t < w.end_us()).map_or(0, |w| w.free_sms)
    };
    let step = profile.table().input_step_tokens;
    let mut out = Vec::new();
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |below: u32| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % u64::from(below)) as u32
    };
    for _ in 0..300 {
        let input = step + next(profile.input_tokens_max() - step);
        let prefix = next(input + 1);
        let layer = next(32);
        profile.slack_windows_between(input, prefix, layer, &mut out).unwrap();
        let cheapest = &profile.bucket(input, prefix).unwrap().layers[layer as usize].slack_windows;
        let input_low = input / step * step;
        let rows = [input_low, (input_low + step).min(profile.input_tokens_max())];
        let prefix_step = 1024;
        let corners: Vec<&Vec<scheduler::table::SlackWindow>> = rows
            .iter()
            .flat_map(|&row| {
                [prefix / prefix_step * prefix_step, prefix.div_ceil(prefix_step) * prefix_step]
                    .map(|p| &profile.bucket(row, p.min(row / prefix_step * prefix_step)).unwrap().layers[layer as usize].slack_windows)
            })
            .collect();
        let end = cheapest.last().map_or(0.0, |w| w.end_us());
        for k in 0..200 {
            let t = end * f64::from(k) / 200.0;
            let here = free_at(&out, t);
            assert!(here <= free_at(cheapest, t), "({input}, {prefix}) layer {layer} at {t} µs: outside the cheapest corner's windows");
            for corner in &corners {
                assert!(here <= free_at(corner, t), "({input}, {prefix}) layer {layer} at {t} µs: {here} SMs, a corner has fewer");
            }
        }
    }
}

/// Goal: a duration past `DURATION_US_MAX` (1e12 µs, 11.6 days) is refused wherever a table
/// holds one, so that no sum of them (a count past the largest row costed as back-to-back
/// kernels, a write queue's layers) reaches infinity. Write rows of 1 µs for 1 IOCB and 1e308
/// µs for 2 were accepted, and 5 IOCBs then cost 2 × 1e308 + 1 = inf.
#[test]
fn durations_past_the_bound_are_refused() {
    let mut t = common::table();
    let row = t.io_costs.iter().position(|r| r.kind == IoKind::Write && r.sm_budget == 4 && r.iocb_count == 2).unwrap();
    t.io_costs[row - 1].duration_us = 1.0;
    for later in &mut t.io_costs[row..row + 3] {
        later.duration_us = 1e308;
    }
    let (_, text) = message(load(t));
    assert!(text.contains("io_costs.duration_us") && text.contains("1000000000000"), "{text}");
    let mut t = common::table();
    t.decode_steps[0].duration_us = 1e12 + 1.0;
    assert!(message(load(t)).1.contains("decode_steps.duration_us"));
    let mut t = common::table();
    for layer in &mut t.buckets[0].layers {
        layer.compute_duration_us = 2e12;
    }
    assert!(message(load(t)).1.contains("compute_duration_us"));
    // The bound itself is a duration.
    let mut t = common::table();
    t.decode_steps[0].duration_us = scheduler::table::DURATION_US_MAX;
    load(t).expect("a duration of exactly the bound");
}

/// Goal: every I/O cost row moves whole IOCBs of one size, at least one LBA (512 bytes) each:
/// the policy and the runtime count reads and writes in that one size. A row of 1 byte for 1
/// IOCB was accepted (a runtime then counted a layer in u32::MAX IOCBs), as were bytes that do
/// not divide into the count and write rows of another size than the read rows (the runtime
/// counted write IOCBs in the read size and costed them with the write rows).
#[test]
fn io_cost_rows_hold_one_iocb_size_of_whole_lbas() {
    let profile = load(common::table()).unwrap();
    assert_eq!(profile.iocb_bytes(), 1024 * 1024);
    type Corruption = fn(&mut ProfileTable);
    let cases: [(&str, Corruption); 4] = [
        ("less than one 512-byte LBA", |t| {
            for row in &mut t.io_costs {
                row.bytes = u64::from(row.iocb_count);
            }
        }),
        ("do not divide", |t| t.io_costs[1].bytes = 3 * 1024 * 1024 + 1),
        ("bytes per IOCB", |t| {
            for row in t.io_costs.iter_mut().filter(|r| r.kind == IoKind::Write) {
                row.bytes /= 2;
            }
        }),
        ("not a multiple of 512", |t| {
            for row in &mut t.io_costs {
                row.bytes = 1000 * u64::from(row.iocb_count);
            }
        }),
    ];
    for (reason, corrupt) in cases {
        let mut t = common::table();
        corrupt(&mut t);
        let (error, text) = message(load(t));
        assert!(matches!(error, SchedulerError::InvalidField { .. }), "{text}");
        assert!(text.contains("io_costs.bytes") && text.contains(reason), "{reason}: {text}");
    }
}

/// Goal: a lookup never picks a bucket with more new tokens (more compute, a longer layer) than
/// the request has. With a prefix step that does not divide the input step (4096 and 3072, as
/// `tutti-profile analytic --prefix-step 3072` and `import` accept), the input-4096 row lists
/// prefixes 0 and 3072 only: input 4096 with 4000 cached rounded the prefix up to 6144 and capped
/// it at 3072, a bucket of 1024 new tokens for a request of 96, and the policy granted write time
/// inside a layer ~5× longer than the real one. Such a request is `OutOfRange` (the runtime's
/// conservative fallback); where the capped bucket is no more expensive, it is still used.
#[test]
fn a_prefix_past_the_rows_last_grid_prefix_never_rounds_to_more_new_tokens() {
    use scheduler::table::Bucket;
    let mut t = common::table();
    t.input_step_tokens = 4096;
    t.input_step_count = 2;
    t.prefix_step_tokens = 3072;
    t.buckets = [(4096, 0), (4096, 3072), (8192, 0), (8192, 3072), (8192, 6144)]
        .map(|(input_tokens, prefix_tokens)| Bucket { input_tokens, prefix_tokens, layers: vec![common::layer(); common::LAYERS as usize] })
        .to_vec();
    let profile = load(t).unwrap();
    let out_of_range =
        |input: u32, prefix: u32| matches!(profile.bucket(input, prefix), Err(SchedulerError::OutOfRange { what: "prefix_tokens", .. }));
    // 96 new tokens; the only bucket of input ≤ 4096 above prefix 3072 has 1024.
    assert!(out_of_range(4096, 4000), "{:?}", profile.bucket(4096, 4000).map(|b| (b.input_tokens, b.prefix_tokens)));
    assert!(out_of_range(4096, 4096), "fully cached: 0 new tokens");
    assert!(out_of_range(5000, 4500), "500 new tokens; (4096, 3072) has 1024");
    // Capped, but no more new tokens than the request: (4096, 3072) has 1024, the request 4000.
    let b = profile.bucket(8000, 4000).unwrap();
    assert_eq!((b.input_tokens, b.prefix_tokens), (4096, 3072));
    // Not capped: rounded up within the row, as before.
    let b = profile.bucket(8192, 4000).unwrap();
    assert_eq!((b.input_tokens, b.prefix_tokens), (8192, 6144));
    let b = profile.bucket(4096, 3000).unwrap();
    assert_eq!((b.input_tokens, b.prefix_tokens), (4096, 3072));
    // The windows the policy plans with fail the same way.
    let mut out = Vec::new();
    assert!(matches!(
        profile.slack_windows_between(4096, 4000, 0, &mut out),
        Err(SchedulerError::OutOfRange { what: "prefix_tokens", .. })
    ));
    profile.slack_windows_between(8000, 4000, 0, &mut out).unwrap();
}
