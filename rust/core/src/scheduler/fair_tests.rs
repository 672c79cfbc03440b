//! The step-time budget and fair prefill sharing (`fair`), on the simulated model: the
//! budget follows the reported timings, a short request is served beside a long prefill,
//! nothing starves under a stream of arrivals, outputs equal the unconstrained reference.

use super::sim_tests::{spec, synthetic_ms, Sim, Spec};
use crate::{SchedulerConfig, SchedulerType, StepPlan};

fn prompt(id: u64, len: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|j| ((id * 7919 + j * 31 + j * j) % 50) as u32)
        .collect()
}

fn cfg(max_step_ms: Option<f64>) -> SchedulerConfig {
    let mut c = SchedulerConfig::new(4000, 16, 2048);
    c.max_step_ms = max_step_ms;
    c
}

/// Launch one plan, report its synthetic (noiseless) time, update; returns the plan.
fn step(sim: &mut Sim) -> Option<StepPlan> {
    if !sim.launch(false) {
        return None;
    }
    let plan = sim.s.plan().clone();
    sim.complete();
    // `complete` reported a noisy time already when max_step_ms is set: report nothing
    // more (the shape is taken once).
    assert!(
        !sim.s.report_step_time(0.001).unwrap(),
        "a step's time is taken once"
    );
    Some(plan)
}

fn row_of(plan: &StepPlan, sim: &Sim, id: &str) -> Option<(u32, u32)> {
    let idx = sim.s.request_index(id)?;
    plan.rows
        .iter()
        .find(|r| r.req == idx)
        .map(|r| (r.start, r.q))
}

/// One stream decoding, then a long prompt: once the cost model has samples, every step's
/// true (synthetic) time stays near `max_step_ms`, the long prompt is chunked, and its
/// prefill still progresses every step.
#[test]
fn steps_stay_near_the_target_with_a_stream_running() {
    let target = 60.0;
    let mut sim = Sim::new(cfg(Some(target)));
    let specs = vec![
        spec("stream", prompt(1, 20), 400),
        spec("long", prompt(2, 3000), 2),
    ];
    assert!(sim.add(&specs[0]));
    step(&mut sim).expect("stream prefill");
    assert!(sim.add(&specs[1]));
    let mut times = Vec::new();
    let mut chunks = 0;
    while let Some(idx) = sim.s.request_index("long") {
        if sim.outputs.contains_key("long") {
            break;
        }
        let plan = step(&mut sim).expect("a plan");
        let Some(q) = plan.rows.iter().find(|r| r.req == idx).map(|r| r.q) else {
            panic!("the long prompt did not progress in step {}", sim.steps)
        };
        assert!(q >= 1);
        chunks += 1;
        times.push(synthetic_ms(&plan, 0, false));
        assert!(chunks < 400, "too many chunks");
    }
    assert!(chunks > 10, "the long prompt was chunked ({chunks} chunks)");
    // Past the warm-up (and the noisy, outlier-ridden reports), steps stay near the target.
    let late = &times[8..times.len() - 1];
    let over = late.iter().filter(|&&t| t > 1.5 * target).count();
    assert!(
        over * 20 <= late.len(),
        "{over} of {} steps above 1.5x: {late:?}",
        late.len()
    );
    let mut sorted = late.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    assert!(
        median >= 0.6 * target,
        "steps use the budget: median {median} ms"
    );
    assert!(sim.s.stats().time_budget_steps > 0);
    sim.drain(10_000);
    sim.check_outputs(&specs);
}

/// A request alone is not bound: it prefills in `max_batch_tokens` chunks, as without the
/// budget.
#[test]
fn a_request_alone_uses_the_whole_token_budget() {
    for ms in [None, Some(10.0)] {
        let mut sim = Sim::new(cfg(ms));
        assert!(sim.add(&spec("long", prompt(3, 5000), 2)));
        let plan = step(&mut sim).unwrap();
        assert_eq!(plan.input_ids.len(), 2048, "{ms:?}");
        assert_eq!(sim.s.stats().time_budget_steps, 0);
    }
}

