//! PyO3 wrapper of `ferrobatch-kernels`' mixture-of-experts experts (`moe`): a
//! `QuantExperts` holds one MoE layer's packed expert matrices (numpy views, checked once
//! when it is made), and `forward` runs the experts a step's tokens picked with the GIL
//! released, borrowing only those experts' arrays. Kept thin: shapes are checked here or by
//! the kernel, with a `FieldError` naming the argument.

use ferrobatch_kernels::layer::QuantPart;
use ferrobatch_kernels::moe::{self, Expert, Glu, Routes, Shape};
use ferrobatch_kernels::quant::{Backend, QType};
use numpy::{PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::{invalid, kernel_error};
use crate::layer::quant_parts;
use crate::views::{bytes, disjoint, expect_shape, ro, rw, threads_of, two_d};

/// One expert's parts: (qtype, packed uint8 array, rows) of gate/up and of down.
type Parts = Vec<(QType, Py<PyAny>, usize)>;

/// Borrowed parts as the kernel takes them.
fn as_parts<'a>(
    b: &'a [(QType, PyReadonlyArrayDyn<'_, u8>, usize)],
) -> PyResult<Vec<QuantPart<'a>>> {
    b.iter()
        .map(|(qtype, a, n)| {
            Ok(QuantPart {
                qtype: *qtype,
                packed: a.as_slice()?,
                n: *n,
            })
        })
        .collect()
}

/// Each expert's bias, copied (`len` values each), or None.
fn biases(
    field: &'static str,
    given: Option<Vec<Bound<'_, PyAny>>>,
    experts: usize,
    len: usize,
) -> PyResult<Option<Vec<Vec<f32>>>> {
    let Some(given) = given else { return Ok(None) };
    if given.len() != experts {
        return Err(invalid(
            field,
            format!("{field} has {} experts' biases, not {experts}", given.len()),
        ));
    }
    given
        .iter()
        .map(|b| {
            let a = ro::<f32>(b, field, "float32")?;
            expect_shape(field, a.shape(), &[len], "[n]")?;
            Ok(a.as_slice()?.to_vec())
        })
        .collect::<PyResult<_>>()
        .map(Some)
}

#[pyclass(frozen, module = "ferrobatch._core")]
pub struct QuantExperts {
    gate_up: Vec<Parts>,
    down: Vec<Parts>,
    gate_up_bias: Option<Vec<Vec<f32>>>,
    down_bias: Option<Vec<Vec<f32>>>,
    glu: Glu,
    hidden: usize,
    inter: usize,
    backend: Backend,
}

