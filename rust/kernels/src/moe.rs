//! A mixture-of-experts layer's experts on GGUF quantized weights, one call a layer: what
//! transformers' eager experts module computes (`Qwen3MoeExperts.forward`), with each
//! expert's products on [`quant::linear`]:
//!
//! ```text
//! out = 0
//! for each expert e some token picked, in ascending e:
//!     xs = the rows of x of the tokens that picked e
//!     a  = silu(gate) * up of xs @ [Wg_e | Wu_e].T        (quant::linear, fused::silu_mul)
//!     out[t] += (a @ Wd_e.T)[t] * weight[t, e]             (quant::linear, f32)
//! ```
//!
//! So a token's output adds its experts' terms in ascending expert order, each term a
//! product of its own row alone (a row's quantized product does not depend on the other
//! rows of the call): the result of a token is the same whatever else the batch holds.
//!
//! gpt-oss's experts (`GptOssExperts`) add a bias to each product and take [`Glu::Clamped`]
//! between them: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = min(gate,
//! limit)`.

use std::sync::Mutex;

use crate::error::{Expected, KernelError};
use crate::fused;
use crate::layer::{check_parts, quant_product, QuantPart};
use crate::linear::LinearArgs;
use crate::parallel::{row_ranges, run_pieces};
use crate::quant;
use crate::{Elems, ElemsMut};

/// One expert's packed matrices: `gate_up` [2 * inter, hidden] (the gate's rows, then the
/// up projection's), `down` [hidden, inter]; each one or more stacked parts of one type.
/// The biases, where the expert has them: `gate_up_bias` [2 * inter] (the gate's, then the
/// up projection's), `down_bias` [hidden].
#[derive(Clone, Copy, Debug)]
pub struct Expert<'a> {
    pub gate_up: &'a [QuantPart<'a>],
    pub down: &'a [QuantPart<'a>],
    pub gate_up_bias: Option<&'a [f32]>,
    pub down_bias: Option<&'a [f32]>,
}

/// The activation between an expert's two products, of the gate and up outputs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Glu {
    /// `silu(gate) * up` (Qwen2/3-MoE, Mixtral: [`fused::silu_mul`])
    #[default]
    Silu,
    /// gpt-oss's: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g =
    /// min(gate, limit)` (NaN kept), `sigmoid(v) = 1 / (1 + exp(-v))` in f32 with
    /// [`fused::silu_mul`]'s `exp`
    Clamped { limit: f32, alpha: f32 },
}

/// The routing of a call's tokens: `ids[t * top_k + j]` is token `t`'s `j`-th expert (an
/// index of the call's experts; the number of experts itself means none, as transformers'
/// modules allow), `weights[t * top_k + j]` its weight.
#[derive(Clone, Copy, Debug)]
pub struct Routes<'a> {
    pub ids: &'a [i64],
    pub weights: &'a [f32],
    pub top_k: usize,
}

/// The shapes of a call: `tokens` rows of `hidden` inputs, experts of width `inter`; and
/// the activation `glu` between each expert's products.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub tokens: usize,
    pub hidden: usize,
    pub inter: usize,
    pub glu: Glu,
}

/// The tokens that picked one expert, with their weights: `(expert, [(token, weight)])`.
type Picks = (usize, Vec<(usize, f32)>);

/// The experts each token picked, by expert, in ascending expert order and, within an
/// expert, ascending token order.
fn by_expert(routes: &Routes<'_>, experts: usize) -> Result<Vec<Picks>, KernelError> {
    let mut lists: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts];
    for (i, (&id, &w)) in routes.ids.iter().zip(routes.weights).enumerate() {
        let e = usize::try_from(id)
            .ok()
            .filter(|&e| e <= experts)
            .ok_or_else(|| KernelError::Invalid {
                field: "ids",
                message: format!("ids holds {id}, not an expert index 0 ..= {experts}"),
            })?;
        if e < experts {
            lists[e].push((i / routes.top_k, w));
        }
    }
    Ok(lists
        .into_iter()
        .enumerate()
        .filter(|(_, l)| !l.is_empty())
        .collect())
}

