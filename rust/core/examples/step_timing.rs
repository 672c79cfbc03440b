//! Quick timing of a decode step (schedule + update) at N running requests, pure Rust.
//! `cargo run -p ferrobatch-core --release --example step_timing [N] [page]`
use ferrobatch_core::request::StopConditions;
use ferrobatch_core::{Scheduler, SchedulerConfig};
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let n = args.first().copied().unwrap_or(1024);
    let page = args.get(1).copied().unwrap_or(16);
    let mut cfg = SchedulerConfig::new(n * 64, page, 8192);
    cfg.max_requests_per_batch = n;
    cfg.allow_block_sharing = std::env::var("NO_SHARING").is_err();
    let mut s = Scheduler::new(cfg).unwrap();
    let mut x = 12345u64;
    for i in 0..n {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let len = std::env::var("PROMPT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(16 + (x >> 33) as usize % 240);
        let prompt = (0..len)
            .map(|j| ((x >> 20) as u32 + j as u32 * 7919) % 32000)
            .collect();
        let stop = StopConditions {
            max_new_tokens: 100_000,
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
            break;
        }
    }
    let toks = vec![7i32; n];
    let mut ts = Vec::new();
    let mut tu = Vec::new();
    for _ in 0..std::env::var("STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
    {
        let t0 = Instant::now();
        s.schedule().unwrap().unwrap();
        let t1 = Instant::now();
        s.update(&toks).unwrap();
        let t2 = Instant::now();
        ts.push((t1 - t0).as_secs_f64() * 1e6);
        tu.push((t2 - t1).as_secs_f64() * 1e6);
    }
    let mean = (ts.iter().sum::<f64>() + tu.iter().sum::<f64>()) / ts.len() as f64;
    ts.sort_by(f64::total_cmp);
    tu.sort_by(f64::total_cmp);
    println!(
        "N={n} page={page}: schedule median {:.1} us, update median {:.1} us, mean step {:.1} us, width {}",
        ts[ts.len() / 2],
        tu[tu.len() / 2],
        mean,
        s.plan().full_width
    );
}
