"""Quantize on load one matrix at a time, inside transformers' own loader.

`Engine(path, quantization=...)` on one process: `from_pretrained` runs with a
`StreamQuantizer` (a transformers `HfQuantizer`, method "ferrobatch"), which transformers
calls for each matrix right after reading it and applying its key renames and conversions.
The matrix is quantized there (`quantize.quantize_weight`, the same bytes as quantizing the
loaded model) and only its `QuantWeight` is kept, on a zero-length stand-in parameter;
`quantize.quantize_model` then swaps the modules in. So the float model is never whole in
memory: the peak is the quantized weights, the small float tensors and one matrix in fp32
(an 8B bf16 checkpoint: ~7 GB, against 20-22 GB for a read of the whole model first).

Which matrices are quantized, and to which type, is `quantize.layer_type`'s rule, the one
`quantize_model` applies. A matrix the quantizer refuses (a NaN, an infinity) fails the
load with its `FieldError`, naming the tensor. Tensor-parallel ranks still read their
shares whole (`narrow_read`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:  # transformers' loader with per-parameter conversion ops (5.x; tested on 5.24)
    from transformers.core_model_loading import ConversionOps
    from transformers.quantizers import HfQuantizer
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
    )
    from transformers.utils.quantization_config import QuantizationConfigMixin
    AVAILABLE = True
except ImportError:  # an older loader: converting reads are read whole, then quantized
    ConversionOps = HfQuantizer = QuantizationConfigMixin = object  # type: ignore[misc,assignment]
    AVAILABLE = False

from ferrobatch.errors import FieldError
from ferrobatch.gguf import quantize

__all__ = ["AVAILABLE", "METHOD", "StreamConfig", "StreamQuantizer", "load"]

#: the `quant_method` transformers knows the quantizer by
METHOD = "ferrobatch"


class StreamConfig(QuantizationConfigMixin):
    """The quantization transformers is asked for: every matrix to `qtype` (a name of
    `quantize.ON_LOAD_TYPES`), as `quantize.layer_type` assigns it."""

    def __init__(self, qtype: str = "Q8_0", **_: Any) -> None:
        self.quant_method = METHOD
        self.qtype = qtype


class _Quantize(ConversionOps):
    """The op transformers applies to a matrix that needs quantization: its `QuantWeight`
    on a zero-length uint8 stand-in."""

    def __init__(self, quantizer: StreamQuantizer) -> None:
        self.quantizer = quantizer

    def convert(self, input_dict: dict[str, Any], **_: Any) -> dict[str, Any]:
        out = {}
        for name, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            qtype = self.quantizer.types.get(name)
            out[name] = tensor if qtype is None else self.quantizer.quantized(name, tensor, qtype)
        return out


class StreamQuantizer(HfQuantizer):
    """Quantizes each matrix as transformers reads it (module docstring). `types`: the
    parameter names it takes and their types; `error`: the first refusal, which `load`
    raises once transformers is done (an exception inside a conversion, transformers
    reports as a conversion error of its own and goes on)."""

    requires_calibration = False

    def __init__(self, quantization_config: StreamConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.types: dict[str, str] = {}
        self.error: FieldError | None = None

    def param_needs_quantization(self, model: nn.Module, param_name: str, **_: Any) -> bool:
        owner, _, leaf = param_name.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            return False
        if leaf != "weight" or not quantize.quantizable(module):
            return False
        qtype = quantize.layer_type(module.weight, self.quantization_config.qtype)
        if qtype is None:
            return False
        self.types[param_name] = qtype
        return True

    def quantized(self, name: str, weight: torch.Tensor, qtype: str) -> nn.Parameter:
        """The stand-in for `weight` quantized to `qtype` (`name`: the parameter's)."""
        stand_in = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        try:
            setattr(stand_in, quantize.PRE_QUANTIZED, quantize.quantize_named(name, weight, qtype))
        except FieldError as e:  # (raised by `load` once transformers is done)
            self.error = self.error or e
        return stand_in

    def get_quantize_ops(self) -> ConversionOps:
        return _Quantize(self)

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def _register() -> None:
    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        AUTO_QUANTIZATION_CONFIG_MAPPING[METHOD] = StreamConfig
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        AUTO_QUANTIZER_MAPPING[METHOD] = StreamQuantizer


def load(qtype: str, wanted: torch.dtype,
         load_checkpoint: Callable[..., tuple[Any, Any]]) -> tuple[Any, Any]:
    """`(model, tokenizer)`: `load_checkpoint(dtype=, quantization_config=)` (the plain
    load, its keyword arguments passed to `from_pretrained`) in `wanted` with every matrix
    quantized to `qtype` as it is read, then `quantize.quantize_model`'s modules swapped
    in. Raises the first matrix's refusal (`FieldError`, field "quantization")."""
    _register()
    model, tokenizer = load_checkpoint(dtype=wanted, quantization_config=StreamConfig(qtype))
    quantizer = getattr(model, "hf_quantizer", None)
    if isinstance(quantizer, StreamQuantizer):
        quantizer.remove_quantization_config(model)
        if quantizer.error is not None:
            raise quantizer.error
    quantize.quantize_model(model, qtype, dtype=wanted)
    return model, tokenizer