/// An offline batch (`set_offline`: its caller waits for all of it) is not bound either:
/// its prompts prefill in `max_batch_tokens` chunks; once a request that is not offline
/// arrives, the budget binds again.
#[test]
fn an_offline_batch_uses_the_whole_token_budget() {
    let mut sim = Sim::new(cfg(Some(10.0)));
    let mut specs: Vec<Spec> = (0..6u64)
        .map(|i| spec(&format!("b{i}"), prompt(40 + i, 900), 40))
        .collect();
    for s in &specs {
        assert!(sim.add(s));
        sim.s.set_offline(&s.id, true).unwrap();
    }
    let plan = step(&mut sim).unwrap();
    assert_eq!(plan.input_ids.len(), 2048, "whole token budget");
    assert_eq!(sim.s.stats().time_budget_steps, 0);
    let online = spec("online", prompt(50, 900), 4);
    assert!(sim.add(&online));
    specs.push(online);
    for _ in 0..4 {
        step(&mut sim);
    }
    assert!(
        sim.s.stats().time_budget_steps > 0,
        "binds beside a request that is not offline"
    );
    let e = sim.s.set_offline("nobody", true).unwrap_err();
    assert_eq!(e.field, Some("request_id"));
    sim.drain(10_000);
    sim.check_outputs(&specs);
}

