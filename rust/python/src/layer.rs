//! PyO3 wrapper of `ferrobatch-kernels`' whole decoder layer (`layer`): a `LeanLayer` holds
//! one layer's packed weights and norms (numpy views, checked once when it is made), and
//! `forward` runs the layer on a step's decode rows with the GIL released. Kept thin: every
//! shape the kernel needs is checked here or by the kernel, with a `FieldError` naming the
//! argument.

use ferrobatch_kernels::fused::Gate;
use ferrobatch_kernels::layer::{
    self, Packed as PackedWeight, Product, QkNorm, QuantPart, Sandwich, Step, Weights,
};
use ferrobatch_kernels::quant::{self, Backend, QType};
use ferrobatch_kernels::{amx, f32_linear, Window};
use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use std::ops::Range;

use crate::errors::{invalid, kernel_error};
use crate::views::{disjoint, expect_shape, ro, rw, threads_of, two_d, ty, In, Out, Span, Ty};

/// How a layer's products are packed (`weight_dtype`).
#[derive(Clone, Copy)]
enum Kind {
    /// bf16 bits in `amx_pack`'s layout ("bfloat16")
    Amx,
    /// float32 in `f32_pack`'s layout ("float32")
    F32,
    /// bf16 / fp16 bits in `f32_pack_half`'s layout ("bfloat16_panels", "float16_panels")
    Half(f32_linear::Half),
    /// GGUF quantized parts in `quant_pack`'s layout ("quantized")
    Quant,
}

impl Kind {
    fn of(weight_dtype: &str) -> PyResult<Self> {
        Ok(match weight_dtype {
            "bfloat16" => Kind::Amx,
            "float32" => Kind::F32,
            "bfloat16_panels" => Kind::Half(f32_linear::Half::Bf16),
            "float16_panels" => Kind::Half(f32_linear::Half::F16),
            "quantized" => Kind::Quant,
            other => {
                return Err(invalid(
                    "weight_dtype",
                    format!(
                        "weight_dtype must be \"bfloat16\", \"float32\", \"bfloat16_panels\", \
                         \"float16_panels\" or \"quantized\", not {other:?}"
                    ),
                ))
            }
        })
    }
}

/// One packed product: the array (`kind`'s layout) or, quantized, its parts (type, packed
/// rows, output rows), its optional bias and its shape.
struct Packed {
    packed: Py<PyAny>,
    parts: Vec<(QType, Py<PyAny>, usize)>,
    bias: Option<Py<PyAny>>,
    n: usize,
    kind: Kind,
}

impl Packed {
    fn new(
        field: &'static str,
        packed: &Bound<'_, PyAny>,
        bias: Option<&Bound<'_, PyAny>>,
        (n, k): (usize, usize),
        kind: Kind,
    ) -> PyResult<Self> {
        let mut parts = Vec::new();
        let (len, want, layout) = match kind {
            Kind::F32 => {
                let p = ro::<f32>(packed, field, "float32 (f32_pack's layout)")?;
                (p.len(), f32_linear::packed_len(n, k), "f32_packed_len")
            }
            Kind::Half(_) => {
                let p = ro::<u16>(packed, field, "uint16 (f32_pack_half's layout)")?;
                (p.len(), f32_linear::packed_len(n, k), "f32_packed_len")
            }
            Kind::Amx => {
                let p = ro::<u16>(packed, field, "uint16 (amx_pack's layout)")?;
                (p.len(), amx::packed_len(n, k), "amx_packed_len")
            }
            Kind::Quant => {
                parts = quant_parts(field, packed, (n, k))?;
                (0, 0, "")
            }
        };
        if len != want {
            return Err(invalid(
                field,
                format!("{field} has {len} elements, not {layout}({n}, {k}) = {want}"),
            ));
        }
        if let Some(b) = bias {
            let b = ro::<f32>(b, "bias", "float32")?;
            if b.len() != n {
                return Err(invalid(
                    "bias",
                    format!("{field}'s bias has {} elements, not {n}", b.len()),
                ));
            }
        }
        Ok(Packed {
            packed: packed.clone().unbind(),
            parts,
            bias: bias.map(|b| b.clone().unbind()),
            n,
            kind,
        })
    }
}

