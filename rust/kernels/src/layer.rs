//! A whole Llama-style decoder layer in one call, for a step whose every row goes to the
//! decode kernel: the same kernels, in the same order and with the same roundings, as the
//! lean layer the Python runner otherwise strings together one call at a time
//! (`ferrobatch.runner.lean_layers`), so the two give bit-equal results:
//!
//! ```text
//! h   = bf16(rms_norm(x) * w_in)                      (fused::rms_norm)
//! qkv = h @ [Wq | Wk | Wv].T + b                       (amx::linear or f32_linear, f32)
//! q   = rope(qkv[:, q]) (f32);  k = cache(rope(qkv[:, k]))
//! cache[slots] = k, cache(qkv[:, v])                  (fused::write_rows)
//! att = cache(attention(q, cache))                     (decode::paged_decode_attention)
//! x  += att @ Wo.T + b;  h = bf16(rms_norm(x) * w_post)
//! a   = bf16(silu(gate) * up) of h @ [Wg | Wu].T       (amx::linear, fused::silu_mul)
//! x  += a @ Wd.T + b                                   (f32 adds)
//! ```
//!
//! Gemma 2 / 3 layers ([`Weights::sandwich`]) also normalize the attention's and the MLP's
//! outputs before they join the residual (`x += rms_norm(att @ Wo.T)`, `x +=
//! rms_norm(a @ Wd.T)`, each into its own f32 buffer first), gate with GELU's tanh
//! approximation ([`Gate`]), scale every norm weight as `(1 + w)` ([`Weights::norm_offset`])
//! and may cap attention scores ([`Weights::softcap`]).
//!
//! With f32 weights ([`Packed::F32`], an fp32 model's) or half-precision ones in
//! [`f32_linear`]'s panels ([`Packed::Half`], widened exactly in its k loop) `h` and `a`
//! stay f32, the attention output is not rounded (f32 into the o product) and the products
//! run on [`f32_linear`]. With GGUF quantized weights ([`Packed::Quant`]: each product one or
//! more stacked parts of one type, a GGUF model's q/k in Q4_K beside v in Q6_K) the same f32
//! layer runs its products on [`quant::linear`] (each f32 input row quantized to int8 inside). `cache(.)` rounds to the KV cache's type. Each part splits over threads exactly when the
//! Python layer's call of it would (the same element thresholds), which changes no result.
//! The intermediate buffers are per-thread scratch reused from call to call (a fresh
//! allocation of a few MiB costs its page faults at every decode step).

use std::cell::RefCell;

use crate::amx;
use crate::error::KernelError;
use crate::f32_linear;
use crate::fused::{self, Gate, NormInput, RmsNorm, Rope, WriteRows};
use crate::linear::LinearArgs;
use crate::quant::{self, QType};
use crate::{paged_decode_attention, DecodeArgs, Elems, ElemsMut, Window};

/// A packed weight: bf16 for [`amx::linear`] ([`amx::pack`]'s layout), f32 for
/// [`f32_linear::linear`] ([`f32_linear::pack`]'s layout), bf16 / fp16 for
/// [`f32_linear::linear_half`] ([`f32_linear::pack_half`]'s layout: f32 products), or GGUF
/// quantized parts for [`quant::linear`] on `backend` (f32 inputs).
#[derive(Clone, Copy, Debug)]
pub enum Packed<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
    Half(f32_linear::Half, &'a [u16]),
    Quant {
        parts: &'a [QuantPart<'a>],
        backend: quant::Backend,
    },
}

/// Consecutive output rows of a quantized product, of one type: `n` rows [`quant::pack`]ed.
#[derive(Clone, Copy, Debug)]
pub struct QuantPart<'a> {
    pub qtype: QType,
    pub packed: &'a [u8],
    pub n: usize,
}

impl Packed<'_> {
    /// `Ok` when the packing holds a weight `[n, k]`; else what is wrong with it.
    fn check(&self, n: usize, k: usize) -> Result<(), String> {
        let (got, want) = match self {
            Packed::Bf16(p) => (p.len(), amx::packed_len(n, k)),
            Packed::Half(_, p) => (p.len(), f32_linear::packed_len(n, k)),
            Packed::F32(p) => (p.len(), f32_linear::packed_len(n, k)),
            Packed::Quant { parts, .. } => return check_parts(parts, n, k),
        };
        if got != want {
            return Err(format!("has {got} elements, not {want} for [{n}, {k}]"));
        }
        Ok(())
    }

    /// Whether the products take f32 inputs ([`f32_linear`], [`quant`]) rather than bf16 ones.
    fn wide(&self) -> bool {
        !matches!(self, Packed::Bf16(_))
    }
}

/// `Ok` when `parts` stack to a weight `[n, k]`, each packed whole.
pub(crate) fn check_parts(parts: &[QuantPart<'_>], n: usize, k: usize) -> Result<(), String> {
    if parts.is_empty() {
        return Err("has no quantized parts".into());
    }
    let rows: usize = parts.iter().map(|p| p.n).sum();
    if rows != n {
        return Err(format!("has parts of {rows} rows in all, not {n}"));
    }
    for (i, p) in parts.iter().enumerate() {
        let want = quant::packed_len(p.qtype, p.n, k).map_err(|e| format!("part {i}: {e}"))?;
        if p.packed.len() != want {
            return Err(format!(
                "part {i} ({} [{}, {k}]) has {} bytes, not {want}",
                p.qtype.name(),
                p.n,
                p.packed.len()
            ));
        }
    }
    Ok(())
}

/// One packed product of the layer: the packed `W` [n, k] and its f32 bias [n].
#[derive(Clone, Copy, Debug)]
pub struct Product<'a> {
    pub packed: Packed<'a>,
    pub bias: Option<&'a [f32]>,
    /// output columns
    pub n: usize,
}

/// Per-head RMSNorms of q and k before rope (Qwen3): `[dim]` weights, one epsilon.
#[derive(Clone, Copy, Debug)]
pub struct QkNorm<'a> {
    pub q: Elems<'a>,
    pub k: Elems<'a>,
    pub eps: f32,
}

/// Gemma's norms of the attention's and the MLP's outputs, before each joins the residual:
/// `[hidden]` weights, one epsilon.
#[derive(Clone, Copy, Debug)]
pub struct Sandwich<'a> {
    pub attn: Elems<'a>,
    pub mlp: Elems<'a>,
    pub eps: f32,
}