/// Decodes that alone outlast the budget (many streams of a slow model): a prompt arriving
/// then gets as much predicted time per step as the rest of the step, not just the floor's
/// share of `max_step_ms`, while the streams' steps at most about double.
#[test]
fn prompts_get_as_much_time_as_the_decodes() {
    let target = 4.0;
    let mut sim = Sim::new(cfg(Some(target)));
    let mut specs: Vec<Spec> = (0..12u64)
        .map(|i| spec(&format!("s{i}"), prompt(60 + i, 8), 300))
        .collect();
    for s in &specs {
        assert!(sim.add(s));
    }
    for _ in 0..40 {
        step(&mut sim);
    }
    let long = spec("long", prompt(70, 1500), 2);
    assert!(sim.add(&long));
    specs.push(long);
    let (mut allowances, mut lengths) = (Vec::new(), Vec::new());
    while !sim.outputs.contains_key("long") {
        let plan = step(&mut sim).expect("a plan");
        if row_of(&plan, &sim, "long").is_some_and(|(_, q)| q > 1) {
            // the synthetic machine's decode-only step: 2 ms, and 1.5 ms a decode
            let decodes = plan.rows.iter().filter(|r| r.q == 1).count() as f64;
            let alone = 2.0 + 1.5 * decodes;
            allowances.push(sim.s.stats().prefill_budget_ms / alone);
            lengths.push(synthetic_ms(&plan, 0, false) / alone);
        }
        assert!(allowances.len() < 1000, "the long prompt crawls");
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let allowance = median(&mut allowances);
    assert!(
        allowance >= 0.6,
        "prefill allowance / decode step {allowance} (the floor alone: {})",
        0.25 * target / 20.0
    );
    let length = median(&mut lengths);
    assert!(length <= 2.2, "the streams' steps grew {length}x");
    sim.drain(20_000);
    sim.check_outputs(&specs);
}

/// A short request arriving while a long prompt prefills (streams running) is admitted in
/// the next step, beside the long prompt, and samples its first token there.
#[test]
fn a_short_request_is_served_beside_a_long_prefill() {
    let mut sim = Sim::new(cfg(Some(80.0)));
    let stream = spec("stream", prompt(4, 10), 300);
    let long = spec("long", prompt(5, 4000), 2);
    let short = spec("short", prompt(6, 12), 3);
    assert!(sim.add(&stream));
    for _ in 0..3 {
        step(&mut sim);
    }
    assert!(sim.add(&long));
    for _ in 0..5 {
        step(&mut sim);
    }
    assert!(!sim.outputs.contains_key("long"), "still prefilling");
    assert!(sim.add(&short));
    let plan = step(&mut sim).unwrap();
    let (start, q) = row_of(&plan, &sim, "short").expect("admitted at once");
    assert_eq!(
        (start, q),
        (0, 12),
        "its whole prompt, sampled in this step"
    );
    assert!(
        row_of(&plan, &sim, "long").is_some(),
        "the long prompt progresses too"
    );
    assert!(
        row_of(&plan, &sim, "stream").is_some(),
        "the stream decodes"
    );
    sim.drain(10_000);
    sim.check_outputs(&[stream, long, short]);
}

/// No starvation: short requests arrive every step while two long prompts prefill; the
/// oldest in-flight prefill progresses every step, every request finishes, and outputs
/// equal the unconstrained reference. Also with a budget so small that the decodes alone
/// exceed it (the floors keep prefills moving).
#[test]
fn fair_share_never_starves_a_long_prompt() {
    for target in [1.0, 40.0, 150.0] {
        let mut sim = Sim::new(cfg(Some(target)));
        let mut specs: Vec<Spec> = vec![
            spec("long0", prompt(10, 2500), 3),
            spec("long1", prompt(11, 1800), 3),
        ];
        for s in &specs {
            assert!(sim.add(s));
        }
        let mut steps = 0;
        let mut arrivals = 0u64;
        while sim.s.has_unfinished() {
            if arrivals < 150 {
                let s = spec(
                    &format!("s{arrivals}"),
                    prompt(100 + arrivals, 3 + (arrivals % 20) as usize),
                    1 + (arrivals % 7) as usize,
                );
                assert!(sim.add(&s));
                specs.push(s);
                arrivals += 1;
            }
            // The oldest in-flight prefill (the anchor) progresses in every step.
            let anchor = sim
                .s
                .live_requests()
                .filter(|(_, r)| r.state == crate::RequestState::Prefilling)
                .min_by_key(|(_, r)| r.key)
                .map(|(i, _)| i);
            let plan = step(&mut sim).expect("a plan while unfinished");
            if let Some(idx) = anchor {
                assert!(
                    plan.rows.iter().any(|r| r.req == idx),
                    "target {target}: the oldest in-flight prefill left out"
                );
            }
            steps += 1;
            assert!(steps < 20_000, "target {target}: no end in sight");
        }
        sim.check_outputs(&specs);
        for s in &specs {
            assert!(sim.outputs.contains_key(&s.id), "lost {}", s.id);
        }
    }
}

/// Prompts sharing a long prefix, arriving together while a stream decodes: the budget
/// chunks the first one's prompt, and the others are put off until it has filled the shared
/// blocks (each then takes them as hits) instead of computing them beside it.
#[test]
fn shared_prefixes_are_computed_once_when_the_budget_chunks_them() {
    let mut sim = Sim::new(cfg(Some(60.0)));
    let stream = spec("stream", prompt(20, 12), 400);
    assert!(sim.add(&stream));
    for _ in 0..3 {
        step(&mut sim);
    }
    let shared = prompt(21, 960);
    let mut specs = vec![stream];
    for i in 0..4u64 {
        let mut p = shared.clone();
        p.extend(prompt(30 + i, 20 + i as usize));
        let s = spec(&format!("p{i}"), p, 3);
        assert!(sim.add(&s));
        specs.push(s);
    }
    let mut computed_shared = 0usize;
    let mut steps = 0;
    while !(0..4).all(|i| sim.outputs.contains_key(&format!("p{i}"))) {
        let plan = step(&mut sim).expect("a plan");
        for i in 1..4 {
            if let Some((start, q)) = row_of(&plan, &sim, &format!("p{i}")) {
                let (start, end) = (start as usize, (start + q) as usize);
                computed_shared += end.min(shared.len()).saturating_sub(start);
            }
        }
        steps += 1;
        assert!(steps < 2000, "no end in sight");
    }
    assert!(sim.s.stats().time_budget_steps > 0, "the budget bound");
    assert_eq!(computed_shared, 0, "followers computed shared tokens");
    assert_eq!(sim.s.stats().prefix_hit_tokens, 3 * 960);
    sim.drain(10_000);
    sim.check_outputs(&specs);
}

/// The budget only binds with `fifo`; `prefill_first` plans as without it.
#[test]
fn prefill_first_ignores_the_time_budget() {
    let mut c = cfg(Some(5.0));
    c.scheduler_type = SchedulerType::PrefillFirst;
    let mut sim = Sim::new(c);
    assert!(sim.add(&spec("a", prompt(1, 3000), 2)));
    assert!(sim.add(&spec("b", prompt(2, 10), 2)));
    let plan = step(&mut sim).unwrap();
    assert_eq!(plan.input_ids.len(), 2048);
    assert_eq!(sim.s.stats().time_budget_steps, 0);
}

#[test]
fn bad_values_name_the_field() {
    for v in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = crate::Scheduler::new(cfg(Some(v))).unwrap_err();
        assert_eq!(e.field, Some("max_step_ms"), "{v}");
    }
    let mut s = crate::Scheduler::new(cfg(Some(10.0))).unwrap();
    for v in [0.0, -1.0, f64::NAN] {
        let e = s.report_step_time(v).unwrap_err();
        assert_eq!(e.field, Some("seconds"));
    }
    assert!(!s.report_step_time(0.01).unwrap(), "no step to take it");
}
