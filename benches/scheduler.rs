//! Criterion benchmarks of the ferrobatch-core scheduler (pure Rust, no bindings).
//!
//! * `decode_step/N`: one steady-state decode step (`schedule()` + `update()`) with N running
//!   requests, N = 64, 256, 1024, 4096, page_size 32. Requests (128-token prompts) are
//!   prefilled before timing and never finish while timed; a scheduler is rebuilt, outside the
//!   timed region, every 256 steps, so contexts stay between 128 and 384 tokens.
//! * `decode_step_ahead/N`: the same decode steady state pipelined as an async engine runs
//!   it: one `schedule_ahead()` + one `update()` (of the oldest plan) per step, with two
//!   plans outstanding between the calls (N = 1024).
//! * `prefill_heavy`: every step is a full `max_batch_tokens` of fresh prompt tokens
//!   (16 distinct 512-token prompts per step, chunked, hashed, then finished after one token);
//!   new requests are added to keep the queue full (the adds are part of the timed step).
//! * `prefix_churn`: ~256 live requests that share one of 8 system prompts (256 tokens) plus a
//!   unique 32-token suffix, generating 16 tokens each, arriving and finishing continuously in
//!   a pool small enough that cached blocks are evicted (LRU) all the time.
//!
//! Run: `cargo bench -p ferrobatch-core --bench scheduler -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferrobatch_core::request::StopConditions;
use ferrobatch_core::{Scheduler, SchedulerConfig, SchedulerType};

const PROMPT_LEN: usize = 128;
const PAGE: usize = 32;
/// Decode steps one scheduler instance takes before it is rebuilt: contexts stay in
/// 128 ..= 384 tokens (block tables 4 ..= 12 wide), like the Python bench.
const STEPS_PER_INSTANCE: usize = 256;

fn stop(max_new_tokens: usize) -> StopConditions {
    StopConditions {
        max_new_tokens,
        ..Default::default()
    }
}

fn prompt(seed: usize, len: usize) -> Vec<u32> {
    // distinct per seed; cheap LCG so prompt building does not dominate
    let mut x = (seed as u64)
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            3 + ((x >> 33) % 32000) as u32
        })
        .collect()
}

/// N requests, all prefilled and decoding.
fn decode_scheduler(n: usize) -> Scheduler {
    let blocks_per_req = (PROMPT_LEN + 2 * STEPS_PER_INSTANCE).div_ceil(PAGE) + 1;
    let mut cfg = SchedulerConfig::new(n * blocks_per_req + 16, PAGE, n.max(8192));
    cfg.max_requests_per_batch = n;
    cfg.scheduler_type = SchedulerType::Fifo;
    cfg.safety_margin = Some(0.0);
    let mut s = Scheduler::new(cfg).expect("config");
    for i in 0..n {
        s.add_request(
            &format!("req-{i}"),
            prompt(i, PROMPT_LEN),
            stop(2 * STEPS_PER_INSTANCE),
            0,
        )
        .expect("add");
    }
    let mut toks = Vec::new();
    loop {
        let (n_sampled, n_tokens) = {
            let plan = s.schedule().expect("schedule").expect("plan");
            (plan.num_sampled(), plan.num_tokens())
        };
        toks.clear();
        toks.resize(n_sampled, 7);
        s.update(&toks).expect("update");
        if n_sampled == n && n_tokens == n {
            break;
        }
    }
    s
}

/// Time `k` steps at a time of `step` on schedulers from `fresh`, replaced (untimed) every
/// `STEPS_PER_INSTANCE - 8` steps so no request reaches its length limit.
fn time_steps(
    bch: &mut criterion::Bencher,
    fresh: impl Fn() -> Scheduler,
    mut step: impl FnMut(&mut Scheduler),
) -> Scheduler {
    let mut s = fresh();
    let mut left = STEPS_PER_INSTANCE - 8;
    bch.iter_custom(|iters| {
        let mut total = Duration::ZERO;
        let mut todo = iters as usize;
        while todo > 0 {
            if left == 0 {
                s = fresh(); // not timed
                left = STEPS_PER_INSTANCE - 8;
            }
            let k = todo.min(left);
            let t0 = Instant::now();
            for _ in 0..k {
                step(&mut s);
            }
            total += t0.elapsed();
            todo -= k;
            left -= k;
        }
        total
    });
    s
}

fn bench_decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step");
    for &n in &[64usize, 256, 1024, 4096] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |bch, &n| {
            let toks = vec![7i32; n];
            let s = time_steps(
                bch,
                || decode_scheduler(n),
                |s| {
                    let plan = s.schedule().expect("schedule").expect("plan");
                    debug_assert_eq!(plan.num_sampled(), n);
                    black_box(plan.input_ids.as_ptr());
                    let out = s.update(&toks).expect("update");
                    black_box(out.len());
                },
            );
            let st = s.stats();
            assert_eq!(
                st.running, n,
                "requests finished or were preempted during the bench"
            );
            assert_eq!(st.num_soft_resets + st.num_offloads, 0);
        });
    }
    g.finish();
}

