//! The policies' decisions, window by window, on a hand-made table (tests/common) whose numbers
//! make each expected decision computable by hand. Tutti §3.3 is the specification.

mod common;

use scheduler::policy::{IoPolicy, Issue, LayerPlan, LayerView, NaivePipeline, NoOverlap, QueueView, ReadsOnBudget, SlackAware};
use scheduler::table::{IoKind, Profile};

fn profile() -> Profile {
    Profile::from_table(common::table()).expect("hand-made table is valid")
}

fn view<'a>(table: &'a Profile, layer: u32, unissued: &'a [u32]) -> LayerView<'a> {
    LayerView {
        table,
        input_tokens: 1024,
        prefix_tokens: 1024,
        layer,
        unissued_read_iocbs: unissued,
        outstanding_read_iocbs: 0,
        outstanding_reads_by_budget: &[],
        outstanding_read_kernels: 0,
        outstanding_write_iocbs: 0,
        outstanding_write_kernels: 0,
        in_flight_write_iocbs: 0,
        in_flight_write_sm_budget: 0,
        queued_write_iocbs: 0,
    }
}

fn read(layer: u32, iocb_count: u32, sm_budget: u32, offset_us: f64) -> Issue {
    Issue { kind: IoKind::Read, layer: Some(layer), iocb_count, sm_budget, offset_us, after_reads: false, slack_us: 0.0 }
}

/// Outstanding reads of `iocbs` IOCBs as `kernels` kernels on `sm_budget` SMs.
fn reads_on(sm_budget: u32, iocbs: u32, kernels: u32) -> ReadsOnBudget {
    ReadsOnBudget { sm_budget, iocbs, kernels }
}

fn write(iocb_count: u32, sm_budget: u32, offset_us: f64, after_reads: bool) -> Issue {
    Issue { kind: IoKind::Write, layer: None, iocb_count, sm_budget, offset_us, after_reads, slack_us: 0.0 }
}

/// Goal: the critical layer's reads go first and at once, the next layer's reads are split over
/// the windows by what the cost table says fits, and leftover room runs ahead.
#[test]
fn slack_aware_fills_windows_in_order() {
    let table = profile();
    let unissued = [2, 3, 3, 3];
    let plan = SlackAware.plan_layer(&view(&table, 0, &unissued)).unwrap();
    // Layer 0: 2 IOCBs now on 4 SMs -> SSD busy until 200 µs.
    // Window [0,100): starts after 200 µs -> no room.
    // Window [100,600) on 2 SMs: from 200 µs, 400 µs of room -> 2 IOCBs (300 µs), busy to 500.
    // Window [600,1000) on 4 SMs: layer 1's last IOCB (100 µs) at 600, then layer 2 gets
    // 2 IOCBs (200 µs) at 700; a third would round up to the 4-IOCB row (400 µs) and overflow.
    assert_eq!(
        plan,
        LayerPlan {
            wait_for_all_reads: false,
            issues: vec![read(0, 2, 4, 0.0), read(1, 2, 2, 200.0), read(1, 1, 4, 600.0), read(2, 2, 4, 700.0),],
        }
    );
}

/// Goal: when the next layer's reads cannot all finish inside this layer's windows, they are
/// issued immediately in one kernel instead of trickling into windows (reads are the bottleneck).
#[test]
fn slack_aware_issues_at_once_when_no_window_fits() {
    let table = profile();
    let unissued = [0, 8, 0, 0];
    let plan = SlackAware.plan_layer(&view(&table, 0, &unissued)).unwrap();
    // Windows could hold 1 + 2 + 4 = 7 of the 8 IOCBs: not enough.
    assert_eq!(plan.issues, vec![read(1, 8, 4, 0.0)]);
}

/// Goal: reads already in flight push the estimate of when the SSD is free, so a window that
/// would otherwise fit no longer does.
#[test]
fn slack_aware_accounts_for_reads_in_flight() {
    let table = profile();
    let unissued = [0, 0, 3, 0];
    let mut v = view(&table, 1, &unissued);
    let plan = SlackAware.plan_layer(&v).unwrap();
    // Idle SSD: window [0,100) takes 1 IOCB, [100,600) on 2 SMs the other 2 (300 µs).
    assert_eq!(plan.issues, vec![read(2, 1, 4, 0.0), read(2, 2, 2, 100.0)]);
    // 8 IOCBs in flight -> busy until 800 µs; only [600,1000) remains, 200 µs of room: 2 IOCBs.
    v.outstanding_read_iocbs = 8;
    let plan = SlackAware.plan_layer(&v).unwrap();
    assert_eq!(plan.issues, vec![read(2, 3, 4, 0.0)]);
}

/// Goal: writes outstanding hold the SSD as reads in flight do: under the read/write barrier a
/// read waits while a write is in flight (`tutti-runtime`; the simulator's carried write with
/// `WriteCarry::reads_wait_for_in_flight`), so layer k+1's reads may not be placed into windows
/// the write takes. 8 write IOCBs outstanding on 4 SMs (1600 µs) outlast every window of the
/// 1000 µs layer: no window is suitable and layer 1's 3 IOCBs go at once. Before, the windows
/// were priced from the reads alone and took them at 0 and 100 µs, inside the write.
#[test]
fn slack_aware_keeps_reads_out_of_windows_outstanding_writes_take() {
    let table = profile();
    let unissued = [0, 3, 0, 0];
    let mut v = view(&table, 0, &unissued);
    // Idle SSD: [0,100) takes 1 IOCB, [100,600) on 2 SMs the other 2.
    assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, vec![read(1, 1, 4, 0.0), read(1, 2, 2, 100.0)]);
    v.outstanding_write_iocbs = 8;
    v.outstanding_write_kernels = 1;
    v.in_flight_write_iocbs = 8;
    assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, vec![read(1, 3, 4, 0.0)]);
    // A write of 400 µs (2 IOCBs): [100,600) on 2 SMs holds 1 IOCB (150 µs) from 400, and
    // [600,1000) the other 2.
    v.outstanding_write_iocbs = 2;
    v.in_flight_write_iocbs = 2;
    assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, vec![read(1, 1, 2, 400.0), read(1, 2, 4, 600.0)]);
}

