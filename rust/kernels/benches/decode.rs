//! Micro-benchmark of `paged_decode_attention` at the shapes of ferrobatch's decode steps,
//! one thread (run it pinned: `taskset -c 1`).
//!
//! * `smollm2`: 64 rows, 9 query heads over 3 KV heads, head_dim 64, page 16, 50..100 keys
//!   per row (mean 75);
//! * `tiny_llama`: 64 rows, 4 over 2 heads, head_dim 64, page 32, 100..240 keys (mean 170);
//! * `dim128`: 64 rows, 16 over 4 heads, head_dim 128, page 16, 100..300 keys;
//! * `g1`: 64 rows, 4 over 4 heads (no grouping), head_dim 64, page 32, 50..150 keys;
//! * `g8`: 64 rows, 16 over 2 heads, head_dim 64, page 16, 50..150 keys.
//!
//! Each in bf16 and fp32 (query, cache and output of one type), over the first 8 rows of
//! one layer (`l2`: their keys and values, 0.5 MB for smollm2 bf16, stay in L2), over one
//! layer's cache (`hot`: 3.7 MB for smollm2 bf16, more than this machine's 2 MB L2) and over
//! 30 layers' caches used in turn (`cold`, as a real step is). A row's chunks are
//! a random permutation of the cache's chunks.
//!
//! Every call is timed alone (a plain harness, not criterion: on a shared machine the
//! minimum and the median of single calls are steadier than a mean over batches); printed
//! in ns per (query head x key) pair and per call.
//!
//! Run: `taskset -c 1 cargo bench -p ferrobatch-kernels --bench decode [-- FILTER]`

use std::hint::black_box;

use std::time::{Duration, Instant};

use ferrobatch_kernels::{paged_decode_attention, DecodeArgs, Elems, ElemsMut, Window};
use half::bf16;

struct Shape {
    name: &'static str,
    rows: usize,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    page: usize,
    keys: (usize, usize),
}

const SHAPES: [Shape; 5] = [
    Shape {
        name: "smollm2",
        rows: 64,
        heads: 9,
        kv_heads: 3,
        dim: 64,
        page: 16,
        keys: (50, 100),
    },
    Shape {
        name: "tiny_llama",
        rows: 64,
        heads: 4,
        kv_heads: 2,
        dim: 64,
        page: 32,
        keys: (100, 240),
    },
    Shape {
        name: "dim128",
        rows: 64,
        heads: 16,
        kv_heads: 4,
        dim: 128,
        page: 16,
        keys: (100, 300),
    },
    Shape {
        name: "g1",
        rows: 64,
        heads: 4,
        kv_heads: 4,
        dim: 64,
        page: 32,
        keys: (50, 150),
    },
    Shape {
        name: "g8",
        rows: 64,
        heads: 16,
        kv_heads: 2,
        dim: 64,
        page: 16,
        keys: (50, 150),
    },
];

/// A deterministic xorshift stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// One layer's inputs, fp32; the caches hold exactly the rows' chunks, shuffled.
struct Layer {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    table: Vec<i32>,
    seqlens: Vec<i32>,
    width: usize,
}

fn layer(s: &Shape, rng: &mut Rng) -> Layer {
    let width = s.keys.1.div_ceil(s.page);
    let seqlens: Vec<i32> = (0..s.rows)
        .map(|_| (s.keys.0 + rng.below(s.keys.1 - s.keys.0 + 1)) as i32)
        .collect();
    let chunks = s.rows * width;
    let mut perm: Vec<i32> = (0..chunks as i32).collect();
    for i in (1..chunks).rev() {
        perm.swap(i, rng.below(i + 1));
    }
    let cache = chunks * s.page * s.kv_heads * s.dim;
    let mut vals = |n: usize| (0..n).map(|_| rng.unit()).collect::<Vec<f32>>();
    Layer {
        q: vals(s.rows * s.heads * s.dim),
        k: vals(cache),
        v: vals(cache),
        table: perm,
        seqlens,
        width,
    }
}

fn to_bf16(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect()
}

/// The arguments of the first `rows` rows of layer `l` (`q` already cut to them).
fn args<'a>(s: &Shape, l: &'a Layer, rows: usize, [q, k, v]: [Elems<'a>; 3]) -> DecodeArgs<'a> {
    DecodeArgs {
        q,
        k_cache: k,
        v_cache: v,
        block_tables: &l.table[..rows * l.width],
        seqlens: &l.seqlens[..rows],
        heads: s.heads,
        kv_heads: s.kv_heads,
        dim: s.dim,
        page: s.page,
        width: l.width,
        window: Window::Full,
        scale: 1.0 / (s.dim as f32).sqrt(),
        softcap: None,
        threads: 1,
    }
}

/// Times `call` alone until `budget` is spent (after a short warm-up); returns the minimum
/// and the median of the calls, in ns.
fn time(budget: Duration, mut call: impl FnMut()) -> (f64, f64) {
    let warm = Instant::now();
    while warm.elapsed() < budget / 5 {
        call();
    }
    let mut ns = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || ns.len() < 20 {
        let t = Instant::now();
        call();
        ns.push(t.elapsed().as_nanos() as f64);
    }
    ns.sort_by(f64::total_cmp);
    (ns[0], ns[ns.len() / 2])
}

fn main() {
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let budget = Duration::from_millis(1500);
    println!(
        "{:<22} {:>9} {:>9} {:>10}",
        "case", "min ns/p", "med ns/p", "med us"
    );
    for s in &SHAPES {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let layers: Vec<Layer> = (0..30).map(|_| layer(s, &mut rng)).collect();
        let bf: Vec<[Vec<u16>; 3]> = layers
            .iter()
            .map(|l| [to_bf16(&l.q), to_bf16(&l.k), to_bf16(&l.v)])
            .collect();
        let pairs = |l: &Layer, rows: usize| {
            l.seqlens[..rows].iter().map(|&n| n as u64).sum::<u64>() * s.heads as u64
        };
        for (tag, count, rows) in [("l2", 1, 8), ("hot", 1, s.rows), ("cold", 30, s.rows)] {
            let per_call =
                layers[..count].iter().map(|l| pairs(l, rows)).sum::<u64>() as f64 / count as f64;
            let nq = rows * s.heads * s.dim;
            for dtype in ["bf16", "fp32"] {
                let name = format!("{}/{dtype}/{tag}", s.name);
                if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
                    continue;
                }
                let mut out_f = vec![0f32; nq];
                let mut out_b = vec![0u16; nq];
                let mut i = 0;
                let (min, med) = time(budget, || {
                    let (l, [q, k, v]) = (&layers[i % count], &bf[i % count]);
                    i += 1;
                    if dtype == "bf16" {
                        let a = args(
                            s,
                            l,
                            rows,
                            [Elems::Bf16(&q[..nq]), Elems::Bf16(k), Elems::Bf16(v)],
                        );
                        paged_decode_attention(black_box(&a), ElemsMut::Bf16(&mut out_b))
                    } else {
                        let a = args(
                            s,
                            l,
                            rows,
                            [Elems::F32(&l.q[..nq]), Elems::F32(&l.k), Elems::F32(&l.v)],
                        );
                        paged_decode_attention(black_box(&a), ElemsMut::F32(&mut out_f))
                    }
                    .unwrap();
                });
                println!(
                    "{name:<22} {:>9.2} {:>9.2} {:>10.1}",
                    min / per_call,
                    med / per_call,
                    med / 1e3
                );
            }
        }
    }
}