/// The layer's weights and shapes.
#[derive(Clone, Copy, Debug)]
pub struct Weights<'a> {
    /// `[hidden]` each: the norm before the attention, and the one before the MLP
    pub input_norm: Elems<'a>,
    pub post_norm: Elems<'a>,
    pub input_eps: f32,
    pub post_eps: f32,
    /// `[heads * dim + 2 * kv_heads * dim, hidden]`: q, k, v stacked
    pub qkv: Product<'a>,
    /// `[hidden, heads * dim]`
    pub o: Product<'a>,
    /// `[2 * inter, hidden]`: gate, up stacked
    pub gate_up: Product<'a>,
    /// `[hidden, inter]`
    pub down: Product<'a>,
    /// each head's q and k normalized before rope, if the layer does (Qwen3)
    pub qk_norm: Option<QkNorm<'a>>,
    /// the attention's and the MLP's outputs normalized before the residual (Gemma 2 / 3)
    pub sandwich: Option<Sandwich<'a>>,
    /// added to every norm weight (f32): 0, or 1 for Gemma's `(1 + w)`
    pub norm_offset: f32,
    /// the MLP gate's activation
    pub gate: Gate,
    /// attention scores capped as `cap * tanh(score / cap)` (Gemma 2)
    pub softcap: Option<f32>,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub dim: usize,
    /// the rotated columns of each head (`dim`, or fewer where the rotary embedding covers
    /// part of each head: Phi-4-mini); the step's cos / sin are `[rows, rot]`
    pub rot: usize,
    pub inter: usize,
}

/// What the step gives every layer: positions, cache slots and the decode kernel's rows.
#[derive(Clone, Copy, Debug)]
pub struct Step<'a> {
    /// `[rows, rot]` f32 rotary embedding of each row's position
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    /// `[rows]` cache slot of each row's new key and value
    pub slots: &'a [i64],
    /// `[rows, width]` chunk ids, as [`DecodeArgs`] has them
    pub block_tables: &'a [i32],
    pub seqlens: &'a [i32],
    pub width: usize,
    pub page: usize,
    pub window: Window,
    /// multiplies every attention score
    pub scale: f32,
    /// threads each part may split over (torch's thread count)
    pub threads: usize,
}

/// Elementwise parts split from this many elements on (the Python layer's threshold).
const SPLIT_ELEMS: usize = 1 << 16;
/// bf16 products split from this many multiply-adds on (`amx_ops.linear`'s threshold).
const SPLIT_MACS: usize = 1 << 20;
/// f32 products from this many (`f32_ops.SPLIT_MACS`): at a few rows they are bound by the
/// weights' bytes, which two cores read faster than one.
const SPLIT_MACS_F32: usize = 1 << 18;
/// quantized products (per part) from this many (`quant_ops.SPLIT_MACS`).
const SPLIT_MACS_QUANT: usize = 1 << 18;

/// The intermediate buffers of one call.
#[derive(Default)]
struct Scratch {
    strip: Vec<f32>,
    qn: Vec<f32>,
    kn: Vec<f32>,
    h: Vec<u16>,
    h32: Vec<f32>,
    qkv: Vec<f32>,
    /// the attention's or the MLP's output normalized (Gemma's sandwich norms)
    sandwiched: Vec<f32>,
    q: Vec<f32>,
    k: Vec<u16>,
    k32: Vec<f32>,
    att: Vec<u16>,
    att32: Vec<f32>,
    out: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<u16>,
    act32: Vec<f32>,
    /// one quantized part's output rows, before they go to their columns
    part: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `v[..n]`, grown (never shrunk) to at least `n` elements.
fn take<T: Copy + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}

/// One decoder layer on the f32 residual stream `x` [rows, hidden] (updated in place), the
/// new keys and values written to `k_cache` / `v_cache` ([slots, kv_heads, dim], one type),
/// every row attended by the decode kernel. Checks every shape before anything is written;
/// an error names the argument at fault (the Python binding's spelling).
pub fn decoder_layer(
    w: &Weights<'_>,
    s: &Step<'_>,
    x: &mut [f32],
    k_cache: ElemsMut<'_>,
    v_cache: ElemsMut<'_>,
) -> Result<(), KernelError> {
    let rows = s.slots.len();
    let (nq, nk) = (w.heads * w.dim, w.kv_heads * w.dim);
    let width = nq + 2 * nk;
    validate(w, s, x.len(), rows, width)?;
    if rows == 0 {
        return Ok(());
    }
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let sc = &mut *guard;
        let hidden = w.hidden;
        let elems = |n: usize| if n >= SPLIT_ELEMS { s.threads } else { 1 };
        // the products' inputs: bf16 for bf16 weights, f32 for f32 ones
        let wide = w.qkv.packed.wide();
        let mut h = if wide {
            Act::F32(take(&mut sc.h32, rows * hidden))
        } else {
            Act::Bf16(take(&mut sc.h, rows * hidden))
        };
        let norm = |weight, eps| RmsNorm {
            weight,
            rows,
            hidden,
            eps,
            weight_offset: w.norm_offset,
            threads: elems(rows * hidden),
        };
        fused::rms_norm(
            &norm(w.input_norm, w.input_eps),
            NormInput::Plain(Elems::F32(&*x)),
            h.out(),
        )?;
        let qkv = take(&mut sc.qkv, rows * width);
        product(
            &w.qkv,
            h.input(),
            rows,
            hidden,
            qkv,
            s.threads,
            &mut sc.part,
        )?;
        // (src, its row width, q's column, k's column) of rope: q/k normalized per head first
        // where the layer does (Qwen3), each into a buffer of its own
        let (q_src, k_src): (RopeSrc<'_>, RopeSrc<'_>) = match &w.qk_norm {
            None => ((&*qkv, width, 0), (&*qkv, width, nq)),
            Some(n) => {
                let qn = take(&mut sc.qn, rows * nq);
                let kn = take(&mut sc.kn, rows * nk);
                let strip = &mut sc.strip;
                let src = (&*qkv, width, rows, w.dim);
                let off = w.norm_offset;
                head_norm(src, 0, nq, (n.q, n.eps, off), strip, qn, elems(rows * nq))?;
                head_norm(src, nq, nk, (n.k, n.eps, off), strip, kn, elems(rows * nk))?;
                ((&*qn, nq, 0), (&*kn, nk, 0))
            }
        };
        let q = take(&mut sc.q, rows * nq);
        let rope = |src, heads| rope_of(src, heads, s, (w.dim, w.rot), elems(rows * heads * w.dim));
        fused::rope(&rope(q_src, w.heads), ElemsMut::F32(&mut *q))?;
        // the rotated keys in the cache's type, then both rows at their slots
        let (k_rot, mut k_cache, mut v_cache): (Elems<'_>, _, _) = match (k_cache, v_cache) {
            (ElemsMut::F32(kc), ElemsMut::F32(vc)) => {
                let k = take(&mut sc.k32, rows * nk);
                fused::rope(&rope(k_src, w.kv_heads), ElemsMut::F32(&mut *k))?;
                (Elems::F32(&*k), ElemsMut::F32(kc), ElemsMut::F32(vc))
            }
            (ElemsMut::Bf16(kc), ElemsMut::Bf16(vc)) => {
                let k = take(&mut sc.k, rows * nk);
                fused::rope(&rope(k_src, w.kv_heads), ElemsMut::Bf16(&mut *k))?;
                (Elems::Bf16(&*k), ElemsMut::Bf16(kc), ElemsMut::Bf16(vc))
            }
            (ElemsMut::F16(kc), ElemsMut::F16(vc)) => {
                let k = take(&mut sc.k, rows * nk);
                fused::rope(&rope(k_src, w.kv_heads), ElemsMut::F16(&mut *k))?;
                (Elems::F16(&*k), ElemsMut::F16(kc), ElemsMut::F16(vc))
            }
            _ => return KernelError::invalid("v_cache", "v_cache must have k_cache's type".into()),
        };
        let write = |src, src_width, col_offset| WriteRows {
            src,
            src_width,
            col_offset,
            width: nk,
            slots: s.slots,
        };
        fused::write_rows(&write(k_rot, nk, 0), reborrow(&mut k_cache))?;
        fused::write_rows(
            &write(Elems::F32(&*qkv), width, nq + nk),
            reborrow(&mut v_cache),
        )?;
        let decode = DecodeArgs {
            q: Elems::F32(&*q),
            k_cache: frozen(&k_cache),
            v_cache: frozen(&v_cache),
            block_tables: s.block_tables,
            seqlens: s.seqlens,
            heads: w.heads,
            kv_heads: w.kv_heads,
            dim: w.dim,
            page: s.page,
            width: s.width,
            window: s.window,
            scale: s.scale,
            softcap: w.softcap,
            threads: s.threads,
        };
        // the attention output: f32 before f32-input products (no rounding in between);
        // before bf16 products in the cache's type (the Python layer's `out_dtype`), as the
        // o product's input: bf16 as it is, fp16 widened (exact) to f32
        let attend = |out: ElemsMut<'_>| {
            paged_decode_attention(&decode, out).map_err(|e| e.on("block_tables"))
        };
        let att: Elems<'_> = match frozen(&k_cache) {
            Elems::I8 { .. } => unreachable!("a writable cache is never int8"),
            Elems::Bf16(_) if !wide => {
                let a = take(&mut sc.att, rows * nq);
                attend(ElemsMut::Bf16(&mut *a))?;
                Elems::Bf16(&*a)
            }
            Elems::F16(_) if !wide => {
                let a = take(&mut sc.att, rows * nq);
                attend(ElemsMut::F16(&mut *a))?;
                let wide = take(&mut sc.att32, rows * nq);
                for (o, &b) in wide.iter_mut().zip(a.iter()) {
                    *o = half::f16::from_bits(b).to_f32();
                }
                Elems::F32(&*wide)
            }
            _ => {
                let a = take(&mut sc.att32, rows * nq);
                attend(ElemsMut::F32(&mut *a))?;
                Elems::F32(&*a)
            }
        };
        let out = take(&mut sc.out, rows * hidden);
        product(&w.o, att, rows, nq, &mut *out, s.threads, &mut sc.part)?;
        let attn_norm = w.sandwich.map(|sw| norm(sw.attn, sw.eps));
        let residual = sandwiched(&*out, attn_norm.as_ref(), &mut sc.sandwiched)?;
        fused::rms_norm(
            &norm(w.post_norm, w.post_eps),
            NormInput::AddResidual {
                x: &mut *x,
                residual: Elems::F32(residual),
            },
            h.out(),
        )?;
        let gate_up = take(&mut sc.gate_up, rows * 2 * w.inter);
        product(
            &w.gate_up,
            h.input(),
            rows,
            hidden,
            &mut *gate_up,
            s.threads,
            &mut sc.part,
        )?;
        let mut act = if wide {
            Act::F32(take(&mut sc.act32, rows * w.inter))
        } else {
            Act::Bf16(take(&mut sc.act, rows * w.inter))
        };
        fused::gated_mul(
            Elems::F32(&*gate_up),
            act.out(),
            rows,
            w.inter,
            w.gate,
            elems(rows * w.inter),
        )?;
        product(
            &w.down,
            act.input(),
            rows,
            w.inter,
            &mut *out,
            s.threads,
            &mut sc.part,
        )?;
        let mlp_norm = w.sandwich.map(|sw| norm(sw.mlp, sw.eps));
        let down = sandwiched(&*out, mlp_norm.as_ref(), &mut sc.sandwiched)?;
        for (x, d) in x.iter_mut().zip(down.iter()) {
            *x += *d;
        }
        Ok(())
    })
}