/// A quantized product's parts: `parts` a sequence of (qtype, uint8 array in
/// `quant_pack`'s layout, rows) whose rows add up to `n`, each packed whole for `k` inputs.
pub(crate) fn quant_parts(
    field: &'static str,
    parts: &Bound<'_, PyAny>,
    (n, k): (usize, usize),
) -> PyResult<Vec<(QType, Py<PyAny>, usize)>> {
    let shape = || {
        invalid(
            field,
            format!("{field} must be a sequence of (qtype, packed uint8 array, rows) parts"),
        )
    };
    let mut out = Vec::new();
    for item in parts.try_iter().map_err(|_| shape())? {
        let (qtype, packed, rows): (String, Bound<'_, PyAny>, usize) =
            item?.extract().map_err(|_| shape())?;
        let qt = crate::quant::qtype_of(&qtype)?;
        let got = ro::<u8>(&packed, field, "uint8 (quant_pack's layout)")?.len();
        let want = quant::packed_len(qt, rows, k).map_err(kernel_error)?;
        if got != want {
            return Err(invalid(
                field,
                format!(
                    "{field}'s {qtype} part of {rows} rows has {got} bytes, not \
                     quant_packed_len({qtype:?}, {rows}, {k}) = {want}"
                ),
            ));
        }
        out.push((qt, packed.unbind(), rows));
    }
    let rows: usize = out.iter().map(|p| p.2).sum();
    if out.is_empty() || rows != n {
        return Err(invalid(
            field,
            format!("{field}'s parts have {rows} rows in all, not {n}"),
        ));
    }
    Ok(out)
}

/// A borrowed packed weight.
enum PackedView<'py> {
    Bf16(PyReadonlyArrayDyn<'py, u16>),
    F32(PyReadonlyArrayDyn<'py, f32>),
    Half(f32_linear::Half, PyReadonlyArrayDyn<'py, u16>),
    Quant(Vec<(QType, PyReadonlyArrayDyn<'py, u8>, usize)>),
}

/// The borrowed views of one product for a call.
struct Views<'py> {
    packed: PackedView<'py>,
    bias: Option<PyReadonlyArrayDyn<'py, f32>>,
    n: usize,
}

impl<'py> Views<'py> {
    fn of(py: Python<'py>, p: &Packed, field: &'static str) -> PyResult<Self> {
        let a = p.packed.bind(py);
        Ok(Views {
            packed: match p.kind {
                Kind::F32 => PackedView::F32(ro::<f32>(a, field, "float32")?),
                Kind::Half(half) => PackedView::Half(half, ro::<u16>(a, field, "uint16")?),
                Kind::Amx => PackedView::Bf16(ro::<u16>(a, field, "uint16")?),
                Kind::Quant => PackedView::Quant(
                    p.parts
                        .iter()
                        .map(|(qt, a, n)| Ok((*qt, ro::<u8>(a.bind(py), field, "uint8")?, *n)))
                        .collect::<PyResult<_>>()?,
                ),
            },
            bias: p
                .bias
                .as_ref()
                .map(|b| ro::<f32>(b.bind(py), "bias", "float32"))
                .transpose()?,
            n: p.n,
        })
    }

    /// A quantized product's parts as the kernel takes them (none for the other kinds).
    fn quant_parts(&self) -> PyResult<Vec<QuantPart<'_>>> {
        match &self.packed {
            PackedView::Quant(parts) => parts
                .iter()
                .map(|(qtype, a, n)| {
                    Ok(QuantPart {
                        qtype: *qtype,
                        packed: a.as_slice()?,
                        n: *n,
                    })
                })
                .collect(),
            _ => Ok(Vec::new()),
        }
    }

    /// The product, its quantized parts (if any) being `parts` on `backend`.
    fn product<'s>(
        &'s self,
        parts: &'s [QuantPart<'s>],
        backend: Backend,
    ) -> PyResult<Product<'s>> {
        Ok(Product {
            packed: match &self.packed {
                PackedView::Bf16(a) => PackedWeight::Bf16(a.as_slice()?),
                PackedView::F32(a) => PackedWeight::F32(a.as_slice()?),
                PackedView::Half(half, a) => PackedWeight::Half(*half, a.as_slice()?),
                PackedView::Quant(_) => PackedWeight::Quant { parts, backend },
            },
            bias: self.bias.as_ref().map(|b| b.as_slice()).transpose()?,
            n: self.n,
        })
    }
}