/// Goal: a read waits behind the one write kernel in flight, not behind the writes released
/// with it that wait for the reads. `tutti-runtime` hands write layers over one at a time and,
/// while reads are pending, none (the barrier): after a decode step released 4 layers of 2
/// IOCBs, the next prefill's reads wait for the layer in flight alone (400 µs), and go into the
/// same windows as behind a single 2-IOCB write. Before, all 8 IOCBs were priced ahead of them
/// (4 × 400 µs, past every window): every layer's reads went at once and nothing ran ahead.
/// Once that layer is written, the other 3 still wait and the reads go as on an idle SSD.
#[test]
fn slack_aware_prices_reads_behind_the_write_in_flight_only() {
    let table = profile();
    let unissued = [0, 3, 0, 0];
    let mut v = view(&table, 0, &unissued);
    v.outstanding_write_iocbs = 8;
    v.outstanding_write_kernels = 4;
    v.in_flight_write_iocbs = 2;
    assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, vec![read(1, 1, 2, 400.0), read(1, 2, 4, 600.0)]);
    v.outstanding_write_iocbs = 6;
    v.outstanding_write_kernels = 3;
    v.in_flight_write_iocbs = 0;
    assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, vec![read(1, 1, 4, 0.0), read(1, 2, 2, 100.0)]);
}

/// Goal: the write kernel in flight is priced on the SMs it runs on, not the table's largest
/// write budget. `tutti-runtime` hands a layer a decode step released over on that step's free
/// SMs: a 2-IOCB layer on 2 SMs takes 600 µs, not the 400 µs it takes on 4. Priced on 4 SMs,
/// layer 1's 5 reads fit ([100,600) on 2 SMs holds 1 from 400, [600,1000) the other 4), though
/// from 600 only [600,1000) is left and holds 4: the reads went into windows late. On its own
/// 2 SMs no window is suitable and they go at once. A budget not known (0) is priced on the
/// table's largest, and one below every profiled write budget on the slowest (here 2 SMs).
#[test]
fn slack_aware_prices_the_write_in_flight_on_its_own_sm_budget() {
    let table = profile();
    let unissued = [0, 5, 0, 0];
    let mut v = view(&table, 0, &unissued);
    v.outstanding_write_iocbs = 2;
    v.outstanding_write_kernels = 1;
    v.in_flight_write_iocbs = 2;
    let windows = vec![read(1, 1, 2, 400.0), read(1, 4, 4, 600.0)];
    for budget in [0, 4] {
        v.in_flight_write_sm_budget = budget;
        assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, windows, "in-flight budget {budget}");
    }
    for budget in [2, 1] {
        v.in_flight_write_sm_budget = budget;
        assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, vec![read(1, 5, 4, 0.0)], "in-flight budget {budget}");
    }
}

/// Goal: the outstanding reads are priced on the SMs they run on, as the write in flight is.
/// `tutti-runtime` hands a whole read layer over on the budget its plan chose for it, so a
/// run-ahead layer partly placed in a 2-SM window runs entirely on 2 SMs: 4 IOCBs take 600 µs
/// there (150 per IOCB), not the 400 µs they take on 4. Behind them a write may start at 600
/// at the earliest, in [600,1000). Priced on the table's largest read budget, [100,600) was
/// granted from 400 as time (a 0-IOCB write a runtime moving layers adds up), under reads still
/// running. Not known (0) or on 4 SMs: as before; below every profiled budget (1): the slowest.
#[test]
fn slack_aware_prices_outstanding_reads_on_their_own_sm_budget() {
    let table = profile();
    let unissued = [0, 0, 0, 0];
    let mut v = view(&table, 2, &unissued);
    v.outstanding_read_iocbs = 4;
    v.outstanding_read_kernels = 1;
    v.queued_write_iocbs = 1;
    let reads_on_2_sms_us = table.io_duration_us(IoKind::Read, 4, 2).unwrap();
    assert_eq!(reads_on_2_sms_us, 600.0);
    for budget in [2, 1] {
        let reads = [reads_on(budget, 4, 1)];
        let v = LayerView { outstanding_reads_by_budget: &reads, ..v };
        let plan = SlackAware.plan_layer(&v).unwrap();
        assert!(plan.issues.iter().all(|issue| issue.offset_us >= reads_on_2_sms_us), "read budget {budget}: {plan:?}");
        assert_eq!(plan.issues, vec![write(1, 4, 600.0, true)], "read budget {budget}");
    }
    let window_time = Issue { slack_us: 200.0, ..write(0, 2, 400.0, true) };
    for budget in [0, 4] {
        let reads = [reads_on(budget, 4, 1)];
        let v = LayerView { outstanding_reads_by_budget: &reads, ..v };
        assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, vec![window_time, write(1, 4, 600.0, true)], "read budget {budget}");
    }
}

/// The outstanding reads of a view, by the SM budget they run on.
fn set_outstanding_reads<'a>(v: &mut LayerView<'a>, by_budget: &'a [ReadsOnBudget]) {
    v.outstanding_read_iocbs = by_budget.iter().map(|reads| reads.iocbs).sum();
    v.outstanding_read_kernels = by_budget.iter().map(|reads| reads.kernels).sum();
    v.outstanding_reads_by_budget = by_budget;
}

