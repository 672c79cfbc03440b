//! Scenario tests of the scheduler and the prefix cache.

use crate::pool::Place;
use crate::request::StopConditions;
use crate::{
    AttentionType, ErrorKind, FinishReason, RequestState, Scheduler, SchedulerConfig,
    SchedulerType, SCRATCH_CHUNK, ZERO_CHUNK,
};

fn stop(max_new: usize) -> StopConditions {
    StopConditions {
        max_new_tokens: max_new,
        ..Default::default()
    }
}

fn cfg(num_blocks: usize, page: usize, mbt: usize) -> SchedulerConfig {
    let mut c = SchedulerConfig::new(num_blocks, page, mbt);
    c.safety_margin = Some(0.0);
    c
}

/// One step feeding token `t` to every sampled row; returns (id, token, finish) deltas.
fn step(s: &mut Scheduler, t: i32) -> Vec<(String, i32, Option<FinishReason>)> {
    let n = match s.schedule().unwrap() {
        Some(p) => p.num_sampled(),
        None => 0,
    };
    let out = s.update(&vec![t; n]).unwrap().clone();
    s.check_invariants().unwrap();
    (0..out.len())
        .map(|k| {
            (
                s.request(out.reqs[k]).unwrap().id.clone(),
                out.token_ids[k],
                out.finish_reasons[k],
            )
        })
        .collect()
}

fn run(s: &mut Scheduler, t: i32) {
    let mut n = 0;
    while s.has_unfinished() {
        step(s, t);
        n += 1;
        assert!(n < 10_000);
    }
}

fn idx(s: &Scheduler, id: &str) -> u32 {
    s.request_index(id).unwrap()
}

#[test]
fn add_request_rejections_name_the_field() {
    let mut s = Scheduler::new(cfg(4, 4, 16)).unwrap();
    let e = s.add_request("a", vec![], stop(1), 0).unwrap_err();
    assert!(e.message.contains("prompt_token_ids") && e.kind == ErrorKind::Value);
    assert_eq!(e.field(), Some("prompt"));
    let e = s.add_request("a", vec![1], stop(0), 0).unwrap_err();
    assert!(e.message.contains("max_new_tokens"));
    assert_eq!(e.field(), Some("max_new_tokens"));
    // 4 blocks of 4 = 16 tokens: 10 + 7 - 1 = 16 fits, 10 + 8 - 1 = 17 does not.
    s.add_request("ok", vec![1; 10], stop(7), 0).unwrap();
    let e = s.add_request("big", vec![1; 10], stop(8), 0).unwrap_err();
    assert!(e.message.contains("num_blocks"), "{}", e.message);
    assert_eq!(e.field(), Some("max_new_tokens"));
    // A prompt that cannot fit even with one new token is the prompt's fault.
    let e = s.add_request("huge", vec![1; 17], stop(1), 0).unwrap_err();
    assert_eq!(e.field(), Some("prompt"));
    let e = s.add_request("ok", vec![1], stop(1), 0).unwrap_err();
    assert!(e.message.contains("request_id"));
    assert_eq!(e.field(), Some("request_id"));
    let mut sq = stop(2);
    sq.stop_sequences = vec![vec![]];
    let e = s.add_request("sq", vec![1], sq, 0).unwrap_err();
    assert!(e.message.contains("stop_sequences"));
    assert_eq!(e.field(), Some("stop_sequences"));
    let mut c = cfg(100, 4, 16);
    c.max_batch_cache_tokens = Some(8);
    let mut s = Scheduler::new(c).unwrap();
    let e = s.add_request("x", vec![1; 8], stop(2), 0).unwrap_err();
    assert!(e.message.contains("max_batch_cache_tokens"));
    assert_eq!(e.field(), Some("max_new_tokens"));
}

/// Every configuration the fit tests run under: full, sliding, hybrid, cache-read budget.
fn fit_configs() -> Vec<SchedulerConfig> {
    let mut out = vec![cfg(4, 4, 16), cfg(1, 2, 16)];
    let mut c = cfg(3, 4, 16);
    c.layer_types = vec![AttentionType::Sliding];
    c.sliding_window = Some(6);
    out.push(c.clone());
    c.num_blocks = 2; // smaller than the ring (3): the ring bounds nothing, the pool does
    out.push(c);
    let mut c = cfg(7, 4, 16);
    c.layer_types = vec![AttentionType::Full, AttentionType::Sliding];
    c.sliding_window = Some(5);
    out.push(c.clone());
    c.num_blocks = 1; // a hybrid request needs two chunks: nothing fits
    out.push(c);
    let mut c = cfg(100, 4, 16);
    c.max_batch_cache_tokens = Some(9);
    out.push(c);
    out
}

#[test]
fn check_fits_is_add_requests_check_and_max_request_tokens_its_bound() {
    for c in fit_configs() {
        let s = Scheduler::new(c.clone()).unwrap();
        let most = s.max_request_tokens();
        for p in 0..40usize {
            for m in 0..40usize {
                let fits = s.check_fits(p, m);
                let mut t = Scheduler::new(c.clone()).unwrap();
                let added = t.add_request("r", vec![1; p], stop(m), 0);
                assert_eq!(fits.is_ok(), added.is_ok(), "{c:?} p={p} m={m}");
                if let (Err(a), Err(b)) = (&fits, &added) {
                    assert_eq!(a.field(), b.field(), "p={p} m={m}");
                    assert_eq!(a.kind, ErrorKind::Value);
                }
                if p >= 1 && m >= 1 {
                    assert_eq!(fits.is_ok(), p + m <= most, "{c:?} p={p} m={m} most={most}");
                }
            }
        }
        assert!(s.check_fits(usize::MAX / 2, usize::MAX / 2).is_err());
    }
    let s = Scheduler::new(cfg(4, 4, 16)).unwrap();
    assert_eq!(s.max_request_tokens(), 17);
    assert_eq!(s.check_fits(0, 1).unwrap_err().field(), Some("prompt"));
    assert_eq!(
        s.check_fits(1, 0).unwrap_err().field(),
        Some("max_new_tokens")
    );
    assert_eq!(s.check_fits(17, 1).unwrap_err().field(), Some("prompt"));
    assert_eq!(
        s.check_fits(16, 2).unwrap_err().field(),
        Some("max_new_tokens")
    );
}