/// A Llama-style decoder layer run by `forward` in one call: `input_norm` / `post_norm`
/// [hidden] in `norm_dtype`, the packed products `qkv` [heads * dim + 2 * kv_heads * dim,
/// hidden], `o` [hidden, heads * dim], `gate_up` [2 * inter, hidden], `down` [hidden, inter],
/// each with an optional float32 bias: `amx_pack`ed bf16 with `weight_dtype` "bfloat16"
/// (the products' inputs rounded to bf16), `f32_pack`ed with "float32" (f32 inputs),
/// `f32_pack_half`ed bf16 / fp16 with "bfloat16_panels" / "float16_panels" (f32 inputs;
/// bit for bit "float32" over the widened weights), or with "quantized" each product a
/// sequence of GGUF parts (qtype, `quant_pack`ed uint8 rows, rows) stacked in order (f32
/// inputs, each row quantized to int8 in the product, as `quant_linear`; the backend is
/// `quant_backend()`'s at each call). Gemma 2 / 3 layers add `post_attn_norm` /
/// `post_mlp_norm` [hidden] (the attention's and the MLP's outputs normalized before the
/// residual, with `sandwich_eps`), `norm_offset` 1.0 (every norm weight counts as `1 + w`),
/// `activation` "gelu_pytorch_tanh" (else "silu") and, Gemma 2, `softcap` (attention scores
/// capped as `softcap * tanh(score / softcap)`). The arrays are kept (not copied): the
/// caller must not change them while the layer is in use.
#[pyclass(frozen, module = "ferrobatch._core")]
pub struct LeanLayer {
    input_norm: Py<PyAny>,
    post_norm: Py<PyAny>,
    norm_ty: Ty,
    eps: (f32, f32),
    qkv: Packed,
    o: Packed,
    gate_up: Packed,
    down: Packed,
    /// per-head q / k norm weights [dim] (in `norm_ty`) and their epsilon (Qwen3)
    qk_norm: Option<(Py<PyAny>, Py<PyAny>, f32)>,
    /// Gemma's norms of the attention's and the MLP's outputs (in `norm_ty`), their epsilon
    sandwich: Option<(Py<PyAny>, Py<PyAny>, f32)>,
    norm_offset: f32,
    gate: Gate,
    softcap: Option<f32>,
    /// the rotated columns of each head (`dim` unless the rope covers part of each head)
    rot: usize,
    dims: [usize; 5],
}