/// Goal: outstanding read layers on different SM budgets are each priced on their own. One
/// layer of 1 IOCB on 4 SMs (100 µs) and one on 2 (150 µs) hold the SSD to 250 µs; a write IOCB
/// on 2 SMs (300 µs) then fits the [100,600) window from 250. Priced both on the smaller
/// budget (2 × 150 = 300 µs) the write went at 300, 50 µs of window left unused.
#[test]
fn slack_aware_prices_each_outstanding_read_layer_on_its_own_sm_budget() {
    let table = profile();
    let unissued = [0, 0, 0, 0];
    let mut v = view(&table, 2, &unissued);
    v.queued_write_iocbs = 1;
    let reads = [reads_on(4, 1, 1), reads_on(2, 1, 1)];
    set_outstanding_reads(&mut v, &reads);
    assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, vec![write(1, 2, 250.0, true)]);
}

/// Goal: on a table where fewer SMs are faster (reads 100 µs per IOCB on 2 SMs, 150 on 4, as
/// the measured io table in docs/scheduler.md has 1 SM faster than 2), a layer on 4 SMs is not
/// priced on the 2-SM rows because another outstanding layer runs on 2: 150 + 100 = 250 µs,
/// so the write IOCB (300 µs on 2 SMs) goes at 250. On the smallest budget the two were
/// priced at 200 µs and the write went at 200, under a read still running.
#[test]
fn slack_aware_prices_mixed_outstanding_reads_no_faster_than_their_own_budgets() {
    let mut rows = common::table();
    for row in rows.io_costs.iter_mut().filter(|row| row.kind == IoKind::Read) {
        row.duration_us = if row.sm_budget == 2 { 100.0 } else { 150.0 } * f64::from(row.iocb_count);
    }
    let table = Profile::from_table(rows).expect("valid table");
    let unissued = [0, 0, 0, 0];
    let mut v = view(&table, 2, &unissued);
    v.queued_write_iocbs = 1;
    let reads = [reads_on(4, 1, 1), reads_on(2, 1, 1)];
    set_outstanding_reads(&mut v, &reads);
    let plan = SlackAware.plan_layer(&v).unwrap();
    assert!(plan.issues.iter().all(|issue| issue.offset_us >= 250.0), "{plan:?}");
    assert_eq!(plan.issues, vec![write(1, 2, 250.0, true)]);
}

/// Goal: a decode step prices the outstanding reads on their own SM budget too: 4 read IOCBs
/// on 2 SMs hold the SSD to 600 µs of the 1000 µs step, room for 2 write IOCBs (400 µs on 4
/// SMs) from 600. Priced on 4 SMs (400 µs) the same 2 went at 400, under the reads.
#[test]
fn slack_aware_decode_step_prices_outstanding_reads_on_their_own_sm_budget() {
    let table = profile();
    let queue = QueueView {
        table: &table,
        context_tokens: 1024,
        outstanding_read_iocbs: 4,
        outstanding_reads_by_budget: &[ReadsOnBudget { sm_budget: 2, iocbs: 4, kernels: 1 }],
        outstanding_write_iocbs: 0,
        outstanding_write_kernels: 0,
        in_flight_write_iocbs: 0,
        in_flight_write_sm_budget: 0,
        queued_write_iocbs: 4,
    };
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(2, 4, 600.0, true)]);
    for budget in [0, 4] {
        let reads = [reads_on(budget, 4, 1)];
        let queue = QueueView { outstanding_reads_by_budget: &reads, ..queue };
        assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(2, 4, 400.0, true)], "read budget {budget}");
    }
}

/// Goal: the released writes waiting behind the reads still come before new writes: a prefill
/// window's writes start after the write in flight, the reads, then the rest, one after the
/// other. Windows [0,100) on 4 SMs, [100,600) on 2, [600,1000) on 4; a write IOCB takes 200 µs
/// on 4 SMs, 300 on 2. A 1-IOCB write layer in flight (to 200 µs), 1 read IOCB outstanding
/// behind it (to 300 µs), a second write layer of 1 IOCB waiting (to 500 µs): [100,600)'s
/// 100 µs left are granted as time and the new IOCB goes into [600,1000).
#[test]
fn slack_aware_starts_writes_after_the_released_writes_waiting_behind_the_reads() {
    let window_time = |sm_budget: u32, offset_us: f64, slack_us: f64| Issue { slack_us, ..write(0, sm_budget, offset_us, true) };
    let table = profile();
    let unissued = [0, 0, 0, 0];
    let mut v = view(&table, 2, &unissued);
    v.queued_write_iocbs = 1;
    v.outstanding_read_iocbs = 1;
    v.outstanding_read_kernels = 1;
    v.outstanding_write_iocbs = 2;
    v.outstanding_write_kernels = 2;
    v.in_flight_write_iocbs = 1;
    let plan = SlackAware.plan_layer(&v).unwrap();
    assert_eq!(plan.issues, vec![window_time(2, 500.0, 100.0), write(1, 4, 600.0, true)]);
}

/// Goal: writes only go into room left after every read of the request is issued, start after
/// the reads (stream dependency) and must end inside their window.
#[test]
fn slack_aware_writes_only_into_leftover_slack() {
    let table = profile();
    let unissued = [0, 0, 0, 1];
    let mut v = view(&table, 2, &unissued);
    v.queued_write_iocbs = 3;
    let plan = SlackAware.plan_layer(&v).unwrap();
    // Layer 3's last IOCB fills [0,100). Writes: [100,600) on 2 SMs holds one (300 µs), the
    // next two (400 µs on 4 SMs) go to [600,1000).
    assert_eq!(plan.issues, vec![read(3, 1, 4, 0.0), write(1, 2, 100.0, true), write(2, 4, 600.0, true)]);

    // With a read of a later layer still unissued, no write is placed at all.
    let unissued = [0, 0, 0, 8];
    let mut v = view(&table, 1, &unissued);
    v.queued_write_iocbs = 3;
    let plan = SlackAware.plan_layer(&v).unwrap();
    assert!(plan.issues.iter().all(|i| i.kind == IoKind::Read), "{plan:?}");
}

