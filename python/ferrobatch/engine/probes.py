"""The construction-time probes of `Engine`: the paged path against the model's own forward,
and a packed step against each request alone (`ModelProbes._probe_model`)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from ferrobatch.engine.model_checks import config_lengths
from ferrobatch.errors import FieldError
from ferrobatch.gguf import modules as quant_modules
from ferrobatch.models import model_lock
from ferrobatch.runner.patches import eval_mode

if TYPE_CHECKING:
    from ferrobatch.engine.llm_engine import Engine

logger = logging.getLogger("ferrobatch")


class ModelProbes:
    """`Engine`'s probes; failures raise `NotImplementedError` naming the model."""

    def _probe_model(self: Engine) -> None:
        """Check at construction that the paged path computes what the model computes.

        1. A short prompt and one decode step through the paged path (a scratch scheduler
           over the same cache), compared with the model's own forward: a model whose
           attention does not go through transformers' attention interface, or goes through
           it with something the paged attention ignores, fails here.
        2. A packed step (`_probe_packed`): several requests of different lengths in one
           batch, one of them a chunked prefill, then decode steps side by side, each
           compared with the same request run alone through the same runner: a model that
           derives something from the whole forward (the batch, the step's length, the
           cache) fails here instead of answering differently next to other requests.

        Failures raise `NotImplementedError`. The chunks the probe writes are rewritten
        before any real request reads them.
        """
        self.probe_relative_error: float | None = None
        self.probe_packed_error: float | None = None
        try:
            # another engine on the same model must not switch its attention meanwhile
            with model_lock(self.model), self._probe_products():
                self._probe_own_forward()
                self._probe_packed()
        except (NotImplementedError, FieldError):
            raise
        except Exception as exc:
            raise NotImplementedError(
                f"{type(self.model).__name__} cannot run through ferrobatch's paged attention: "
                f"the probe forward failed with {type(exc).__name__}: {exc}"
            ) from exc

    def _probe_products(self: Engine) -> contextlib.AbstractContextManager:
        """The products the probes run with. Quantized products (GGUF weights) run on the
        reference path: the kernels quantize activations to int8, whose roundings turn the
        paged attention's last-bit differences into errors these probes would take for a
        missing feature. The probes check how the model computes attention and whether a
        row depends on its batch, which its weights do not decide, but each reference
        product dequantizes its weight (about 1.5 s a forward of a 1.5B model, 28 forwards
        here): so one decoder layer of each attention kind (`runner.layer_types`: full,
        sliding) keeps its weights, dequantized once, the other layers' products give their
        biases only (each layer still runs its attention, every kind on real activations),
        and the head gives its first rows' logits (`quant_modules.few_layers`)."""
        return quant_modules.few_layers(self.model, list(self.runner.layer_types))

    def _half_precision(self: Engine) -> bool:
        """Whether the runner's products round to half precision (a bf16 / fp16 model or
        cache, an int8 cache, or linears run in half precision by the runner)."""
        half = (torch.float16, torch.bfloat16)
        act = self.runner.activation_dtype
        return (
            self.runner.cache.quantized  # int8 keys and values: rounded more than bf16
            or self.runner.cache.keys[0].dtype in half
            or next(self.model.parameters()).dtype in half
            or act in half
        )

    def _probe_tolerance(self: Engine) -> float:
        # fp32 agrees to ~1e-6 on CPU (TF32 matmuls on CUDA: ~1e-3); half precision only
        # rounds differently (bf16 SmolLM2: ~0.016), so there only a gross error is refused.
        if self._half_precision():
            return 0.25
        return 2e-3 if self.device.type == "cpu" else 1e-2

    def _probe_drive(
        self: Engine, prompts: dict[str, list[int]], decodes: int, max_batch_tokens: int
    ) -> dict[str, list[torch.Tensor]] | None:
        """Run `prompts` together through a scratch scheduler (`max_batch_tokens` per step)
        and the runner, feeding each request fixed tokens (not its samples, so two runs see
        the same inputs whatever their logits); returns each request's `decodes + 1`
        sampled logits (fp32, CPU), or None when the cache cannot hold them."""
        scratch = self._build_scheduler(max_batch_tokens=max_batch_tokens)
        try:
            for rid, p in prompts.items():
                scratch.add_request(rid, p, decodes + 1)
        except ValueError:
            return None
        got: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
        rope = self.rope
        for rid, p in prompts.items():
            if rope is not None:
                rope.add(rid, len(p))
        try:
            for _ in range(64 * (decodes + 1) * len(prompts)):
                plan = scratch.schedule()
                if plan is None:
                    break
                logits = self.runner.execute(plan)
                rids = list(plan.request_ids)
                tokens = []
                for i, row in enumerate(plan.logits_rows):
                    rid = rids[int(row)]
                    got[rid].append(logits[i].detach().float().cpu())
                    tokens.append((13 * len(got[rid]) + 7 * len(rid) + 5) % self.vocab_size)
                out = scratch.update(tokens)
                if rope is not None:
                    rope.after_update(scratch, plan, out.finished_request_ids)
        finally:
            if rope is not None:
                for rid in prompts:
                    rope.forget(rid)
        if any(len(v) != decodes + 1 for v in got.values()):
            return None
        return got

    def _probe_own_forward(self: Engine) -> None:
        """Probe 1 (see `_probe_model`)."""
        name = type(self.model).__name__
        n = max(2, min(12, self.max_model_len - 3, self.num_blocks * self.config.page_size - 1))
        prompt = [(7 * i + 3) % self.vocab_size for i in range(n)]
        scratch = self._build_scheduler()
        try:
            scratch.add_request("ferrobatch-probe", prompt, 2)
        except ValueError:
            return  # a cache too small for even the probe: requests will be refused anyway
        got: list[torch.Tensor] = []
        tokens = list(prompt)
        while len(got) < 2:
            plan = scratch.schedule()
            if plan is None:
                break
            logits = self.runner.execute(plan)
            if len(plan.logits_indices):
                got.append(logits[-1].detach().float().cpu())
                tokens.append(int(logits[-1].argmax()))
            scratch.update([int(logits[i].argmax()) for i in range(len(plan.logits_indices))])
        with torch.inference_mode(), eval_mode(self.model):
            ids = torch.tensor([tokens[: n + 1]], device=self.device)
            ref = self.model(input_ids=ids, use_cache=False).logits[0, n - 1 :]
        ref = ref.detach().float().cpu()
        if len(got) != 2 or ref.shape[0] != 2:
            return
        if not bool(torch.isfinite(ref).all()):
            raise FieldError(
                f"{name}: the model's own forward gives non-finite logits (NaN or infinity) "
                f"on a {n}-token probe prompt: {_non_finite_weight(self.model)}", "model")
        out = torch.stack(got)
        tol = self._probe_tolerance()
        err = float((out - ref).norm() / ref.norm().clamp_min(1e-6))
        self.probe_relative_error = err
        if not err <= tol:
            raise NotImplementedError(
                f"{name}: logits through ferrobatch's paged attention differ from the model's "
                f"own forward (relative error {err:.2g} > {tol}); this architecture uses "
                "attention features the paged attention does not implement"
            )
        if self._half_precision() and err > 0.05:
            why = ("the int8 KV cache (kv_cache_dtype='int8') rounds this model's keys and "
                   "values coarsely" if self.runner.cache.quantized
                   else "expected rounding in half precision is smaller")
            logger.warning(
                "ferrobatch: %s logits through the paged attention differ from the model's own "
                "forward by %.2g (relative); %s",
                name,
                err,
                why,
            )

    def _probe_lengths(self: Engine) -> list[int]:
        """Prompt lengths of the packed probe: short and page-crossing ones, plus lengths
        on both sides of every length the model's config names (sliding window, attention
        chunk, rope switch: `_config_lengths`) when small enough to run at construction;
        all within the context and the cache."""
        page = self.config.page_size
        lengths = [3, 9, page + 5]
        small = 4 * page + 8
        for v in config_lengths(self.model.config):
            if v + 3 <= small:
                lengths += [v - 2, v + 3]
        room = min(self.max_model_len - 6, self.num_blocks * page // 2 - 6)
        return sorted({max(1, min(n, room)) for n in lengths})

    def _probe_packed(self: Engine) -> None:
        """Probe 2 (see `_probe_model`): the lengths of `_probe_lengths`, 4 decode steps
        each, packed with a token budget that chunks the longest prompt, against each
        request alone (one prefill step, then its decodes)."""
        name = type(self.model).__name__
        lengths = self._probe_lengths()
        if len(lengths) < 2:
            return
        decodes = 4
        prompts = {
            f"ferrobatch-probe-{i}": [(11 * j + 17 * i + 3) % self.vocab_size for j in range(n)]
            for i, n in enumerate(lengths)
        }
        longest = max(lengths)
        budget = max(len(lengths) + 1, sum(lengths[:-1]) + max(1, longest // 3))
        packed = self._probe_drive(prompts, decodes, budget)
        if packed is None:
            return
        err = 0.0
        worst = ""
        for rid, p in prompts.items():
            alone = self._probe_drive({rid: p}, decodes, len(p) + 1)
            if alone is None:
                return
            a, b = torch.stack(packed[rid]), torch.stack(alone[rid])
            e = float((a - b).norm() / b.norm().clamp_min(1e-6))
            if e > err:
                err, worst = e, f"{len(p)}-token prompt"
        self.probe_packed_error = err
        tol = self._probe_tolerance()
        if not err <= tol:
            raise NotImplementedError(
                f"{name}: a request's logits in a packed step (next to requests of other "
                f"lengths, with a chunked prefill) differ from the same request run alone "
                f"(relative error {err:.2g} > {tol}, {worst}); the model derives something "
                "from the whole forward (the batch, the step's length or the cache) that "
                "ferrobatch does not make per request"
            )


def _non_finite_weight(model: torch.nn.Module) -> str:
    """Which floating tensor of `model` holds a NaN or infinity (the first found), or that
    none of its floating tensors does (the values overflow in the forward, or sit in
    quantized blocks)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, t in named:
        if t.is_floating_point() and t.device.type != "meta":
            bad = (~torch.isfinite(t.detach())).nonzero()
            if len(bad):
                at = tuple(int(i) for i in bad[0])
                return f"{name} holds {float(t.detach()[at])} at [{', '.join(map(str, at))}]"
    return ("no floating weight holds a NaN or infinity, so the values overflow in the "
            "forward or a quantized block's scale is not finite")