#[pymethods]
impl LeanLayer {
    #[new]
    #[pyo3(signature = (*, input_norm, post_norm, norm_dtype, input_eps, post_eps, qkv, o,
                        gate_up, down, hidden, heads, kv_heads, dim, inter, qkv_bias = None,
                        o_bias = None, gate_up_bias = None, down_bias = None,
                        weight_dtype = "bfloat16", q_norm = None, k_norm = None,
                        qk_norm_eps = 1e-6, post_attn_norm = None, post_mlp_norm = None,
                        sandwich_eps = 1e-6, norm_offset = 0.0, activation = "silu",
                        softcap = None, rot = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        input_norm: &Bound<'_, PyAny>,
        post_norm: &Bound<'_, PyAny>,
        norm_dtype: &str,
        input_eps: f32,
        post_eps: f32,
        qkv: &Bound<'_, PyAny>,
        o: &Bound<'_, PyAny>,
        gate_up: &Bound<'_, PyAny>,
        down: &Bound<'_, PyAny>,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        dim: usize,
        inter: usize,
        qkv_bias: Option<&Bound<'_, PyAny>>,
        o_bias: Option<&Bound<'_, PyAny>>,
        gate_up_bias: Option<&Bound<'_, PyAny>>,
        down_bias: Option<&Bound<'_, PyAny>>,
        weight_dtype: &str,
        q_norm: Option<&Bound<'_, PyAny>>,
        k_norm: Option<&Bound<'_, PyAny>>,
        qk_norm_eps: f32,
        post_attn_norm: Option<&Bound<'_, PyAny>>,
        post_mlp_norm: Option<&Bound<'_, PyAny>>,
        sandwich_eps: f32,
        norm_offset: f32,
        activation: &str,
        softcap: Option<f32>,
        rot: Option<usize>,
    ) -> PyResult<Self> {
        let kind = Kind::of(weight_dtype)?;
        if [hidden, heads, kv_heads, dim, inter].contains(&0) {
            return Err(invalid(
                "hidden",
                "hidden, heads, kv_heads, dim and inter must all be >= 1",
            ));
        }
        if !dim.is_multiple_of(2) || !heads.is_multiple_of(kv_heads) {
            return Err(invalid(
                "dim",
                format!("dim must be even and heads ({heads}) a multiple of kv_heads ({kv_heads})"),
            ));
        }
        let norm_ty = ty(norm_dtype, "norm_dtype")?;
        let norms = [("input_norm", input_norm), ("post_norm", post_norm)];
        check_norms(norms, norm_ty, ("hidden", hidden))?;
        let qk_norm = norm_pair(
            ("q_norm", q_norm),
            ("k_norm", k_norm),
            norm_ty,
            ("dim", dim),
        )?
        .map(|(q, k)| (q, k, qk_norm_eps));
        let sandwich = norm_pair(
            ("post_attn_norm", post_attn_norm),
            ("post_mlp_norm", post_mlp_norm),
            norm_ty,
            ("hidden", hidden),
        )?
        .map(|(a, m)| (a, m, sandwich_eps));
        let gate = Gate::from_name(activation).ok_or_else(|| {
            invalid(
                "activation",
                format!("activation must be \"silu\" or \"gelu_pytorch_tanh\", not {activation:?}"),
            )
        })?;
        if !norm_offset.is_finite() {
            return Err(invalid("norm_offset", "norm_offset must be finite"));
        }
        if softcap.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
            return Err(invalid(
                "softcap",
                format!("softcap must be finite and > 0, not {softcap:?}"),
            ));
        }
        let rot = rot.unwrap_or(dim);
        if !rot.is_multiple_of(2) || rot > dim {
            return Err(invalid(
                "rot",
                format!("rot must be even and at most dim = {dim}, not {rot}"),
            ));
        }
        let (nq, nk) = (heads * dim, kv_heads * dim);
        Ok(LeanLayer {
            input_norm: input_norm.clone().unbind(),
            post_norm: post_norm.clone().unbind(),
            norm_ty,
            eps: (input_eps, post_eps),
            qkv: Packed::new("qkv", qkv, qkv_bias, (nq + 2 * nk, hidden), kind)?,
            o: Packed::new("o", o, o_bias, (hidden, nq), kind)?,
            gate_up: Packed::new("gate_up", gate_up, gate_up_bias, (2 * inter, hidden), kind)?,
            down: Packed::new("down", down, down_bias, (hidden, inter), kind)?,
            qk_norm,
            sandwich,
            norm_offset,
            gate,
            softcap,
            rot,
            dims: [hidden, heads, kv_heads, dim, inter],
        })
    }

    /// The layer on `x` float32 [rows, hidden] (updated in place): the rows' new keys and
    /// values written at `slots` (int64 [rows]) of `k_cache` / `v_cache` ([slots, kv_heads,
    /// dim] in `cache_dtype`), then every row attended by the decode kernel over
    /// `block_tables` (int32 [rows, width]) and `seqlens` (int32 [rows], the new token
    /// included) with the rotary `cos` / `sin` float32 [rows, dim]. `window` 0 = full
    /// attention. Parts split over at most `threads` threads of the kernel pool.
    #[pyo3(signature = (x, k_cache, v_cache, cos, sin, slots, block_tables, seqlens, *,
                        cache_dtype, page, window, scale, threads))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        k_cache: &Bound<'_, PyAny>,
        v_cache: &Bound<'_, PyAny>,
        cos: &Bound<'_, PyAny>,
        sin: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        block_tables: &Bound<'_, PyAny>,
        seqlens: &Bound<'_, PyAny>,
        cache_dtype: &str,
        page: usize,
        window: usize,
        scale: f32,
        threads: i64,
    ) -> PyResult<()> {
        let args = StepArgs {
            cos,
            sin,
            slots,
            block_tables,
            seqlens,
            cache_dtype,
            page,
            window,
            scale,
            threads,
        };
        run_layers(py, &[self], x, &[k_cache], &[v_cache], &args, (&[], &[0]))
    }
}