/// `out` as it joins the residual: normalized by `norm` into `buf` where the layer has
/// sandwich norms (Gemma 2 / 3), else as it is.
fn sandwiched<'a>(
    out: &'a [f32],
    norm: Option<&RmsNorm<'_>>,
    buf: &'a mut Vec<f32>,
) -> Result<&'a [f32], KernelError> {
    let Some(norm) = norm else {
        return Ok(out);
    };
    let normed = take(buf, out.len());
    fused::rms_norm(
        norm,
        NormInput::Plain(Elems::F32(out)),
        ElemsMut::F32(normed),
    )?;
    Ok(normed)
}

/// What rope reads: (the rows, their width, the first column).
type RopeSrc<'a> = (&'a [f32], usize, usize);

/// The rope of `heads` heads of `dim` (the first `rot` columns rotated) from `(src, its
/// row width, first column)`.
fn rope_of<'a>(
    (src, src_width, col_offset): RopeSrc<'a>,
    heads: usize,
    s: &Step<'a>,
    (dim, rot): (usize, usize),
    threads: usize,
) -> Rope<'a> {
    Rope {
        src: Elems::F32(src),
        cos: s.cos,
        sin: s.sin,
        rows: s.slots.len(),
        src_width,
        col_offset,
        heads,
        dim,
        rot,
        threads,
    }
}

/// `out` [rows, cols] = the per-head RMSNorm (rows of `dim`, `weight` [dim]) of columns
/// `off .. off + cols` of `src` ([rows, width]), copied into `strip` first: what the lean
/// forward does with a contiguous copy of that slice and `fused_ops.rms_norm`.
fn head_norm(
    (src, width, rows, dim): (&[f32], usize, usize, usize),
    off: usize,
    cols: usize,
    (weight, eps, weight_offset): (Elems<'_>, f32, f32),
    strip: &mut Vec<f32>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    let strip = take(strip, rows * cols);
    for (r, dst) in strip.chunks_exact_mut(cols).enumerate() {
        dst.copy_from_slice(&src[r * width + off..r * width + off + cols]);
    }
    let norm = RmsNorm {
        weight,
        rows: rows * cols / dim,
        hidden: dim,
        eps,
        weight_offset,
        threads,
    };
    fused::rms_norm(
        &norm,
        NormInput::Plain(Elems::F32(&*strip)),
        ElemsMut::F32(out),
    )
}

/// A product's input buffer: bf16 before bf16 weights, f32 before f32 ones.
enum Act<'a> {
    Bf16(&'a mut [u16]),
    F32(&'a mut [f32]),
}

impl Act<'_> {
    fn out(&mut self) -> ElemsMut<'_> {
        match self {
            Act::Bf16(v) => ElemsMut::Bf16(v),
            Act::F32(v) => ElemsMut::F32(v),
        }
    }

    fn input(&self) -> Elems<'_> {
        match self {
            Act::Bf16(v) => Elems::Bf16(v),
            Act::F32(v) => Elems::F32(v),
        }
    }
}