#[test]
fn lifetime_chunks_counts_full_blocks_and_the_ring() {
    let s = Scheduler::new(cfg(8, 4, 16)).unwrap();
    assert_eq!(
        (0..10).map(|n| s.lifetime_chunks(n)).collect::<Vec<_>>(),
        vec![0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    );
    let mut c = cfg(8, 4, 16);
    c.layer_types = vec![AttentionType::Full, AttentionType::Sliding];
    c.sliding_window = Some(6); // ring of 3
    let s = Scheduler::new(c).unwrap();
    assert_eq!(s.lifetime_chunks(1), 2);
    assert_eq!(s.lifetime_chunks(12), 3 + 3);
    assert_eq!(s.lifetime_chunks(40), 10 + 3);
    // A request whose lifetime needs exactly the pool fits; one more key does not.
    let fits = (1..100)
        .take_while(|&n| s.lifetime_chunks(n) <= 8)
        .last()
        .unwrap();
    assert_eq!(s.max_request_tokens(), fits + 1);
}

#[test]
fn reserved_chunk_ids() {
    assert_eq!((ZERO_CHUNK, SCRATCH_CHUNK), (0, 1));
    let mut s = Scheduler::new(cfg(3, 2, 16)).unwrap();
    s.add_request("a", vec![1; 5], stop(1), 0).unwrap();
    let p = s.schedule().unwrap().unwrap();
    assert!(p
        .block_table_full
        .iter()
        .all(|&c| c as u32 != ZERO_CHUNK && c as u32 != SCRATCH_CHUNK));
}

#[test]
fn getters_match_stats() {
    let mut c = cfg(6, 2, 4);
    c.cpu_offload_blocks = 8;
    let mut s = Scheduler::new(c).unwrap();
    let same = |s: &Scheduler| {
        let st = s.stats();
        assert_eq!(s.num_free_blocks(), st.num_free_blocks);
        assert_eq!(s.num_cached_blocks(), st.num_cached_blocks);
        assert_eq!(s.num_waiting(), st.waiting);
        assert_eq!(s.num_running(), st.running);
        assert_eq!(s.num_swapped(), st.swapped);
        assert_eq!(s.num_stalled(), st.stalled_requests);
    };
    same(&s);
    for i in 0..5 {
        s.add_request(&format!("r{i}"), vec![i as u32 + 1; 5], stop(6), i)
            .unwrap();
    }
    same(&s);
    let mut saw = (false, false, false);
    while s.has_unfinished() {
        let n = s.schedule().unwrap().map_or(0, |p| p.num_sampled());
        same(&s);
        saw.0 |= s.num_swapped() > 0;
        saw.1 |= s.num_stalled() > 0;
        saw.2 |= s.num_cached_blocks() > 0;
        s.update(&vec![3; n]).unwrap();
        same(&s);
    }
    assert!(saw.0 && saw.1 && saw.2, "{saw:?}");
}

#[test]
fn config_rejections_name_the_field() {
    for (c, field) in [
        (SchedulerConfig::new(0, 4, 4), "num_blocks"),
        (SchedulerConfig::new(4, 0, 4), "page_size"),
        (SchedulerConfig::new(4, 4, 0), "max_batch_tokens"),
    ] {
        let e = Scheduler::new(c).unwrap_err();
        assert!(e.message.contains(field), "{}", e.message);
        assert_eq!(e.field(), Some(field));
    }
    let mut c = SchedulerConfig::new(4, 4, 4);
    c.safety_margin = Some(1.5);
    assert!(Scheduler::new(c)
        .unwrap_err()
        .message
        .contains("safety_margin"));
    let mut c = SchedulerConfig::new(4, 4, 4);
    c.layer_types = vec![crate::AttentionType::Sliding];
    assert!(Scheduler::new(c)
        .unwrap_err()
        .message
        .contains("sliding_window"));
}

#[test]
fn call_order_errors() {
    let mut s = Scheduler::new(cfg(8, 4, 16)).unwrap();
    assert_eq!(s.update(&[1]).unwrap_err().kind, ErrorKind::Runtime);
    s.add_request("a", vec![1, 2], stop(3), 0).unwrap();
    s.schedule().unwrap().unwrap();
    assert_eq!(s.schedule().unwrap_err().kind, ErrorKind::Runtime);
    assert_eq!(s.update(&[1, 2]).unwrap_err().kind, ErrorKind::Value);
    assert_eq!(s.update(&[-1]).unwrap_err().kind, ErrorKind::Value);
    s.update(&[1]).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn chunked_prefill_continues_where_it_stopped() {
    let mut s = Scheduler::new(cfg(16, 4, 5)).unwrap();
    s.add_request("a", (0..12).collect(), stop(2), 0).unwrap();
    s.add_request("b", (100..103).collect(), stop(2), 0)
        .unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    assert_eq!(p.input_ids, vec![0, 1, 2, 3, 4]);
    assert_eq!(p.num_sampled(), 0);
    s.update(&[]).unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    assert_eq!(p.positions, vec![5, 6, 7, 8, 9]);
    s.update(&[]).unwrap();
    // a finishes its prompt (2 tokens, sampled), b starts with the 3 remaining budget tokens.
    let p = s.schedule().unwrap().unwrap().clone();
    assert_eq!(p.input_ids, vec![10, 11, 100, 101, 102]);
    assert_eq!(p.logits_indices, vec![1, 4]);
    assert_eq!(p.cu_seqlens_q, vec![0, 2, 5]);
    assert_eq!(p.seqlens_k, vec![12, 3]);
    s.update(&[7, 7]).unwrap();
    run(&mut s, 7);
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn every_stop_condition() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let mut eos = stop(10);
    eos.eos_token_ids = vec![9];
    s.add_request("eos", vec![1, 2], eos, 0).unwrap();
    let mut st = stop(10);
    st.stop_token_ids = vec![8];
    s.add_request("stopid", vec![1, 3], st, 0).unwrap();
    let mut sq = stop(10);
    sq.stop_sequences = vec![vec![5, 6]];
    s.add_request("seq", vec![1, 4], sq, 0).unwrap();
    s.add_request("len", vec![1, 5], stop(3), 0).unwrap();
    let mut fins = std::collections::HashMap::new();
    let feed = [5, 6, 8, 9, 3];
    for (i, &t) in feed.iter().enumerate() {
        for (id, tok, f) in step(&mut s, t) {
            assert_eq!(tok, t);
            if let Some(f) = f {
                fins.insert(id, (i, f));
            }
        }
    }
    assert_eq!(fins["seq"], (1, FinishReason::Stop));
    assert_eq!(fins["len"], (2, FinishReason::Length));
    assert_eq!(fins["stopid"], (2, FinishReason::Stop));
    assert_eq!(fins["eos"], (3, FinishReason::Stop));
    assert!(!s.has_unfinished());
    // A stop sequence spanning prompt and output does not count: only generated tokens.
    let mut sq = stop(2);
    sq.stop_sequences = vec![vec![4, 5]];
    s.add_request("span", vec![1, 4], sq, 0).unwrap();
    let d = step(&mut s, 5);
    assert_eq!(d[0].2, None);
}

#[test]
fn priority_then_arrival_order() {
    let mut c = cfg(64, 4, 64);
    c.max_requests_per_batch = 1;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("p2", vec![1], stop(1), 2).unwrap();
    s.add_request("p0a", vec![1], stop(1), 0).unwrap();
    s.add_request("p1", vec![1], stop(1), 1).unwrap();
    s.add_request("p0b", vec![1], stop(1), 0).unwrap();
    let order: Vec<String> = (0..4).map(|_| step(&mut s, 3)[0].0.clone()).collect();
    assert_eq!(order, ["p0a", "p0b", "p1", "p2"]);
}

#[test]
fn skip_prefix_lookup_computes_every_position_and_still_registers() {
    let mut s = Scheduler::new(cfg(32, 4, 64)).unwrap();
    let prompt: Vec<u32> = (0..10).collect(); // 2 full blocks + 2
    s.add_request("a", prompt.clone(), stop(3), 0).unwrap();
    step(&mut s, 1);
    let a_blocks = s.request(idx(&s, "a")).unwrap().full[..2].to_vec();
    // "b" skips the lookup: it computes all 10 positions in fresh chunks.
    s.add_request_opts("b", prompt.clone(), stop(3), 0, true)
        .unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    let rows: Vec<(u32, u32)> = p.rows.iter().map(|r| (r.start, r.q)).collect();
    assert_eq!(rows[1], (0, 10));
    let ib = idx(&s, "b");
    let b_blocks = s.request(ib).unwrap().full[..2].to_vec();
    assert!(b_blocks.iter().all(|c| !a_blocks.contains(c)));
    assert_eq!(s.stats().prefix_hit_tokens, 0);
    s.check_invariants().unwrap();
    s.update(&vec![1; p.num_sampled()]).unwrap();
    s.check_invariants().unwrap();
    // "c" (no flag) still takes two verified full-block hits.
    s.add_request("c", prompt, stop(3), 0).unwrap();
    let _ = s.schedule().unwrap().unwrap();
    assert_eq!(s.stats().prefix_hit_tokens, 8);
    s.check_invariants().unwrap();
}

#[test]
fn cache_salts_never_share_blocks() {
    let mut s = Scheduler::new(cfg(32, 4, 64)).unwrap();
    let prompt: Vec<u32> = (0..10).collect(); // 2 full blocks + 2
    s.add_request("a", prompt.clone(), stop(3), 0).unwrap();
    s.set_cache_salt("a", 7).unwrap();
    step(&mut s, 1);
    // another salt (and the shared namespace) misses; the same salt hits both blocks
    s.add_request("b", prompt.clone(), stop(3), 0).unwrap();
    s.set_cache_salt("b", 8).unwrap();
    s.add_request("c", prompt.clone(), stop(3), 0).unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    assert_eq!(s.stats().prefix_hit_tokens, 0);
    s.check_invariants().unwrap();
    s.update(&vec![1; p.num_sampled()]).unwrap();
    s.add_request("d", prompt, stop(3), 0).unwrap();
    s.set_cache_salt("d", 7).unwrap();
    let _ = s.schedule().unwrap().unwrap();
    assert_eq!(s.stats().prefix_hit_tokens, 8);
    s.check_invariants().unwrap();
    // a request that has started can't change namespace
    assert!(s.set_cache_salt("d", 1).is_err());
    assert!(s.set_cache_salt("nope", 1).is_err());
}

#[test]
fn prefix_hits_refcounts_and_last_token_computed() {
    let mut s = Scheduler::new(cfg(32, 4, 64)).unwrap();
    let prompt: Vec<u32> = (0..8).collect(); // exactly 2 full blocks
    s.add_request("a", prompt.clone(), stop(3), 0).unwrap();
    step(&mut s, 1); // a prefilled: its 2 full blocks are registered
    let ia = idx(&s, "a");
    let a_blocks = s.request(ia).unwrap().full.clone();
    assert!(s.pool().is_hashed(a_blocks[0]) && s.pool().is_hashed(a_blocks[1]));
    // b shares both blocks but must compute its last prompt token: 1 block hit only.
    s.add_request("b", prompt.clone(), stop(3), 0).unwrap();
    let mut longer = prompt.clone();
    longer.extend([50, 51]);
    s.add_request("c", longer, stop(3), 0).unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    let ib = idx(&s, "b");
    let ic = idx(&s, "c");
    let rb = s.request(ib).unwrap();
    let rc = s.request(ic).unwrap();
    assert_eq!(rb.full[0], a_blocks[0]);
    assert_ne!(rb.full[1], a_blocks[1]);
    assert_eq!(&rc.full[..2], &a_blocks[..]);
    assert_eq!(s.pool().refcount(a_blocks[0]), 3);
    assert_eq!(s.pool().refcount(a_blocks[1]), 2);
    assert_eq!(s.stats().prefix_hit_tokens, 4 + 8);
    // b recomputes positions 4..8, c computes 8..10.
    let rows: Vec<(u32, u32)> = p.rows.iter().map(|r| (r.start, r.q)).collect();
    assert_eq!(&rows[1..], &[(4, 4), (8, 2)]);
    s.check_invariants().unwrap();
    s.update(&vec![1; p.num_sampled()]).unwrap();
    run(&mut s, 1);
    assert_eq!(s.pool().refcount(a_blocks[0]), 0);
    assert_eq!(s.pool().place(a_blocks[0]), Place::Cached);
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn cached_blocks_evicted_lru_deepest_first() {
    let mut s = Scheduler::new(cfg(6, 2, 64)).unwrap();
    s.add_request("a", vec![1, 2, 3, 4, 5], stop(1), 0).unwrap();
    run(&mut s, 9);
    s.add_request("b", vec![6, 7, 8, 9, 10], stop(1), 0)
        .unwrap();
    run(&mut s, 9);
    // a's blocks [1,2] [3,4] then b's [6,7] [8,9] cached; a's freed first, deepest first.
    let cached = s.pool().cached_chunks();
    assert_eq!(cached.len(), 4);
    assert_eq!(s.pool().num_uninit(), 2);
    // A new 5-token request needs 3 blocks: 2 uninit, then evicts a's deepest block.
    let a_deep = cached[0];
    s.add_request("c", vec![20, 21, 22, 23, 24], stop(1), 0)
        .unwrap();
    s.schedule().unwrap().unwrap();
    assert!(!s.pool().is_hashed(a_deep));
    assert_eq!(s.pool().num_evictions(), 1);
    s.update(&[1]).unwrap();
    // a's first block is still a hit.
    s.add_request("a2", vec![1, 2, 3, 4, 5], stop(1), 0)
        .unwrap();
    s.schedule().unwrap().unwrap();
    assert_eq!(s.stats().prefix_hit_tokens, 2);
    s.update(&[1]).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn failed_admission_leaves_hit_blocks_untouched() {
    let mut s = Scheduler::new(cfg(6, 2, 64)).unwrap();
    s.add_request("a", vec![1, 2, 3, 4, 5], stop(1), 0).unwrap();
    run(&mut s, 9);
    // big holds 4 of the 6 chunks (2 uninit + 2 reclaimed from the cache? no: hits none).
    s.add_request("big", vec![30, 31, 32, 33, 34, 35, 36], stop(2), 0)
        .unwrap();
    s.schedule().unwrap().unwrap();
    let before_cached = s.pool().cached_chunks();
    let before_ref: Vec<u32> = s.pool().refcounts().to_vec();
    // b hits a's first block but needs 2 more chunks while only the cached ones remain.
    s.add_request("b", vec![1, 2, 3, 4, 5, 6, 7, 8], stop(1), 0)
        .unwrap();
    s.update(&[1]).unwrap();
    let hits_before = s.stats().prefix_hit_tokens;
    // big decodes (needs 1 new block), b cannot be admitted.
    let p = s.schedule().unwrap().unwrap().clone();
    assert_eq!(p.num_rows(), 1);
    assert_eq!(s.stats().prefix_hit_tokens, hits_before);
    assert_eq!(
        s.request(idx(&s, "b")).unwrap().state,
        RequestState::Waiting
    );
    let _ = (before_cached, before_ref);
    s.check_invariants().unwrap();
    s.update(&[1]).unwrap();
    run(&mut s, 1);
}

#[test]
fn twin_hashes_are_misses() {
    let mut c = cfg(32, 2, 64);
    c.hash_mask = 0; // every block hash collides
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("a", vec![1, 2, 3, 4, 5], stop(1), 0).unwrap();
    run(&mut s, 9);
    s.add_request("b", vec![1, 9, 3, 4, 5], stop(1), 0).unwrap();
    run(&mut s, 9);
    assert_eq!(
        s.stats().prefix_hit_tokens,
        0,
        "different content must not hit"
    );
    s.add_request("c", vec![1, 2, 7, 7, 7], stop(1), 0).unwrap();
    run(&mut s, 9);
    assert_eq!(s.stats().prefix_hit_tokens, 2, "same first block hits once");
}

#[test]
fn preemption_soft_reset_and_offload_keep_last_active() {
    for offload in [0, 32] {
        let mut c = cfg(6, 2, 64);
        c.cpu_offload_blocks = offload;
        let mut s = Scheduler::new(c).unwrap();
        // Each needs up to 4 + 7 - 1 = 10 tokens = 5 blocks; together they cannot fit.
        s.add_request("a", vec![1, 2, 3, 4], stop(7), 0).unwrap();
        s.add_request("b", vec![5, 6, 7, 8], stop(7), 0).unwrap();
        let mut lens = std::collections::HashMap::new();
        let mut n = 0;
        while s.has_unfinished() {
            for (id, t, _) in step(&mut s, 3) {
                if t >= 0 {
                    *lens.entry(id).or_insert(0) += 1;
                }
            }
            n += 1;
            assert!(n < 1000);
        }
        assert_eq!(lens["a"], 7);
        assert_eq!(lens["b"], 7);
        let st = s.stats();
        assert!(st.num_preemptions > 0);
        if offload > 0 {
            assert!(st.num_offloads > 0 && st.num_soft_resets == 0);
        } else {
            assert!(st.num_soft_resets > 0 && st.num_offloads == 0);
        }
        assert_eq!(st.num_used_blocks, 0);
    }
    // A lone request as large as the pool runs to completion.
    let mut s = Scheduler::new(cfg(3, 2, 64)).unwrap();
    s.add_request("solo", vec![1, 2, 3], stop(4), 0).unwrap();
    run(&mut s, 1);
    assert_eq!(s.stats().num_preemptions, 0);
}

#[test]
fn cancel_in_every_state_frees_everything() {
    let mut c = cfg(8, 2, 4);
    c.cpu_offload_blocks = 16;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("w", vec![1; 3], stop(2), 5).unwrap(); // stays waiting (low priority)
    s.add_request("p", vec![2; 9], stop(2), 0).unwrap(); // prefilling (chunked)
    s.schedule().unwrap().unwrap();
    assert_eq!(
        s.request(idx(&s, "p")).unwrap().state,
        RequestState::Prefilling
    );
    // Cancel while the plan is outstanding: its row is ignored by update.
    assert!(s.cancel("p"));
    assert!(!s.cancel("p"));
    assert!(s.cancel("w"));
    let out = s.update(&[]).unwrap().clone();
    assert_eq!(out.len(), 2);
    assert!(out
        .finish_reasons
        .iter()
        .all(|r| *r == Some(FinishReason::Cancelled)));
    assert!(!s.has_unfinished());
    assert_eq!(s.stats().num_used_blocks, 0);
    // Decoding and swapped.
    s.add_request("d", vec![3; 2], stop(5), 0).unwrap();
    step(&mut s, 1);
    assert_eq!(
        s.request(idx(&s, "d")).unwrap().state,
        RequestState::Decoding
    );
    assert!(s.cancel("d"));
    // Cancellations with no plan: update(&[]) reports them.
    assert!(s.has_unfinished());
    assert!(s.schedule().unwrap().is_none());
    let out = s.update(&[]).unwrap().clone();
    assert_eq!(out.len(), 1);
    assert_eq!(s.request_index("d"), None);
    s.check_invariants().unwrap();
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn swapped_request_cancel_releases_slots() {
    let mut c = cfg(6, 2, 64);
    c.cpu_offload_blocks = 32;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("a", vec![1, 2, 3, 4], stop(7), 0).unwrap();
    s.add_request("b", vec![5, 6, 7, 8], stop(7), 0).unwrap();
    let mut swapped = false;
    for _ in 0..50 {
        step(&mut s, 3);
        if s.stats().swapped > 0 {
            swapped = true;
            break;
        }
    }
    assert!(swapped);
    let victim = s
        .live_requests()
        .find(|(_, r)| r.state == RequestState::Swapped)
        .map(|(_, r)| r.id.clone())
        .unwrap();
    assert!(s.cancel(&victim));
    assert_eq!(s.swap_pool().num_free(), 32);
    run(&mut s, 3);
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn recompute_resets_a_request_which_then_prefills_prompt_and_generated() {
    let mut s = Scheduler::new(cfg(8, 2, 64)).unwrap();
    s.add_request("a", vec![1, 2, 3], stop(6), 0).unwrap();
    s.add_request("b", vec![4, 5], stop(6), 0).unwrap();
    step(&mut s, 7); // both prefilled, one token each
    step(&mut s, 8); // one decode each: a holds 3 + 2 tokens, 4 computed
    assert_eq!(
        s.request(idx(&s, "a")).unwrap().state,
        RequestState::Decoding
    );
    let used = s.stats().num_used_blocks;
    // while a plan is outstanding: refused, nothing changed
    s.schedule().unwrap().unwrap();
    let e = s.recompute("a").unwrap_err();
    assert_eq!(e.kind, ErrorKind::Runtime);
    assert!(e.message.contains("outstanding"));
    s.update(&[9, 9]).unwrap();
    s.check_invariants().unwrap();
    assert!(s.recompute("a").unwrap());
    s.check_invariants().unwrap();
    let r = s.request(idx(&s, "a")).unwrap();
    assert_eq!(r.state, RequestState::Waiting);
    assert_eq!(r.num_computed, 0);
    assert!(s.stats().num_used_blocks < used + 1);
    assert_eq!(s.stats().num_recomputes, 1);
    assert_eq!(s.stats().num_soft_resets, 0);
    // waiting, unknown: nothing to do
    assert!(!s.recompute("a").unwrap());
    assert!(!s.recompute("nope").unwrap());
    // the next plan prefills a's prompt + its 3 generated tokens in one row, sampling the
    // last (its two full blocks come back from the prefix cache: prefix caching is on)
    let plan = s.schedule().unwrap().unwrap().clone();
    let row = plan
        .rows
        .iter()
        .position(|r| s.request(r.req).unwrap().id == "a")
        .unwrap();
    let (r, t0) = (plan.rows[row], plan.cu_seqlens_q[row] as usize);
    assert_eq!((r.start, r.q, r.sampled), (4, 2, true));
    assert_eq!(&plan.input_ids[t0..t0 + 2], &[8, 9]);
    assert_eq!(&plan.positions[t0..t0 + 2], &[4, 5]);
    let n = plan.num_sampled();
    s.update(&vec![3; n]).unwrap();
    run(&mut s, 3);
    // a got exactly max_new_tokens tokens in total, nothing leaks
    assert_eq!(s.stats().generated_tokens, 12);
    assert_eq!(s.stats().num_used_blocks, 0);
    // a finished request: false
    s.add_request("c", vec![1], stop(1), 0).unwrap();
    run(&mut s, 3);
    assert!(!s.recompute("c").unwrap());
}

#[test]
fn recompute_without_prefix_caching_prefills_everything() {
    let mut c = cfg(8, 2, 64);
    c.allow_block_sharing = false;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("a", vec![1, 2, 3], stop(6), 0).unwrap();
    step(&mut s, 7);
    step(&mut s, 8);
    assert!(s.recompute("a").unwrap());
    let plan = s.schedule().unwrap().unwrap().clone();
    assert_eq!(plan.rows.len(), 1);
    assert_eq!((plan.rows[0].start, plan.rows[0].q), (0, 5));
    assert_eq!(&plan.input_ids, &[1, 2, 3, 7, 8]);
    assert_eq!(&plan.positions, &[0, 1, 2, 3, 4]);
    assert_eq!(plan.logits_indices, vec![4]);
    s.update(&[5]).unwrap();
    run(&mut s, 3);
    assert_eq!(s.stats().generated_tokens, 6);
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn recompute_of_a_swapped_request_releases_its_slots() {
    let mut c = cfg(6, 2, 64);
    c.cpu_offload_blocks = 32;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("a", vec![1, 2, 3, 4], stop(7), 0).unwrap();
    s.add_request("b", vec![5, 6, 7, 8], stop(7), 0).unwrap();
    let mut victim = None;
    for _ in 0..50 {
        step(&mut s, 3);
        victim = s
            .live_requests()
            .find(|(_, r)| r.state == RequestState::Swapped)
            .map(|(_, r)| r.id.clone());
        if victim.is_some() {
            break;
        }
    }
    let victim = victim.expect("a request was swapped out");
    assert!(s.recompute(&victim).unwrap());
    s.check_invariants().unwrap();
    assert_eq!(s.swap_pool().num_free(), 32);
    assert_eq!(s.stats().swapped, 0);
    run(&mut s, 3);
    assert_eq!(s.stats().generated_tokens, 14);
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn safety_margin_blocks_new_admissions_only() {
    let mut c = SchedulerConfig::new(10, 2, 64);
    c.safety_margin = Some(0.5);
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("a", vec![1; 12], stop(2), 0).unwrap(); // 6 blocks
    s.add_request("b", vec![2; 2], stop(2), 0).unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    // Admitting a leaves 4/10 free < 0.5: b waits.
    assert_eq!(p.num_rows(), 1);
    s.update(&[1]).unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    assert_eq!(p.num_rows(), 1, "a keeps decoding, b still held back");
    s.update(&[1]).unwrap();
    run(&mut s, 1);
    assert_eq!(s.stats().finished, 2);
}

#[test]
fn cache_read_budget_limits_batch() {
    let mut c = cfg(64, 4, 64);
    c.max_batch_cache_tokens = Some(20);
    let mut s = Scheduler::new(c).unwrap();
    for i in 0..4 {
        s.add_request(&format!("r{i}"), vec![i; 8], stop(3), 0)
            .unwrap();
    }
    while s.has_unfinished() {
        let p = s.schedule().unwrap().unwrap().clone();
        assert!(p.seqlens_k.iter().sum::<i32>() <= 20);
        s.update(&vec![1; p.num_sampled()]).unwrap();
    }
}

#[test]
fn prefill_first_finishes_prefills_before_decodes() {
    let mut c = cfg(64, 4, 6);
    c.scheduler_type = SchedulerType::PrefillFirst;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("d", vec![1], stop(10), 0).unwrap();
    step(&mut s, 1); // d decoding now
    s.add_request("p", vec![2; 12], stop(1), 0).unwrap();
    step(&mut s, 1); // fills the budget: d decodes (first in running) + p chunk? no: d placed after p
    let p = s.schedule().unwrap().unwrap().clone();
    // p is an in-flight prefill: it comes first.
    assert_eq!(s.request(p.rows[0].req).unwrap().id, "p");
    s.update(&vec![1; p.num_sampled()]).unwrap();
    run(&mut s, 1);
}

/// Every array of the current plan (full attention only) as a from-scratch build would
/// write it from the requests' state (checks the in-place steady step and rows appended to it).
fn check_plan(s: &Scheduler) {
    let p = s.plan();
    let page = s.config().page_size;
    let n = p.rows.len();
    let width = p
        .rows
        .iter()
        .map(|r| s.request(r.req).unwrap().full.len())
        .max()
        .unwrap();
    assert_eq!(p.full_width, width);
    assert_eq!(p.block_table_full.len(), n * width);
    assert_eq!(p.cu_seqlens_q.len(), n + 1);
    let (mut li, mut lr) = (Vec::new(), Vec::new());
    for (i, row) in p.rows.iter().enumerate() {
        let r = s.request(row.req).unwrap();
        let (start, q) = (row.start as usize, row.q as usize);
        assert_eq!(start, r.num_computed);
        let (t0, t1) = (p.cu_seqlens_q[i] as usize, p.cu_seqlens_q[i + 1] as usize);
        assert_eq!(t1 - t0, q);
        let want: Vec<i32> = r.tokens[start..start + q]
            .iter()
            .map(|&t| t as i32)
            .collect();
        assert_eq!(&p.input_ids[t0..t1], &want[..]);
        let want: Vec<i32> = (start..start + q).map(|x| x as i32).collect();
        assert_eq!(&p.positions[t0..t1], &want[..]);
        let want: Vec<i32> = (start..start + q)
            .map(|x| (r.full[x / page] as usize * page + x % page) as i32)
            .collect();
        assert_eq!(&p.slot_mapping_full[t0..t1], &want[..]);
        assert_eq!(p.seqlens_k[i], (start + q) as i32);
        assert_eq!(row.sampled, start + q == r.tokens.len());
        if row.sampled {
            li.push(t1 as i32 - 1);
            lr.push(i as i32);
        }
        let mut want: Vec<i32> = r.full.iter().map(|&c| c as i32).collect();
        want.resize(width, 0);
        assert_eq!(&p.block_table_full[i * width..(i + 1) * width], &want[..]);
    }
    assert_eq!((p.logits_indices.clone(), p.logits_rows.clone()), (li, lr));
    assert_eq!(p.input_ids.len(), p.cu_seqlens_q[n] as usize);
}

#[test]
fn steady_decode_steps_match_a_fresh_build() {
    // Page 4, prompts of different lengths (rows cross blocks at different steps, the table
    // widens), requests finishing, a cancel, a late arrival and an exported plan in between.
    let mut s = Scheduler::new(cfg(400, 4, 64)).unwrap();
    for i in 0..6u32 {
        let prompt = (0..3 + 2 * i).map(|j| 10 + i * 100 + j).collect();
        s.add_request(&format!("r{i}"), prompt, stop(30 + 3 * i as usize), 0)
            .unwrap();
    }
    let mut spare = crate::StepPlan::default();
    let mut repeated = 0;
    for k in 0..80 {
        if k == 12 {
            assert!(s.cancel("r5"));
        }
        if k == 20 || k == 26 {
            // Admitted behind the steady rows (a prefill row appended to them).
            let prompt = (0..5 + k as u32).collect();
            s.add_request(&format!("late{k}"), prompt, stop(6), 0)
                .unwrap();
        }
        let Some(p) = s.schedule().unwrap() else {
            break;
        };
        let n = p.num_sampled();
        check_plan(&s);
        repeated += s.plan_repeats_rows() as usize;
        if k % 3 == 0 {
            s.export_plan(&mut spare);
            assert_eq!(spare.input_ids, s.plan().input_ids);
            assert_eq!(spare.block_table_full, s.plan().block_table_full);
        }
        s.update(&vec![1; n]).unwrap();
        s.check_invariants().unwrap();
    }
    assert!(repeated > 5, "the steady path ran ({repeated} steps)");
}

// ----- one plan ahead (schedule_ahead) ------------------------------------------------

fn eos_stop(max_new: usize, eos: u32) -> StopConditions {
    StopConditions {
        max_new_tokens: max_new,
        eos_token_ids: vec![eos],
        ..Default::default()
    }
}

/// Chunks of request `id` (full then ring).
fn chunks_of(s: &Scheduler, id: &str) -> Vec<u32> {
    let r = s.request(idx(s, id)).unwrap();
    r.full.iter().chain(&r.ring).copied().collect()
}

#[test]
fn schedule_ahead_needs_exactly_one_outstanding_plan() {
    let mut s = Scheduler::new(cfg(16, 4, 64)).unwrap();
    s.add_request("a", vec![1, 2, 3], stop(8), 0).unwrap();
    let e = s.schedule_ahead().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Runtime);
    assert!(e.message.contains("none"), "{}", e.message);
    s.schedule().unwrap().unwrap();
    assert_eq!(s.num_outstanding(), 1);
    let p = s.schedule_ahead().unwrap().unwrap();
    assert!(p.ahead);
    assert_eq!(s.num_outstanding(), 2);
    let e = s.schedule_ahead().unwrap_err();
    assert!(e.message.contains("two"), "{}", e.message);
    let e = s.schedule().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Runtime);
    assert!(e.message.contains("outstanding"));
    s.check_invariants().unwrap();
    // Wrong token count for the oldest plan (1 sampled row).
    assert_eq!(s.update(&[4, 4]).unwrap_err().kind, ErrorKind::Value);
    s.update(&[4]).unwrap();
    assert_eq!(s.num_outstanding(), 1);
    s.update(&[5]).unwrap();
    assert_eq!(s.num_outstanding(), 0);
    s.check_invariants().unwrap();
    let r = s.request(idx(&s, "a")).unwrap();
    assert_eq!(r.tokens, vec![1, 2, 3, 4, 5]);
}

#[test]
fn ahead_plan_has_placeholders_for_pending_tokens() {
    let mut s = Scheduler::new(cfg(16, 4, 64)).unwrap();
    s.add_request("a", vec![1, 2, 3], stop(8), 0).unwrap();
    s.add_request("b", vec![4, 5], stop(8), 0).unwrap();
    let n = s.schedule().unwrap().unwrap().clone();
    assert!(!n.ahead && n.prev_token_index.is_empty() && n.prev_token(0) == -1);
    let a = s.schedule_ahead().unwrap().unwrap().clone();
    assert_eq!(a.num_rows(), 2);
    assert_eq!(a.input_ids, vec![0, 0]);
    assert_eq!(a.prev_token_index, vec![0, 1]);
    assert_eq!(a.positions, vec![3, 2]);
    assert_eq!(a.seqlens_k, vec![4, 3]);
    assert_eq!(a.logits_indices, vec![0, 1]);
    // a's position 3 lives in its first block; b's position 2 too.
    let ca = chunks_of(&s, "a");
    assert_eq!(a.slot_mapping_full[0], (ca[0] * 4 + 3) as i32);
    s.check_invariants().unwrap();
    let out = s.update(&[7, 8]).unwrap().clone();
    assert_eq!(out.token_ids, vec![7, 8]);
    let out = s.update(&[9, 10]).unwrap().clone();
    assert_eq!(out.token_ids, vec![9, 10]);
    assert_eq!(s.request(idx(&s, "a")).unwrap().tokens, vec![1, 2, 3, 7, 9]);
    assert_eq!(s.request(idx(&s, "b")).unwrap().tokens, vec![4, 5, 8, 10]);
    // Back to schedule(): the next plan feeds the known last tokens.
    let p = s.schedule().unwrap().unwrap();
    assert_eq!(p.input_ids, vec![9, 10]);
    assert_eq!(p.positions, vec![4, 3]);
    s.check_invariants().unwrap();
}

#[test]
fn ahead_eos_at_n_drops_row_and_frees_after_n_plus_1() {
    let mut s = Scheduler::new(cfg(16, 4, 64)).unwrap();
    s.add_request("a", vec![1, 2, 3], eos_stop(10, 9), 0)
        .unwrap();
    s.add_request("b", vec![4, 5], stop(10), 0).unwrap();
    s.schedule().unwrap().unwrap();
    s.schedule_ahead().unwrap().unwrap();
    let ca = chunks_of(&s, "a");
    let used = s.stats().num_used_blocks;
    // a stops (EOS) in N while it has a row in N+1.
    let out = s.update(&[9, 7]).unwrap().clone();
    assert_eq!(out.len(), 2);
    assert_eq!(out.finish_reasons[0], Some(FinishReason::Stop));
    assert_eq!(out.token_ids, vec![9, 7]);
    s.check_invariants().unwrap();
    // Its chunks are held for N+1 (which writes position 3 of a).
    assert_eq!(s.stats().num_used_blocks, used);
    assert!(ca.iter().all(|&c| s.pool().refcount(c) == 1));
    assert_eq!(s.deferred_chunks(), ca);
    let out = s.update(&[1, 2]).unwrap().clone();
    assert_eq!(out.len(), 1, "a's row in N+1 is dropped");
    assert_eq!(out.token_ids, vec![2]);
    assert_eq!(s.request(out.reqs[0]).unwrap().id, "b");
    assert!(ca.iter().all(|&c| s.pool().refcount(c) == 0));
    assert!(s.deferred_chunks().is_empty());
    s.check_invariants().unwrap();
    assert_eq!(s.stats().finished, 1);
    run(&mut s, 1);
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn ahead_cancel_with_two_outstanding_defers_free_and_reports_once() {
    let mut s = Scheduler::new(cfg(16, 4, 64)).unwrap();
    s.add_request("a", vec![1, 2, 3], stop(10), 0).unwrap();
    s.add_request("b", vec![4, 5], stop(10), 0).unwrap();
    s.schedule().unwrap().unwrap();
    s.schedule_ahead().unwrap().unwrap();
    let cb = chunks_of(&s, "b");
    assert!(s.cancel("b"));
    assert!(!s.cancel("b"));
    s.check_invariants().unwrap();
    assert!(
        cb.iter().all(|&c| s.pool().refcount(c) == 1),
        "held for N and N+1"
    );
    let out = s.update(&[7, 8]).unwrap().clone();
    // a's token, then b's cancellation (its token from N is dropped).
    assert_eq!(out.len(), 2);
    assert_eq!(out.token_ids, vec![7, -1]);
    assert_eq!(out.finish_reasons[1], Some(FinishReason::Cancelled));
    assert!(
        cb.iter().all(|&c| s.pool().refcount(c) == 1),
        "N+1 still uses them"
    );
    s.check_invariants().unwrap();
    let out = s.update(&[9, 10]).unwrap().clone();
    assert_eq!(out.len(), 1);
    assert_eq!(out.token_ids, vec![9]);
    assert!(cb.iter().all(|&c| s.pool().refcount(c) == 0));
    s.check_invariants().unwrap();
    assert_eq!(s.stats().finished, 1);
    // Cancel with one outstanding (a sync plan): deferred to that plan's update.
    s.schedule().unwrap().unwrap();
    let ca = chunks_of(&s, "a");
    assert!(s.cancel("a"));
    assert!(ca.iter().all(|&c| s.pool().refcount(c) == 1));
    s.check_invariants().unwrap();
    let out = s.update(&[1]).unwrap().clone();
    assert_eq!(out.token_ids, vec![-1]);
    assert_eq!(s.stats().num_used_blocks, 0);
    s.check_invariants().unwrap();
}

#[test]
fn ahead_leaves_out_requests_whose_finish_is_certain() {
    let mut s = Scheduler::new(cfg(16, 4, 64)).unwrap();
    s.add_request("one", vec![1, 2], stop(1), 0).unwrap();
    s.schedule().unwrap().unwrap();
    // Its only token is sampled by N: nothing to plan.
    assert!(s.schedule_ahead().unwrap().is_none());
    assert_eq!(s.num_outstanding(), 1);
    assert_eq!(s.stats().stalled_requests, 0);
    s.add_request("two", vec![3, 4], stop(2), 0).unwrap();
    let p = s.schedule_ahead().unwrap().unwrap().clone();
    assert_eq!(p.num_rows(), 1, "only the new request");
    assert_eq!(s.request(p.rows[0].req).unwrap().id, "two");
    assert_eq!(p.prev_token_index, vec![-1, -1]);
    let out = s.update(&[5]).unwrap().clone();
    assert_eq!(out.finish_reasons, vec![Some(FinishReason::Length)]);
    // "two" got 1 token from N+1; its second one finishes it: nothing to plan ahead.
    s.update(&[6]).unwrap();
    s.schedule().unwrap().unwrap();
    assert!(s.schedule_ahead().unwrap().is_none());
    let out = s.update(&[7]).unwrap().clone();
    assert_eq!(out.finish_reasons, vec![Some(FinishReason::Length)]);
    assert!(!s.has_unfinished());
    s.check_invariants().unwrap();
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn ahead_continues_a_chunked_prefill() {
    // max_batch_tokens 4: a 10-token prompt runs 4 + 4 + 2.
    let mut s = Scheduler::new(cfg(16, 4, 4)).unwrap();
    let prompt: Vec<u32> = (10..20).collect();
    s.add_request("a", prompt.clone(), stop(3), 0).unwrap();
    let n = s.schedule().unwrap().unwrap().clone();
    assert_eq!((n.num_tokens(), n.num_sampled()), (4, 0));
    let a = s.schedule_ahead().unwrap().unwrap().clone();
    assert_eq!(a.positions, vec![4, 5, 6, 7]);
    assert_eq!(a.input_ids, vec![14, 15, 16, 17]);
    assert_eq!(a.prev_token_index, vec![-1; 4]);
    assert_eq!(a.num_sampled(), 0);
    assert_eq!(s.update(&[]).unwrap().len(), 0);
    let b = s.schedule_ahead().unwrap().unwrap().clone();
    assert_eq!(b.positions, vec![8, 9]);
    assert_eq!(b.num_sampled(), 1, "the prompt's last token is sampled");
    s.update(&[]).unwrap();
    let c = s.schedule_ahead().unwrap().unwrap().clone();
    assert_eq!(
        (c.positions.clone(), c.input_ids.clone()),
        (vec![10], vec![0])
    );
    assert_eq!(c.prev_token_index, vec![0]);
    s.update(&[1]).unwrap();
    s.check_invariants().unwrap();
    let d = s.schedule_ahead().unwrap().unwrap().clone();
    assert_eq!(
        (d.positions.clone(), d.prev_token_index.clone()),
        (vec![11], vec![0])
    );
    s.update(&[2]).unwrap();
    // D samples the third token, which finishes it.
    assert!(s.schedule_ahead().unwrap().is_none());
    let out = s.update(&[3]).unwrap().clone();
    assert_eq!(out.finish_reasons, vec![Some(FinishReason::Length)]);
    let r = s.request(out.reqs[0]).unwrap();
    assert_eq!(&r.tokens[10..], &[1, 2, 3]);
}

#[test]
fn ahead_never_preempts_and_returns_none_when_nothing_fits() {
    // Two blocks of 2: a and b hold one each; both need a second one for position 2.
    let mut c = cfg(2, 2, 64);
    c.cpu_offload_blocks = 4;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("a", vec![1, 2], stop(3), 0).unwrap();
    s.add_request("b", vec![3, 4], stop(3), 0).unwrap();
    let n = s.schedule().unwrap().unwrap().clone();
    assert_eq!(n.num_rows(), 2);
    assert!(s.schedule_ahead().unwrap().is_none());
    let st = s.stats();
    assert_eq!((st.stalled_requests, st.stalled_blocks), (2, 2));
    assert_eq!(st.num_preemptions, 0);
    assert_eq!(s.num_outstanding(), 1);
    s.check_invariants().unwrap();
    s.update(&[5, 6]).unwrap();
    // The sync path preempts as usual.
    let p = s.schedule().unwrap().unwrap().clone();
    assert_eq!(p.num_rows(), 1);
    assert_eq!(s.stats().num_preemptions, 1);
    assert_eq!(p.swap_out.len(), 2);
    s.update(&[7]).unwrap();
    run(&mut s, 1);
    assert_eq!(s.stats().num_used_blocks, 0);
    s.check_invariants().unwrap();
}

#[test]
fn ahead_pins_the_free_swap_out_sources_of_the_outstanding_plan() {
    // Three blocks of 2: a holds 1, b holds 2. a's position 2 needs a block: b is swapped
    // out; a takes one of its chunks, the other stays free while the copy is pending.
    let mut c = cfg(3, 2, 64);
    c.cpu_offload_blocks = 4;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("a", vec![1, 2], stop(3), 0).unwrap();
    s.add_request("b", vec![3, 4, 5], stop(2), 0).unwrap();
    s.schedule().unwrap().unwrap();
    s.update(&[5, 6]).unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    assert_eq!((p.num_rows(), p.swap_out.len()), (1, 4));
    let free_src: Vec<u32> = p
        .swap_out
        .chunks(2)
        .map(|pr| pr[0] as u32)
        .filter(|&c| s.pool().refcount(c) == 0)
        .collect();
    assert_eq!(free_src.len(), 1);
    let src = free_src[0];
    s.check_invariants().unwrap();
    let a = s.schedule_ahead().unwrap().unwrap().clone();
    assert_eq!(a.num_rows(), 1, "b is swapped: no swap-in ahead");
    assert!(a.swap_in.is_empty() && a.swap_out.is_empty());
    assert_eq!(s.pool().refcount(src), 1, "pinned until the plan's update");
    assert_eq!(s.deferred_chunks(), vec![src]);
    s.check_invariants().unwrap();
    s.update(&[7]).unwrap();
    assert_eq!(s.pool().refcount(src), 0);
    s.check_invariants().unwrap();
    s.update(&[8]).unwrap();
    run(&mut s, 1);
    assert_eq!(s.stats().num_used_blocks, 0);
    assert_eq!(s.stats().num_soft_resets, 0);
}

#[test]
fn ahead_admits_new_requests_but_not_past_a_swapped_one() {
    let mut s = Scheduler::new(cfg(16, 4, 64)).unwrap();
    s.add_request("a", vec![1, 2, 3], stop(8), 0).unwrap();
    s.schedule().unwrap().unwrap();
    s.add_request("b", vec![4, 5, 6, 7, 8], stop(8), 0).unwrap();
    let p = s.schedule_ahead().unwrap().unwrap().clone();
    assert_eq!(p.num_rows(), 2);
    assert_eq!(p.input_ids, vec![0, 4, 5, 6, 7, 8]);
    assert_eq!(p.prev_token_index, vec![0, -1, -1, -1, -1, -1]);
    assert_eq!(p.positions, vec![3, 0, 1, 2, 3, 4]);
    assert_eq!(p.logits_indices, vec![0, 5]);
    s.check_invariants().unwrap();
    s.update(&[1]).unwrap();
    let out = s.update(&[2, 3]).unwrap().clone();
    assert_eq!(out.token_ids, vec![2, 3]);
    s.check_invariants().unwrap();
}

#[test]
fn ahead_prefix_hits_only_registered_blocks() {
    // Page 2. "a" computes [1,2,3,4] in N; "b" shares [1,2,3,4,5]. Ahead of N, a's blocks
    // are not registered yet: b computes everything. After N's update they are hits.
    let mut s = Scheduler::new(cfg(32, 2, 64)).unwrap();
    s.add_request("a", vec![1, 2, 3, 4, 9], stop(4), 0).unwrap();
    s.schedule().unwrap().unwrap();
    s.add_request("b", vec![1, 2, 3, 4, 5], stop(4), 0).unwrap();
    let p = s.schedule_ahead().unwrap().unwrap().clone();
    assert_eq!(p.num_rows(), 2);
    assert_eq!(p.positions[1], 0, "no hit before a's blocks are registered");
    assert_eq!(s.stats().prefix_hit_tokens, 0);
    s.update(&[1]).unwrap();
    s.add_request("c", vec![1, 2, 3, 4, 6], stop(4), 0).unwrap();
    let p2 = s.schedule_ahead().unwrap().unwrap().clone();
    let rc = p2
        .rows
        .iter()
        .position(|r| s.request(r.req).unwrap().id == "c")
        .unwrap();
    assert_eq!(p2.rows[rc].start, 4, "hits a's two registered blocks");
    assert_eq!(s.stats().prefix_hit_tokens, 4);
    s.check_invariants().unwrap();
    s.update(&[1, 1]).unwrap();
    s.update(&[1, 1, 1]).unwrap();
    run(&mut s, 1);
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn steady_decode_ahead_advances_in_place_and_falls_back() {
    // Page 4, three decoding requests: pipelined steps cross block boundaries.
    let mut s = Scheduler::new(cfg(32, 4, 64)).unwrap();
    for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
        let mut st = eos_stop(40, 9);
        st.max_new_tokens = 40;
        s.add_request(id, vec![10 + i as u32; 3 + i], st, 0)
            .unwrap();
    }
    s.schedule().unwrap().unwrap();
    s.update(&[1, 1, 1]).unwrap();
    // A steady decode plan outstanding: schedule_ahead advances it in place.
    s.schedule().unwrap().unwrap();
    let mut next_tok = 2;
    let mut prev_pos: Vec<i32> = s.plan().positions.clone();
    for step in 0..10 {
        let p = s.schedule_ahead().unwrap().unwrap().clone();
        assert!(s.plan_repeats_rows(), "step {step}: steady ahead path");
        assert_eq!(p.prev_token_index, vec![0, 1, 2]);
        assert_eq!(p.input_ids, vec![0, 0, 0]);
        assert_eq!(
            p.positions,
            prev_pos.iter().map(|x| x + 1).collect::<Vec<_>>()
        );
        prev_pos = p.positions.clone();
        s.check_invariants().unwrap();
        let out = s.update(&[next_tok; 3]).unwrap().clone();
        assert_eq!(out.token_ids, vec![next_tok; 3]);
        next_tok += 1;
        if next_tok == 9 {
            next_tok = 10; // not EOS yet
        }
    }
    // b stops (EOS) in the oldest plan: its row in the newer one is dead, the next ahead
    // plan is built by the general path without b.
    s.schedule_ahead().unwrap().unwrap();
    let out = s.update(&[5, 9, 5]).unwrap().clone();
    assert_eq!(out.finish_reasons[1], Some(FinishReason::Stop));
    s.check_invariants().unwrap();
    let p = s.schedule_ahead().unwrap().unwrap().clone();
    assert!(!s.plan_repeats_rows());
    assert_eq!(p.num_rows(), 2);
    assert_eq!(
        p.prev_token_index,
        vec![0, 2],
        "a and c's tokens of the plan with b"
    );
    let out = s.update(&[6, 6, 6]).unwrap().clone();
    assert_eq!(out.len(), 2, "b's row dropped");
    s.update(&[7, 7]).unwrap();
    // Back to schedule(): known tokens, no placeholders.
    let p = s.schedule().unwrap().unwrap().clone();
    assert!(!p.ahead && p.prev_token_index.is_empty());
    assert_eq!(p.input_ids, vec![7, 7]);
    s.update(&[8, 8]).unwrap();
    // The in-place sync advance from a plan that followed an ahead plan.
    let p = s.schedule().unwrap().unwrap().clone();
    assert!(s.plan_repeats_rows());
    assert_eq!(p.input_ids, vec![8, 8]);
    s.check_invariants().unwrap();
    s.update(&[1, 1]).unwrap();
    run(&mut s, 1);
    assert_eq!(s.stats().num_used_blocks, 0);
}

/// (request id, start, q) of each row of a plan.
fn rows_of(s: &Scheduler, p: &crate::StepPlan) -> Vec<(String, u32, u32)> {
    p.rows
        .iter()
        .map(|r| (s.request(r.req).unwrap().id.clone(), r.start, r.q))
        .collect()
}

#[test]
fn a_block_filled_in_the_step_is_shared_a_step_later_not_computed_twice() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let shared: Vec<u32> = (0..12).collect(); // 3 full blocks
    let mut a = shared.clone();
    a.extend([100, 101]);
    let mut b = shared.clone();
    b.extend([200, 201, 202]);
    s.add_request("a", a, stop(2), 0).unwrap();
    s.add_request("b", b, stop(2), 0).unwrap();
    s.add_request("c", (50..60).collect(), stop(2), 0).unwrap(); // shares nothing
    let p = s.schedule().unwrap().unwrap().clone();
    // b is put off (its first block is one a fills in this step); c, behind it, is not
    assert_eq!(
        rows_of(&s, &p),
        vec![("a".into(), 0, 14), ("c".into(), 0, 10)]
    );
    assert_eq!(s.stats().deferred_admissions, 1);
    assert_eq!(s.stats().waiting, 1);
    s.check_invariants().unwrap();
    s.update(&vec![1; p.num_sampled()]).unwrap();
    // next step: b takes a's three blocks as hits and computes its own tail only
    let p = s.schedule().unwrap().unwrap().clone();
    let rows = rows_of(&s, &p);
    assert!(rows.contains(&("b".into(), 12, 3)), "{rows:?}");
    assert_eq!(s.stats().prefix_hit_tokens, 12);
    let (ia, ib) = (idx(&s, "a"), idx(&s, "b"));
    assert_eq!(
        s.request(ia).unwrap().full[..3],
        s.request(ib).unwrap().full[..3]
    );
    s.check_invariants().unwrap();
    s.update(&vec![1; p.num_sampled()]).unwrap();
    run(&mut s, 1);
    assert_eq!(s.stats().deferred_admissions, 1);
}

#[test]
fn a_request_is_put_off_again_while_another_prefill_fills_its_next_block() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let p8: Vec<u32> = (0..8).collect();
    let q4 = [20, 21, 22, 23];
    let mut a = p8.clone();
    a.extend([100, 101]);
    let mut b = p8.clone();
    b.extend(q4);
    b.extend([200, 201]);
    s.add_request("a", a, stop(3), 0).unwrap();
    s.add_request("b", b, stop(3), 0).unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    assert_eq!(rows_of(&s, &p), vec![("a".into(), 0, 10)]);
    assert_eq!(s.stats().deferred_admissions, 1);
    s.update(&vec![1; p.num_sampled()]).unwrap();
    // d, ahead of b by priority, fills the block after the shared 8 tokens that b needs
    // next: b is put off once more, and then takes 12 tokens as hits
    let mut d = p8.clone();
    d.extend(q4);
    d.extend([300, 301]);
    s.add_request("d", d, stop(3), -1).unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    let rows = rows_of(&s, &p);
    assert!(rows.contains(&("d".into(), 8, 6)), "{rows:?}");
    assert!(!rows.iter().any(|r| r.0 == "b"), "{rows:?}");
    assert_eq!(s.stats().deferred_admissions, 2);
    s.check_invariants().unwrap();
    s.update(&vec![1; p.num_sampled()]).unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    let rows = rows_of(&s, &p);
    assert!(rows.contains(&("b".into(), 12, 2)), "{rows:?}");
    assert_eq!(s.stats().deferred_admissions, 2);
    s.check_invariants().unwrap();
    s.update(&vec![1; p.num_sampled()]).unwrap();
    run(&mut s, 1);
}

#[test]
fn nothing_is_put_off_without_prefix_caching_or_when_switched_off() {
    for (sharing, defer) in [(false, true), (true, false)] {
        let mut c = cfg(64, 4, 64);
        c.allow_block_sharing = sharing;
        c.defer_shared_prefixes = defer;
        let mut s = Scheduler::new(c).unwrap();
        let shared: Vec<u32> = (0..12).collect();
        s.add_request("a", shared.clone(), stop(2), 0).unwrap();
        s.add_request("b", shared, stop(2), 0).unwrap();
        let p = s.schedule().unwrap().unwrap().clone();
        assert_eq!(p.rows.len(), 2);
        assert_eq!(s.stats().deferred_admissions, 0);
    }
}

fn priority_cfg(num_blocks: usize) -> SchedulerConfig {
    let mut c = cfg(num_blocks, 4, 64);
    c.priority_preemption = true;
    c
}

#[test]
fn priority_preempts_only_lower_priority_running_requests() {
    // 10 chunks of 4 tokens; "lo" (priority 5) fills all of them
    let mut s = Scheduler::new(priority_cfg(10)).unwrap();
    s.add_request("lo", (0..36).collect(), stop(4), 5).unwrap();
    step(&mut s, 1);
    step(&mut s, 1);
    assert_eq!(s.stats().num_free_blocks, 0);
    s.add_request("same", (100..108).collect(), stop(2), 5)
        .unwrap();
    step(&mut s, 1);
    // an equal priority never preempts: "same" waits
    assert_eq!(
        s.request(idx(&s, "same")).unwrap().state,
        RequestState::Waiting
    );
    assert_eq!(s.stats().priority_preemptions, 0);
    s.add_request("hi", (200..208).collect(), stop(2), 0)
        .unwrap();
    let p = s.schedule().unwrap().unwrap().clone();
    assert_eq!(s.stats().priority_preemptions, 1);
    assert_eq!(
        s.request(idx(&s, "lo")).unwrap().state,
        RequestState::Waiting
    );
    assert_eq!(p.rows[0].req, idx(&s, "hi"));
    s.check_invariants().unwrap();
    s.update(&vec![1; p.num_sampled()]).unwrap();
    run(&mut s, 1);
    assert_eq!(s.stats().finished, 3);
}

#[test]
fn priority_preemption_is_off_by_default() {
    let mut s = Scheduler::new(cfg(10, 4, 64)).unwrap();
    s.add_request("lo", (0..36).collect(), stop(4), 5).unwrap();
    step(&mut s, 1);
    step(&mut s, 1);
    s.add_request("hi", (200..208).collect(), stop(2), 0)
        .unwrap();
    step(&mut s, 1);
    assert_eq!(
        s.request(idx(&s, "lo")).unwrap().state,
        RequestState::Decoding
    );
    assert_eq!(s.stats().num_preemptions, 0);
}

#[test]
fn low_priority_requests_finish_under_a_stream_of_high_priority_ones() {
    // A new high-priority request that needs the whole pool arrives whenever none waits:
    // "lo" is preempted for priority at most MAX_PRIORITY_PREEMPTIONS times, ages while it
    // waits, and finishes.
    use super::preemption::{MAX_PRIORITY_PREEMPTIONS, PRIORITY_AGING_STEPS};
    let mut s = Scheduler::new(priority_cfg(10)).unwrap();
    s.add_request("lo", (0..36).collect(), stop(4), 2).unwrap();
    let mut k = 0u32;
    let mut lo_done = 0;
    for n in 0..(20 * PRIORITY_AGING_STEPS) {
        if s.stats().waiting == 0 {
            let prompt = (1000 + 40 * k..1036 + 40 * k).collect();
            s.add_request(&format!("hi{k}"), prompt, stop(4), 0)
                .unwrap();
            k += 1;
        }
        if step(&mut s, 1)
            .iter()
            .any(|(id, _, fin)| id == "lo" && fin.is_some())
        {
            lo_done = n;
            break;
        }
    }
    assert!(lo_done > 0, "the low-priority request finished");
    let st = s.stats();
    assert!(st.priority_preemptions >= 1);
    assert!(st.priority_preemptions <= MAX_PRIORITY_PREEMPTIONS as u64);
    assert!(k >= 2, "high-priority requests kept arriving ({k})");
}

#[test]
fn waiting_requests_age_into_higher_priority() {
    use super::preemption::PRIORITY_AGING_STEPS;
    // one row per step: "lo" (priority 1) waits behind "busy" (priority 0) and ages until it
    // outranks it, then takes its place
    let mut c = priority_cfg(64);
    c.max_requests_per_batch = 1;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("busy", (0..4).collect(), stop(200), 0)
        .unwrap();
    step(&mut s, 1);
    s.add_request("lo", (100..108).collect(), stop(2), 1)
        .unwrap();
    let mut n = 0;
    while s.request(idx(&s, "lo")).unwrap().state == RequestState::Waiting {
        step(&mut s, 1);
        n += 1;
        assert!(n < 4 * PRIORITY_AGING_STEPS, "lo starved");
    }
    assert!(n >= PRIORITY_AGING_STEPS, "admitted after {n} steps");
    assert!(s.request(idx(&s, "lo")).unwrap().key.0 < 0);
    assert_eq!(s.stats().priority_preemptions, 1);
    run(&mut s, 1);
}