/// `layers` (a model's decoder layers in order, each a `LeanLayer`) on `x` float32 [rows,
/// hidden] in one call: layer `i` with `k_caches[i]` / `v_caches[i]`, every layer over the
/// same step (`LeanLayer.forward`'s other arguments, shared: one rope, one scale). A model
/// whose layers attend in more than one way (sliding and full layers) gives the other
/// attention groups' `(slots, block_tables, seqlens, window, rope)` in `groups` (`rope`
/// None, or the group's own `(cos, sin)`: Gemma 3's local and global layers) and each
/// layer's group in `group_of` (0: the positional arguments' group, `i`: `groups[i - 1]`).
/// Bit for bit the layers' own `forward` calls in order; the caches must not overlap one
/// another or `x`.
#[pyfunction]
#[pyo3(signature = (layers, x, k_caches, v_caches, cos, sin, slots, block_tables, seqlens, *,
                    cache_dtype, page, window, scale, threads, groups = None,
                    group_of = None))]
#[allow(clippy::too_many_arguments)]
pub fn lean_layers_forward(
    py: Python<'_>,
    layers: Vec<PyRef<'_, LeanLayer>>,
    x: &Bound<'_, PyAny>,
    k_caches: Vec<Bound<'_, PyAny>>,
    v_caches: Vec<Bound<'_, PyAny>>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    block_tables: &Bound<'_, PyAny>,
    seqlens: &Bound<'_, PyAny>,
    cache_dtype: &str,
    page: usize,
    window: usize,
    scale: f32,
    threads: i64,
    groups: Option<Vec<GroupArgs<'_>>>,
    group_of: Option<Vec<usize>>,
) -> PyResult<()> {
    if layers.is_empty() || k_caches.len() != layers.len() || v_caches.len() != layers.len() {
        return Err(invalid(
            "k_caches",
            format!(
                "one k_cache and one v_cache a layer: {} layers, {} k_caches, {} v_caches \
                 (at least one layer)",
                layers.len(),
                k_caches.len(),
                v_caches.len()
            ),
        ));
    }
    let groups = groups.unwrap_or_default();
    let group_of = group_of.unwrap_or_else(|| vec![0; layers.len()]);
    if group_of.len() != layers.len() || group_of.iter().any(|&g| g > groups.len()) {
        return Err(invalid(
            "group_of",
            format!(
                "group_of must give each of the {} layers a group in 0 ..= {}, not {group_of:?}",
                layers.len(),
                groups.len()
            ),
        ));
    }
    let args = StepArgs {
        cos,
        sin,
        slots,
        block_tables,
        seqlens,
        cache_dtype,
        page,
        window,
        scale,
        threads,
    };
    let layers: Vec<&LeanLayer> = layers.iter().map(|l| &**l).collect();
    let k: Vec<&Bound<'_, PyAny>> = k_caches.iter().collect();
    let v: Vec<&Bound<'_, PyAny>> = v_caches.iter().collect();
    run_layers(py, &layers, x, &k, &v, &args, (&groups, &group_of))
}

