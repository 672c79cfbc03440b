"""Embedding requests (`Engine.embed`): how a prompt becomes one, the pooling a checkpoint
asks for (sentence-transformers' `modules.json` and `1_Pooling/config.json`), and the result.

An embedding request runs through the same scheduler, paged cache and steps as generation:
a request for one greedy token whose prompt rows are also pooled (`ferrobatch.sampling.pooling`);
the token is dropped. Its chunks are freed when it finishes (full blocks stay in the prefix
cache as any request's do).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferrobatch.engine.outputs import EmbeddingOutput
from ferrobatch.engine.request import Prompt, Request, make_request
from ferrobatch.errors import FieldError
from ferrobatch.sampling.params import SamplingParams
from ferrobatch.sampling.pooling import Pooled, check_pooling

if TYPE_CHECKING:
    from ferrobatch.engine.llm_engine import Engine

__all__ = ["PoolingDefaults", "embedding_request", "pooling_defaults"]

# sentence-transformers pooling-config keys and the mode each names
_ST_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
# sentence-transformers modules that change nothing ferrobatch computes
_ST_NEUTRAL = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingDefaults:
    """What `embed` does when the caller names no pooling: the checkpoint's
    (sentence-transformers) settings, else last-token pooling, normalized. `error`: why the
    checkpoint's own pipeline can't be reproduced (a module ferrobatch does not apply);
    `source` says where the defaults came from."""

    pooling: str = "last"
    normalize: bool = True
    source: str = "default"
    error: str | None = None


def pooling_defaults(model_dir: Any) -> PoolingDefaults:
    """The pooling of the sentence-transformers pipeline saved in `model_dir` (its
    `modules.json`), or the default when there is none."""
    if not model_dir:
        return PoolingDefaults()
    root = Path(str(model_dir))
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return PoolingDefaults()
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, ValueError) as exc:
        return PoolingDefaults(source=str(modules_file), error=f"unreadable: {exc}")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        return PoolingDefaults(source=str(modules_file),
                               error="not a list of module objects")
    mode, normalize, error = "last", False, None
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            mode, error = _st_pooling(root / str(module.get("path", "")) / "config.json")
        elif kind not in _ST_NEUTRAL:
            error = f"its module {kind!r} is not applied by ferrobatch"
        if error is not None:
            break
    return PoolingDefaults(mode, normalize, str(modules_file), error)


def _st_pooling(config_file: Path) -> tuple[str, str | None]:
    """(mode, error) of a sentence-transformers Pooling module's config."""
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return "last", f"its pooling config is unreadable: {exc}"
    if not isinstance(cfg, dict):
        return "last", f"its pooling config holds a {type(cfg).__name__}, not an object"
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if len(on) != 1 or on[0] not in _ST_MODES:
        return "last", f"its pooling {on} is not one of {sorted(_ST_MODES)}"
    if cfg.get("include_prompt", True) is not True:
        return "last", "its pooling excludes the instruction prompt (include_prompt=false)"
    return _ST_MODES[on[0]], None


def resolve_pooling(
    defaults: PoolingDefaults, pooling: str | None, normalize: bool | None
) -> tuple[str, bool]:
    """The (pooling, normalize) a call runs with: the arguments where given, else the
    checkpoint's; a `FieldError` where neither is usable."""
    if pooling is None and defaults.error is not None:
        raise FieldError(
            f"pooling: the checkpoint's sentence-transformers pipeline ({defaults.source}) "
            f"can't be reproduced: {defaults.error}; pass pooling= to choose one", "pooling")
    return check_pooling(
        defaults.pooling if pooling is None else pooling,
        defaults.normalize if normalize is None else normalize,
    )


def embedding_request(engine: Engine, prompt: Prompt, pooling: str, normalize: bool,
                      new_id: Any) -> Request:
    """A validated embedding request for `engine` (`FieldError` naming the field)."""
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    req = make_request(engine, prompt, sp, None, new_id)
    req.pool = Pooled(pooling, normalize, len(req.prompt_ids))
    return req


def embedding_output(req: Request) -> EmbeddingOutput:
    """The finished request's embedding."""
    assert req.pool is not None
    vec = req.pool.vector()
    return EmbeddingOutput(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_ids),
        embedding=vec.tolist(),
        pooling=req.pool.mode,
        normalized=req.pool.normalize,
    )
