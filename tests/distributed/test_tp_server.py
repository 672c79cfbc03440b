"""`ferrobatch serve --tensor-parallel-size 2` as a real process (gloo, 2 ranks), through
the `openai` client: concurrent greedy completions equal `model.generate`, a streamed chat,
prompt logprobs (echo), and a clean exit on SIGINT (workers stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tiny_models
from server_helpers import build_model, build_tokenizer, client, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def test_serve_tensor_parallel_2(tmp_path: Path) -> None:
    tok = build_tokenizer()
    model = build_model(tok)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    port = free_port()
    path = os.pathsep.join(p for p in (str(ROOT / "python"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ferrobatch.cli", "serve", str(tmp_path / "m"), "--port",
           str(port), "--num-blocks", "64", "--page-size", "8", "--max-batch-tokens", "16",
           "--threads", "1", "--dtype", "float32", "--tensor-parallel-size", "2",
           "--served-model-name", "tiny"]
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        status = wait_healthy(proc, url, 120)
        assert status == 200, (tmp_path / "serve.log").read_text(errors="replace")
        oa = client(url)
        prompts = [tok.encode(t) for t in ("Hello there", "the quick brown fox jumps",
                                           "a", "numbers one two three four five six")]

        def complete(ids: list[int]) -> list[int]:
            r = oa.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
            return tok.encode(r.choices[0].text)

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(complete, prompts))
        for ids, got in zip(prompts, texts, strict=True):
            want = tiny_models.generate_greedy(model, ids, 10, ignore_eos=True)
            assert tok.decode(got) == tok.decode(want, skip_special_tokens=True)
        chunks = oa.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            temperature=0, stream=True)
        assert sum(len(c.choices[0].delta.content or "") for c in chunks if c.choices) > 0
        r = oa.completions.create(model="tiny", prompt=prompts[1], max_tokens=1, echo=True,
                                  logprobs=1, temperature=0)
        lps = r.choices[0].logprobs.token_logprobs
        assert len(lps) == len(prompts[1]) + 1 and all(x is None or x <= 0 for x in lps)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    out = (tmp_path / "serve.log").read_text(errors="replace")
    assert proc.returncode == 0, out
