"""``POST /v1/embeddings`` with the official ``openai`` client against the real engine: every
input form, both encodings, equality with `Engine.embed`, batching with chat, bad input."""

from __future__ import annotations

import base64
import concurrent.futures

import httpx
import numpy as np
import pytest
import torch
from server_helpers import MODEL, client


def _model_embedding(engine, ids: list[int]) -> torch.Tensor:
    """The reference: the model's own last hidden state at the last token, normalized."""
    with torch.no_grad():
        h = engine.model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(h.float(), dim=0)


def test_string_and_lists(real_engine, real_server):
    c = client(real_server.url)
    texts = ["The capital of France is Paris.", "Hello world"]
    got = c.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1]
    assert got.usage.prompt_tokens == sum(len(real_engine.tokenizer(t)["input_ids"])
                                          for t in texts)
    for text, d in zip(texts, got.data, strict=True):
        ids = list(real_engine.tokenizer(text)["input_ids"])
        torch.testing.assert_close(torch.tensor(d.embedding), _model_embedding(real_engine, ids),
                                   rtol=1e-5, atol=1e-5)
    one = c.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    assert one.data[0].embedding == got.data[0].embedding
    ids = list(real_engine.tokenizer(texts[1])["input_ids"])
    by_ids = c.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert by_ids.data[0].embedding == got.data[1].embedding
    nested = c.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    assert len(nested.data) == 2 and nested.data[0].embedding == got.data[1].embedding


def test_base64_is_the_float32_bytes(real_server):
    c = client(real_server.url)
    floats = c.embeddings.create(model=MODEL, input="Hello world", encoding_format="float")
    # the openai client decodes base64 itself when it asked for it; read the raw body too
    raw = httpx.post(real_server.url + "/v1/embeddings", json={
        "model": MODEL, "input": "Hello world", "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.tolist() == pytest.approx(floats.data[0].embedding, rel=0, abs=0)
    decoded = c.embeddings.create(model=MODEL, input="Hello world")  # client default: base64
    assert decoded.data[0].embedding == floats.data[0].embedding


def test_embeddings_beside_chat(real_engine, real_server):
    c = client(real_server.url)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        chats = [pool.submit(c.chat.completions.create, model=MODEL, max_tokens=16,
                             temperature=0, messages=[{"role": "user", "content": "Hello"}])
                 for _ in range(2)]
        embs = [pool.submit(c.embeddings.create, model=MODEL, input="Paged attention",
                            encoding_format="float") for _ in range(3)]
        outs = [f.result() for f in embs]
        assert all(len(f.result().choices) == 1 for f in chats)
    assert outs[0].data[0].embedding == outs[1].data[0].embedding == outs[2].data[0].embedding


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 7}, "dimensions"),
    ({"input": "x", "pooling": "max"}, "pooling"),
    ({"input": 5}, "input"),
    ({}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(real_server, body, param):
    r = httpx.post(real_server.url + "/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_too_long_input_and_unknown_model(real_engine, real_server):
    r = httpx.post(real_server.url + "/v1/embeddings",
                   json={"model": MODEL, "input": [5] * (real_engine.max_model_len + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(real_server.url + "/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_dimensions_equal_to_the_model_size_is_accepted(real_engine, real_server):
    c = client(real_server.url)
    out = c.embeddings.create(model=MODEL, input="Hello", dimensions=real_engine.embedding_size,
                              encoding_format="float")
    assert len(out.data[0].embedding) == real_engine.embedding_size


def test_a_body_that_is_not_json_is_refused(real_server):
    r = httpx.post(real_server.url + "/v1/embeddings", content=b'{"input": "x"}',
                   headers={"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_type"