/// `out` [tokens, hidden] = the experts' outputs for the `tokens` rows of `x` [tokens,
/// hidden] routed by `routes` (see the module docs). `experts[e]` is None for an expert
/// the caller did not pass: a token routed to it is an error naming "ids". Products run on
/// `backend`. With `threads` > 1, a decode-sized call (every picked expert at most
/// `EXPERT_PARALLEL_ROWS` rows) runs whole experts on each thread; otherwise each product
/// splits over `threads` threads where it is large enough (as `quant_ops.linear` splits).
/// Either way the result is the same bits. Errors name the argument whose length or value
/// is wrong.
pub fn experts(
    x: &[f32],
    shape: Shape,
    routes: Routes<'_>,
    experts: &[Option<Expert<'_>>],
    out: &mut [f32],
    threads: usize,
    backend: quant::Backend,
) -> Result<(), KernelError> {
    let Shape {
        tokens,
        hidden,
        inter,
        glu,
    } = shape;
    let cells = tokens
        .checked_mul(hidden)
        .ok_or(KernelError::Overflow { field: "x" })?;
    let formula = Expected::NotFormula("tokens * hidden");
    KernelError::check_len("x", x.len(), cells, formula)?;
    KernelError::check_len("out", out.len(), cells, formula)?;
    let picks = tokens
        .checked_mul(routes.top_k)
        .ok_or(KernelError::Overflow { field: "ids" })?;
    let formula = Expected::NotFormula("tokens * top_k");
    KernelError::check_len("ids", routes.ids.len(), picks, formula)?;
    KernelError::check_len("weights", routes.weights.len(), picks, formula)?;
    if routes.top_k == 0 && tokens > 0 {
        return KernelError::invalid("ids", "ids has no expert a token (top_k 0)".into());
    }
    out.fill(0.0);
    let lists = by_expert(&routes, experts.len())?;
    // every picked expert's weights, checked before anything runs
    let mut picked = Vec::with_capacity(lists.len());
    for (e, _) in &lists {
        let e = *e;
        let Some(ex) = experts[e] else {
            return KernelError::invalid(
                "ids",
                format!("ids routes a token to expert {e}, whose weights were not passed"),
            );
        };
        check_parts(ex.gate_up, 2 * inter, hidden)
            .map_err(|m| KernelError::Layout(format!("expert {e}'s gate_up {m}")))?;
        check_parts(ex.down, hidden, inter)
            .map_err(|m| KernelError::Layout(format!("expert {e}'s down {m}")))?;
        for (name, bias, want) in [
            ("gate_up_bias", ex.gate_up_bias, 2 * inter),
            ("down_bias", ex.down_bias, hidden),
        ] {
            if let Some(b) = bias {
                if b.len() != want {
                    return Err(KernelError::Layout(format!(
                        "expert {e}'s {name} has {} values, not {want}",
                        b.len()
                    )));
                }
            }
        }
        picked.push(ex);
    }
    let call = Call {
        x,
        hidden,
        inter,
        glu,
        threads,
        backend,
    };
    let few_rows = lists.iter().all(|(_, l)| l.len() <= EXPERT_PARALLEL_ROWS);
    if threads > 1 && lists.len() > 1 && few_rows {
        // decode-sized calls: whole experts on each thread (one meeting a call, where
        // splitting each small product over the threads meets twice an expert); the
        // terms are added below in expert order, so the bits are those of the other way
        let ranges = row_ranges(lists.len(), threads.min(lists.len()));
        let mut ys: Vec<Vec<f32>> = vec![Vec::new(); lists.len()];
        let mut rest: &mut [Vec<f32>] = &mut ys;
        let mut pieces = Vec::with_capacity(ranges.len());
        for r in ranges {
            let (mine, more) = rest.split_at_mut(r.len());
            pieces.push((r, mine));
            rest = more;
        }
        let failed = Mutex::new(None);
        let one = Call { threads: 1, ..call };
        run_pieces(pieces, |range, mine| {
            let mut bufs = Bufs::default();
            for (slot, i) in mine.iter_mut().zip(range) {
                if let Err(e) = one.expert(picked[i], &lists[i].1, &mut bufs) {
                    *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    return;
                }
                *slot = std::mem::take(&mut bufs.y);
            }
        });
        if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        for ((_, list), y) in lists.iter().zip(&ys) {
            add_terms(out, list, y, hidden);
        }
        return Ok(());
    }
    let mut bufs = Bufs::default();
    for ((_, list), ex) in lists.iter().zip(picked) {
        call.expert(ex, list, &mut bufs)?;
        add_terms(out, list, &bufs.y, hidden);
    }
    Ok(())
}

/// Experts whose calls have at most this many rows each run whole on one thread apiece
/// (`threads` > 1): a decode step's.
const EXPERT_PARALLEL_ROWS: usize = 4;

/// `out[t] += y[r] * w` for each row `r` of `y` [rows, hidden] and its `(t, w)` of `list`.
fn add_terms(out: &mut [f32], list: &[(usize, f32)], y: &[f32], hidden: usize) {
    for (r, &(t, w)) in list.iter().enumerate() {
        let row = &mut out[t * hidden..(t + 1) * hidden];
        for (o, &v) in row.iter_mut().zip(&y[r * hidden..(r + 1) * hidden]) {
            *o += v * w;
        }
    }
}

/// `rows[r] += bias` for each row of `rows` ([_, bias.len()]).
fn add_bias(rows: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in rows.chunks_exact_mut(b.len()) {
            for (v, &c) in row.iter_mut().zip(b) {
                *v += c;
            }
        }
    }
}