/// Goal: deferred writes fill decode steps (one window per step, context rounded down) and the
/// rest stays queued; nothing is flushed at the end of prefill.
#[test]
fn slack_aware_defers_writes_to_decode() {
    let table = profile();
    let mut queue = QueueView {
        table: &table,
        context_tokens: 1500,
        outstanding_read_iocbs: 0,
        outstanding_reads_by_budget: &[],
        outstanding_write_iocbs: 0,
        outstanding_write_kernels: 0,
        in_flight_write_iocbs: 0,
        in_flight_write_sm_budget: 0,
        queued_write_iocbs: 8,
    };
    assert!(SlackAware.plan_prefill_end(&queue).unwrap().is_empty());
    // Context 1500 rounds down to the 1000 µs step: 4 writes (800 µs) fit, 5 would cost 1600.
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(4, 4, 0.0, true)]);
    // Two writes still in flight (400 µs): 600 µs of room left -> 2 more.
    queue.outstanding_write_iocbs = 2;
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(2, 4, 400.0, true)]);
    // Below the first profiled context: a typed error, not a guess.
    queue.context_tokens = 10;
    assert!(SlackAware.plan_decode_step(&queue).is_err());
}

/// Goal: a decode step prices the write kernel in flight on the SMs it runs on, as a layer does
/// (`slack_aware_prices_the_write_in_flight_on_its_own_sm_budget`). A 1-IOCB write handed over
/// on 2 SMs takes 300 µs, not the 200 µs it takes on 4: of the 1000 µs step (4 SMs free),
/// 700 µs are left, room for 2 new IOCBs (400 µs) and not 4 (800 µs). Priced on 4 SMs, all 4
/// went at 200 and ran to 1100, past the step. Not known (0) or on 4 SMs: as before.
#[test]
fn slack_aware_decode_step_prices_the_write_in_flight_on_its_own_sm_budget() {
    let table = profile();
    let mut queue = QueueView {
        table: &table,
        context_tokens: 1024,
        outstanding_read_iocbs: 0,
        outstanding_reads_by_budget: &[],
        outstanding_write_iocbs: 1,
        outstanding_write_kernels: 1,
        in_flight_write_iocbs: 1,
        in_flight_write_sm_budget: 2,
        queued_write_iocbs: 4,
    };
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(2, 4, 300.0, true)]);
    for budget in [0, 4] {
        queue.in_flight_write_sm_budget = budget;
        assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(4, 4, 200.0, true)], "in-flight budget {budget}");
    }
}

/// Goal: a write in flight on a budget below every profiled one is priced on the slowest budget
/// the table has, not the smallest: fewer SMs need not be slower (`Profile::io_duration_us`).
/// Writes here take 300 µs per IOCB on 2 SMs and 400 on 4. A 1-IOCB write in flight on 1 SM is
/// taken for 400 µs: of the 1000 µs step, one new IOCB (400 µs on 4 SMs) goes at 400. Priced on
/// the smallest budget's 300 µs, it went at 300, into time the write may still take.
#[test]
fn slack_aware_prices_a_write_in_flight_below_every_budget_on_the_slowest() {
    let mut raw = common::table();
    for row in raw.io_costs.iter_mut().filter(|r| r.kind == IoKind::Write) {
        row.duration_us = if row.sm_budget == 2 { 300.0 } else { 400.0 } * f64::from(row.iocb_count);
    }
    let table = Profile::from_table(raw).expect("valid: durations grow with counts within a budget");
    let queue = QueueView {
        table: &table,
        context_tokens: 1024,
        outstanding_read_iocbs: 0,
        outstanding_reads_by_budget: &[],
        outstanding_write_iocbs: 1,
        outstanding_write_kernels: 1,
        in_flight_write_iocbs: 1,
        in_flight_write_sm_budget: 1,
        queued_write_iocbs: 4,
    };
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(1, 4, 400.0, true)]);
}

/// Goal: a decode step prices the writes ahead of it as `plan_layer` does: the write kernel in
/// flight on its own budget, plus what the other outstanding writes add (never less than
/// nothing). Writes on 4 SMs here cost more than twice as much at 4 IOCBs as at 2 (100, 250,
/// 700 µs at 1, 2, 4). A layer of 3 IOCBs (priced on the 4-IOCB row: 700 µs) in flight, one of 1
/// behind it: the 4 outstanding IOCBs as 2 kernels are priced 2 × 250 = 500 µs, below the
/// kernel in flight alone. Before, the decode step took the writes for 500 + 700 − 700 = 500 µs
/// and granted 2 IOCBs at 500 µs, while the layer in flight held the SSD until 700; `plan_layer`
/// priced the same writes at 700 + max(0, 500 − 700) = 700.
#[test]
fn slack_aware_decode_step_prices_outstanding_writes_as_plan_layer_does() {
    let mut raw = common::table();
    for row in raw.io_costs.iter_mut().filter(|r| r.kind == IoKind::Write && r.sm_budget == 4) {
        row.duration_us = match row.iocb_count {
            1 => 100.0,
            2 => 250.0,
            4 => 700.0,
            _ => 1400.0,
        };
    }
    let table = Profile::from_table(raw).expect("valid: durations grow with counts within a budget");
    let queue = QueueView {
        table: &table,
        context_tokens: 1024,
        outstanding_read_iocbs: 0,
        outstanding_reads_by_budget: &[],
        outstanding_write_iocbs: 4,
        outstanding_write_kernels: 2,
        in_flight_write_iocbs: 3,
        in_flight_write_sm_budget: 4,
        queued_write_iocbs: 4,
    };
    let step = SlackAware.plan_decode_step(&queue).unwrap();
    // The 1000 µs step from 700 µs: 2 IOCBs (250 µs) fit, 3 (the 4-IOCB row) do not.
    assert_eq!(step, vec![write(2, 4, 700.0, true)]);
    let unissued = [0; common::LAYERS as usize];
    let layer = LayerView {
        outstanding_write_iocbs: queue.outstanding_write_iocbs,
        outstanding_write_kernels: queue.outstanding_write_kernels,
        in_flight_write_iocbs: queue.in_flight_write_iocbs,
        in_flight_write_sm_budget: queue.in_flight_write_sm_budget,
        queued_write_iocbs: queue.queued_write_iocbs,
        ..view(&table, 0, &unissued)
    };
    let plan = SlackAware.plan_layer(&layer).unwrap();
    // The layer's last window, [600, 1000) on 4 SMs, from the same 700 µs.
    assert_eq!(plan.issues.first().map(|issue| issue.offset_us), Some(step[0].offset_us), "{plan:?}");
}

