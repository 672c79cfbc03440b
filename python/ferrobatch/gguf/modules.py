"""`QuantLinear` and `QuantEmbedding`: layers whose weight stays GGUF blocks in memory.

Products run on `ferrobatch.cpu.quant_ops` (the Rust kernels: AVX-512 VNNI, AVX2 or a
portable path, equal bit for bit) over a copy of the rows packed at the first product; the
reference path dequantizes the weight with `gguf.quants.dequantize` a slice of rows at a
time, inside the call (nothing dequantized is kept), for an fp32 `F.linear`. `set_backend` /
`backend()` choose ("auto", "kernel", "reference"; `FERROBATCH_QUANT_PATH` sets the process
default) so tests can compare.

The kernel contract (what `QuantLinear` calls, `kernel_ops()`; `QuantWeight` is
`ferrobatch.gguf.formats`'):

* `supports(qtype: str) -> bool`;
* `linear(x, weight) -> y`: `x` fp32 C-contiguous [m, k] CPU, `weight` a `QuantWeight`;
  returns fp32 [m, n] = `x @ dequantize(weight).T` (no bias: added here);
* `dequantize(weight) -> w`: fp32 [n, k] (the embedding's looked-up rows).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrobatch.cpu import pages, quant_ops
from ferrobatch.gguf.formats import QuantWeight, dequantize_reference

__all__ = ["BACKENDS", "QuantEmbedding", "QuantLinear", "backend", "few_layers", "get_backend",
           "kernel_ops", "kernels_run", "packed_weight", "prepare_for_serving", "probe_cache",
           "probe_weights", "probing", "quant_dequantize", "quant_linear", "set_backend"]

logger = logging.getLogger("ferrobatch")

BACKENDS = ("auto", "kernel", "reference")
#: the reference path dequantizes at most this many fp32 weights at once (32 MiB)
REFERENCE_CHUNK = 8 << 20

_backend = os.environ.get("FERROBATCH_QUANT_PATH", "auto")
if _backend not in BACKENDS:
    logger.warning("ferrobatch: FERROBATCH_QUANT_PATH=%r is not one of %s; using 'auto'",
                   _backend, ", ".join(BACKENDS))
    _backend = "auto"


def get_backend() -> str:
    return _backend


def set_backend(name: str) -> str:
    """Set the process-wide backend of quantized products ("auto": the kernels where they
    run, else the reference; "kernel": the kernels or an error; "reference": always the
    reference path). Returns the previous one."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    previous, _backend = _backend, name
    return previous


@contextmanager
def backend(name: str) -> Iterator[None]:
    """`set_backend(name)` for the block, then the previous backend again."""
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