/// `out = x @ W.T + b` [rows, p.n] of one packed product with `k` inputs (`part`: scratch
/// for a quantized product's parts).
fn product(
    p: &Product<'_>,
    x: Elems<'_>,
    rows: usize,
    k: usize,
    out: &mut [f32],
    threads: usize,
    part: &mut Vec<f32>,
) -> Result<(), KernelError> {
    let macs = rows.saturating_mul(p.n).saturating_mul(k);
    let split = match p.packed {
        Packed::Bf16(_) => SPLIT_MACS,
        Packed::F32(_) | Packed::Half(..) => SPLIT_MACS_F32,
        Packed::Quant { .. } => SPLIT_MACS_QUANT,
    };
    let args = LinearArgs {
        m: rows,
        n: p.n,
        k,
        threads: if macs >= split { threads } else { 1 },
    };
    match (p.packed, x) {
        (Packed::Bf16(packed), x) => amx::linear(&args, x, packed, p.bias, out),
        (Packed::F32(packed), Elems::F32(x)) => f32_linear::linear(&args, x, packed, p.bias, out),
        (Packed::Half(half, packed), Elems::F32(x)) => {
            f32_linear::linear_half(half, &args, x, packed, p.bias, out)
        }
        (Packed::Quant { parts, backend }, Elems::F32(x)) => {
            quant_product(parts, backend, &args, x, out, threads, part)?;
            if let Some(bias) = p.bias {
                for row in out.chunks_exact_mut(p.n) {
                    for (o, b) in row.iter_mut().zip(bias) {
                        *o += *b;
                    }
                }
            }
            Ok(())
        }
        (Packed::F32(_) | Packed::Half(..) | Packed::Quant { .. }, _) => {
            KernelError::invalid("x", "f32 and quantized weights take f32 inputs".into())
        }
    }
}