/// `a[r, i]` = [`Glu::Clamped`] of `g = gu[r, i]`, `u = gu[r, inter + i]` for the rows of
/// `gu` [rows, 2 * inter].
fn clamped_glu(gu: &[f32], a: &mut [f32], inter: usize, limit: f32, alpha: f32) {
    for (row, out) in gu.chunks_exact(2 * inter).zip(a.chunks_exact_mut(inter)) {
        let (gate, up) = row.split_at(inter);
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            let g = if g > limit { limit } else { g };
            let u = u.clamp(-limit, limit);
            let s = 1.0 / (1.0 + fused::exp(-(g * alpha)));
            *o = (u + 1.0) * (g * s);
        }
    }
}

/// One call's inputs and settings, shared by its experts.
#[derive(Clone, Copy)]
struct Call<'a> {
    x: &'a [f32],
    hidden: usize,
    inter: usize,
    glu: Glu,
    threads: usize,
    backend: quant::Backend,
}

/// Scratch of one expert's products, reused from expert to expert.
#[derive(Default)]
struct Bufs {
    xs: Vec<f32>,
    gu: Vec<f32>,
    a: Vec<f32>,
    /// the expert's output rows [rows, hidden]
    y: Vec<f32>,
    part: Vec<f32>,
}

impl Call<'_> {
    /// `bufs.y` = expert `ex`'s output rows for the tokens of `list` (weights not applied).
    fn expert(
        &self,
        ex: Expert<'_>,
        list: &[(usize, f32)],
        bufs: &mut Bufs,
    ) -> Result<(), KernelError> {
        let Call {
            x,
            hidden,
            inter,
            glu,
            threads,
            backend,
        } = *self;
        let m = list.len();
        bufs.xs.clear();
        for &(t, _) in list {
            bufs.xs.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
        }
        bufs.gu.resize(m * 2 * inter, 0.0);
        let args = LinearArgs {
            m,
            n: 2 * inter,
            k: hidden,
            threads,
        };
        quant_product(
            ex.gate_up,
            backend,
            &args,
            &bufs.xs,
            &mut bufs.gu,
            threads,
            &mut bufs.part,
        )?;
        add_bias(&mut bufs.gu, ex.gate_up_bias);
        bufs.a.resize(m * inter, 0.0);
        match glu {
            Glu::Silu => fused::silu_mul(
                Elems::F32(&bufs.gu),
                ElemsMut::F32(&mut bufs.a),
                m,
                inter,
                threads,
            )?,
            Glu::Clamped { limit, alpha } => {
                clamped_glu(&bufs.gu, &mut bufs.a, inter, limit, alpha)
            }
        }
        bufs.y.resize(m * hidden, 0.0);
        let args = LinearArgs {
            m,
            n: hidden,
            k: inter,
            threads,
        };
        quant_product(
            ex.down,
            backend,
            &args,
            &bufs.a,
            &mut bufs.y,
            threads,
            &mut bufs.part,
        )?;
        add_bias(&mut bufs.y, ex.down_bias);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{pack, packed_len, QType};

    /// Random GGUF Q8_0 rows [n, k] (a scale of 1/64 in fp16, codes -20..20).
    fn q8_rows(seed: u64, n: usize, k: usize) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut rows = Vec::new();
        for _ in 0..n * k / 32 {
            rows.extend_from_slice(&half::f16::from_f32(1.0 / 64.0).to_le_bytes());
            for _ in 0..32 {
                rows.push(((next() % 41) as i8 - 20) as u8);
            }
        }
        rows
    }

    fn packed(rows: &[u8], n: usize, k: usize) -> Vec<u8> {
        let mut p = vec![0u8; packed_len(QType::Q8_0, n, k).unwrap()];
        pack(QType::Q8_0, rows, n, k, &mut p, 1).unwrap();
        p
    }

    fn linear(p: &[u8], x: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        let args = LinearArgs {
            m,
            n,
            k,
            threads: 1,
        };
        quant::linear(QType::Q8_0, &args, x, p, &mut out, quant::Backend::Portable).unwrap();
        out
    }

    #[test]
    fn experts_add_each_tokens_terms_in_expert_order_and_do_not_depend_on_the_batch() {
        check_experts(Glu::Silu, false);
    }

    #[test]
    fn gpt_oss_experts_add_biases_around_the_clamped_glu() {
        check_experts(
            Glu::Clamped {
                limit: 0.75,
                alpha: 1.702,
            },
            true,
        );
    }

    /// `glu(a, j)`: [`Glu`]'s activation of row `a` [2 * inter] at `j`, spelled out
    fn glu_ref(glu: Glu, gu: &[f32], inter: usize) -> Vec<f32> {
        (0..inter)
            .map(|j| {
                let (g, u) = (gu[j], gu[inter + j]);
                match glu {
                    Glu::Silu => g / (1.0 + fused::exp(-g)) * u,
                    Glu::Clamped { limit, alpha } => {
                        let g = g.min(limit);
                        let sig = 1.0 / (1.0 + fused::exp(-(g * alpha)));
                        (u.max(-limit).min(limit) + 1.0) * (g * sig)
                    }
                }
            })
            .collect()
    }

    fn check_experts(glu: Glu, biased: bool) {
        let (hidden, inter, n_experts, top_k, tokens) = (64, 32, 4, 2, 5);
        let biases: Vec<(Vec<f32>, Vec<f32>)> = (0..n_experts)
            .map(|e| {
                let b = |n: usize, s: usize| -> Vec<f32> {
                    (0..n)
                        .map(|i| ((i * 13 + e * 7 + s) % 17) as f32 / 8.0 - 1.0)
                        .collect()
                };
                (b(2 * inter, 1), b(hidden, 2))
            })
            .collect();
        let weights: Vec<(Vec<u8>, Vec<u8>)> = (0..n_experts as u64)
            .map(|e| {
                let gu = q8_rows(10 + e, 2 * inter, hidden);
                let d = q8_rows(20 + e, hidden, inter);
                (packed(&gu, 2 * inter, hidden), packed(&d, hidden, inter))
            })
            .collect();
        let parts: Vec<([QuantPart<'_>; 1], [QuantPart<'_>; 1])> = weights
            .iter()
            .map(|(gu, d)| {
                let gate_up = QuantPart {
                    qtype: QType::Q8_0,
                    packed: gu,
                    n: 2 * inter,
                };
                let down = QuantPart {
                    qtype: QType::Q8_0,
                    packed: d,
                    n: hidden,
                };
                ([gate_up], [down])
            })
            .collect();
        let table: Vec<Option<Expert<'_>>> = parts
            .iter()
            .zip(&biases)
            .map(|((gu, d), (bgu, bd))| {
                Some(Expert {
                    gate_up: gu,
                    down: d,
                    gate_up_bias: biased.then_some(&bgu[..]),
                    down_bias: biased.then_some(&bd[..]),
                })
            })
            .collect();
        let x: Vec<f32> = (0..tokens * hidden)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        // token 4 picks expert 4 (= the count: none) in its second slot
        let ids = [3i64, 0, 1, 2, 2, 3, 0, 1, 1, 4];
        let w: Vec<f32> = (0..tokens * top_k)
            .map(|i| 0.25 + i as f32 / 16.0)
            .collect();
        let shape = Shape {
            tokens,
            hidden,
            inter,
            glu,
        };
        let routes = Routes {
            ids: &ids,
            weights: &w,
            top_k,
        };
        let mut out = vec![f32::NAN; tokens * hidden];
        experts(
            &x,
            shape,
            routes,
            &table,
            &mut out,
            2,
            quant::Backend::Portable,
        )
        .unwrap();
        // the formula, token by token, expert by expert in ascending order
        for t in 0..tokens {
            let row = &x[t * hidden..(t + 1) * hidden];
            let mut picks: Vec<(usize, f32)> = (0..top_k)
                .filter(|&j| ids[t * top_k + j] < n_experts as i64)
                .map(|j| (ids[t * top_k + j] as usize, w[t * top_k + j]))
                .collect();
            picks.sort_by_key(|p| p.0);
            let mut want = vec![0f32; hidden];
            for (e, wt) in picks {
                let mut gu = linear(&weights[e].0, row, 1, 2 * inter, hidden);
                if biased {
                    gu.iter_mut().zip(&biases[e].0).for_each(|(v, b)| *v += b);
                }
                let a = glu_ref(glu, &gu, inter);
                let mut y = linear(&weights[e].1, &a, 1, hidden, inter);
                if biased {
                    y.iter_mut().zip(&biases[e].1).for_each(|(v, b)| *v += b);
                }
                for (o, v) in want.iter_mut().zip(y) {
                    *o += v * wt;
                }
            }
            assert_eq!(&out[t * hidden..(t + 1) * hidden], &want[..], "token {t}");
        }
        // one thread (each expert in turn, not whole experts a thread): the same bits
        let mut serial = vec![f32::NAN; tokens * hidden];
        experts(
            &x,
            shape,
            routes,
            &table,
            &mut serial,
            1,
            quant::Backend::Portable,
        )
        .unwrap();
        assert_eq!(serial, out);
        // token 1 alone: the same bits
        let mut alone = vec![0f32; hidden];
        let one = Routes {
            ids: &ids[2..4],
            weights: &w[2..4],
            top_k,
        };
        let shape1 = Shape {
            tokens: 1,
            hidden,
            inter,
            glu,
        };
        experts(
            &x[hidden..2 * hidden],
            shape1,
            one,
            &table,
            &mut alone,
            1,
            quant::Backend::Portable,
        )
        .unwrap();
        assert_eq!(&alone[..], &out[hidden..2 * hidden]);
    }

    #[test]
    fn bad_routes_are_refused_naming_the_field() {
        let (hidden, inter) = (32, 32);
        let gu = packed(&q8_rows(1, 2 * inter, hidden), 2 * inter, hidden);
        let d = packed(&q8_rows(2, hidden, inter), hidden, inter);
        let gp = [QuantPart {
            qtype: QType::Q8_0,
            packed: &gu,
            n: 2 * inter,
        }];
        let dp = [QuantPart {
            qtype: QType::Q8_0,
            packed: &d,
            n: hidden,
        }];
        let table = [
            Some(Expert {
                gate_up: &gp,
                down: &dp,
                gate_up_bias: None,
                down_bias: None,
            }),
            None,
        ];
        let x = vec![0.5f32; hidden];
        let mut out = vec![0f32; hidden];
        let shape = Shape {
            tokens: 1,
            hidden,
            inter,
            glu: Glu::Silu,
        };
        let field = |ids: &[i64], w: &[f32], experts: &[Option<Expert<'_>>], out: &mut [f32]| {
            let routes = Routes {
                ids,
                weights: w,
                top_k: 1,
            };
            match super::experts(&x, shape, routes, experts, out, 1, quant::Backend::Portable) {
                Err(KernelError::Invalid { field, .. })
                | Err(KernelError::Length { field, .. }) => field,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(field(&[5], &[1.0], &table, &mut out), "ids"); // past the count
        assert_eq!(field(&[-1], &[1.0], &table, &mut out), "ids");
        assert_eq!(field(&[1], &[1.0], &table, &mut out), "ids"); // not passed
        assert_eq!(field(&[0, 0], &[1.0, 1.0], &table, &mut out), "ids"); // length
        assert_eq!(field(&[0], &[], &table, &mut out), "weights");
        assert_eq!(field(&[0], &[1.0], &table, &mut [0f32; 3]), "out");
    }
}