/// Goal: reads issued and not completed are priced as the kernels they reach the SSD as, each
/// with its command latency: three layers of 2 IOCBs waiting in a runtime that hands them over
/// one at a time take 3 × (50 + 200) = 750 µs, not one 6-IOCB kernel's 650, so a window ending
/// at 850 µs has no room for a run-ahead IOCB (150 µs). Before, it got one at 650 µs, where the
/// layers ahead of it were still reading. Where queued kernels hide the latency (one kernel),
/// it still goes.
#[test]
fn slack_aware_prices_outstanding_reads_per_kernel() {
    let mut t = common::table();
    t.io_costs.retain(|row| row.kind == IoKind::Write);
    for count in 1..=8u32 {
        t.io_costs.push(scheduler::table::IoCostEntry {
            kind: IoKind::Read,
            iocb_count: count,
            sm_budget: 4,
            duration_us: 50.0 + 100.0 * f64::from(count),
            bytes: u64::from(count) << 20,
        });
    }
    t.io_costs.sort_by_key(|row| (row.kind, row.sm_budget, row.iocb_count));
    for layer in t.buckets.iter_mut().flat_map(|bucket| bucket.layers.iter_mut()) {
        layer.slack_windows = vec![scheduler::table::SlackWindow { offset_us: 0.0, duration_us: 850.0, free_sms: 4 }];
    }
    let table = Profile::from_table(t).unwrap();
    let unissued = [0, 0, 0, 1];
    let mut v = view(&table, 0, &unissued);
    v.outstanding_read_iocbs = 6;
    v.outstanding_read_kernels = 3;
    assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, vec![], "no room left for a run-ahead read");
    v.outstanding_read_kernels = 1;
    assert_eq!(SlackAware.plan_layer(&v).unwrap().issues, vec![read(3, 1, 4, 650.0)]);
}

/// Goal: a decode step priced as the runtime and the simulator price it
/// (`Profile::decode_pricing_context`) is never `OutOfRange`, whatever the context and the
/// queues: validation refuses a table with no decode row, a context before the first row is
/// priced as that row, and every I/O lookup is at the largest profiled budget. So both may take
/// an `OutOfRange` from `plan_decode_step` as an error (it once stood for "a table with no decode
/// row", a step without writes). Rows start at 1024 here, past the contexts 0 and 1.
#[test]
fn slack_aware_decode_steps_as_priced_are_never_out_of_range() {
    let table = profile();
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let edges = [0, 1, 1023, 1024, 1025, 1500, 2047, 2048, 2049, u32::MAX - 1, u32::MAX];
    let contexts: Vec<u32> = edges.into_iter().chain((0..2000).map(|_| next() as u32)).collect();
    let counts = [0, 1, 7, 8, 9, u32::MAX];
    for (case, context) in contexts.into_iter().enumerate() {
        let pick = |n: u64| counts[(n % counts.len() as u64) as usize];
        let budgets = [0, 1, 2, 3, 4, u32::MAX];
        // Entries that hold none, some, all or more than all of the outstanding reads.
        let reads = [
            reads_on(budgets[(next() % 6) as usize], pick(next()), pick(next())),
            reads_on(budgets[(next() % 6) as usize], pick(next()), pick(next())),
        ];
        let queue = QueueView {
            table: &table,
            context_tokens: table.decode_pricing_context(context),
            outstanding_read_iocbs: pick(next()),
            outstanding_reads_by_budget: &reads[..(next() % 3) as usize],
            outstanding_write_iocbs: pick(next()),
            outstanding_write_kernels: pick(next()),
            in_flight_write_iocbs: pick(next()),
            in_flight_write_sm_budget: [0, 1, 2, 3, 4, u32::MAX][(next() % 6) as usize],
            // Never 0: with nothing queued the step returns before any lookup.
            queued_write_iocbs: pick(next()).max(1),
        };
        if let Err(error) = SlackAware.plan_decode_step(&queue) {
            let QueueView { outstanding_read_iocbs: reads, outstanding_write_iocbs: writes, queued_write_iocbs: queued, .. } = queue;
            panic!("case {case}, context {context}: {error} (reads {reads}, writes {writes}, queued {queued})");
        }
    }
}

/// Goal: a decode step between two rows gets the fewer free SMs of the two, as prefill windows
/// between grid points do. Rows 1024 → 4 SMs free, 2048 → 2: a context of 1500 writes on 2 SMs
/// (the step rounded down, 1000 µs: 2 IOCBs, as 3 are priced by the 4-IOCB row's 1200 µs).
/// Before, it took the row below's 4 SMs,
/// more than the real step may leave free (a longer step can be more memory-bound).
#[test]
fn slack_aware_decode_steps_between_rows_take_the_fewer_free_sms() {
    let mut t = common::table();
    t.decode_steps[1].free_sms = 2;
    let table = Profile::from_table(t).unwrap();
    let mut queue = QueueView {
        table: &table,
        context_tokens: 1500,
        outstanding_read_iocbs: 0,
        outstanding_reads_by_budget: &[],
        outstanding_write_iocbs: 0,
        outstanding_write_kernels: 0,
        in_flight_write_iocbs: 0,
        in_flight_write_sm_budget: 0,
        queued_write_iocbs: 8,
    };
    assert_eq!(table.decode_step(1500).unwrap().free_sms, 2);
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(2, 2, 0.0, true)]);
    // On a row: that row's.
    queue.context_tokens = 1024;
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(4, 4, 0.0, true)]);
    // Past the last row: the last row's (2000 µs on 2 SMs: 4 IOCBs, 1200 µs).
    queue.context_tokens = 3000;
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(4, 2, 0.0, true)]);
}