/// `out` [rows, n] = `x` @ the stacked parts' weights.T, each part's rows into its columns
/// (through `part` when there are several rows). Each part splits over `threads` from
/// [`SPLIT_MACS_QUANT`] multiply-adds on, as `quant_ops.linear` does.
pub(crate) fn quant_product(
    parts: &[QuantPart<'_>],
    backend: quant::Backend,
    args: &LinearArgs,
    x: &[f32],
    out: &mut [f32],
    threads: usize,
    part: &mut Vec<f32>,
) -> Result<(), KernelError> {
    let (rows, n, k) = (args.m, args.n, args.k);
    let mut col = 0;
    for p in parts {
        let macs = rows.saturating_mul(p.n).saturating_mul(k);
        let a = LinearArgs {
            m: rows,
            n: p.n,
            k,
            threads: if macs >= SPLIT_MACS_QUANT { threads } else { 1 },
        };
        if parts.len() == 1 {
            return quant::linear(p.qtype, &a, x, p.packed, out, backend);
        }
        if rows == 1 {
            quant::linear(p.qtype, &a, x, p.packed, &mut out[col..col + p.n], backend)?;
        } else {
            let y = take(part, rows * p.n);
            quant::linear(p.qtype, &a, x, p.packed, y, backend)?;
            for (o, y) in out.chunks_exact_mut(n).zip(y.chunks_exact(p.n)) {
                o[col..col + p.n].copy_from_slice(y);
            }
        }
        col += p.n;
    }
    Ok(())
}

fn reborrow<'b>(e: &'b mut ElemsMut<'_>) -> ElemsMut<'b> {
    match e {
        ElemsMut::F32(s) => ElemsMut::F32(s),
        ElemsMut::Bf16(s) => ElemsMut::Bf16(s),
        ElemsMut::F16(s) => ElemsMut::F16(s),
    }
}

fn frozen<'b>(e: &'b ElemsMut<'_>) -> Elems<'b> {
    match e {
        ElemsMut::F32(s) => Elems::F32(s),
        ElemsMut::Bf16(s) => Elems::Bf16(s),
        ElemsMut::F16(s) => Elems::F16(s),
    }
}

/// The shapes the parts do not check themselves (the rest they check before writing:
/// the norms and q/k/v product run before the first cache write, and the cache writes
/// check every slot before writing any).
fn validate(
    w: &Weights<'_>,
    s: &Step<'_>,
    x_len: usize,
    rows: usize,
    width: usize,
) -> Result<(), KernelError> {
    if w.dim == 0 || w.heads == 0 || w.kv_heads == 0 || w.hidden == 0 || w.inter == 0 {
        return KernelError::invalid(
            "dims",
            format!(
                "hidden, heads, kv_heads, dim and inter must be >= 1, not {}, {}, {}, {}, {}",
                w.hidden, w.heads, w.kv_heads, w.dim, w.inter
            ),
        );
    }
    if let Some(n) = &w.qk_norm {
        for (field, e) in [("q_norm", n.q), ("k_norm", n.k)] {
            if e.len() != w.dim {
                return KernelError::invalid(
                    field,
                    format!("{field} has {} elements, not dim = {}", e.len(), w.dim),
                );
            }
        }
    }
    if let Some(n) = &w.sandwich {
        for (field, e) in [("post_attn_norm", n.attn), ("post_mlp_norm", n.mlp)] {
            if e.len() != w.hidden {
                return KernelError::invalid(
                    field,
                    format!(
                        "{field} has {} elements, not hidden = {}",
                        e.len(),
                        w.hidden
                    ),
                );
            }
        }
    }
    if !w.norm_offset.is_finite() {
        let msg = format!("norm_offset must be finite, not {}", w.norm_offset);
        return KernelError::invalid("norm_offset", msg);
    }
    if w.softcap.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
        let msg = format!("softcap must be finite and > 0, not {:?}", w.softcap);
        return KernelError::invalid("softcap", msg);
    }
    if x_len != rows * w.hidden {
        return KernelError::invalid(
            "x",
            format!(
                "x has {x_len} elements, not rows * hidden = {} * {}",
                rows, w.hidden
            ),
        );
    }
    let outs = [
        ("qkv", w.qkv.n, width),
        ("o", w.o.n, w.hidden),
        ("gate_up", w.gate_up.n, 2 * w.inter),
        ("down", w.down.n, w.hidden),
    ];
    for (field, got, want) in outs {
        if got != want {
            return KernelError::invalid(
                field,
                format!("{field} has {got} output columns, expected {want}"),
            );
        }
    }
    if s.seqlens.len() != rows {
        return KernelError::invalid(
            "seqlens",
            format!(
                "seqlens has {} rows, the step {rows} (every row goes to the decode kernel)",
                s.seqlens.len()
            ),
        );
    }
    // the products' and the decode kernel's own checks run only after the cache writes
    for (field, p, k) in [
        ("qkv", &w.qkv, w.hidden),
        ("o", &w.o, w.heads * w.dim),
        ("gate_up", &w.gate_up, w.hidden),
        ("down", &w.down, w.inter),
    ] {
        if std::mem::discriminant(&p.packed) != std::mem::discriminant(&w.qkv.packed) {
            return KernelError::invalid(
                field,
                format!(
                    "{field}'s packed weight must be of qkv's kind (amx bf16, f32, half panels \
                     or quantized)"
                ),
            );
        }
        if let Err(why) = p.packed.check(p.n, k) {
            return KernelError::invalid(field, format!("{field}'s packed weight {why}"));
        }
        if p.bias.is_some_and(|b| b.len() != p.n) {
            return KernelError::invalid(
                field,
                format!("{field}'s bias must have {} elements", p.n),
            );
        }
    }
    if s.block_tables.len() != rows * s.width {
        return KernelError::invalid(
            "block_tables",
            format!(
                "block_tables has {} elements, not rows * width = {rows} * {}",
                s.block_tables.len(),
                s.width
            ),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::testing::values;
    use crate::isa::{require_or_skip, Isa};
    use half::bf16;

    const H: usize = 32;
    const HEADS: usize = 4;
    const KV: usize = 2;
    const D: usize = 8;
    const I: usize = 64; // (whole Q8_0 blocks of 32, for the quantized layers)
    const PAGE: usize = 4;
    const SLOTS: usize = 32;
    const EPS: f32 = 1e-5;

    fn round(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
    }

    fn wide(v: &[u16]) -> Vec<f64> {
        v.iter().map(|&b| bf16::from_bits(b).to_f64()).collect()
    }

    /// A packed product and its bf16 weight [n, k] widened, for the reference.
    fn product_of(seed: u64, n: usize, k: usize, scale: f32) -> (Vec<u16>, Vec<f64>) {
        let w = round(&values(seed, n * k, scale));
        let mut packed = vec![0u16; amx::packed_len(n, k)];
        amx::pack(&w, n, k, &mut packed).expect("pack");
        (packed, wide(&w))
    }

    fn matmul(x: &[f64], w: &[f64], rows: usize, n: usize, k: usize) -> Vec<f64> {
        let mut out = vec![0.0; rows * n];
        for r in 0..rows {
            for j in 0..n {
                out[r * n + j] = (0..k).map(|l| x[r * k + l] * w[j * k + l]).sum();
            }
        }
        out
    }

    /// Gemma's parts of the reference layer: the sandwich norms' weights (widened), the
    /// attention's score cap; every norm weight then counts as `1 + w`, the gate is GELU's.
    type GemmaRef<'a> = Option<(&'a [f64], &'a [f64], f64)>;

    fn norm_offset(x: &[f64], w: &[f64], rows: usize, offset: f64) -> Vec<f64> {
        let mut out = vec![0.0; x.len()];
        for r in 0..rows {
            let row = &x[r * H..(r + 1) * H];
            let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / H as f64 + EPS as f64).sqrt();
            for j in 0..H {
                out[r * H + j] = row[j] * inv * (w[j] + offset);
            }
        }
        out
    }

    fn rope(x: &mut [f64], cos: &[f32], sin: &[f32]) {
        let half = D / 2;
        let orig = x.to_vec();
        for j in 0..D {
            let rot = if j < half {
                -orig[j + half]
            } else {
                orig[j - half]
            };
            x[j] = orig[j] * cos[j] as f64 + rot * sin[j] as f64;
        }
    }

    /// The layer in f64 from the same bf16 weights and cache (no intermediate rounding).
    #[allow(clippy::too_many_arguments)]
    fn reference(
        x: &[f32],
        norms: (&[f64], &[f64]),
        wts: [&[f64]; 4],
        k_cache: &[f64],
        v_cache: &[f64],
        s: &Step<'_>,
        rows: usize,
        gemma: GemmaRef<'_>,
    ) -> Vec<f64> {
        let (nq, nk) = (HEADS * D, KV * D);
        let width = nq + 2 * nk;
        let off = if gemma.is_some() { 1.0 } else { 0.0 };
        let norm = |x: &[f64], w: &[f64], rows| norm_offset(x, w, rows, off);
        let mut x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let qkv = matmul(&norm(&x, norms.0, rows), wts[0], rows, width, H);
        let (mut kc, mut vc) = (k_cache.to_vec(), v_cache.to_vec());
        let mut att = vec![0.0; rows * nq];
        for r in 0..rows {
            let (cos, sin) = (&s.cos[r * D..(r + 1) * D], &s.sin[r * D..(r + 1) * D]);
            let row = &qkv[r * width..(r + 1) * width];
            let slot = s.slots[r] as usize;
            for h in 0..KV {
                let mut k = row[nq + h * D..nq + (h + 1) * D].to_vec();
                rope(&mut k, cos, sin);
                kc[(slot * KV + h) * D..][..D].copy_from_slice(&k);
                vc[(slot * KV + h) * D..][..D].copy_from_slice(&row[nq + nk + h * D..][..D]);
            }
            let keys = s.seqlens[r] as usize;
            let slot_of =
                |p: usize| s.block_tables[r * s.width + p / PAGE] as usize * PAGE + p % PAGE;
            for h in 0..HEADS {
                let mut q = row[h * D..(h + 1) * D].to_vec();
                rope(&mut q, cos, sin);
                let g = h / (HEADS / KV);
                let scores: Vec<f64> = (0..keys)
                    .map(|p| {
                        let k = &kc[(slot_of(p) * KV + g) * D..][..D];
                        let v = s.scale as f64 * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>();
                        match gemma {
                            Some((_, _, cap)) => cap * (v / cap).tanh(),
                            None => v,
                        }
                    })
                    .collect();
                let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|v| (v - top).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (p, w) in e.iter().enumerate() {
                    let v = &vc[(slot_of(p) * KV + g) * D..][..D];
                    for j in 0..D {
                        att[r * nq + h * D + j] += w / sum * v[j];
                    }
                }
            }
        }
        let mut o = matmul(&att, wts[1], rows, H, nq);
        if let Some((attn, _, _)) = gemma {
            o = norm(&o, attn, rows);
        }
        for (x, o) in x.iter_mut().zip(&o) {
            *x += o;
        }
        let gu = matmul(&norm(&x, norms.1, rows), wts[2], rows, 2 * I, H);
        let act: Vec<f64> = (0..rows * I)
            .map(|t| {
                let (r, i) = (t / I, t % I);
                let g = gu[r * 2 * I + i];
                let a = match gemma {
                    None => g / (1.0 + (-g).exp()),
                    Some(_) => {
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh())
                    }
                };
                a * gu[r * 2 * I + I + i]
            })
            .collect();
        let mut d = matmul(&act, wts[3], rows, H, I);
        if let Some((_, mlp, _)) = gemma {
            d = norm(&d, mlp, rows);
        }
        x.iter().zip(&d).map(|(a, b)| a + b).collect()
    }

    /// The four products' weights: packed (bf16 or f32) and widened for the reference.
    struct Packs {
        bf16: [Vec<u16>; 4],
        f32: [Vec<f32>; 4],
        wide: [Vec<f64>; 4],
    }

    fn packs(f32_weights: bool) -> Packs {
        let (nq, nk) = (HEADS * D, KV * D);
        let shapes = [(nq + 2 * nk, H), (H, nq), (2 * I, H), (H, I)];
        let mut out = Packs {
            bf16: Default::default(),
            f32: Default::default(),
            wide: Default::default(),
        };
        for (i, &(n, k)) in shapes.iter().enumerate() {
            let seed = i as u64 + 1;
            if f32_weights {
                let w = values(seed, n * k, 0.3);
                let mut packed = vec![0f32; f32_linear::packed_len(n, k)];
                f32_linear::pack(&w, n, k, &mut packed).expect("pack");
                out.wide[i] = w.iter().map(|&v| f64::from(v)).collect();
                out.f32[i] = packed;
            } else {
                let (packed, wide) = product_of(seed, n, k, 0.3);
                out.bf16[i] = packed;
                out.wide[i] = wide;
            }
        }
        out
    }

    fn weights<'a>(
        p: &'a Packs,
        norms: &'a (Vec<u16>, Vec<u16>),
        f32_weights: bool,
    ) -> Weights<'a> {
        let (nq, nk) = (HEADS * D, KV * D);
        let product = |i: usize, n: usize| Product {
            packed: if f32_weights {
                Packed::F32(&p.f32[i])
            } else {
                Packed::Bf16(&p.bf16[i])
            },
            bias: None,
            n,
        };
        test_weights(
            norms,
            [
                product(0, nq + 2 * nk),
                product(1, H),
                product(2, 2 * I),
                product(3, H),
            ],
        )
    }

    /// The test layer's weights: bf16 norms, the four products (qkv, o, gate/up, down).
    fn test_weights<'a>(norms: &'a (Vec<u16>, Vec<u16>), p: [Product<'a>; 4]) -> Weights<'a> {
        let [qkv, o, gate_up, down] = p;
        Weights {
            input_norm: Elems::Bf16(&norms.0),
            post_norm: Elems::Bf16(&norms.1),
            input_eps: EPS,
            post_eps: EPS,
            qkv,
            o,
            gate_up,
            down,
            qk_norm: None,
            sandwich: None,
            norm_offset: 0.0,
            gate: Gate::Silu,
            softcap: None,
            hidden: H,
            heads: HEADS,
            kv_heads: KV,
            dim: D,
            rot: D,
            inter: I,
        }
    }

    /// What the bf16 products need of the CPU (every CPU with AMX tiles has AVX-512 BF16).
    const BF16: &[Isa] = &[Isa::Avx512F, Isa::Avx512Bf16];

    #[test]
    fn a_layer_is_the_reference_computation_to_its_rounding_with_bf16_products() {
        if require_or_skip(BF16) {
            check_layer(false, 0.03, false); // bf16 products and cache
        }
    }

    #[test]
    fn a_layer_is_the_reference_computation_to_its_rounding_with_f32_products() {
        if require_or_skip(&[Isa::Avx512F]) {
            check_layer(true, 1e-5, false); // f32 products and cache
        }
    }

    /// Gemma 2's layer: sandwich norms, `(1 + w)` norm weights, GELU gate, capped scores.
    #[test]
    fn a_gemma_layer_is_the_reference_computation_to_its_rounding() {
        if require_or_skip(&[Isa::Avx512F]) {
            check_layer(true, 1e-5, true);
        }
    }

    /// The layer against the f64 reference (within `tol` of the largest output), then a bad
    /// slot: an error naming it, x and the caches unchanged.
    fn check_layer(f32_weights: bool, tol: f64, gemma: bool) {
        let rows = 3;
        let p = packs(f32_weights);
        let norms = (round(&values(5, H, 1.0)), round(&values(6, H, 1.0)));
        let sandwich = (round(&values(11, H, 1.0)), round(&values(12, H, 1.0)));
        let mut weights = weights(&p, &norms, f32_weights);
        let cap = 0.5; // (low enough to change the scores)
        if gemma {
            weights.sandwich = Some(Sandwich {
                attn: Elems::Bf16(&sandwich.0),
                mlp: Elems::Bf16(&sandwich.1),
                eps: EPS,
            });
            weights.norm_offset = 1.0;
            weights.gate = Gate::GeluTanh;
            weights.softcap = Some(cap);
        }
        let sandwich_wide = (wide(&sandwich.0), wide(&sandwich.1));
        // rows of 5, 1 and 8 keys: the new key last, the others already cached
        let seqlens = [5i32, 1, 8];
        let tables = [0i32, 1, 2, 0, 3, 4];
        let slots: Vec<i64> = (0..rows)
            .map(|r| {
                let p = seqlens[r] as usize - 1;
                (tables[r * 2 + p / PAGE] as usize * PAGE + p % PAGE) as i64
            })
            .collect();
        let angle = values(7, rows * D, 3.0);
        let cos: Vec<f32> = angle.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angle.iter().map(|a| a.sin()).collect();
        let step = Step {
            cos: &cos,
            sin: &sin,
            slots: &slots,
            block_tables: &tables,
            seqlens: &seqlens,
            width: 2,
            page: PAGE,
            window: Window::Full,
            scale: 1.0 / (D as f32).sqrt(),
            threads: 1,
        };
        let (kv0, vv0) = (
            values(8, SLOTS * KV * D, 1.0),
            values(9, SLOTS * KV * D, 1.0),
        );
        let (mut kb, mut vb) = (round(&kv0), round(&vv0));
        let (mut kf, mut vf) = (kv0.clone(), vv0.clone());
        let (kw, vw): (Vec<f64>, Vec<f64>) = if f32_weights {
            (
                kf.iter().map(|&v| f64::from(v)).collect(),
                vf.iter().map(|&v| f64::from(v)).collect(),
            )
        } else {
            (wide(&kb), wide(&vb))
        };
        let x0 = values(10, rows * H, 1.0);
        let wide_refs = [
            &p.wide[0][..],
            &p.wide[1][..],
            &p.wide[2][..],
            &p.wide[3][..],
        ];
        let want = reference(
            &x0,
            (&wide(&norms.0), &wide(&norms.1)),
            wide_refs,
            &kw,
            &vw,
            &step,
            rows,
            gemma.then_some((&sandwich_wide.0[..], &sandwich_wide.1[..], cap as f64)),
        );
        let mut x = x0.clone();
        let (kc, vc) = caches(f32_weights, &mut kb, &mut vb, &mut kf, &mut vf);
        decoder_layer(&weights, &step, &mut x, kc, vc).expect("layer");
        let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
        for (got, want) in x.iter().zip(&want) {
            assert!(
                (*got as f64 - want).abs() <= tol * scale,
                "{got} vs {want} (scale {scale})"
            );
        }
        let before = (x.clone(), kb.clone(), vb.clone(), kf.clone(), vf.clone());
        let bad = [0i64, 1, SLOTS as i64];
        let (kc, vc) = caches(f32_weights, &mut kb, &mut vb, &mut kf, &mut vf);
        let err = decoder_layer(
            &weights,
            &Step {
                slots: &bad,
                ..step
            },
            &mut x,
            kc,
            vc,
        )
        .expect_err("slot out of range");
        assert_eq!(err.field(), Some("slots"));
        let now = || (x.clone(), kb.clone(), vb.clone(), kf.clone(), vf.clone());
        assert_eq!(before, now());
        if gemma {
            let bad = [
                (f32::NAN, Some(cap), "norm_offset"),
                (1.0, Some(0.0), "softcap"),
                (1.0, Some(f32::INFINITY), "softcap"),
            ];
            for (norm_offset, softcap, field) in bad {
                let w = Weights {
                    norm_offset,
                    softcap,
                    ..weights
                };
                let (kc, vc) = caches(f32_weights, &mut kb, &mut vb, &mut kf, &mut vf);
                let err = decoder_layer(&w, &step, &mut x, kc, vc).expect_err(field);
                assert_eq!(err.field(), Some(field));
            }
            assert_eq!(before, (x, kb, vb, kf, vf));
        }
    }

    /// The f32 caches for f32 weights, else the bf16 ones.
    fn caches<'a>(
        f32_weights: bool,
        kb: &'a mut [u16],
        vb: &'a mut [u16],
        kf: &'a mut [f32],
        vf: &'a mut [f32],
    ) -> (ElemsMut<'a>, ElemsMut<'a>) {
        if f32_weights {
            (ElemsMut::F32(kf), ElemsMut::F32(vf))
        } else {
            (ElemsMut::Bf16(kb), ElemsMut::Bf16(vb))
        }
    }

    #[test]
    fn half_panels_give_the_bits_of_their_widened_f32_weights() {
        if !require_or_skip(&[Isa::Avx512F]) {
            return;
        }
        let (nq, nk) = (HEADS * D, KV * D);
        let shapes = [(nq + 2 * nk, H), (H, nq), (2 * I, H), (H, I)];
        let mut half: [Vec<u16>; 4] = Default::default();
        let mut widened = packs(true);
        for (i, &(n, k)) in shapes.iter().enumerate() {
            let w = round(&values(i as u64 + 1, n * k, 0.3));
            half[i] = vec![0u16; f32_linear::packed_len(n, k)];
            f32_linear::pack_half(f32_linear::Half::Bf16, &w, n, k, &mut half[i]).expect("pack");
            let wide: Vec<f32> = w.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
            f32_linear::pack(&wide, n, k, &mut widened.f32[i]).expect("pack");
        }
        let norms = (round(&values(5, H, 1.0)), round(&values(6, H, 1.0)));
        let f32_weights = weights(&widened, &norms, true);
        let mut half_weights = f32_weights;
        for (p, h) in [
            &mut half_weights.qkv,
            &mut half_weights.o,
            &mut half_weights.gate_up,
            &mut half_weights.down,
        ]
        .into_iter()
        .zip(&half)
        {
            p.packed = Packed::Half(f32_linear::Half::Bf16, h);
        }
        let step = Step {
            cos: &[1.0; 2 * D],
            sin: &[0.0; 2 * D],
            slots: &[0, 9],
            block_tables: &[0, 2],
            seqlens: &[1, 2],
            width: 1,
            page: PAGE,
            window: Window::Full,
            scale: 0.5,
            threads: 2,
        };
        let run = |w: &Weights<'_>| {
            let mut x = values(11, 2 * H, 1.0);
            let (mut kc, mut vc) = (
                values(12, SLOTS * KV * D, 1.0),
                vec![0.5f32; SLOTS * KV * D],
            );
            decoder_layer(
                w,
                &step,
                &mut x,
                ElemsMut::F32(&mut kc),
                ElemsMut::F32(&mut vc),
            )
            .expect("layer");
            (x, kc, vc)
        };
        let (got, want) = (run(&half_weights), run(&f32_weights));
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.0), bits(&want.0));
        assert_eq!((bits(&got.1), bits(&got.2)), (bits(&want.1), bits(&want.2)));
    }

    #[test]
    fn mixed_weight_kinds_are_refused_naming_the_product() {
        if !require_or_skip(BF16) {
            return;
        }
        let (pb, pf) = (packs(false), packs(true));
        let norms = (round(&values(5, H, 1.0)), round(&values(6, H, 1.0)));
        let mut w = weights(&pb, &norms, false);
        w.down.packed = Packed::F32(&pf.f32[3]);
        let step = Step {
            cos: &[0.0; D],
            sin: &[0.0; D],
            slots: &[0],
            block_tables: &[0],
            seqlens: &[1],
            width: 1,
            page: PAGE,
            window: Window::Full,
            scale: 1.0,
            threads: 1,
        };
        let mut x = vec![0f32; H];
        let (mut kc, mut vc) = (vec![0u16; SLOTS * KV * D], vec![0u16; SLOTS * KV * D]);
        let err = decoder_layer(
            &w,
            &step,
            &mut x,
            ElemsMut::Bf16(&mut kc),
            ElemsMut::Bf16(&mut vc),
        )
        .expect_err("mixed kinds");
        assert_eq!(err.field(), Some("down"));
    }

    /// GGUF Q8_0 rows of `values(seed, n * k, 0.3)`: a block's fp16 scale, its 32 codes.
    fn q8_0_rows(seed: u64, n: usize, k: usize) -> Vec<u8> {
        let w = values(seed, n * k, 0.3);
        let mut out = Vec::with_capacity(n * k / 32 * 34);
        for block in w.chunks_exact(32) {
            let top = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = half::f16::from_f32(top / 127.0);
            out.extend_from_slice(&d.to_le_bytes());
            let d = d.to_f32();
            out.extend(block.iter().map(|v| {
                (if d > 0.0 { (v / d).round() } else { 0.0 }).clamp(-127.0, 127.0) as i8 as u8
            }));
        }
        out
    }

    /// The four products as Q8_0: per product its GGUF rows, the rows packed, and the rows
    /// dequantized and packed for `f32_linear`.
    struct QuantPacks {
        rows: [Vec<u8>; 4],
        packed: [Vec<u8>; 4],
        f32: [Vec<f32>; 4],
    }

    const SHAPES: [(usize, usize); 4] = [
        (HEADS * D + 2 * KV * D, H),
        (H, HEADS * D),
        (2 * I, H),
        (H, I),
    ];

    fn quant_packs() -> QuantPacks {
        let mut out = QuantPacks {
            rows: Default::default(),
            packed: Default::default(),
            f32: Default::default(),
        };
        for (i, &(n, k)) in SHAPES.iter().enumerate() {
            let rows = q8_0_rows(i as u64 + 21, n, k);
            let mut packed = vec![0u8; quant::packed_len(QType::Q8_0, n, k).expect("len")];
            quant::pack(QType::Q8_0, &rows, n, k, &mut packed, 1).expect("pack");
            let mut w = vec![0f32; n * k];
            quant::dequantize(QType::Q8_0, &rows, n, k, &mut w).expect("dequantize");
            let mut f = vec![0f32; f32_linear::packed_len(n, k)];
            f32_linear::pack(&w, n, k, &mut f).expect("pack");
            (out.rows[i], out.packed[i], out.f32[i]) = (rows, packed, f);
        }
        out
    }

    /// A step of `rows` decode rows (2 chunks each), keys 1.. cached before.
    fn quant_step<'a>(rows: usize, cos: &'a [f32], sin: &'a [f32], meta: &'a StepRows) -> Step<'a> {
        Step {
            cos: &cos[..rows * D],
            sin: &sin[..rows * D],
            slots: &meta.slots[..rows],
            block_tables: &meta.tables[..rows * 2],
            seqlens: &meta.seqlens[..rows],
            width: 2,
            page: PAGE,
            window: Window::Full,
            scale: 0.4,
            threads: 2,
        }
    }

    struct StepRows {
        slots: Vec<i64>,
        tables: Vec<i32>,
        seqlens: Vec<i32>,
    }

    fn step_rows() -> StepRows {
        // row r: chunks 2r, 2r + 1, r + 2 keys, the new one last
        let seqlens: Vec<i32> = (0..3).map(|r| r + 2).collect();
        let tables: Vec<i32> = (0..6).collect();
        let slots = (0..3)
            .map(|r| {
                let p = seqlens[r] as usize - 1;
                (tables[r * 2 + p / PAGE] as usize * PAGE + p % PAGE) as i64
            })
            .collect();
        StepRows {
            slots,
            tables,
            seqlens,
        }
    }

    /// `w` on `rows` rows from fixed x and f32 caches: (x, k cache, v cache) after.
    fn run_f32_cache(w: &Weights<'_>, s: &Step<'_>) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let rows = s.slots.len();
        let mut x = values(31, rows * H, 1.0);
        let (mut kc, mut vc) = (
            values(32, SLOTS * KV * D, 1.0),
            values(33, SLOTS * KV * D, 1.0),
        );
        decoder_layer(w, s, &mut x, ElemsMut::F32(&mut kc), ElemsMut::F32(&mut vc)).expect("layer");
        (x, kc, vc)
    }

    fn quant_weights<'a>(
        norms: &'a (Vec<u16>, Vec<u16>),
        parts: [&'a [QuantPart<'a>]; 4],
        bias: Option<&'a [f32]>,
    ) -> Weights<'a> {
        let product = |i: usize| Product {
            packed: Packed::Quant {
                parts: parts[i],
                backend: quant::Backend::auto(),
            },
            bias: if i == 0 { bias } else { None },
            n: SHAPES[i].0,
        };
        test_weights(norms, std::array::from_fn(product))
    }

    fn whole<'a>(q: &'a QuantPacks) -> [[QuantPart<'a>; 1]; 4] {
        std::array::from_fn(|i| {
            [QuantPart {
                qtype: QType::Q8_0,
                packed: &q.packed[i],
                n: SHAPES[i].0,
            }]
        })
    }

    #[test]
    fn a_quantized_layer_is_its_dequantized_f32_layer_to_the_activations_rounding() {
        if !require_or_skip(&[Isa::Avx512F]) {
            return; // (the f32 layer it is compared with runs on f32_linear)
        }
        let q = quant_packs();
        let norms = (round(&values(5, H, 1.0)), round(&values(6, H, 1.0)));
        let parts = whole(&q);
        let quant = quant_weights(&norms, [&parts[0], &parts[1], &parts[2], &parts[3]], None);
        let mut f32_weights = quant;
        for (p, f) in [
            &mut f32_weights.qkv,
            &mut f32_weights.o,
            &mut f32_weights.gate_up,
            &mut f32_weights.down,
        ]
        .into_iter()
        .zip(&q.f32)
        {
            p.packed = Packed::F32(f);
        }
        let angle = values(7, 3 * D, 3.0);
        let cos: Vec<f32> = angle.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angle.iter().map(|a| a.sin()).collect();
        let meta = step_rows();
        for rows in [1, 3] {
            let s = quant_step(rows, &cos, &sin, &meta);
            let (got, want) = (run_f32_cache(&quant, &s), run_f32_cache(&f32_weights, &s));
            for (g, w) in [(&got.0, &want.0), (&got.1, &want.1), (&got.2, &want.2)] {
                let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                let off = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(off <= 0.02 * scale, "rows {rows}: off by {off} of {scale}");
            }
            assert_ne!(
                got.0, want.0,
                "the activations are quantized: not the f32 bits"
            );
        }
    }

    #[test]
    fn stacked_quantized_parts_give_the_bits_of_one_part() {
        let q = quant_packs();
        let norms = (round(&values(5, H, 1.0)), round(&values(6, H, 1.0)));
        let parts = whole(&q);
        // q and k (rows 0 .. nq + nk of the stacked qkv) as one part, v as another
        let (n0, k) = (HEADS * D + KV * D, H);
        let (head, tail) = q.rows[0].split_at(n0 * k / 32 * 34);
        let mut split = Vec::new();
        for (rows, n) in [(head, n0), (tail, KV * D)] {
            let mut packed = vec![0u8; quant::packed_len(QType::Q8_0, n, k).expect("len")];
            quant::pack(QType::Q8_0, rows, n, k, &mut packed, 1).expect("pack");
            split.push((packed, n));
        }
        let two = [
            QuantPart {
                qtype: QType::Q8_0,
                packed: &split[0].0,
                n: split[0].1,
            },
            QuantPart {
                qtype: QType::Q8_0,
                packed: &split[1].0,
                n: split[1].1,
            },
        ];
        let bias = values(41, SHAPES[0].0, 0.5);
        let one = quant_weights(
            &norms,
            [&parts[0], &parts[1], &parts[2], &parts[3]],
            Some(&bias),
        );
        let stacked = quant_weights(&norms, [&two, &parts[1], &parts[2], &parts[3]], Some(&bias));
        let angle = values(7, 3 * D, 3.0);
        let cos: Vec<f32> = angle.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angle.iter().map(|a| a.sin()).collect();
        let meta = step_rows();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for rows in [1, 3] {
            let s = quant_step(rows, &cos, &sin, &meta);
            let (got, want) = (run_f32_cache(&stacked, &s), run_f32_cache(&one, &s));
            assert_eq!(bits(&got.0), bits(&want.0), "rows {rows}");
            assert_eq!((bits(&got.1), bits(&got.2)), (bits(&want.1), bits(&want.2)));
        }
    }

    #[test]
    fn quantized_parts_that_do_not_make_the_product_are_refused_naming_it() {
        let q = quant_packs();
        let norms = (round(&values(5, H, 1.0)), round(&values(6, H, 1.0)));
        let parts = whole(&q);
        let short = [QuantPart {
            n: SHAPES[2].0 - 16,
            ..parts[2][0]
        }];
        let cut = [QuantPart {
            packed: &q.packed[3][1..],
            ..parts[3][0]
        }];
        let other = [QuantPart {
            qtype: QType::Q4_0,
            ..parts[1][0]
        }];
        let meta = step_rows();
        let (cos, sin) = ([1f32; 3 * D], [0f32; 3 * D]);
        let s = quant_step(1, &cos, &sin, &meta);
        for (field, w) in [
            ("gate_up", [&parts[0][..], &parts[1], &short, &parts[3]]),
            ("down", [&parts[0][..], &parts[1], &parts[2], &cut]),
            ("o", [&parts[0][..], &other, &parts[2], &parts[3]]),
            ("qkv", [&[][..], &parts[1], &parts[2], &parts[3]]),
        ] {
            let w = quant_weights(&norms, w, None);
            let mut x = vec![0.5f32; H];
            let (mut kc, mut vc) = (vec![0f32; SLOTS * KV * D], vec![0f32; SLOTS * KV * D]);
            let err = decoder_layer(
                &w,
                &s,
                &mut x,
                ElemsMut::F32(&mut kc),
                ElemsMut::F32(&mut vc),
            )
            .expect_err(field);
            assert_eq!(err.field(), Some(field), "{err}");
            assert!(x.iter().all(|&v| v == 0.5) && kc.iter().all(|&v| v == 0.0));
        }
    }
}
