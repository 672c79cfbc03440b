//! Quick timing of a decode step (schedule + update) at N running requests, pure Rust, set up
//! exactly like `benches/step_bindings.py` (so the two are comparable): N distinct 128-token
//! prompts, page 32 by default, prefilled before timing; each repeat builds a fresh scheduler,
//! takes 8 warm-up steps, then times `STEPS` (256) steps; reported: medians over `REPEATS` (7)
//! of the per-repeat means.
//!
//! `cargo run -p ferrobatch-core --release --example step_timing [N] [page]`
//! Env: `STEPS`, `REPEATS`, `NO_SHARING` (prefix caching off), `WAITING` (requests queued
//! behind the full batch while timed).
use ferrobatch_core::request::StopConditions;
use ferrobatch_core::{Scheduler, SchedulerConfig};
use std::time::Instant;

const PROMPT_LEN: usize = 128;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// As `make()` in benches/step_bindings.py.
fn make(n: usize, steps: usize, page: usize) -> Scheduler {
    let max_new = 2 * steps + 64;
    let blocks_per_req = (PROMPT_LEN + max_new).div_ceil(page) + 1;
    let mut cfg = SchedulerConfig::new(n * blocks_per_req + 16, page, n.max(8192));
    cfg.max_requests_per_batch = n;
    cfg.safety_margin = Some(0.0);
    cfg.allow_block_sharing = std::env::var("NO_SHARING").is_err();
    let mut s = Scheduler::new(cfg).unwrap();
    for i in 0..n {
        let prompt = (0..PROMPT_LEN)
            .map(|j| ((i * 131 + j * 7) % 30000 + 3) as u32)
            .collect();
        let stop = StopConditions {
            max_new_tokens: max_new,
            ..Default::default()
        };
        s.add_request(&format!("req-{i}"), prompt, stop, 0).unwrap();
    }
    loop {
        let p = s.schedule().unwrap().unwrap();
        let k = p.num_sampled();
        let done = k == n && p.num_tokens() == n;
        s.update(&vec![7; k]).unwrap();
        if done {
            return s;
        }
    }
}

/// The timed steps (a separate symbol so `valgrind --tool=callgrind --collect-atstart=no
/// --toggle-collect='step_timing::timed_steps'` counts only them).
#[inline(never)]
fn timed_steps(s: &mut Scheduler, toks: &[i32], steps: usize) -> (f64, f64, f64) {
    let (mut ts, mut tu) = (0.0, 0.0);
    let t_all = Instant::now();
    for _ in 0..steps {
        let t0 = Instant::now();
        s.schedule().unwrap().unwrap();
        let t1 = Instant::now();
        s.update(toks).unwrap();
        let t2 = Instant::now();
        ts += (t1 - t0).as_secs_f64();
        tu += (t2 - t1).as_secs_f64();
    }
    (ts, tu, t_all.elapsed().as_secs_f64())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let n = args.first().copied().unwrap_or(1024);
    let page = args.get(1).copied().unwrap_or(32);
    let steps = env("STEPS", 256);
    let toks = vec![7i32; n];
    let (mut ms, mut mu, mut mt) = (Vec::new(), Vec::new(), Vec::new());
    let mut width = 0;
    for _ in 0..env("REPEATS", 7) {
        let mut s = make(n, steps + 8, page);
        // Requests queued behind a full batch (max_requests_per_batch = N): they wait.
        for i in 0..env("WAITING", 0) {
            let stop = StopConditions {
                max_new_tokens: 16,
                ..Default::default()
            };
            s.add_request(&format!("wait-{i}"), vec![5; PROMPT_LEN], stop, 0)
                .unwrap();
        }
        for _ in 0..8 {
            s.schedule().unwrap().unwrap();
            s.update(&toks).unwrap();
        }
        let (ts, tu, total) = timed_steps(&mut s, &toks, steps);
        assert_eq!(s.stats().running, n, "every request must still be running");
        width = width.max(s.plan().full_width);
        ms.push(ts / steps as f64 * 1e6);
        mu.push(tu / steps as f64 * 1e6);
        mt.push(total / steps as f64 * 1e6);
    }
    println!(
        "N={n} page={page}: schedule {:.1} us, update {:.1} us, step {:.1} us (medians of means), width {width}",
        median(&mut ms),
        median(&mut mu),
        median(&mut mt),
    );
}
