"""Guided decoding (`SamplingParams(json_schema=..., regex=..., grammar=...)`, llguidance):
outputs always match the grammar, under batching with unconstrained batch mates, seeded
sampling, forced preemption (soft resets and offloads) and the async pipeline, and never
through the runner's greedy screen."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
import tiny_models
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.errors import FieldError
from ferrobatch.models import bundled_model_dir
from ferrobatch.runner.greedy_head import GreedyHead
from isa_helpers import needs_greedy_screen
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=200)
    kind: Literal["cat", "dog"]


SCHEMA = Pet.model_json_schema()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bundled_model_dir())


def _tiny(tokenizer, **cfg) -> Engine:
    """A random tiny Llama with the SmolLM2 vocabulary and tokenizer: every structured
    token it emits comes from the mask, not from a model that knows JSON."""
    model = tiny_models.llama(vocab_size=len(tokenizer), eos_token_id=2, bos_token_id=1)
    return Engine(model, tokenizer=tokenizer, config=ContinuousBatchingConfig(**cfg), seed=0)


def _check(out, n_tokens: int) -> None:
    assert out.finish_reason == "stop", (out.text, out.finish_reason)
    Pet.model_validate_json(out.text, strict=True)
    assert len(out.token_ids) <= n_tokens


def _mixed(n: int) -> list[SamplingParams]:
    """Guided greedy, guided seeded sampling and unconstrained rows, interleaved."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(SamplingParams(max_new_tokens=60, json_schema=SCHEMA))
        elif i % 3 == 1:
            out.append(SamplingParams(max_new_tokens=60, json_schema=SCHEMA, temperature=1.0,
                                      top_k=50, seed=i))  # fmt: skip
        else:
            out.append(SamplingParams(max_new_tokens=40, temperature=1.0, seed=i))
    return out


def test_params_validation() -> None:
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(json_schema=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema={"type": "nonsense"})
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema="{not json")
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema=[1, 2])
    with pytest.raises(ValueError, match="regex"):
        SamplingParams(regex="[0-9")
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar="start: foo")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(regex="a", ignore_eos=True)
    sp = SamplingParams(json_schema=json.dumps(SCHEMA))
    assert sp.guided and not SamplingParams().guided
    # key counts only where every key is declared (undeclared ones could repeat)
    for open_object in ({"type": "object", "minProperties": 2},
                        {"type": "object", "properties": {"a": {"type": "object",
                         "patternProperties": {"^x": {}}, "additionalProperties": False,
                         "maxProperties": 1}}}):  # fmt: skip
        with pytest.raises(FieldError, match="minProperties") as err:
            SamplingParams(json_schema=open_object)
        assert err.value.field == "json_schema"
    SamplingParams(json_schema={"type": "object", "properties": {"a": {}, "b": {}},
                                "additionalProperties": False, "minProperties": 1})


@pytest.mark.parametrize("mode", ["sync", "soft_reset", "offload", "async", "async_preempt"])
def test_random_model_outputs_match_schema(tokenizer, mode: str) -> None:
    cfg = {"page_size": 8, "max_batch_tokens": 64, "num_blocks": 256}
    if mode in ("soft_reset", "offload", "async_preempt"):
        cfg["num_blocks"] = 24  # 12 requests of ~20 + 60 tokens: preempted again and again
    if mode == "offload":
        cfg["cpu_offload_space"] = 0.05
    if mode.startswith("async"):
        cfg["use_async_batching"] = True
    eng = _tiny(tokenizer, **cfg)
    try:
        prompts = [f"Describe pet number {i} as JSON." for i in range(12)]
        params = _mixed(12)
        outs = eng.generate(prompts, params, progress=False)
        for out, sp in zip(outs, params, strict=True):
            if sp.guided:
                _check(out, 60)
        if mode in ("soft_reset", "offload", "async_preempt"):
            st = eng.stats()
            assert st["num_preemptions"] > 0, st
            assert st["num_offloads" if mode == "offload" else "num_soft_resets"] > 0, st
    finally:
        eng.close()


def test_random_model_regex_and_lark(tokenizer) -> None:
    eng = _tiny(tokenizer, page_size=8, num_blocks=128)
    try:
        lark = 'start: "answer: " ("yes" | "no") "."'
        outs = eng.generate(
            ["a", "b", "c"],
            [SamplingParams(max_new_tokens=30, regex=r"[0-9]{3}-[a-z]{2,5}"),
             SamplingParams(max_new_tokens=30, grammar=lark, temperature=1.0, seed=1),
             SamplingParams(max_new_tokens=30, json_schema=True)],
            progress=False,
        )  # fmt: skip
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", outs[0].text), outs[0].text
        assert re.fullmatch(r"answer: (yes|no)\.", outs[1].text), outs[1].text
        assert outs[0].finish_reason == outs[1].finish_reason == "stop"
    finally:
        eng.close()


@needs_greedy_screen
def test_bundled_model_greedy_skips_greedy_screen(monkeypatch) -> None:
    """The bundled model's runner has the greedy screen (forced on: whether it wins is a
    timing of this CPU); a guided greedy row must not take it (its tokens would ignore the
    mask) while plain greedy batch mates still may."""
    monkeypatch.setattr(GreedyHead, "wins", lambda self, *a, **k: True)
    eng = Engine()
    try:
        assert eng.runner.fast_greedy
        tok = eng.tokenizer
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "Give me a pet as JSON with name, age and kind."}],
            tokenize=False, add_generation_prompt=True,
        )  # fmt: skip
        plain = eng.generate([chat], SamplingParams(max_new_tokens=8), progress=False)[0]
        outs = eng.generate(
            [chat, chat, "The capital of France is"],
            [SamplingParams(max_new_tokens=60, json_schema=SCHEMA),
             SamplingParams(max_new_tokens=60, json_schema=SCHEMA, temperature=0.8, seed=5),
             SamplingParams(max_new_tokens=8)],
            progress=False,
        )  # fmt: skip
        _check(outs[0], 60)
        _check(outs[1], 60)
        assert not plain.text.startswith("{")  # unconstrained, the model writes prose/markdown
    finally:
        eng.close()


def test_a_grammar_that_fails_while_generating_fails_its_request_only(tokenizer) -> None:
    # llguidance accepts a schema with no finite instance and gives up while generating:
    # that request fails with a FieldError on its field (not "stop" with output that does
    # not match); its batch mates finish as usual
    endless = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                               "required": ["c"]}}, "$ref": "#/$defs/n"}
    eng = _tiny(tokenizer, page_size=8, num_blocks=128)
    try:
        with pytest.raises(FieldError, match="no output can satisfy it") as err:
            eng.generate(["a"], SamplingParams(max_new_tokens=30, json_schema=endless),
                         progress=False)
        assert err.value.field == "json_schema"
        bad = eng.add_request("a", SamplingParams(max_new_tokens=30, json_schema=endless))
        good = eng.add_request("b", SamplingParams(max_new_tokens=60, json_schema=SCHEMA))
        with pytest.raises(FieldError):
            eng.get_output(bad, timeout=120)
        _check(eng.get_output(good, timeout=120), 60)
    finally:
        eng.close()
