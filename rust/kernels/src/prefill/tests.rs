use super::*;
use crate::decode::{paged_decode_attention, Elems};
use half::{bf16, f16};
use proptest::prelude::*;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn below(seed: &mut u64, n: usize) -> usize {
    (((lcg(seed) + 1.0) * 0.5 * n as f32) as usize).min(n - 1)
}

/// A random call: rows of 1 ..= `max_q` tokens at random depths, a random chunk table.
struct Case {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    table: Vec<i32>,
    cu: Vec<i32>,
    seqlens: Vec<i32>,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    page: usize,
    width: usize,
    window: Window,
}

#[allow(clippy::too_many_arguments)]
fn case(
    seed: u64,
    rows: usize,
    kv_heads: usize,
    g: usize,
    dim: usize,
    page: usize,
    window: Window,
    max_q: usize,
    max_ctx: usize,
) -> Case {
    let mut s = seed;
    let heads = kv_heads * g;
    let width = match window {
        Window::Full => (max_q + max_ctx).div_ceil(page),
        Window::Sliding { window } => (max_q + window - 1).div_ceil(page) + 1,
    };
    let chunks = (width + 3).max(12);
    let (mut table, mut cu, mut seqlens) = (Vec::new(), vec![0i32], Vec::new());
    for _ in 0..rows {
        let q = 1 + below(&mut s, max_q);
        let ctx = below(&mut s, max_ctx + 1);
        seqlens.push((q + ctx) as i32);
        cu.push(cu.last().unwrap() + q as i32);
        for _ in 0..width {
            table.push(1 + below(&mut s, chunks - 1) as i32);
        }
    }
    let tokens = *cu.last().unwrap() as usize;
    let n = |len: usize, s: &mut u64| (0..len).map(|_| lcg(s) * 3.0).collect::<Vec<_>>();
    Case {
        q: n(tokens * heads * dim, &mut s),
        k: n(chunks * page * kv_heads * dim, &mut s),
        v: n(chunks * page * kv_heads * dim, &mut s),
        table,
        cu,
        seqlens,
        heads,
        kv_heads,
        dim,
        page,
        width,
        window,
    }
}

/// f64 reference of the same semantics, from widened values.
fn reference(c: &Case, q: &[f32], k: &[f32], v: &[f32], softcap: Option<f32>) -> Vec<f64> {
    let (g, d) = (c.heads / c.kv_heads, c.dim);
    let mut out = vec![0f64; q.len()];
    for r in 0..c.seqlens.len() {
        let (t0, t1) = (c.cu[r] as usize, c.cu[r + 1] as usize);
        let s = c.seqlens[r] as usize - (t1 - t0);
        for tok in t0..t1 {
            let p = s + tok - t0;
            let lo = match c.window {
                Window::Full => 0,
                Window::Sliding { window } => (p + 1).saturating_sub(window),
            };
            let slots: Vec<usize> = (lo..=p)
                .map(|x| {
                    let col = match c.window {
                        Window::Full => x / c.page,
                        Window::Sliding { .. } => (x / c.page) % c.width,
                    };
                    c.table[r * c.width + col] as usize * c.page + x % c.page
                })
                .collect();
            for h in 0..c.heads {
                let kvh = h / g;
                let qv = &q[(tok * c.heads + h) * d..][..d];
                let sc: Vec<f64> = slots
                    .iter()
                    .map(|&sl| {
                        let kr = &k[(sl * c.kv_heads + kvh) * d..][..d];
                        let mut x: f64 =
                            qv.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        x *= 0.125;
                        if let Some(cap) = softcap {
                            x = (x / cap as f64).tanh() * cap as f64;
                        }
                        x
                    })
                    .collect();
                let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for (wi, &sl) in w.iter().zip(&slots) {
                    let vr = &v[(sl * c.kv_heads + kvh) * d..][..d];
                    for j in 0..d {
                        out[(tok * c.heads + h) * d + j] += wi / z * vr[j] as f64;
                    }
                }
            }
        }
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ty {
    F32,
    Bf16,
    F16,
    I8,
}

/// Storage of `x` in type `ty`: the bits, int8 data and scales, and the values the kernel
/// sees.
struct Stored {
    f: Vec<f32>,
    bits: Vec<u16>,
    i8s: Vec<i8>,
    scales: Vec<f32>,
    seen: Vec<f32>,
    dim: usize,
    ty: Ty,
}

fn stored(ty: Ty, x: &[f32], dim: usize) -> Stored {
    let mut st = Stored {
        f: x.to_vec(),
        bits: Vec::new(),
        i8s: Vec::new(),
        scales: Vec::new(),
        seen: x.to_vec(),
        dim,
        ty,
    };
    match ty {
        Ty::F32 => {}
        Ty::Bf16 => {
            st.bits = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            st.seen = st
                .bits
                .iter()
                .map(|&b| bf16::from_bits(b).to_f32())
                .collect();
        }
        Ty::F16 => {
            st.bits = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
            st.seen = st
                .bits
                .iter()
                .map(|&b| f16::from_bits(b).to_f32())
                .collect();
        }
        Ty::I8 => {
            st.seen.clear();
            for v in x.chunks_exact(dim) {
                let amax = v.iter().fold(0f32, |m, &e| m.max(e.abs()));
                let s = if amax > 0.0 { amax / 127.0 } else { 1.0 };
                st.scales.push(s);
                for &e in v {
                    let q = (e / s).round().clamp(-127.0, 127.0) as i8;
                    st.i8s.push(q);
                    st.seen.push(f32::from(q) * s);
                }
            }
        }
    }
    st
}

impl Stored {
    fn elems(&self) -> Elems<'_> {
        match self.ty {
            Ty::F32 => Elems::F32(&self.f),
            Ty::Bf16 => Elems::Bf16(&self.bits),
            Ty::F16 => Elems::F16(&self.bits),
            Ty::I8 => Elems::I8 {
                data: &self.i8s,
                scales: &self.scales,
                group: self.dim,
            },
        }
    }
}

fn args_of<'a>(
    c: &'a Case,
    q: Elems<'a>,
    k: Elems<'a>,
    v: Elems<'a>,
    softcap: Option<f32>,
    threads: usize,
) -> PrefillArgs<'a> {
    PrefillArgs {
        paged: DecodeArgs {
            q,
            k_cache: k,
            v_cache: v,
            block_tables: &c.table,
            seqlens: &c.seqlens,
            heads: c.heads,
            kv_heads: c.kv_heads,
            dim: c.dim,
            page: c.page,
            width: c.width,
            window: c.window,
            scale: 0.125,
            softcap,
            threads,
        },
        cu_seqlens_q: &c.cu,
    }
}