class _Kernels:
    """The kernel contract over `ferrobatch.cpu.quant_ops`: a weight's GGUF rows are packed
    for the products once, at its first product (the packed copy is kept beside the rows,
    for as long as the rows' tensor lives), and dequantized from the rows themselves."""

    def __init__(self) -> None:
        # by `id` of the rows' tensor (tensors compare elementwise, so no weak-key dict);
        # an entry goes with its tensor (`weakref.finalize`)
        self._packed: dict[int, quant_ops.PackedWeight] = {}
        self._lock = threading.Lock()

    def supports(self, qtype: str) -> bool:
        return qtype.lower() in quant_ops.QTYPES

    def packed(self, weight: QuantWeight) -> quant_ops.PackedWeight:
        """`weight` packed for `quant_ops.linear` (made once per rows tensor)."""
        key = id(weight.data)
        found = self._packed.get(key)
        if found is None:
            with self._lock:
                found = self._packed.get(key)
                if found is None:
                    found = quant_ops.pack(weight.qtype, weight.data, weight.n, weight.k)
                    self._packed[key] = found
                    weakref.finalize(weight.data, self._packed.pop, key, None)
        return found

    def release(self, weight: QuantWeight) -> None:
        """Drop `weight`'s packed copy (made again at its next product)."""
        with self._lock:
            self._packed.pop(id(weight.data), None)

    def linear(self, x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
        return quant_ops.linear(x, self.packed(weight))

    def dequantize(self, weight: QuantWeight) -> torch.Tensor:
        rows = quant_ops.dequantize(weight.qtype, weight.data, weight.n, weight.k)
        return torch.from_numpy(rows)

    def quantizes(self, qtype: str) -> bool:
        """Whether `quantize` makes `qtype` (the K-types)."""
        return qtype.lower() in quant_ops.QUANTIZERS

    def quantize(self, w: torch.Tensor, qtype: str) -> torch.Tensor:
        """Float `w` [n, k] as the GGUF rows of `qtype` (uint8 [n, row bytes])."""
        return quant_ops.quantize(w, qtype)


_KERNELS = _Kernels()


def kernel_ops() -> _Kernels | None:
    """The compiled kernels (`ferrobatch.cpu.quant_ops`) behind the kernel contract."""
    return _KERNELS


def _kernel_for(qtype: str) -> Any:
    """The kernels' module for a product of `qtype` under the current backend, or None for
    the reference path."""
    if _backend == "reference":
        return None
    ops = kernel_ops()
    supports = getattr(ops, "supports", None) if ops is not None else None
    if ops is not None and (supports is None or supports(qtype)):
        return ops
    if _backend == "kernel":
        raise RuntimeError(f"quantized backend 'kernel' asked for, but ferrobatch.cpu.quant_ops "
                           f"{'does not run ' + qtype if ops is not None else 'is not available'}")
    return None


def kernels_run(qtype: str) -> bool:
    """Whether products of `qtype` run on the kernels under the current backend."""
    return _kernel_for(qtype) is not None


def probing() -> bool:
    """Whether `probe_weights` stand-ins are active."""
    return bool(_probe_weights)


def packed_weight(weight: QuantWeight) -> quant_ops.PackedWeight:
    """`weight` packed for `quant_ops.linear`: the copy its `QuantLinear` products use (made
    once, at the first use)."""
    return _KERNELS.packed(weight)


def _dequantized(weight: QuantWeight) -> torch.Tensor:
    """`weight` as fp32 [n, k]: the compiled dequantization (bit for bit `gguf.quants`',
    `tests/cpu/test_quant_ops.py`) where it takes the type, else `gguf.quants` itself."""
    if _KERNELS.supports(weight.qtype):
        return _KERNELS.dequantize(weight)
    return dequantize_reference(weight)


def quant_linear(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """fp32 `x` [m, k] @ `weight`.T -> fp32 [m, n] (the kernels or the reference path)."""
    ops = _kernel_for(weight.qtype)
    if ops is not None:
        return ops.linear(x, weight)
    if weight.n * weight.k <= REFERENCE_CHUNK:
        return F.linear(x, _dequantized(weight))
    out = torch.empty(x.shape[0], weight.n, dtype=torch.float32)
    step = max(1, REFERENCE_CHUNK // weight.k)
    for start in range(0, weight.n, step):
        stop = min(weight.n, start + step)
        out[:, start:stop] = F.linear(x, _dequantized(weight.slice_rows(start, stop)))
    return out


def quant_dequantize(weight: QuantWeight) -> torch.Tensor:
    """`weight` as fp32 [n, k] (the kernels or the reference path)."""
    ops = _kernel_for(weight.qtype)
    return ops.dequantize(weight) if ops is not None else _dequantized(weight)


class QuantLinear(nn.Module):
    """`nn.Linear` over a `QuantWeight` (the weight's blocks held as a uint8 buffer `qdata`,
    never dequantized beyond one call). Computes in fp32; returns the input's dtype. `bias`
    is an ordinary parameter (fp32 or the model's dtype). `reduce` (None, or set by
    `ferrobatch.distributed.quant_shard` on a row-parallel layer): applied to the product
    before the bias (the sum of the ranks' partial products, then their bias)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_q = weight
        self.in_features = weight.k
        self.out_features = weight.n
        self.qtype = weight.qtype
        # a buffer, so `model.to(...)`, `named_buffers()` and memory counts see it; not in
        # the state dict (it is no `nn.Linear` weight)
        self.register_buffer("qdata", weight.data, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qdata is not self.weight_q.data:  # moved or replaced: the weight follows
            self.weight_q = QuantWeight(self.qtype, self.out_features, self.in_features,
                                        self.qdata)
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.to(torch.float32).contiguous()
        out = self.product(flat)
        if self.reduce is not None:
            out = self.reduce(out)
        if self.bias is not None:
            out = out + self.bias.to(torch.float32)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 `x` [m, k] (C-contiguous) @ the weight.T, no bias: what `forward` adds the
        bias to (`probe_weights`' stand-in while one is active)."""
        probe = _probe_weights.get(id(self)) if _probe_weights else None
        return quant_linear(x, self.weight_q) if probe is None else probe(x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype}, bias={self.bias is not None}")


#: `probe_weights`' stand-ins while it is active: id(QuantLinear) -> its product
_probe_weights: dict[int, Any] = {}


class _ProbeCache:
    """The dequantized stand-in weights of `probe_weights` while any `probe_cache` block is
    open: (data pointer, type, rows, columns) -> fp32 [rows, k]; emptied when the last
    block closes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.weights: dict[tuple[int, str, int, int], torch.Tensor] = {}

    def dequantized(self, weight: QuantWeight) -> torch.Tensor:
        if self.depth == 0:
            return _dequantized(weight)
        key = (weight.data.data_ptr(), weight.qtype, weight.n, weight.k)
        with self.lock:
            hit = self.weights.get(key)
        if hit is None:
            hit = _dequantized(weight)
            with self.lock:
                if self.depth:
                    self.weights[key] = hit
        return hit


_probe_cache = _ProbeCache()


@contextmanager
def probe_cache() -> Iterator[None]:
    """Inside the block each weight `probe_weights` stands in for is dequantized once,
    however many times `probe_weights` is entered (an engine's construction enters it three
    times: its probes, its output head's check, its lean layers' check); the copies are
    dropped when the last open block closes. The weights must not change inside it."""
    with _probe_cache.lock:
        _probe_cache.depth += 1
    try:
        yield
    finally:
        with _probe_cache.lock:
            _probe_cache.depth -= 1
            if _probe_cache.depth == 0:
                _probe_cache.weights.clear()


class _ProbeProduct:
    """A stand-in product of `probe_weights`: fp32 `x` @ the first `rows` rows of the
    weight, dequantized once (None: no rows), every other output 0."""

    def __init__(self, weight: QuantWeight, rows: int) -> None:
        self.n = weight.n
        self.rows = min(rows, weight.n)
        self.w = _probe_cache.dequantized(weight.slice_rows(0, self.rows)) \
            if self.rows else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.w is not None and self.rows == self.n:
            return F.linear(x, self.w)
        out = torch.zeros(x.shape[0], self.n, dtype=torch.float32)
        if self.w is not None:
            out[:, :self.rows] = F.linear(x, self.w)
        return out


@contextmanager
def probe_weights(full: list[QuantLinear], zero: list[QuantLinear],
                  head: QuantLinear | None = None, head_rows: int = 4096) -> Iterator[None]:
    """For checks of how a model computes rather than of its weights (the engine's
    construction probes): inside the block the `full` layers multiply by their weights
    dequantized once (the reference path's products without dequantizing at every call),
    the `zero` layers by zeros (their outputs are their biases), and `head` by its first
    `head_rows` rows (its other outputs 0). Other layers are unchanged. Not reentrant."""
    made = {id(m): _ProbeProduct(m.weight_q, m.out_features) for m in full}
    made.update({id(m): _ProbeProduct(m.weight_q, 0) for m in zero})
    if head is not None:
        made[id(head)] = _ProbeProduct(head.weight_q, head_rows)
    _probe_weights.update(made)
    try:
        yield
    finally:
        for key in made:
            _probe_weights.pop(key, None)


def _decoder_layers(model: nn.Module, count: int) -> nn.ModuleList | None:
    """The model's list of `count` decoder layers (the first `ModuleList` of that length
    whose every member holds a `QuantLinear`), or None."""
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) == count and all(
                any(isinstance(x, QuantLinear) for x in layer.modules()) for layer in m):
            return m
    return None


def few_layers(model: nn.Module, kinds: Sequence[str] | Callable[[], Sequence[str]] | None,
               head_rows: int = 4096) -> contextlib.AbstractContextManager:
    """`probe_weights` for checks of how `model` computes (not of its weights): the first
    decoder layer of each attention kind in `kinds` (one entry per decoder layer: "full",
    "sliding", ...; or a function giving them, called only for a quantized model) keeps its
    weights, every other decoder layer's products give their biases only, the output head
    its first `head_rows` rows; `kinds` None: every product of the model gives its bias only
    (its output head's too). Any other product of a quantized model runs on the reference
    path for the block (`backend("reference")`: process-wide, as the engine's probes set
    it). Without `QuantLinear` layers nothing changes; without a list of decoder layers of
    `len(kinds)` every product is the reference path's."""
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not quant:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(backend("reference"))
    if kinds is None:
        stack.enter_context(probe_weights([], quant))
        return stack
    kinds = list(kinds() if callable(kinds) else kinds)
    layers = _decoder_layers(model, len(kinds))
    if layers is None:
        return stack
    kept = sorted({kinds.index(t) for t in kinds})
    full = [m for i in kept for m in layers[i].modules() if isinstance(m, QuantLinear)]
    real = {id(m) for m in full}
    inside = {id(m) for layer in layers for m in layer.modules()}
    zero = [m for m in quant if id(m) in inside and id(m) not in real]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    stack.enter_context(probe_weights(full, zero, head if isinstance(head, QuantLinear)
                                      else None, head_rows))
    return stack


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over a `QuantWeight` [vocab, dim]: only the looked-up rows are
    dequantized, to `dtype`. `embed_scale` (Gemma3's scaled embedding) multiplies them as the
    replaced module did (`embed_scale` rounded to `dtype` first)."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype = torch.float32,
                 embed_scale: torch.Tensor | float | None = None,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight_q = weight
        self.num_embeddings = weight.n
        self.embedding_dim = weight.k
        self.qtype = weight.qtype
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.register_buffer("qdata", weight.data, persistent=False)
        if embed_scale is not None:
            self.register_buffer("embed_scale", torch.as_tensor(embed_scale), persistent=False)
        else:
            self.embed_scale = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qdata is not self.weight_q.data:
            self.weight_q = QuantWeight(self.qtype, self.num_embeddings, self.embedding_dim,
                                        self.qdata)
        ids = input_ids.reshape(-1)
        if ids.numel() == 1:  # (a decode step's one token: no sort, no gather)
            out = quant_dequantize(self.weight_q.rows(ids))
        else:
            unique, inverse = torch.unique(ids, return_inverse=True)
            out = quant_dequantize(self.weight_q.rows(unique)).index_select(0, inverse)
        out = out.reshape(*input_ids.shape, self.embedding_dim)
        out = out.to(self.dtype)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(self.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"


def quantized_modules(model: nn.Module) -> list[Any]:
    """The `QuantLinear` / `QuantEmbedding` modules of `model`."""
    return [m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]


def prepare_for_serving(model: nn.Module, stacked: Sequence[QuantLinear] = ()) -> int:
    """Pack every `QuantLinear`'s rows for the kernels now (when the kernels run them), then
    take the GGUF rows' pages out of the resident set (`pages.release`: views of the file's
    memory map, mapped again from the file where the reference path or an embedding lookup
    needs them) and trim the C heap: the process keeps one copy of each matrix, the packed
    one. The `stacked` layers (whose products the
    runner's lean layers run stacked, from copies of their own) are not packed, and a copy
    made for them by an earlier forward is dropped (made again if their own forward runs);
    so are the layers a module's `pack_own_products()` returns after packing copies of its
    own (MoE experts, `gguf/experts.py`). Returns the number of matrices packed."""
    # the construction probes' dequantized weights, freed by now, go back to the kernel
    # before the packed copies are made (glibc keeps freed blocks: a Qwen3-30B-A3B-shaped
    # file's first-layer experts are 2.4 GB of them, which packing would otherwise add to)
    pages.trim_heap()
    # layers computing some `QuantLinear` products in a call of their own (MoE experts:
    # `pack_own_products` packs theirs and names the layers whose copies are not needed)
    own = [m for module in model.modules()
           if callable(getattr(module, "pack_own_products", None))
           for m in module.pack_own_products()]
    skip = {id(m) for m in (*stacked, *own)}
    packed = 0
    for module in model.modules():
        if not isinstance(module, QuantLinear):
            continue
        if id(module) in skip:
            _KERNELS.release(module.weight_q)
        elif _kernel_for(module.qtype) is not None:
            _KERNELS.packed(module.weight_q)
            packed += 1
    pages.release(m.qdata for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding))
    pages.trim_heap()
    return packed
