"""Micro-benchmark: the per-step cost of guided decoding's token mask
(`ferrobatch.sampling.guided`).

For B guided rows (a JSON schema, llguidance matchers on the SmolLM2 tokenizer, vocabulary
49,152), times one step's mask: each row's matcher consumes its last token and fills its
bitmask row, the bitmasks are unpacked and the forbidden scores set to -inf
(`guided.mask_rows` on fp32 scores [B, V]); beside it, the sampler's own full-logits greedy
step on the same scores without a grammar. The tokens fed are a valid JSON output (forced
greedy decoding of random scores), so every step is a real mid-document state.

    python benches/guided_mask.py [steps]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python")]

from ferrobatch.models import bundled_model_dir  # noqa: E402
from ferrobatch.sampling.guided import GuideFactory, mask_rows  # noqa: E402
from ferrobatch.sampling.params import SamplingParams  # noqa: E402
from ferrobatch.sampling.sampler import Sampler, SamplingState  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["name", "age", "tags", "kind"],
    "additionalProperties": False,
}


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    tok = AutoTokenizer.from_pretrained(bundled_model_dir())  # the bundled SmolLM2's
    vocab = 49152
    t = time.perf_counter()
    factory = GuideFactory(tok, vocab, [2])
    factory.ll_tokenizer()
    print(f"llguidance tokenizer: {1e3 * (time.perf_counter() - t):.0f} ms (once per engine)")
    sp = SamplingParams(json_schema=SCHEMA)
    t = time.perf_counter()
    for _ in range(20):
        factory.guide(sp)
    print(f"grammar compile + matcher: {1e3 * (time.perf_counter() - t) / 20:.2f} ms/request "
          "(at add time, caller's thread)")
    sampler = Sampler(seed=0)
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 8, 32, 64):
        states = [SamplingState(sp, [1], guide=factory.guide(sp)) for _ in range(batch)]
        plain = [SamplingState(SamplingParams(), [1]) for _ in range(batch)]
        mask_t, base_t = [], []
        for _ in range(steps):
            scores = torch.randn(batch, vocab, generator=gen)
            t0 = time.perf_counter()
            s2 = scores.clone()
            mask_rows(s2, states)
            t1 = time.perf_counter()
            sampler.sample(scores, plain)
            s3 = scores.clone()
            s3.argmax(dim=-1)
            t2 = time.perf_counter()
            mask_t.append(t1 - t0)
            base_t.append(t2 - t1)
            toks = s2.argmax(dim=-1).tolist()
            for s, tk in zip(states, toks, strict=True):
                if not (s.guide.matcher.is_stopped() or s.guide.matcher.is_accepting()):
                    s.output_ids.append(tk)
        print(f"batch {batch:3d}: mask {1e3 * statistics.median(mask_t):6.2f} ms/step "
              f"({1e3 * statistics.median(mask_t) / batch:5.3f} ms/row), "
              f"unguided greedy sample {1e3 * statistics.median(base_t):6.2f} ms/step")


if __name__ == "__main__":
    main()
