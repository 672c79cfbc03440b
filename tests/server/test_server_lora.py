"""LoRA adapters over the server with the official ``openai`` client: ``model=<adapter>``
picks one (tokens equal to PEFT's model with it), ``/v1/models`` lists them, and
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` change them while serving."""

from __future__ import annotations

import concurrent.futures
import copy

import httpx
import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine
from server_helpers import MODEL, build_model, client, serve

peft = pytest.importorskip("peft")


def _adapter(base, path, seed: int, targets: list[str]) -> None:
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(30.0)
    model.save_pretrained(str(path))


@pytest.fixture(scope="module")
def lora_server(tokenizer, tmp_path_factory):
    base = build_model(tokenizer)
    paths = {}
    for i, (name, targets) in enumerate({"sql": ["q_proj", "v_proj"],
                                         "poet": ["down_proj", "o_proj"]}.items()):
        paths[name] = str(tmp_path_factory.mktemp(name))
        _adapter(base, paths[name], 20 + i, targets)
    engine = Engine(base, tokenizer=tokenizer, config=ContinuousBatchingConfig(num_blocks=256),
                    lora_modules={"sql": paths["sql"]}, enable_lora=True)
    with serve(engine) as srv:
        yield srv, base, paths
    engine.close()


def peft_ids(base, path: str | None, ids: list[int], new: int) -> list[int]:
    model = base if path is None else peft.PeftModel.from_pretrained(copy.deepcopy(base), path)
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, eos_token_id=None,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             pad_token_id=0)
    return out[0, len(ids):].tolist()




def test_model_picks_the_adapter(lora_server, tokenizer):
    srv, base, paths = lora_server
    ids = list(tokenizer("The capital of France is")["input_ids"])
    c = client(srv.url)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = {name: pool.submit(c.completions.create, model=name, prompt=ids, max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
                for name in (MODEL, "sql")}
        texts = {name: f.result().choices[0].text for name, f in outs.items()}
    want_base = tokenizer.decode(peft_ids(base, None, ids, 8), skip_special_tokens=True)
    want_sql = tokenizer.decode(peft_ids(base, paths["sql"], ids, 8), skip_special_tokens=True)
    assert texts[MODEL] == want_base
    assert texts["sql"] == want_sql
    assert want_sql != want_base


def test_models_list_and_runtime_load_unload(lora_server, tokenizer):
    srv, base, paths = lora_server
    c = client(srv.url)
    ids = {m.id: m for m in c.models.list().data}
    assert set(ids) == {MODEL, "sql"}
    assert ids["sql"].parent == MODEL
    r = httpx.post(srv.url + "/v1/load_lora_adapter",
                   json={"lora_name": "poet", "lora_path": paths["poet"]})
    assert r.status_code == 200, r.text
    assert {m.id for m in c.models.list().data} == {MODEL, "sql", "poet"}
    prompt = list(tokenizer("Hello world")["input_ids"])
    got = c.completions.create(model="poet", prompt=prompt, max_tokens=6, temperature=0,
                               extra_body={"ignore_eos": True}).choices[0].text
    assert got == tokenizer.decode(peft_ids(base, paths["poet"], prompt, 6),
                                   skip_special_tokens=True)
    r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "poet"})
    assert r.status_code == 200, r.text
    r = httpx.post(srv.url + "/v1/completions", json={"model": "poet", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("route,body,status,param", [
    ("load", {"lora_name": "sql", "lora_path": "/nowhere"}, 400, "lora_name"),
    ("load", {"lora_name": "new", "lora_path": "/nowhere"}, 400, "lora_path"),
    ("load", {"lora_name": "", "lora_path": "/x"}, 400, "lora_name"),
    ("load", {"lora_path": "/x"}, 400, "lora_name"),
    ("unload", {"lora_name": "never-loaded"}, 400, "lora_name"),
])
def test_bad_adapter_requests(lora_server, route, body, status, param):
    srv, _, _ = lora_server
    r = httpx.post(srv.url + f"/v1/{route}_lora_adapter", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_embeddings_refuse_an_adapter(lora_server):
    srv, _, _ = lora_server
    r = httpx.post(srv.url + "/v1/embeddings", json={"model": "sql", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