/// The kernel's fp32 output with a cache of type `cache` and queries of type `q`, and the
/// f64 reference over the values the kernel sees.
fn run(c: &Case, softcap: Option<f32>, threads: usize, cache: Ty, q: Ty) -> (Vec<f32>, Vec<f64>) {
    let (ks, vs, qs) = (
        stored(cache, &c.k, c.dim),
        stored(cache, &c.v, c.dim),
        stored(q, &c.q, c.dim),
    );
    let args = args_of(c, qs.elems(), ks.elems(), vs.elems(), softcap, threads);
    let mut out = vec![0f32; c.q.len()];
    paged_prefill_attention(&args, ElemsMut::F32(&mut out)).unwrap();
    (out, reference(c, &qs.seen, &ks.seen, &vs.seen, softcap))
}

fn assert_close(got: &[f32], want: &[f64], tol: f64) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "elem {i}: {g} vs {w}"
        );
    }
}

#[test]
fn full_attention_matches_the_reference() {
    for (rows, kvh, g, dim, page, max_q, max_ctx) in [
        (3, 3, 3, 64, 16, 70, 100),
        (1, 1, 1, 16, 4, 5, 0),
        (4, 2, 4, 20, 7, 40, 50),
        (2, 1, 8, 128, 32, 100, 300),
    ] {
        let c = case(
            rows as u64,
            rows,
            kvh,
            g,
            dim,
            page,
            Window::Full,
            max_q,
            max_ctx,
        );
        for threads in [1, 2, 3] {
            for cache in [Ty::F32, Ty::Bf16] {
                let (got, want) = run(&c, None, threads, cache, Ty::F32);
                assert_close(&got, &want, 2e-5);
            }
        }
    }
}

#[test]
fn sliding_window_and_softcap_match_the_reference() {
    for window in [1, 7, 16, 33, 100] {
        let c = case(
            window as u64 + 7,
            4,
            2,
            3,
            32,
            8,
            Window::Sliding { window },
            50,
            120,
        );
        let (got, want) = run(&c, None, 2, Ty::Bf16, Ty::F32);
        assert_close(&got, &want, 2e-5);
        let (got, want) = run(&c, Some(5.0), 1, Ty::F32, Ty::F32);
        assert_close(&got, &want, 2e-5);
    }
}

#[test]
fn every_storage_type_matches_the_reference() {
    let mut seed = 300;
    for dim in [64, 128, 40] {
        for g in [1, 3, 5] {
            seed += 1;
            let c = case(seed, 3, 2, g, dim, 16, Window::Full, 60, 90);
            for cache in [Ty::F32, Ty::Bf16, Ty::F16, Ty::I8] {
                for q in [Ty::F32, Ty::Bf16, Ty::F16] {
                    let cap = (cache == Ty::F16).then_some(4.0);
                    let (got, want) = run(&c, cap, 1 + seed as usize % 3, cache, q);
                    assert_close(&got, &want, 2e-5);
                }
            }
        }
    }
}