/// Goal: a window with room where not one write IOCB finishes is granted as time: a write of 0
/// IOCBs standing for the rest of the window (`slack_us`), so that a runtime moving whole
/// layers can add such windows up; before, no write was issued at all and a layer bigger than
/// every window never went. On fewer SMs than any write row prices, nothing.
#[test]
fn slack_aware_grants_windows_too_short_for_one_write_as_time() {
    let window_time = |sm_budget: u32, offset_us: f64, slack_us: f64| Issue { slack_us, ..write(0, sm_budget, offset_us, true) };
    let mut t = common::table();
    for step in &mut t.decode_steps {
        step.duration_us = 150.0; // one write IOCB on 4 SMs takes 200 µs
    }
    let table = Profile::from_table(t.clone()).unwrap();
    let mut queue = QueueView {
        table: &table,
        context_tokens: 1500,
        outstanding_read_iocbs: 0,
        outstanding_reads_by_budget: &[],
        outstanding_write_iocbs: 0,
        outstanding_write_kernels: 0,
        in_flight_write_iocbs: 0,
        in_flight_write_sm_budget: 0,
        queued_write_iocbs: 8,
    };
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![window_time(4, 0.0, 150.0)]);
    // A read in flight (100 µs) leaves 50 µs of the step.
    queue.outstanding_read_iocbs = 1;
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![window_time(4, 100.0, 50.0)]);
    // A write in flight past the step's end: no room, but the step's time is granted to bank
    // (`slack_aware_banks_decode_steps_a_write_layer_in_flight_takes_whole`).
    queue.outstanding_write_iocbs = 1;
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![window_time(4, 0.0, 150.0)]);
    // One SM free, below every write row's budget (2): no write can be priced there.
    for step in &mut t.decode_steps {
        step.free_sms = 1;
    }
    let table = Profile::from_table(t).unwrap();
    let queue = QueueView {
        table: &table,
        context_tokens: 1500,
        outstanding_read_iocbs: 0,
        outstanding_reads_by_budget: &[],
        outstanding_write_iocbs: 0,
        outstanding_write_kernels: 0,
        in_flight_write_iocbs: 0,
        in_flight_write_sm_budget: 0,
        queued_write_iocbs: 8,
    };
    assert!(SlackAware.plan_decode_step(&queue).unwrap().is_empty());

    // Prefill windows too: [0,100) on 4 SMs, [100,600) on 2, [600,1000) on 4; one write IOCB
    // takes 200 µs on 4 SMs, 300 on 2. One write in flight (busy to 200 µs): [100,600) holds
    // one from 200. Two (busy to 400 µs): its 200 µs left are too short, granted as time, and
    // the IOCB goes into [600,1000).
    let table = profile();
    let unissued = [0, 0, 0, 0];
    let mut v = view(&table, 2, &unissued);
    v.queued_write_iocbs = 1;
    v.outstanding_write_iocbs = 1;
    let plan = SlackAware.plan_layer(&v).unwrap();
    assert_eq!(plan.issues, vec![write(1, 2, 200.0, true)]);
    v.outstanding_write_iocbs = 2;
    let plan = SlackAware.plan_layer(&v).unwrap();
    assert_eq!(plan.issues, vec![window_time(2, 400.0, 200.0), write(1, 4, 600.0, true)]);
}

/// Goal: the naive baseline reads the next layer and writes the previous one together, with no
/// ordering between them.
#[test]
fn naive_pipeline_reads_next_and_writes_previous_at_once() {
    let table = profile();
    let unissued = [3, 3, 3, 3];
    let plan = NaivePipeline.plan_layer(&view(&table, 0, &unissued)).unwrap();
    assert_eq!(plan.issues, vec![read(0, 3, 4, 0.0), read(1, 3, 4, 0.0)]);
    let unissued = [0, 0, 3, 3];
    let mut v = view(&table, 1, &unissued);
    v.queued_write_iocbs = 2;
    let plan = NaivePipeline.plan_layer(&v).unwrap();
    assert_eq!(plan.issues, vec![read(2, 3, 4, 0.0), write(2, 4, 0.0, false)]);
}

/// Goal: the no-overlap baseline loads everything before layer 0 and nothing afterwards.
#[test]
fn no_overlap_loads_everything_first() {
    let table = profile();
    let unissued = [3, 3, 3, 3];
    let plan = NoOverlap.plan_layer(&view(&table, 0, &unissued)).unwrap();
    assert!(plan.wait_for_all_reads);
    assert_eq!(plan.issues, (0..4).map(|l| read(l, 3, 4, 0.0)).collect::<Vec<_>>());
    let none = [0, 0, 0, 0];
    let plan = NoOverlap.plan_layer(&view(&table, 1, &none)).unwrap();
    assert_eq!(plan, LayerPlan::default());
}

