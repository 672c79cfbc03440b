"""A CPU model's packed linears and lean decoder layers, and which activations dtype a bf16 /
fp16 model runs with, decided once against its own forward (the runner's `activations`
part; the packed layers themselves are `ferrobatch.runner.cpu_linear`, the lean ones
`ferrobatch.runner.lean_layers`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch.distributed.tensor import DTensor

from ferrobatch.attention import context, registry
from ferrobatch.errors import FieldError
from ferrobatch.gguf import modules as quant_modules
from ferrobatch.model_config import text_config
from ferrobatch.models import layer_types_of
from ferrobatch.runner import linear_policy
from ferrobatch.runner.aligned_activations import activation_modules, aligned
from ferrobatch.runner.cpu_linear import PackedLinears
from ferrobatch.runner.lean_layers import LeanLayers
from ferrobatch.runner.panel_weights import narrow_embedding
from ferrobatch.runner.patches import eval_mode
from ferrobatch.runner.quant_linears import QuantLinears

logger = logging.getLogger("ferrobatch")

__all__ = ["PackedActivations"]


class PackedActivations:
    """The runner's packed linears (`linears`: a bf16 / fp16 / fp32 CPU model's; None
    otherwise), a GGUF model's quantized products for the lean layers (`quant`:
    `ferrobatch.runner.quant_linears`, where the model has no plain linears) and lean
    decoder layers (`lean`, over either; None where they don't apply), made and checked
    once at construction; `active()` puts them in place for a forward."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, dtype: torch.dtype,
                 kv_dtype: torch.dtype, vocab_size: int, configs: list,
                 activations: str = "auto", lean_layers: bool = True,
                 batch_invariant: bool = False) -> None:
        """`dtype`: the activations' dtype without packed linears (the runner's); `kv_dtype`
        the KV cache's; `configs` the model's configs (`model_config.model_configs`, for the
        checks' attention); `activations` and `lean_layers` as `ModelRunner` takes them;
        `batch_invariant`: every product on `linear_policy.choose_invariant`'s backend
        (a half-precision model with fp32 activations; `FieldError` where none runs).
        Off the CPU: neither part."""
        if activations not in ("auto", "float32", "model"):
            raise ValueError(f"activations must be 'auto', 'float32' or 'model', "
                             f"not {activations!r}")
        self.model = model
        self._device = device
        self._dtype = dtype
        self._kv_dtype = kv_dtype
        self._vocab_size = vocab_size
        self._configs = configs
        self._invariant = batch_invariant
        self.linears: PackedLinears | None = None
        self.quant: QuantLinears | None = None
        self.lean: LeanLayers | None = None
        #: forwards run the model's own decoder layers even where lean ones exist (a step
        #: with LoRA adapter rows: their hooks need each linear layer called as a module)
        self.lean_off = False
        if device.type == "cpu":
            # a GGUF model's quantized products first (outside the batch-invariant mode): its
            # only plain linears are then inside MoE blocks (Qwen2-MoE's shared-expert gate),
            # which run as their own modules
            quant = QuantLinears.of(model) if lean_layers else None
            self.linears = None if quant is not None and not batch_invariant else \
                self._make_packed_linears("float32" if batch_invariant else activations)
            if batch_invariant:
                self._check_invariant()
            if self.linears is None:
                self.quant = quant
            self.lean = self._make_lean_layers(lean_layers)
            if self.lean is None:
                self.quant = None
        #: batch-invariant mode: the activation modules run over rows padded to a whole
        #: vector loop (`aligned_activations`) in the model's own forwards
        self._aligned = activation_modules(model) if batch_invariant and \
            device.type == "cpu" else []

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the activations between the linear layers."""
        return self.linears.activation_dtype if self.linears is not None else self._dtype

    @property
    def widens(self) -> bool:
        """Whether activations are kept wider than the weights (fp32 between products)."""
        return self.linears is not None and self.linears.widens

    def release_sources(self) -> int:
        """After construction: the checkpoint's pages of the packed linears' own weights out
        of the resident set (`PackedLinears.release_sources`). Returns the bytes given
        back."""
        return 0 if self.linears is None else self.linears.release_sources()

    def hold_in_panels(self) -> int:
        """After construction, for a model the engine loaded: the fp32 weights whose bf16
        panels are their only copy let go (`PackedLinears.hold_in_panels`). Returns the
        bytes let go."""
        return 0 if self.linears is None else self.linears.hold_in_panels()

    def narrow_embedding(self, kept: Callable[[torch.Tensor], bool]) -> int:
        """After `hold_in_panels`, where the linears run on bf16 panels: the input
        embedding's fp32 weight held as bf16 (`panel_weights.narrow_embedding`; a head tied
        to it must read only its panels, and `kept` say no one else holds it). Returns the
        bytes let go."""
        linears = self.linears
        if linears is None or linears.weight_format != linear_policy.FP32_IN_BF16:
            return 0
        let_go = narrow_embedding(self.model, linears.only_on_bf16_panels, kept)
        if let_go:
            linears.same_values_swapped()
        return let_go

    def attention_dtype(self, rows: int) -> torch.dtype | None:
        """The dtype a step of `rows` tokens writes its attention output in: the KV cache's
        where the o product rounds its input to half precision anyway (bf16 products), else
        None (the queries' own, fp32 before fp32-input products: no rounding between the
        attention and the product)."""
        linears = self.linears
        if linears is None or not linears.widens or linears.input_dtype(rows) == torch.float32:
            return None
        return self._kv_dtype

    @contextmanager
    def active(self) -> Iterator[None]:
        """The packed linears, and the lean decoder layers when there are, for a forward."""
        products = self.linears if self.linears is not None else self.quant
        use_lean = products is not None and self.lean is not None and not self.lean_off
        lean = self.lean.active() if use_lean else nullcontext()  # type: ignore[union-attr]
        with products.active() if products is not None else nullcontext(), lean, \
                aligned(self._aligned, context.in_ferrobatch_forward):
            yield

    def stacked_quant_layers(self) -> list[torch.nn.Module]:
        """The `QuantLinear` layers the lean layers run stacked (`QuantLinears`), whose own
        packed copies a served model does not need."""
        return [] if self.quant is None or self.lean is None else self.quant.stacked_layers()

    def close(self) -> None:
        self.lean = None

    def _make_lean_layers(self, lean: bool) -> LeanLayers | None:
        """The lean decoder layers (`ferrobatch.runner.lean_layers`) when asked, they apply,
        and `_lean_holds` (forwards with them are about as close to the exact computation
        as the model's own forward on the same packed weights)."""
        products = self.linears if self.linears is not None else self.quant
        if self.linears is not None and getattr(self.model, "ferrobatch_tp", None) is not None \
                and not _dtensor_shards(self.model):
            # a float share cut by `quant_shard`: its row-parallel linears sum their parts
            # over the ranks in a forward hook, which the lean layers' products bypass
            return None
        layers = LeanLayers.of(self.model, products, context.in_ferrobatch_forward,
                               self._kv_dtype) if lean else None
        if layers is None:
            return None
        holds = self._quant_lean_holds(layers) if products is self.quant \
            else self._lean_holds(layers)
        if not holds:
            logger.info("ferrobatch: lean decoder layers are further from the exact forward "
                        "than the model's own; not used")
            return None
        logger.info("ferrobatch: %d decoder layers run lean (fused kernels)", layers.num_layers)
        if self.quant is not None:
            self.quant.prepack()
            logger.info("ferrobatch: %d quantized linear layers in %d stacked groups "
                        "(%.0f MiB of stacked copies)", self.quant.num_layers,
                        self.quant.num_groups, self.quant.packed_bytes / 2**20)
        return layers

    def _quant_lean_holds(self, lean: LeanLayers) -> bool:
        """A GGUF model's lean layers (`QuantLinears` products) against its own layers on
        two short forwards of the same products: the reference path's, on the first
        decoder layer of each attention kind with its weights (dequantized once), the other
        layers' products giving their biases only (`quant_modules.few_layers`: a lean layer
        computes the same whatever its weights, and the reference products are exact
        where the kernels' int8 activations would turn fp32 rounding differences into
        rounding steps). Each product is the layer's own `QuantLinear` one (stacked
        products are bit for bit their members', tested), so the lean layers must agree
        to fp32 rounding: within 1e-5 of the logits' norm, as an fp32 model's."""
        pairs = []
        try:
            with torch.inference_mode(), eval_mode(self.model), \
                    registry.cast_attention_enabled(self._configs), \
                    quant_modules.few_layers(self.model, layer_types_of(self.model)):
                for n in (16, 33):
                    ids = self._check_ids(n)
                    own = self._logits(ids)
                    with lean.active(everywhere=True):
                        pairs.append((own, self._logits(ids)))
        except Exception as exc:  # noqa: BLE001 - a layer that can't: its own forward
            logger.info("ferrobatch: lean decoder layers fail (%s: %s)", type(exc).__name__, exc)
            return False
        for own, got in pairs:
            if not bool(torch.isfinite(got).all()) or not bool(
                    (got - own).norm() <= 1e-5 * own.norm()):
                logger.info("ferrobatch: lean decoder layers differ from the model's own by "
                            "%.2g of the logits' norm", float((got - own).norm() / own.norm()))
                return False
        return True

    def _lean_holds(self, lean: LeanLayers) -> bool:
        """On two short forwards, the lean layers' logits are within twice the own layers'
        distance from the exact ones (both are bf16-rounded computations whose distance
        varies from input to input by tens of percent; a lean layer that computed something
        else would be off by the size of the logits), plus a floor: 1e-3 of the logits' norm
        for half-precision weights, 1e-5 for fp32 ones (whose lean layers differ from the
        model's own by fp32 rounding: 2e-7 to 1e-6 of the norm measured, tiny models to
        SmolLM2)."""
        assert self.linears is not None
        floor = 1e-5 if self.linears.weight_dtype == torch.float32 else 1e-3
        for n in (16, 33):
            ids = self._check_ids(n)
            try:
                with torch.inference_mode(), eval_mode(self.model):
                    with self.linears.active(exact=True):
                        ref = self._logits(ids)
                    with self.linears.active(everywhere=True), \
                            registry.cast_attention_enabled(self._configs):
                        own = self._logits(ids)
                        with lean.active(everywhere=True):
                            got = self._logits(ids)
            except Exception as exc:  # noqa: BLE001 - a layer that can't: its own forward
                logger.info("ferrobatch: lean decoder layers fail (%s: %s)",
                            type(exc).__name__, exc)
                return False
            if not bool(torch.isfinite(got).all()) or not bool(
                    (got - ref).norm() <= 2 * (own - ref).norm() + floor * ref.norm()):
                return False
        return True

    def _make_packed_linears(self, activations: str) -> PackedLinears | None:
        """Packed linears (`ferrobatch.runner.cpu_linear`): an fp32 model's as they are; a
        half-precision model's with fp32 activations when asked or, with "auto", when a
        forward that way is at least about as close to the exact computation as the model's
        own (a model whose code mixes its activations with half-precision tensors outside
        `nn.Linear` fails that check and keeps its dtype); layers sharing an input grouped
        from one calibration forward."""
        in_fwd = context.in_ferrobatch_forward
        tp = getattr(self.model, "ferrobatch_tp", None) is not None
        if self.model.dtype == torch.float32 and (
                not tp or self._invariant and not _dtensor_shards(self.model)):
            # (a tensor-parallel share only as the batch-invariant mode cuts it, into plain
            # slices: transformers' plan holds DTensors, and a quantized share's float
            # leftovers keep torch's products beside the lean layers' quantized ones)
            linears = PackedLinears.of(self.model, in_thread=in_fwd, dtypes=(torch.float32,),
                                       invariant=self._invariant)
            return self._calibrated(linears)
        if self.model.dtype not in (torch.bfloat16, torch.float16):
            return None
        linears = None
        if activations != "model":
            linears = PackedLinears.of(
                self.model, activation_dtype=torch.float32, in_thread=in_fwd,
                hidden_size=getattr(text_config(self.model.config), "hidden_size", None),
                amx=True, invariant=self._invariant,
                fp32_rows=None if self._invariant
                else linear_policy.probe(self.model.dtype).fp32_from_rows,
            )
            if linears is not None and activations == "auto" and not self._widening_holds(
                linears
            ):
                logger.info("ferrobatch: %s keeps %s activations (its forward with fp32 "
                            "activations is further from the exact one than its own)",
                            type(self.model).__name__, self.model.dtype)
                linears = None
        if linears is None:
            linears = PackedLinears.of(self.model, in_thread=in_fwd)
        return self._calibrated(linears)

    def _check_invariant(self) -> None:
        """Batch-invariant mode: every plain CPU `nn.Linear` runs on packed weights whose
        product is batch-invariant here (`PackedLinears.invariant_backend`); else
        `FieldError` on `batch_invariant`."""
        if self.linears is not None:
            self.linears.invariant_backend()
            if not self.linears.widens and self.linears.weight_dtype != torch.float32:
                raise FieldError(
                    f"batch_invariant: {type(self.model).__name__} does not run with fp32 "
                    "activations over its half-precision weights", "batch_invariant")
        held = set() if self.linears is None else {id(m) for m in self.linears.layers}
        others = _other_products(self.model, held)
        if others:
            raise FieldError(
                f"batch_invariant: {type(self.model).__name__} multiplies by weights that do "
                f"not run on packed batch-invariant products: {', '.join(others[:3])}"
                f"{' ...' if len(others) > 3 else ''} (mixed weight dtypes, no memory for the "
                "copies, Conv1D or fused-expert layers)", "batch_invariant")

    def _calibrated(self, linears: PackedLinears | None) -> PackedLinears | None:
        """`linears` with the layers sharing an input grouped from one calibration forward."""
        if linears is not None:
            ids = self._check_ids(16)
            try:
                with torch.inference_mode(), eval_mode(self.model), \
                        registry.cast_attention_enabled(self._configs):
                    linears.calibrate(lambda: self.model(input_ids=ids, use_cache=False))
            except Exception as exc:  # noqa: BLE001 - no groups then: each layer alone
                logger.info("ferrobatch: no stacked linear groups (calibration forward "
                            "failed: %s: %s)", type(exc).__name__, exc)
            linears.prepack()
            logger.info("ferrobatch: %d linear layers on packed %s weights (%d stacked groups, "
                        "%.0f MiB), %s activations", linears.num_layers, linears.weight_dtype,
                        linears.num_groups, linears.packed_bytes / 2**20,
                        linears.activation_dtype)
        return linears

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits of a check forward of `ids` [1, n] (the caller sets the mode)."""
        return self.model(input_ids=ids, use_cache=False).logits[0].float()

    def _check_ids(self, n: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, self._vocab_size, (1, n), generator=gen).to(self._device)

    def _widening_holds(self, wide: PackedLinears) -> bool:
        """Whether the model's forward with fp32 activations runs and is at least as close
        to the exact computation (fp32 products of the same weights) as its own forward."""
        ids = self._check_ids(16)
        try:
            with torch.inference_mode(), eval_mode(self.model):
                own = self._logits(ids)
                with wide.active(everywhere=True), registry.cast_attention_enabled(self._configs):
                    got = self._logits(ids)
                with wide.active(exact=True):
                    ref = self._logits(ids)
        except Exception as exc:  # noqa: BLE001 - a model that can't: keep its dtype
            logger.info("ferrobatch: fp32 activations fail (%s: %s)", type(exc).__name__, exc)
            return False
        if not bool(torch.isfinite(got).all()):
            return False
        return bool((got - ref).norm() <= (own - ref).norm() * 1.5 + 1e-3 * ref.norm())


def _other_products(model: torch.nn.Module, held: set[int]) -> list[str]:
    """The modules of `model` holding a matrix parameter (2-D or more) that are not packed
    linears (`held`, by id) or embeddings (a lookup: exact): products torch would run with
    an order chosen by the batch (Conv1D, fused MoE experts, a linear left unpacked). GGUF
    modules keep their matrices as buffers, multiplied per row by the quantized kernels."""
    found = []
    for name, module in model.named_modules():
        if id(module) in held or isinstance(module, torch.nn.Embedding):
            continue
        if any(p.dim() >= 2 for p in module.parameters(recurse=False)):
            found.append(f"{name or 'the model'} ({type(module).__name__})")
    return found


def _dtensor_shards(model: torch.nn.Module) -> bool:
    """Whether `model` is a share of transformers' tensor-parallel plan (DTensor weights)."""
    return getattr(model, "ferrobatch_tp", None) is not None and any(
        isinstance(p, DTensor) for p in model.parameters())