#[pymethods]
impl QuantExperts {
    /// One MoE layer's experts: `gate_up[e]` the parts of expert `e`'s gate rows then up
    /// rows ([2 * inter, hidden]), `down[e]` its down projection's ([hidden, inter]); each a
    /// sequence of (qtype, uint8 array in `quant_pack`'s layout, rows). gpt-oss's experts:
    /// `gate_up_bias[e]` (float32 [2 * inter], the gate's then the up's) and `down_bias[e]`
    /// ([hidden]) added to the products, `swiglu` = (limit, alpha) the clamped SwiGLU
    /// between them (else SiLU).
    #[new]
    #[pyo3(signature = (*, gate_up, down, hidden, inter, backend = None, gate_up_bias = None,
                        down_bias = None, swiglu = None))]
    #[allow(clippy::too_many_arguments)] // the Python signature's keywords
    fn new(
        gate_up: Vec<Bound<'_, PyAny>>,
        down: Vec<Bound<'_, PyAny>>,
        hidden: usize,
        inter: usize,
        backend: Option<&str>,
        gate_up_bias: Option<Vec<Bound<'_, PyAny>>>,
        down_bias: Option<Vec<Bound<'_, PyAny>>>,
        swiglu: Option<(f32, f32)>,
    ) -> PyResult<Self> {
        if hidden == 0 || inter == 0 {
            return Err(invalid("hidden", "hidden and inter must be >= 1"));
        }
        if gate_up.is_empty() || gate_up.len() != down.len() {
            return Err(invalid(
                "gate_up",
                format!(
                    "gate_up and down must hold the same number (>= 1) of experts, not {} \
                     and {}",
                    gate_up.len(),
                    down.len()
                ),
            ));
        }
        let gate_up: Vec<Parts> = gate_up
            .iter()
            .map(|p| quant_parts("gate_up", p, (2 * inter, hidden)))
            .collect::<PyResult<_>>()?;
        let down = down
            .iter()
            .map(|p| quant_parts("down", p, (hidden, inter)))
            .collect::<PyResult<_>>()?;
        let backend = crate::quant::backend_of(backend)?;
        let experts = gate_up.len();
        let gate_up_bias = biases("gate_up_bias", gate_up_bias, experts, 2 * inter)?;
        let down_bias = biases("down_bias", down_bias, experts, hidden)?;
        let glu = match swiglu {
            None => Glu::Silu,
            Some((limit, alpha)) if limit.is_finite() && alpha.is_finite() => {
                Glu::Clamped { limit, alpha }
            }
            Some(v) => {
                return Err(invalid(
                    "swiglu",
                    format!("swiglu must be finite (limit, alpha), not {v:?}"),
                ))
            }
        };
        Ok(QuantExperts {
            gate_up,
            down,
            gate_up_bias,
            down_bias,
            glu,
            hidden,
            inter,
            backend,
        })
    }

    /// The number of experts.
    #[getter]
    fn num_experts(&self) -> usize {
        self.gate_up.len()
    }

    /// `out` (float32 [tokens, hidden], overwritten) = the experts' outputs for `x`
    /// (float32 [tokens, hidden]) routed by `ids` (int64 [tokens, top_k]: expert indices,
    /// `num_experts` meaning none) with `weights` (float32 [tokens, top_k]).
    #[pyo3(signature = (x, ids, weights, out, *, threads = 1))]
    fn forward(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        ids: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        threads: i64,
    ) -> PyResult<()> {
        let threads = threads_of(threads)?;
        let xa = ro::<f32>(x, "x", "float32")?;
        let ia = ro::<i64>(ids, "ids", "int64")?;
        let wa = ro::<f32>(weights, "weights", "float32")?;
        let mut o = rw::<f32>(out, "out", "float32")?;
        let (tokens, hidden) = two_d("x", xa.shape(), "[tokens, hidden]")?;
        if hidden != self.hidden {
            return Err(invalid(
                "x",
                format!("x has {hidden} columns, not {}", self.hidden),
            ));
        }
        let (_, top_k) = two_d("ids", ia.shape(), "[tokens, top_k]")?;
        expect_shape("ids", ia.shape(), &[tokens, top_k], "[tokens, top_k]")?;
        expect_shape("weights", wa.shape(), &[tokens, top_k], "[tokens, top_k]")?;
        expect_shape("out", o.shape(), &[tokens, hidden], "[tokens, hidden]")?;
        disjoint(
            "out",
            bytes(o.data(), o.len()),
            &[("x", bytes(xa.data(), xa.len()))],
        )?;
        let id_list = ia.as_slice()?;
        // borrow the arrays of the experts some token picked (an index past the count is
        // the kernel's error to name)
        let count = self.gate_up.len();
        let mut hit = vec![false; count];
        for &e in id_list {
            if let Some(h) = usize::try_from(e).ok().and_then(|e| hit.get_mut(e)) {
                *h = true;
            }
        }
        type Borrowed<'py> = Vec<(QType, PyReadonlyArrayDyn<'py, u8>, usize)>;
        let borrow = |parts: &Parts, field: &'static str| -> PyResult<Borrowed<'_>> {
            parts
                .iter()
                .map(|(qt, a, n)| Ok((*qt, ro::<u8>(a.bind(py), field, "uint8")?, *n)))
                .collect()
        };
        let mut held: Vec<Option<(Borrowed<'_>, Borrowed<'_>)>> = Vec::with_capacity(count);
        for (e, &h) in hit.iter().enumerate() {
            held.push(if h {
                Some((
                    borrow(&self.gate_up[e], "gate_up")?,
                    borrow(&self.down[e], "down")?,
                ))
            } else {
                None
            });
        }
        let mut parts: Vec<Option<(Vec<QuantPart<'_>>, Vec<QuantPart<'_>>)>> =
            Vec::with_capacity(count);
        for h in &held {
            parts.push(match h {
                Some((gu, d)) => Some((as_parts(gu)?, as_parts(d)?)),
                None => None,
            });
        }
        let table: Vec<Option<Expert<'_>>> = parts
            .iter()
            .enumerate()
            .map(|(e, p)| {
                p.as_ref().map(|(gu, d)| Expert {
                    gate_up: gu,
                    down: d,
                    gate_up_bias: self.gate_up_bias.as_ref().map(|v| &v[e][..]),
                    down_bias: self.down_bias.as_ref().map(|v| &v[e][..]),
                })
            })
            .collect();
        let shape = Shape {
            tokens,
            hidden,
            inter: self.inter,
            glu: self.glu,
        };
        let routes = Routes {
            ids: id_list,
            weights: wa.as_slice()?,
            top_k,
        };
        let (xe, oe) = (xa.as_slice()?, o.as_slice_mut()?);
        let backend = self.backend;
        py.detach(|| moe::experts(xe, shape, routes, &table, oe, threads, backend))
            .map_err(kernel_error)
    }
}