/// Goal: over many random windows and queue states, the slack-aware decisions keep Tutti's
/// invariants: the current and the next layer's reads are always fully issued before the layer
/// begins, no layer gets more IOCBs than it has, every write fits inside one window on the SMs
/// that window has free (a write of 0 IOCBs stands for the rest of a window too short for one),
/// and writes appear only once no read is left unissued.
#[test]
fn slack_aware_invariants_hold_on_random_states() {
    use scheduler::table::{LayerProfile, SlackWindow};
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |bound: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % bound
    };
    let mut cases_with_writes = 0;
    let mut cases_with_window_reads = 0;
    let mut cases_with_window_time = 0;
    for case in 0..2000 {
        let mut windows = Vec::new();
        let mut at_us = 0.0;
        for _ in 0..next(5) {
            at_us += next(200) as f64;
            let duration_us = 1.0 + next(800) as f64;
            windows.push(SlackWindow { offset_us: at_us, duration_us, free_sms: next(6) as u32 });
            at_us += duration_us;
        }
        let layer_profile = LayerProfile { compute_duration_us: at_us + 1.0, kv_needed_offset_us: 0.0, slack_windows: windows.clone() };
        let mut t = common::table();
        for bucket in &mut t.buckets {
            bucket.layers = vec![layer_profile.clone(); common::LAYERS as usize];
        }
        let table = Profile::from_table(t).unwrap();
        let layer = next(u64::from(common::LAYERS)) as u32;
        let unissued: Vec<u32> = (0..common::LAYERS).map(|l| if l < layer { 0 } else { next(10) as u32 }).collect();
        let mut v = view(&table, layer, &unissued);
        v.outstanding_read_iocbs = next(6) as u32;
        v.outstanding_write_iocbs = next(3) as u32;
        v.queued_write_iocbs = next(6) as u32;
        // Not known, below every profiled budget, profiled, between and above them; entries
        // that hold none, some or all of the outstanding reads.
        let held = next(u64::from(v.outstanding_read_iocbs) + 1) as u32;
        let reads = [reads_on(next(6) as u32, held, next(3) as u32), reads_on(next(6) as u32, v.outstanding_read_iocbs - held, 1)];
        v.outstanding_reads_by_budget = &reads[..next(3) as usize];
        let plan = SlackAware.plan_layer(&v).unwrap();

        let mut issued = vec![0u32; common::LAYERS as usize];
        let mut writes_seen = false;
        for issue in &plan.issues {
            assert!(issue.iocb_count > 0 || issue.kind == IoKind::Write, "case {case}: {issue:?}");
            match issue.kind {
                IoKind::Read => {
                    let l = issue.layer.expect("reads name a layer");
                    assert!(l >= layer, "case {case}: read of a past layer");
                    issued[l as usize] += issue.iocb_count;
                }
                IoKind::Write => {
                    writes_seen = true;
                    assert!(issue.after_reads, "case {case}: write not ordered after reads");
                    if issue.iocb_count == 0 {
                        // Window time: to the end of a window on its SMs, too short for one IOCB.
                        let one_us = table.io_duration_us(IoKind::Write, 1, issue.sm_budget).unwrap();
                        let window = windows.iter().find(|w| w.offset_us <= issue.offset_us && issue.offset_us < w.end_us());
                        let window = window.unwrap_or_else(|| panic!("case {case}: window time outside every window: {issue:?}"));
                        assert!(issue.sm_budget <= window.free_sms, "case {case}: {issue:?} in {window:?}");
                        assert!((issue.offset_us + issue.slack_us - window.end_us()).abs() < 1e-9, "case {case}: {issue:?} in {window:?}");
                        assert!(issue.slack_us > 0.0 && issue.slack_us < one_us, "case {case}: one IOCB would fit: {issue:?}");
                        cases_with_window_time += 1;
                        continue;
                    }
                    assert_eq!(issue.slack_us, 0.0, "case {case}: {issue:?}");
                    let duration_us = table.io_duration_us(IoKind::Write, issue.iocb_count, issue.sm_budget).unwrap();
                    let fits = windows.iter().any(|w| {
                        w.offset_us <= issue.offset_us
                            && issue.offset_us + duration_us <= w.end_us() + 1e-9
                            && issue.sm_budget <= w.free_sms
                    });
                    assert!(fits, "case {case}: write outside every window: {issue:?} in {windows:?}");
                }
            }
        }
        for l in 0..common::LAYERS as usize {
            assert!(issued[l] <= unissued[l], "case {case}: layer {l} over-issued");
        }
        let critical = [layer as usize, layer as usize + 1];
        for l in critical.into_iter().filter(|&l| l < common::LAYERS as usize) {
            assert_eq!(issued[l], unissued[l], "case {case}: layer {l} not fully issued: {plan:?}");
        }
        let writes_issued: u32 = plan.issues.iter().filter(|i| i.kind == IoKind::Write).map(|i| i.iocb_count).sum();
        assert!(writes_issued <= v.queued_write_iocbs, "case {case}");
        if writes_seen {
            assert_eq!(issued, unissued, "case {case}: writes while reads remain unissued");
            cases_with_writes += 1;
        }
        if plan.issues.iter().any(|i| i.kind == IoKind::Read && i.offset_us > 0.0) {
            cases_with_window_reads += 1;
        }
    }
    // The generator must reach the interesting branches, or the test proves nothing.
    assert!(cases_with_writes > 100, "only {cases_with_writes} cases placed writes");
    assert!(cases_with_window_reads > 100, "only {cases_with_window_reads} cases placed reads in windows");
    assert!(cases_with_window_time > 10, "only {cases_with_window_time} windows were granted as time");
}

/// Goal: per-layer read counts that sum past u32::MAX (a long prefix in small IOCBs) do not
/// overflow the slack-aware policy: it only needs to know whether any read is left before it
/// places writes. Summing them into a u32 panicked in debug builds and wrapped in release (a
/// wrap to 0 would have let writes in while reads were left).
#[test]
fn slack_aware_read_counts_past_u32_do_not_overflow() {
    let table = profile();
    let unissued = [u32::MAX; 4];
    let mut state = view(&table, 0, &unissued);
    state.queued_write_iocbs = 8;
    let plan = SlackAware.plan_layer(&state).unwrap();
    assert_eq!(plan.issues[..2], [read(0, u32::MAX, 4, 0.0), read(1, u32::MAX, 4, 0.0)]);
    assert!(plan.issues.iter().all(|issue| issue.kind == IoKind::Read), "no write while reads are left: {plan:?}");
}

