"""Quantize a float checkpoint's matrices on load (`Engine(path, quantization="q8_0")`).

Every `nn.Linear` (output head included) and the input `nn.Embedding` whose input width is
whole blocks becomes a `QuantLinear` / `QuantEmbedding` over its weight quantized with
`gguf.quants.quantize` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: llama.cpp's reference quantizers);
tied weights share one `QuantWeight`. The K-types (Q4_K, Q5_K, Q6_K), which gguf-py cannot
make, come from the kernels' quantizer (`ferrobatch.cpu.quant_ops.quantize`: fp32 [n, k] ->
uint8 [n, row bytes]; refused when the kernels lack it). IQ4_NL, Q3_K, Q2_K and IQ4_XS are
served from GGUF files only: asking for them is refused naming them so. A K-type layer whose
input width is not whole 256-weight blocks takes llama.cpp's fallback type (Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0: 32-weight blocks, so SmolLM2's 576-wide or Qwen2.5-0.5B's
896-wide matrices stay quantized, as in the `Q4_K_M` files llama.cpp writes); a layer whose
input width is not whole blocks of either keeps its float weight, and the log says which.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from ferrobatch.errors import FieldError
from ferrobatch.gguf.formats import QUANT_TYPES, QuantWeight, block_shape, row_bytes
from ferrobatch.gguf.modules import QuantEmbedding, QuantLinear, kernel_ops

__all__ = ["FALLBACK", "GGUF_PY_QUANTIZERS", "ON_LOAD_TYPES", "PRE_QUANTIZED", "check_device",
           "check_name", "layer_type", "pre_quantized", "quantizable", "quantize_model",
           "quantize_named", "quantize_weight", "type_for_width"]

logger = logging.getLogger("ferrobatch")

#: the types gguf-py quantizes
GGUF_PY_QUANTIZERS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
#: the types quantize-on-load offers (the others of `QUANT_TYPES` are served from GGUF files
#: only: no quantizer here makes them)
ON_LOAD_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
#: llama.cpp's type for a K-type matrix whose input width is not whole 256-weight blocks
#: (its quantizer's fallback for such rows)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _kernel_quantizer(qtype: str) -> Any:
    """The kernels' quantizer of `qtype`, or None."""
    ops = kernel_ops()
    fn = getattr(ops, "quantize", None) if ops is not None else None
    takes = getattr(ops, "quantizes", None)
    if not callable(fn) or (callable(takes) and not takes(qtype)):
        return None
    return fn


def check_name(name: Any) -> str:
    """The type `name` asks for ("q8_0" -> "Q8_0"); `FieldError` (field "quantization") for a
    name that is not a quantized type or one with no quantizer here."""
    qtype = str(name).upper() if isinstance(name, str) else None
    if qtype not in ON_LOAD_TYPES:
        served = " (served from GGUF files only: no quantizer makes it on load)" \
            if qtype in QUANT_TYPES else ""
        raise FieldError(f"quantization must be one of "
                         f"{', '.join(q.lower() for q in ON_LOAD_TYPES)} or None, not "
                         f"{name!r}{served}", "quantization")
    if qtype not in GGUF_PY_QUANTIZERS and _kernel_quantizer(qtype) is None:
        raise FieldError(
            f"quantization {qtype.lower()} needs a K-type quantizer "
            "(ferrobatch.cpu.quant_ops.quantize), which this build does not have: use "
            f"{', '.join(q.lower() for q in GGUF_PY_QUANTIZERS)}, or load a GGUF file that "
            "holds K-type tensors", "quantization")
    return qtype


def check_device(device: Any) -> None:
    if device is not None and torch.device(device).type != "cpu":
        raise FieldError(f"quantized weights run on the CPU only, not {device}", "device")


#: rows widened to fp32 and quantized at a time: the whole matrix widened at once would add
#: 4 bytes a weight while every other float weight is still held (2.1 GB for the embedding
#: of an 8B model, the first matrix quantized)
ROWS_AT_ONCE = 4096

#: the attribute of a stand-in parameter (`stream_quantize`) that holds its matrix quantized
PRE_QUANTIZED = "ferrobatch_quantized"