/// `schedule_ahead()` + `update()` of the older plan per step (one plan always in flight).
fn bench_decode_ahead(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step_ahead");
    let n = 1024usize;
    g.throughput(Throughput::Elements(n as u64));
    g.bench_with_input(BenchmarkId::from_parameter(n), &n, |bch, &n| {
        let toks = vec![7i32; n];
        let fresh = || {
            let mut s = decode_scheduler(n);
            s.schedule().expect("schedule").expect("plan");
            s
        };
        let s = time_steps(bch, fresh, |s| {
            let plan = s.schedule_ahead().expect("ahead").expect("plan");
            debug_assert_eq!(plan.num_sampled(), n);
            black_box(plan.input_ids.as_ptr());
            let out = s.update(&toks).expect("update");
            black_box(out.len());
        });
        assert_eq!(s.stats().running, n, "requests finished during the bench");
    });
    g.finish();
}

/// Keeps `queue` requests waiting; every step prefills `max_batch_tokens` fresh tokens.
fn bench_prefill_heavy(c: &mut Criterion) {
    const LEN: usize = 512;
    const BUDGET: usize = 8192;
    let mut g = c.benchmark_group("prefill_heavy");
    g.throughput(Throughput::Elements(BUDGET as u64));
    g.bench_function("8192_tokens_per_step", |bch| {
        let mut cfg = SchedulerConfig::new(4 * BUDGET / PAGE + 64, PAGE, BUDGET);
        cfg.safety_margin = Some(0.0);
        let mut s = Scheduler::new(cfg).expect("config");
        // pre-built prompts, reused round-robin (ids stay unique; prefix hits are avoided by
        // cycling through more prompts than the pool can keep cached)
        let prompts: Vec<Vec<u32>> = (0..256).map(|i| prompt(1_000_000 + i, LEN)).collect();
        let mut next = 0usize;
        let mut toks = Vec::new();
        bch.iter(|| {
            while s.stats().waiting < 2 * BUDGET / LEN {
                s.add_request(
                    &format!("p{next}"),
                    prompts[next % prompts.len()].clone(),
                    stop(1),
                    0,
                )
                .expect("add");
                next += 1;
            }
            let n_sampled = s.schedule().expect("schedule").expect("plan").num_sampled();
            toks.clear();
            toks.resize(n_sampled, 7);
            black_box(s.update(&toks).expect("update").len());
        });
        let st = s.stats();
        assert!(st.prompt_tokens > 0);
    });
    g.finish();
}

/// Requests sharing system prompts arrive and finish continuously.
fn bench_prefix_churn(c: &mut Criterion) {
    const SYS: usize = 256;
    const SUFFIX: usize = 32;
    const GEN: usize = 16;
    const LIVE: usize = 256;
    // room for the live set plus a little cache: shared prefixes stay, suffixes churn
    let per_req = (SYS + SUFFIX + GEN).div_ceil(16);
    let mut cfg = SchedulerConfig::new(
        LIVE * (SUFFIX + GEN).div_ceil(16) + 8 * per_req + 64,
        16,
        4096,
    );
    cfg.max_requests_per_batch = LIVE;
    cfg.safety_margin = Some(0.0);
    let mut s = Scheduler::new(cfg).expect("config");
    let systems: Vec<Vec<u32>> = (0..8).map(|i| prompt(7_000 + i, SYS)).collect();
    let mut next = 0usize;
    let mut toks = Vec::new();
    let mut g = c.benchmark_group("prefix_churn");
    g.bench_function("256_live_8_prefixes", |bch| {
        bch.iter(|| {
            let st = s.stats();
            let mut live = st.waiting + st.running + st.swapped;
            while live < LIVE {
                let mut p = systems[next % 8].clone();
                p.extend(prompt(next, SUFFIX));
                s.add_request(&format!("c{next}"), p, stop(GEN), 0)
                    .expect("add");
                next += 1;
                live += 1;
            }
            let n_sampled = s.schedule().expect("schedule").expect("plan").num_sampled();
            toks.clear();
            toks.resize(n_sampled, 7);
            black_box(s.update(&toks).expect("update").len());
        });
    });
    g.finish();
    let st = s.stats();
    assert!(
        st.prefix_hit_tokens > 0,
        "the churn case must hit the prefix cache"
    );
    eprintln!(
        "prefix_churn: {} requests finished, prefix hit rate {:.1}%, {} evictions, {} preemptions",
        st.finished,
        100.0 * st.prefix_hit_tokens as f64 / st.prompt_tokens.max(1) as f64,
        st.num_evictions,
        st.num_preemptions
    );
}

criterion_group!(
    benches,
    bench_decode,
    bench_decode_ahead,
    bench_prefill_heavy,
    bench_prefix_churn
);
criterion_main!(benches);