/// Goal: under the read/write barrier the writes already released start only once the reads
/// ahead of them completed, so a prefill window's writes start after both, one after the other
/// (sum), not after the longer of the two (max). Windows [0,100) on 4 SMs, [100,600) on 2,
/// [600,1000) on 4; 2 read IOCBs outstanding (200 µs) then 1 write (200 µs): the SSD is busy to
/// 400 µs, [100,600)'s 200 µs left are too short for a write on 2 SMs (300 µs) and are granted
/// as time, and the IOCB goes into [600,1000). Before, it went at 200 µs, into the outstanding
/// write's time.
#[test]
fn slack_aware_starts_writes_after_outstanding_reads_and_writes_both() {
    let window_time = |sm_budget: u32, offset_us: f64, slack_us: f64| Issue { slack_us, ..write(0, sm_budget, offset_us, true) };
    let table = profile();
    let unissued = [0, 0, 0, 0];
    let mut v = view(&table, 2, &unissued);
    v.queued_write_iocbs = 1;
    v.outstanding_read_iocbs = 2;
    v.outstanding_read_kernels = 1;
    v.outstanding_write_iocbs = 1;
    let plan = SlackAware.plan_layer(&v).unwrap();
    assert_eq!(plan.issues, vec![window_time(2, 400.0, 200.0), write(1, 4, 600.0, true)]);
}

/// Goal: writes released and not written are priced as the kernels they reach the SSD as (a
/// runtime hands them over a layer at a time, each paying its command latency), as outstanding
/// reads are. Writes cost 50 + 175 µs per IOCB; a 1500 µs decode step; 4 write IOCBs
/// outstanding as 2 layers take 2 × 400 = 800 µs, leaving room for 3 more (575 µs), not one
/// 4-IOCB kernel's 750 µs, which left room for 4 (750 µs) that overran the step by 50 µs.
#[test]
fn slack_aware_prices_outstanding_writes_per_kernel() {
    let mut t = common::table();
    t.io_costs.retain(|row| row.kind == IoKind::Read);
    for count in 1..=8u32 {
        t.io_costs.push(scheduler::table::IoCostEntry {
            kind: IoKind::Write,
            iocb_count: count,
            sm_budget: 4,
            duration_us: 50.0 + 175.0 * f64::from(count),
            bytes: u64::from(count) << 20,
        });
    }
    t.io_costs.sort_by_key(|row| (row.kind, row.sm_budget, row.iocb_count));
    for step in &mut t.decode_steps {
        (step.duration_us, step.free_sms) = (1500.0, 4);
    }
    let table = Profile::from_table(t).unwrap();
    let mut queue = QueueView {
        table: &table,
        context_tokens: 1500,
        outstanding_read_iocbs: 0,
        outstanding_reads_by_budget: &[],
        outstanding_write_iocbs: 4,
        outstanding_write_kernels: 2,
        in_flight_write_iocbs: 0,
        in_flight_write_sm_budget: 0,
        queued_write_iocbs: 8,
    };
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(3, 4, 800.0, true)]);
    queue.outstanding_write_kernels = 1;
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![write(4, 4, 750.0, true)]);
}

/// Goal: a decode step that a write layer in flight takes whole (writes of 10 ms on 4 SMs, steps
/// of 4.4 ms) is still granted as time, so that a runtime moving whole layers banks it while the
/// layer runs and the next layer can go at the first step after it (`Issue::slack_us`). Before,
/// no grant was made while a layer was outstanding: the carry banked only while the SSD was
/// idle, ~5 steps banking then ~5 writing, about half the write rate the steps allow. Not with
/// two layers outstanding (one already waits behind the one in flight), nor with nothing queued.
#[test]
fn slack_aware_banks_decode_steps_a_write_layer_in_flight_takes_whole() {
    let mut t = common::table();
    t.io_costs.retain(|row| row.kind == IoKind::Read);
    t.io_costs.push(scheduler::table::IoCostEntry {
        kind: IoKind::Write,
        iocb_count: 1,
        sm_budget: 4,
        duration_us: 10_000.0,
        bytes: 1 << 20,
    });
    for step in &mut t.decode_steps {
        (step.duration_us, step.free_sms) = (4400.0, 8);
    }
    let table = Profile::from_table(t).unwrap();
    let mut queue = QueueView {
        table: &table,
        context_tokens: 1500,
        outstanding_read_iocbs: 0,
        outstanding_reads_by_budget: &[],
        outstanding_write_iocbs: 1,
        outstanding_write_kernels: 1,
        in_flight_write_iocbs: 0,
        in_flight_write_sm_budget: 0,
        queued_write_iocbs: 3,
    };
    let banked = Issue { slack_us: 4400.0, ..write(0, 4, 0.0, true) };
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![banked]);
    // Idle: the step's time, as before.
    queue.outstanding_write_iocbs = 0;
    queue.outstanding_write_kernels = 0;
    assert_eq!(SlackAware.plan_decode_step(&queue).unwrap(), vec![banked]);
    // A layer waits behind the one in flight: nothing more is banked.
    (queue.outstanding_write_iocbs, queue.outstanding_write_kernels) = (2, 2);
    assert!(SlackAware.plan_decode_step(&queue).unwrap().is_empty());
    (queue.outstanding_write_iocbs, queue.outstanding_write_kernels, queue.queued_write_iocbs) = (1, 1, 0);
    assert!(SlackAware.plan_decode_step(&queue).unwrap().is_empty());
}