def quantize_weight(weight: torch.Tensor, qtype: str) -> QuantWeight:
    """A float [n, k] matrix (k whole blocks) quantized to `qtype`, `ROWS_AT_ONCE` rows at a
    time (each row's blocks depend on that row alone)."""
    n, k = weight.shape
    if qtype not in GGUF_PY_QUANTIZERS and _kernel_quantizer(qtype) is None:
        check_name(qtype)  # raises the FieldError
    if n <= ROWS_AT_ONCE:
        return QuantWeight(qtype, n, k, _quantize_rows(weight, qtype))
    data = torch.empty(n, row_bytes(qtype, k), dtype=torch.uint8)
    for r in range(0, n, ROWS_AT_ONCE):
        try:
            data[r:r + ROWS_AT_ONCE] = _quantize_rows(weight[r:r + ROWS_AT_ONCE], qtype)
        except FieldError:  # the whole matrix again: its refusal names the row in the matrix
            _quantize_rows(weight, qtype)
            raise
    return QuantWeight(qtype, n, k, data)


def _quantize_rows(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 [n, row bytes]: the rows of `weight` quantized to `qtype`."""
    w = weight.detach().to("cpu", torch.float32).contiguous()
    if qtype in GGUF_PY_QUANTIZERS:
        _check_finite(w)
        with np.errstate(over="ignore"):  # (an overflowed factor is refused below)
            data = torch.from_numpy(np.ascontiguousarray(
                quantize(w.numpy(), GGMLQuantizationType[qtype])))
        _check_factors(data, qtype)
        return data
    data = _kernel_quantizer(qtype)(w, qtype)
    if isinstance(data, QuantWeight):
        data = data.data
    return torch.as_tensor(data, dtype=torch.uint8).contiguous()


#: the fp16 factors at the start of each block of the types gguf-py quantizes (d; Q4_1's
#: and Q5_1's m after it)
_FACTORS = {"Q8_0": 1, "Q4_0": 1, "Q5_0": 1, "Q4_1": 2, "Q5_1": 2}


def _check_finite(w: torch.Tensor) -> None:
    """`FieldError` (field "w", as the kernels' quantizer words it) naming the first NaN or
    infinite weight of `w` [n, k]."""
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        value = float(w[r, c])
        shown = "NaN" if value != value else ("inf" if value > 0 else "-inf")
        raise FieldError(f"w: row {r}, column {c} is {shown}: only finite weights quantize",
                         "w")


def _check_factors(data: torch.Tensor, qtype: str) -> None:
    """`FieldError` (field "w") naming the first block of `data` [n, row bytes] whose fp16
    factors overflowed: weights too large for the type."""
    block, size = block_shape(qtype)
    n = data.shape[0]
    blocks = data.view(n, -1, size)
    factors = blocks[:, :, :2 * _FACTORS[qtype]].contiguous().view(torch.float16)
    bad = ~torch.isfinite(factors).view(n, blocks.shape[1], -1).all(dim=2)
    if bool(bad.any()):
        r, b = (int(i) for i in bad.nonzero()[0])
        raise FieldError(f"w: row {r}, columns {b * block}..{b * block + block}: weights too "
                         f"large for {qtype.lower()}'s fp16 scales", "w")


def quantize_named(name: str, weight: torch.Tensor, qtype: str) -> QuantWeight:
    """`quantize_weight`, a refusal naming the tensor (field "quantization")."""
    try:
        return quantize_weight(weight, qtype)
    except FieldError as e:
        raise FieldError(f"quantization {qtype.lower()} of {name}: {e}",
                         "quantization") from e


def type_for_width(qtype: str, k: int) -> str | None:
    """The type a matrix of input width `k` is quantized to when `qtype` is asked for:
    `qtype` when `k` is whole blocks of it, else its `FALLBACK` when `k` is whole blocks of
    that, else None (the matrix stays float)."""
    for t in (qtype, FALLBACK.get(qtype)):
        if t is not None and k % block_shape(t)[0] == 0:
            return t
    return None


def _is_embedding(m: nn.Module) -> bool:
    return type(m) is nn.Embedding or (isinstance(m, nn.Embedding)
                                       and type(m).__name__.endswith("ScaledWordEmbedding"))


def quantizable(m: nn.Module) -> bool:
    """Whether `m` is a module quantize-on-load replaces (given a type for its width): an
    `nn.Linear` or the input embedding."""
    return type(m) is nn.Linear or _is_embedding(m)


def layer_type(weight: torch.Tensor, qtype: str, width: int | None = None) -> str | None:
    """The type a quantizable module's `weight` is quantized to when `qtype` is asked for
    (`type_for_width` of `width`, the whole matrix's input width, default the weight's own),
    or None where it stays float (`width` not whole blocks, or `weight` on another device
    than the CPU; the meta device of a model being built counts as the CPU)."""
    if weight.device.type not in ("cpu", "meta"):
        return None
    held = pre_quantized(weight)
    k = held.k if held is not None else weight.shape[1]
    found = type_for_width(qtype, k if width is None else width)
    return found if found is not None and k % block_shape(found)[0] == 0 else None


def pre_quantized(weight: torch.Tensor) -> QuantWeight | None:
    """The `QuantWeight` of a matrix quantized while it was read (`stream_quantize`'s
    stand-in parameter), or None for any other tensor."""
    return getattr(weight, PRE_QUANTIZED, None)


def quantize_model(model: nn.Module, qtype: str, widths: dict[str, int] | None = None,
                   dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Replace `model`'s linears and input embedding by quantized ones, in place (see the
    module docstring); returns a summary (also `model.ferrobatch_quantization`). `widths`:
    the whole matrix's input width of a module that holds a share of it (tensor
    parallelism), which decides its type (`type_for_width`), as on one rank. `dtype`: the
    embedding's output dtype (default: the model's). Each float weight is freed as soon as
    nothing else holds it, so the model never holds a matrix twice over."""
    qtype = check_name(qtype)
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                     torch.float32)
    # id(weight) -> (a weak reference to the weight, which tells a reused id, and its
    # quantized form: ties share it)
    done: dict[int, tuple[weakref.ref[torch.Tensor], QuantWeight]] = {}
    quantized_bytes = 0
    kept: list[str] = []
    fallback: list[str] = []
    replaced = 0
    for name in [name for name, _ in model.named_modules()]:
        m = model.get_submodule(name)
        if not quantizable(m):
            continue
        linear = type(m) is nn.Linear
        w = m.weight
        wtype = layer_type(w, qtype, (widths or {}).get(name))
        if wtype is None:
            kept.append(name)
            continue
        if wtype != qtype:
            fallback.append(name)
        seen = done.get(id(w))
        if seen is None or seen[0]() is not w:
            held = pre_quantized(w)
            qw = held if held is not None else quantize_named(f"{name}.weight", w, wtype)
            seen = (weakref.ref(w), qw)
            done[id(w)] = seen
            quantized_bytes += seen[1].nbytes
        qw = seen[1]
        if linear:
            bias = m.bias.detach() if m.bias is not None else None
            new: nn.Module = QuantLinear(qw, bias)
        else:
            new = QuantEmbedding(qw, dtype, embed_scale=getattr(m, "embed_scale", None),
                                 padding_idx=m.padding_idx)
        model.set_submodule(name, new)
        del m, w  # the float weight goes with its module (unless tied elsewhere)
        replaced += 1
    if fallback:
        logger.info("ferrobatch: %d layers quantized to %s (input width not whole 256-weight "
                    "blocks): %s", len(fallback), FALLBACK[qtype], ", ".join(fallback[:4]))
    if kept:
        # (a warning when nothing at all was quantized: the user asked for it and got none)
        log = logger.info if replaced else logger.warning
        log("ferrobatch: %d layers keep float weights (input width not whole %s blocks): %s",
            len(kept), qtype, ", ".join(kept[:4]))
    summary = {"qtype": qtype, "quantized_modules": replaced,
               "quantized_bytes": quantized_bytes, "float_layers": kept,
               "fallback_layers": fallback}
    model.ferrobatch_quantization = summary
    logger.info("ferrobatch: %d layers quantized to %s (%.0f MiB)", replaced, qtype,
                summary["quantized_bytes"] / 2**20)
    return summary
