"""Bad input raises `ferrobatch.errors.FieldError` naming its argument at every layer
(SamplingParams, the config, the engine, the core), and the server reports that name as the
OpenAI error's `param`."""

from __future__ import annotations

import pytest
import tiny_models
from ferrobatch import ContinuousBatchingConfig, Engine, FieldError, SamplingParams, _core
from ferrobatch.errors import QueueFullError
from ferrobatch.server import params
from ferrobatch.server.protocol import APIError
from ferrobatch.server.run import error_payload


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(seed=2**64), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(FieldError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(page_size=3), "page_size"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(max_batch_tokens=0), "max_batch_tokens"),
        (dict(max_memory_percent=0.0), "max_memory_percent"),
        (dict(scheduler_type="lifo"), "scheduler_type"),
        (dict(safety_margin=1.0), "safety_margin"),
        (dict(allow_block_sharing=1), "allow_block_sharing"),
        (dict(use_cuda_graph="yes"), "use_cuda_graph"),
        (dict(max_queue_size=-1), "max_queue_size"),
    ],
)
def test_config_names_the_field(kwargs, field) -> None:
    with pytest.raises(FieldError) as info:
        ContinuousBatchingConfig(**kwargs)
    assert info.value.field == field


def test_core_names_the_field() -> None:
    with pytest.raises(FieldError) as info:
        _core.Scheduler(num_blocks=0, page_size=4, max_batch_tokens=8)
    assert info.value.field == "num_blocks"


@pytest.fixture(scope="module")
def engine():
    cfg = ContinuousBatchingConfig(num_blocks=16, page_size=8, max_batch_tokens=64)
    with Engine(tiny_models.llama(), config=cfg) as eng:
        yield eng


@pytest.mark.parametrize(
    ("prompt", "sampling", "field"),
    [
        ([], None, "prompt"),
        ("text", None, "prompt"),  # no tokenizer
        ([1, 2, 10**6], None, "prompt"),  # outside the vocabulary
        ([1, 2, 3], SamplingParams(max_new_tokens=10**6), "max_new_tokens"),  # the context
        ([1, 2, 3], SamplingParams(max_new_tokens=4, stop_token_ids=[10**6]), "stop_token_ids"),
        ([1, 2, 3], [SamplingParams(), SamplingParams()], "sampling"),
        ([1, 2, 3], {"max_new_tokens": 2, "n": 2}, "n"),  # no such SamplingParams field
        ([1, 2, 3], SamplingParams(max_new_tokens=2, json_schema=True), "json_schema"),
    ],
)
def test_engine_input_checks_name_the_field(engine, prompt, sampling, field) -> None:
    with pytest.raises(FieldError) as info:
        engine.check_request(prompt, sampling)
    assert info.value.field == field


def test_engine_cache_fit_names_max_new_tokens(engine) -> None:
    # 16 blocks of 8 tokens: fits the model's context, not the cache
    too_long = SamplingParams(max_new_tokens=16 * 8 + 8)
    with pytest.raises(FieldError) as info:
        engine.check_request([1, 2, 3], too_long)
    assert info.value.field == "max_new_tokens"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(max_new_tokens=0), "max_tokens"),  # OpenAI's name
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=2.0), "top_p"),
        (dict(presence_penalty=-3.0), "presence_penalty"),
    ],
)
def test_server_param_is_the_field(kwargs, param) -> None:
    with pytest.raises(APIError) as info:
        params.choice_samplings(kwargs, 1)
    body = info.value.body()["error"]
    assert body["param"] == param
    assert param in body["message"]


class _Job:
    prompt_ids = [1, 2, 3]
    sampling = None


class _Rejects:
    """An engine whose admission check raises `exc`."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def check_request(self, prompt, sampling=None):
        raise self.exc


@pytest.mark.parametrize(
    ("field", "prompt_param", "param"),
    [
        ("max_new_tokens", "prompt", "max_tokens"),
        ("prompt", "messages", "messages"),
        ("prompt", "prompt", "prompt"),
        ("stop_token_ids", "prompt", "stop_token_ids"),
    ],
)
def test_server_maps_engine_fields(field, prompt_param, param) -> None:
    eng = _Rejects(FieldError(f"{field}: no", field))
    with pytest.raises(APIError) as info:
        params.check_with_engine(eng, [_Job()], prompt_param)
    assert info.value.body()["error"]["param"] == param


def test_engine_queue_full_is_429() -> None:
    body = error_payload(QueueFullError("max_queue_size=1"))["error"]
    assert body["code"] == "queue_full"
    assert error_payload(RuntimeError("QueueFull"))["error"]["code"] != "queue_full"


def test_server_reports_the_field_of_a_failed_run() -> None:
    body = error_payload(FieldError("max_new_tokens: too many", "max_new_tokens"))["error"]
    assert body["type"] == "invalid_request_error"
    assert body["param"] == "max_tokens"


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], [{"content": "x"}],
                                      [["user", "hi"]], "hi", [{"role": "user", "content": 5}]])
def test_chat_messages_name_the_field(messages) -> None:
    from ferrobatch.engine.llm_engine import _check_messages
    with pytest.raises(FieldError) as info:
        _check_messages(messages)
    assert info.value.field == "messages"
    _check_messages([{"role": "user", "content": "hi"},
                     {"role": "assistant", "tool_calls": [{"id": "a"}]}])


def test_missing_tokenizer_path_names_the_field(tmp_path) -> None:
    with pytest.raises(FieldError) as info:
        Engine(tiny_models.llama(), tokenizer=str(tmp_path / "missing-tokenizer"),
               config=ContinuousBatchingConfig(num_blocks=16, page_size=8))
    assert info.value.field == "tokenizer"