/// Another attention group's `(slots, block_tables, seqlens, window)` for
/// `lean_layers_forward`, and its own `(cos, sin)` where its layers get another rope.
type GroupArgs<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    usize,
    Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
);

/// A step's arguments every layer of a call shares.
struct StepArgs<'a, 'py> {
    cos: &'a Bound<'py, PyAny>,
    sin: &'a Bound<'py, PyAny>,
    slots: &'a Bound<'py, PyAny>,
    block_tables: &'a Bound<'py, PyAny>,
    seqlens: &'a Bound<'py, PyAny>,
    cache_dtype: &'a str,
    page: usize,
    window: usize,
    scale: f32,
    threads: i64,
}

/// `FieldError` unless every norm is a `ty` vector of `len` (named `len.0`) elements.
fn check_norms<const N: usize>(
    norms: [(&'static str, &Bound<'_, PyAny>); N],
    ty: Ty,
    (what, len): (&str, usize),
) -> PyResult<()> {
    for (field, norm) in norms {
        let n = In::new(norm, ty, field)?;
        if n.shape() != [len] {
            return Err(invalid(
                field,
                format!("{field} must be [{what}] = [{len}], not {:?}", n.shape()),
            ));
        }
    }
    Ok(())
}

/// Two norms given together or not at all (q and k, or Gemma's post-attention and post-MLP
/// norms), each checked as [`check_norms`] does.
fn norm_pair(
    (a_field, a): (&'static str, Option<&Bound<'_, PyAny>>),
    (b_field, b): (&'static str, Option<&Bound<'_, PyAny>>),
    ty: Ty,
    len: (&str, usize),
) -> PyResult<Option<(Py<PyAny>, Py<PyAny>)>> {
    match (a, b) {
        (None, None) => Ok(None),
        (Some(a), Some(b)) => {
            check_norms([(a_field, a), (b_field, b)], ty, len)?;
            Ok(Some((a.clone().unbind(), b.clone().unbind())))
        }
        _ => Err(invalid(
            a_field,
            format!("{a_field} and {b_field} are given together or not at all"),
        )),
    }
}

/// The borrowed norms and products of one layer for a call.
struct LayerViews<'py> {
    norms: (In<'py>, In<'py>),
    qk: Option<(In<'py>, In<'py>, f32)>,
    sandwich: Option<(In<'py>, In<'py>, f32)>,
    products: [Views<'py>; 4],
}

