"""lm-evaluation-harness end to end: the real `lm_eval` CLI (`local-completions`, which
scores each choice with `echo: true, logprobs: 1, max_tokens: 1`) against a live loopback
`ferrobatch serve` on the bundled SmolLM2, on a tiny local multiple-choice task
(tests/models/lm_eval_task: a YAML task and a JSONL file, no download). Each choice's
log-likelihood must equal transformers' own (fp32 forward of the same prompt + continuation
token ids) and the accuracy must be the one those log-likelihoods imply.

Skipped unless lm-eval is installed (it is not a dependency of `make test`):
`.venv/bin/pip install "lm-eval[api]==0.4.13"`, then
`.venv/bin/python -m pytest tests/models/test_lm_eval.py -q`.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import free_port

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need its [api] extra

TASK_DIR = Path(__file__).parent / "lm_eval_task"
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def server() -> tuple[str, Path]:
    from ferrobatch.models import bundled_model_dir

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrobatch.cli", "serve", "--port", str(port),
         "--served-model-name", "smol"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("ferrobatch serve did not become ready")
        yield url, bundled_model_dir()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_lm_eval_multiple_choice_matches_transformers(server, tmp_path):
    url, model_dir = server
    # the task with an absolute data path (lm-eval resolves it against its cwd)
    yaml = (TASK_DIR / "ferrobatch_tiny_mc.yaml").read_text().replace(
        "tests/models/lm_eval_task/tiny_mc.jsonl", str(TASK_DIR / "tiny_mc.jsonl")
    )
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "ferrobatch_tiny_mc.yaml").write_text(yaml)
    lm_eval = VENV_BIN / "lm_eval"
    cmd = [
        str(lm_eval) if lm_eval.exists() else "lm_eval",
        "--model", "local-completions",
        "--model_args",
        f"base_url={url}/v1/completions,model=smol,tokenizer_backend=huggingface,"
        f"tokenizer={model_dir},num_concurrent=2,max_retries=1",
        "--tasks", "ferrobatch_tiny_mc", "--include_path", str(tmp_path / "tasks"),
        "--output_path", str(tmp_path / "out"), "--log_samples",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}  # fmt: skip
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print(run.stdout[-800:])
    [results] = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    acc = json.loads(Path(results).read_text())["results"]["ferrobatch_tiny_mc"]["acc,none"]
    [samples] = glob.glob(str(tmp_path / "out" / "**" / "samples_*.jsonl"), recursive=True)
    docs = [json.loads(line) for line in Path(samples).read_text().splitlines()]
    assert len(docs) == 10

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct = 0
    worst = 0.0
    for d in docs:
        lls = []
        for k, arg in enumerate(d["arguments"].values()):
            context, continuation = arg["arg_0"], arg["arg_1"]
            # lm-eval's _encode_pair: the whole string encoded, the context's length cut
            whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            ref = sum(lp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))
            got = float(d["filtered_resps"][k][0])
            worst = max(worst, abs(got - ref))
            assert got == pytest.approx(ref, abs=1e-3), (d["doc_id"], k, got, ref)
            lls.append(ref)
        correct += int(max(range(len(lls)), key=lls.__getitem__) == d["doc"]["answer"])
    print(f"lm-eval acc {acc}; implied by transformers' log-likelihoods {correct / len(docs)};"
          f" max |ll - ref| {worst:.2e}")
    assert acc == pytest.approx(correct / len(docs))