/// A prefill row gives what the decode kernel gives for each of its tokens alone.
#[test]
fn rows_agree_with_the_decode_kernel_token_by_token() {
    for window in [Window::Full, Window::Sliding { window: 20 }] {
        let c = case(5, 3, 2, 3, 64, 8, window, 40, 60);
        let (got, _) = run(&c, Some(3.0), 2, Ty::Bf16, Ty::F32);
        let kb: Vec<u16> = c.k.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let vb: Vec<u16> = c.v.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let (mut table, mut seqlens) = (Vec::new(), Vec::new());
        for r in 0..c.seqlens.len() {
            let q = (c.cu[r + 1] - c.cu[r]) as usize;
            for t in 0..q {
                table.extend_from_slice(&c.table[r * c.width..(r + 1) * c.width]);
                seqlens.push(c.seqlens[r] - (q - t - 1) as i32);
            }
        }
        let args = DecodeArgs {
            q: Elems::F32(&c.q),
            k_cache: Elems::Bf16(&kb),
            v_cache: Elems::Bf16(&vb),
            block_tables: &table,
            seqlens: &seqlens,
            heads: c.heads,
            kv_heads: c.kv_heads,
            dim: c.dim,
            page: c.page,
            width: c.width,
            window: c.window,
            scale: 0.125,
            softcap: Some(3.0),
            threads: 1,
        };
        let mut want = vec![0f32; c.q.len()];
        paged_decode_attention(&args, ElemsMut::F32(&mut want)).unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 2e-5 * (1.0 + b.abs()),
                "elem {i}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn half_outputs_are_the_rounded_fp32_output() {
    for dim in [64, 48] {
        let c = case(dim as u64, 3, 2, 3, dim, 16, Window::Full, 30, 40);
        let (f, _) = run(&c, None, 1, Ty::Bf16, Ty::Bf16);
        let (ks, vs, qs) = (
            stored(Ty::Bf16, &c.k, dim),
            stored(Ty::Bf16, &c.v, dim),
            stored(Ty::Bf16, &c.q, dim),
        );
        let args = args_of(&c, qs.elems(), ks.elems(), vs.elems(), None, 2);
        let mut out = vec![0u16; c.q.len()];
        paged_prefill_attention(&args, ElemsMut::F16(&mut out)).unwrap();
        for (o, x) in out.iter().zip(&f) {
            assert_eq!(*o, f16::from_f32(*x).to_bits());
        }
        paged_prefill_attention(&args, ElemsMut::Bf16(&mut out)).unwrap();
        for (o, x) in out.iter().zip(&f) {
            assert_eq!(*o, bf16::from_f32(*x).to_bits());
        }
    }
}

#[test]
fn bad_arguments_are_errors_not_reads() {
    let c = case(1, 3, 1, 2, 16, 4, Window::Full, 6, 8);
    let base = args_of(
        &c,
        Elems::F32(&c.q),
        Elems::F32(&c.k),
        Elems::F32(&c.v),
        None,
        1,
    );
    let mut out = vec![0f32; c.q.len()];
    let mut bad_table = c.table.clone();
    bad_table[0] = 1000;
    let mut too_many = c.cu.clone();
    too_many[1] = c.seqlens[0] + 1;
    let sliding = Window::Sliding {
        window: c.width * c.page,
    };
    let deep = [40i32; 3];
    let cases: Vec<(PrefillArgs, &str)> = vec![
        (
            PrefillArgs {
                paged: DecodeArgs {
                    block_tables: &bad_table,
                    ..base.paged
                },
                ..base
            },
            "outside",
        ),
        (
            PrefillArgs {
                cu_seqlens_q: &c.cu[1..],
                ..base
            },
            "cu_seqlens_q",
        ),
        (
            PrefillArgs {
                cu_seqlens_q: &too_many,
                ..base
            },
            "query tokens",
        ),
        (
            PrefillArgs {
                paged: DecodeArgs {
                    window: sliding,
                    seqlens: &deep,
                    ..base.paged
                },
                ..base
            },
            "ring",
        ),
        (
            PrefillArgs {
                paged: DecodeArgs {
                    q: Elems::F32(&c.q[1..]),
                    ..base.paged
                },
                ..base
            },
            "elements",
        ),
        (
            PrefillArgs {
                paged: DecodeArgs {
                    kv_heads: 3,
                    ..base.paged
                },
                ..base
            },
            "multiple",
        ),
    ];
    for (args, msg) in cases {
        let e = paged_prefill_attention(&args, ElemsMut::F32(&mut out)).unwrap_err();
        assert!(e.to_string().contains(msg), "{e} lacks {msg:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_layouts_match_the_reference(seed in 0u64..1000, rows in 1usize..5,
                                          kvh in 1usize..4, g in 1usize..9,
                                          dim in prop::sample::select(vec![8usize, 24, 64, 72, 128]),
                                          page in 1usize..20, window in 0usize..40,
                                          max_q in 1usize..80, max_ctx in 0usize..100,
                                          threads in 1usize..4, cache in 0usize..4,
                                          cap in any::<bool>()) {
        let w = if window == 0 { Window::Full } else { Window::Sliding { window } };
        let c = case(seed, rows, kvh, g, dim, page, w, max_q, max_ctx);
        let cache = [Ty::F32, Ty::Bf16, Ty::F16, Ty::I8][cache];
        let (got, want) = run(&c, cap.then_some(3.0), threads, cache, Ty::F32);
        assert_close(&got, &want, 3e-5);
    }
}