impl LeanLayer {
    fn views<'py>(&self, py: Python<'py>) -> PyResult<LayerViews<'py>> {
        Ok(LayerViews {
            norms: (
                In::new(self.input_norm.bind(py), self.norm_ty, "input_norm")?,
                In::new(self.post_norm.bind(py), self.norm_ty, "post_norm")?,
            ),
            qk: match &self.qk_norm {
                None => None,
                Some((q, k, eps)) => Some((
                    In::new(q.bind(py), self.norm_ty, "q_norm")?,
                    In::new(k.bind(py), self.norm_ty, "k_norm")?,
                    *eps,
                )),
            },
            sandwich: match &self.sandwich {
                None => None,
                Some((a, m, eps)) => Some((
                    In::new(a.bind(py), self.norm_ty, "post_attn_norm")?,
                    In::new(m.bind(py), self.norm_ty, "post_mlp_norm")?,
                    *eps,
                )),
            },
            products: [
                Views::of(py, &self.qkv, "qkv")?,
                Views::of(py, &self.o, "o")?,
                Views::of(py, &self.gate_up, "gate_up")?,
                Views::of(py, &self.down, "down")?,
            ],
        })
    }

    /// `FieldError` unless `k_cache` / `v_cache` are [slots, kv_heads, dim] with slots a
    /// multiple of `page`.
    fn check_caches(&self, kc: &Out<'_>, vc: &Out<'_>, page: usize) -> PyResult<()> {
        let [_, _, kv_heads, dim, _] = self.dims;
        for (field, shape) in [("k_cache", kc.shape()), ("v_cache", vc.shape())] {
            if shape.len() != 3
                || shape[1] != kv_heads
                || shape[2] != dim
                || page == 0
                || !shape[0].is_multiple_of(page)
            {
                return Err(invalid(
                    field,
                    format!(
                        "{field} must be [slots, kv_heads = {kv_heads}, dim = {dim}] with slots a \
                         multiple of page = {page}, not {shape:?}"
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl LayerViews<'_> {
    /// The products' quantized parts (empty for the other kinds).
    fn parts(&self) -> PyResult<[Vec<QuantPart<'_>>; 4]> {
        let p = &self.products;
        Ok([
            p[0].quant_parts()?,
            p[1].quant_parts()?,
            p[2].quant_parts()?,
            p[3].quant_parts()?,
        ])
    }

    /// The kernel's view of `layer`'s weights, its quantized parts `parts` on `backend`.
    fn weights<'s>(
        &'s self,
        layer: &LeanLayer,
        parts: &'s [Vec<QuantPart<'s>>; 4],
        backend: Backend,
    ) -> PyResult<Weights<'s>> {
        let [hidden, heads, kv_heads, dim, inter] = layer.dims;
        let p = &self.products;
        Ok(Weights {
            input_norm: self.norms.0.elems(),
            post_norm: self.norms.1.elems(),
            input_eps: layer.eps.0,
            post_eps: layer.eps.1,
            qkv: p[0].product(&parts[0], backend)?,
            o: p[1].product(&parts[1], backend)?,
            gate_up: p[2].product(&parts[2], backend)?,
            down: p[3].product(&parts[3], backend)?,
            qk_norm: self.qk.as_ref().map(|(q, k, eps)| QkNorm {
                q: q.elems(),
                k: k.elems(),
                eps: *eps,
            }),
            sandwich: self.sandwich.as_ref().map(|(a, m, eps)| Sandwich {
                attn: a.elems(),
                mlp: m.elems(),
                eps: *eps,
            }),
            norm_offset: layer.norm_offset,
            gate: layer.gate,
            softcap: layer.softcap,
            hidden,
            heads,
            kv_heads,
            dim,
            rot: layer.rot,
            inter,
        })
    }
}

/// `layers` in order on `x`, layer `i` with `k_caches[i]` / `v_caches[i]`, every argument
/// checked (shapes, dtypes, no cache overlapping another or `x`) before the GIL is
/// released once for them all.
fn run_layers(
    py: Python<'_>,
    layers: &[&LeanLayer],
    x: &Bound<'_, PyAny>,
    k_caches: &[&Bound<'_, PyAny>],
    v_caches: &[&Bound<'_, PyAny>],
    a: &StepArgs<'_, '_>,
    (groups, group_of): (&[GroupArgs<'_>], &[usize]),
) -> PyResult<()> {
    let [hidden, _, _, dim, _] = layers[0].dims;
    let rot = layers[0].rot;
    if let Some(other) = layers
        .iter()
        .find(|l| l.dims[0] != hidden || l.dims[3] != dim || l.rot != rot)
    {
        return Err(invalid(
            "layers",
            format!(
                "every layer must have hidden = {hidden}, dim = {dim} and rot = {rot}, not {}, \
                 {} and {}",
                other.dims[0], other.dims[3], other.rot
            ),
        ));
    }
    let threads = threads_of(a.threads)?;
    let ct = ty(a.cache_dtype, "cache_dtype")?;
    let mut xa = rw::<f32>(x, "x", "float32")?;
    let (rows, _) = two_d("x", xa.shape(), "[rows, hidden]")?;
    expect_shape("x", xa.shape(), &[rows, hidden], "[rows, hidden]")?;
    let mut spans: Vec<(&'static str, Range<usize>)> = vec![("x", xa.span())];
    let mut caches = Vec::with_capacity(layers.len());
    for ((layer, k), v) in layers.iter().zip(k_caches).zip(v_caches) {
        let kc = Out::new(k, ct, "k_cache")?;
        let vc = Out::new(v, ct, "v_cache")?;
        layer.check_caches(&kc, &vc, a.page)?;
        disjoint("k_cache", kc.span(), &spans)?;
        spans.push(("k_cache", kc.span()));
        disjoint("v_cache", vc.span(), &spans)?;
        spans.push(("v_cache", vc.span()));
        caches.push((kc, vc));
    }
    let cos = ro::<f32>(a.cos, "cos", "float32")?;
    let sin = ro::<f32>(a.sin, "sin", "float32")?;
    expect_shape("cos", cos.shape(), &[rows, rot], "[rows, rot]")?;
    expect_shape("sin", sin.shape(), &[rows, rot], "[rows, rot]")?;
    let first = (a.slots, a.block_tables, a.seqlens, a.window, None);
    let metas = std::iter::once(first)
        .chain(
            groups
                .iter()
                .map(|(s, t, l, w, r)| (s, t, l, *w, r.as_ref())),
        )
        .map(|(slots, tables, seqlens, window, rope)| {
            let tables = ro::<i32>(tables, "block_tables", "int32")?;
            let (_, width) = two_d("block_tables", tables.shape(), "[rows, width]")?;
            expect_shape(
                "block_tables",
                tables.shape(),
                &[rows, width],
                "[rows, width]",
            )?;
            let rope = match rope {
                None => None,
                Some((c, s)) => {
                    let c = ro::<f32>(c, "cos", "float32")?;
                    let s = ro::<f32>(s, "sin", "float32")?;
                    expect_shape("cos", c.shape(), &[rows, rot], "[rows, rot]")?;
                    expect_shape("sin", s.shape(), &[rows, rot], "[rows, rot]")?;
                    Some((c, s))
                }
            };
            Ok(GroupMeta {
                slots: ro::<i64>(slots, "slots", "int64")?,
                tables,
                seqlens: ro::<i32>(seqlens, "seqlens", "int32")?,
                width,
                window,
                rope,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let views = layers
        .iter()
        .map(|l| l.views(py))
        .collect::<PyResult<Vec<_>>>()?;
    let parts = views
        .iter()
        .map(LayerViews::parts)
        .collect::<PyResult<Vec<_>>>()?;
    let backend = Backend::auto();
    let weights = views
        .iter()
        .zip(&parts)
        .zip(layers)
        .map(|((v, p), l)| v.weights(l, p, backend))
        .collect::<PyResult<Vec<_>>>()?;
    let (cos, sin) = (cos.as_slice()?, sin.as_slice()?);
    let steps = metas
        .iter()
        .map(|m| {
            let (cos, sin) = match &m.rope {
                None => (cos, sin),
                Some((c, s)) => (c.as_slice()?, s.as_slice()?),
            };
            Ok(Step {
                cos,
                sin,
                slots: m.slots.as_slice()?,
                block_tables: m.tables.as_slice()?,
                seqlens: m.seqlens.as_slice()?,
                width: m.width,
                page: a.page,
                window: if m.window == 0 {
                    Window::Full
                } else {
                    Window::Sliding { window: m.window }
                },
                scale: a.scale,
                threads,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let x = xa.as_slice_mut()?;
    let caches: Vec<_> = caches
        .iter_mut()
        .map(|(k, v)| (k.elems(), v.elems()))
        .collect();
    py.detach(|| {
        for ((w, (k, v)), &g) in weights.iter().zip(caches).zip(group_of) {
            layer::decoder_layer(w, &steps[g], x, k, v)?;
        }
        Ok(())
    })
    .map_err(kernel_error)
}

/// One attention group's step arrays, borrowed for a call.
struct GroupMeta<'py> {
    slots: PyReadonlyArrayDyn<'py, i64>,
    tables: PyReadonlyArrayDyn<'py, i32>,
    seqlens: PyReadonlyArrayDyn<'py, i32>,
    width: usize,
    window: usize,
    rope: Option<(PyReadonlyArrayDyn<'py, f32>, PyReadonlyArrayDyn<'py, f32>)>,
}
