"""`LoraManager`: an engine's LoRA adapters, applied per request in shared steps.

Every linear layer an adapter targets gets a forward hook. Before a step's forward the
engine binds the step's rows (`bind`: which adapter each query token's request uses); the
hook then adds, for each adapter present, `scale * (x @ A.T) @ B.T` to that adapter's rows
of the layer's output (one pair of products per adapter: rows grouped by adapter), and
leaves the other rows (no adapter) as the base model computed them. Outside a bound step
(construction probes, a plain `model(...)` call) the hooks change nothing.

Caps and lifetimes: at most `max_loras` adapters are *active* (have requests in the
scheduler) at once; a request of another adapter waits outside the scheduler until one of
them has no request left (`admit`). An unloaded adapter takes no new requests; its weights go
when its last request finishes. Each loaded adapter has its own prefix-cache salt (`salt`),
so blocks computed under one adapter are never reused under another or without one.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ferrobatch.errors import FieldError
from ferrobatch.lora.adapter import LoraAdapter, LoraWeights

__all__ = ["LoraManager"]


class LoraManager:
    """The adapters of one engine's model (see the module docstring); thread-safe for
    `load` / `unload` / `check` from any thread while the stepping thread binds steps."""

    def __init__(self, model: torch.nn.Module, max_loras: int = 4) -> None:
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise FieldError(f"max_loras must be an integer >= 1, got {max_loras!r}",
                             "max_loras")
        self.model = model
        self.max_loras = max_loras
        self._lock = threading.Lock()
        self._adapters: dict[str, LoraAdapter] = {}  # loaded, by name
        self._salts: dict[str, int] = {}  # by name; unique per load
        self._ids = itertools.count(1)
        self._live: dict[int, int] = {}  # salt -> requests in the scheduler
        self._by_salt: dict[int, LoraAdapter] = {}  # every adapter a request still uses
        self._hooked: dict[str, Any] = {}  # module path -> hook handle
        self._modules = dict(model.named_modules())
        self._head = model.get_output_embeddings()
        # the step being run, in the thread that runs it (module path -> [(rows, weights)]):
        # a forward of the same model in another thread (the caller's own, a second
        # engine's) sees none and passes the hooks untouched
        self._bound = threading.local()

    # --- adapters ------------------------------------------------------------------------

    def load(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name` (`FieldError` if the name is taken or
        the adapter doesn't fit the model)."""
        if not isinstance(name, str) or not name or not name.strip():
            raise FieldError(f"lora_name must be a non-empty string, got {name!r}", "lora_name")
        adapter = LoraAdapter.load(name, path, self.model)
        for module in adapter.modules:
            if self._modules.get(module) is self._head:
                raise FieldError(f"lora_modules: adapter {name!r} targets the output head "
                                 f"{module!r}, which ferrobatch doesn't adapt", "lora_modules")
        with self._lock:
            if name in self._adapters:
                raise FieldError(f"lora_name: an adapter named {name!r} is already loaded",
                                 "lora_name")
            salt = next(self._ids)
            self._adapters[name], self._salts[name] = adapter, salt
            self._by_salt[salt] = adapter
            for module in adapter.modules:
                if module not in self._hooked:
                    self._hooked[module] = self._modules[module].register_forward_hook(
                        self._hook(module))

    def unload(self, name: str) -> None:
        """Take `name` out of service (`FieldError` if unknown): no new requests; requests
        already using it finish with it."""
        with self._lock:
            if name not in self._adapters:
                raise FieldError(f"lora_name: no adapter named {name!r} is loaded", "lora_name")
            del self._adapters[name]
            salt = self._salts.pop(name)
            if not self._live.get(salt):
                self._by_salt.pop(salt, None)

    def names(self) -> list[str]:
        """The loaded adapters' names, in load order."""
        with self._lock:
            return list(self._adapters)

    def path_of(self, name: str) -> str:
        """Where adapter `name` was loaded from."""
        with self._lock:
            return self._adapters[name].path

    def salt(self, name: str | None) -> int:
        """The prefix-cache salt of a request of adapter `name` (0: no adapter);
        `FieldError` (field "lora") for an unknown name."""
        if name is None:
            return 0
        with self._lock:
            salt = self._salts.get(name)
        if salt is None:
            raise FieldError(f"lora: no adapter named {name!r} is loaded (loaded: "
                             f"{self.names()})", "lora")
        return salt

    # --- admission (the stepping thread) -------------------------------------------------

    def admit(self, salt: int) -> bool:
        """Whether a request of the adapter with `salt` may enter the scheduler now (fewer
        than `max_loras` adapters active, or its own already is); counts it in if so.
        `FieldError` (field "lora") where the adapter was unloaded before the request
        started: its weights are gone once no started request uses them."""
        if salt == 0:
            return True
        with self._lock:
            if salt not in self._by_salt:
                raise FieldError("lora: the request's adapter was unloaded before the "
                                 "request started", "lora")
            if salt not in self._live and len(self._live) >= self.max_loras:
                return False
            self._live[salt] = self._live.get(salt, 0) + 1
            return True

    def release(self, salt: int) -> None:
        """A request of that adapter left the scheduler (finished, cancelled, failed)."""
        if salt == 0:
            return
        with self._lock:
            left = self._live.get(salt, 0) - 1
            if left > 0:
                self._live[salt] = left
                return
            self._live.pop(salt, None)
            if salt not in self._salts.values():  # unloaded meanwhile: drop its weights
                self._by_salt.pop(salt, None)

    @property
    def active(self) -> int:
        """Adapters with requests in the scheduler."""
        with self._lock:
            return len(self._live)

    # --- steps ---------------------------------------------------------------------------

    @contextmanager
    def bind(self, row_salts: Sequence[int], cu_seqlens_q: Any) -> Iterator[None]:
        """Inside the block, forwards apply each row's adapter (`row_salts[r]`, 0: none) to
        the query tokens `cu_seqlens_q[r] .. cu_seqlens_q[r + 1]` of the step."""
        salts = np.asarray(row_salts, dtype=np.int64)
        if not salts.any():
            yield
            return
        cu = np.asarray(cu_seqlens_q, dtype=np.int64)
        per_token = np.repeat(salts, np.diff(cu))
        step: dict[str, list[tuple[torch.Tensor, LoraWeights]]] = {}
        for salt in np.unique(per_token[per_token != 0]).tolist():
            rows = torch.from_numpy(np.flatnonzero(per_token == salt))
            adapter = self._by_salt[int(salt)]
            for module, weights in adapter.modules.items():
                step.setdefault(module, []).append((rows, weights))
        self._bound.step = step
        try:
            yield
        finally:
            self._bound.step = None

    def _hook(self, module_name: str) -> Any:
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> Any:
            step = getattr(self._bound, "step", None)
            if step is None or module_name not in step:
                return None
            x = inputs[0]
            flat_x = x.reshape(-1, x.shape[-1])
            flat_y = output.reshape(-1, output.shape[-1])
            for rows, w in step[module_name]:
                rows = rows.to(flat_x.device)
                xr = flat_x.index_select(0, rows).float()
                delta = F.linear(F.linear(xr, w.a), w.b) * w.scale
                flat_y = flat_y.index_add(0, rows, delta.to(flat_y.dtype))
            return flat_y.reshape(output.shape)

        return hook

    def close(self) -> None:
        """Remove the hooks (the model is as it was)."""
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
