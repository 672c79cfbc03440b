"""`torchrun --nproc-per-node 2` on a script that builds `Engine(path,
tensor_parallel_size=2)`: rank 0 generates (greedy, equal to `model.generate`), rank 1
serves inside `Engine(...)` and exits 0 when rank 0 closes; after the close no gloo thread
is left on rank 0 (a group left to the interpreter's exit can abort it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tiny_models
from server_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, os, sys
from ferrobatch import Engine, SamplingParams
with Engine(sys.argv[1], tensor_parallel_size=2, config=dict(num_blocks=64, page_size=4)) as e:
    out = e.generate([[1, 5, 7, 9, 11, 13]], SamplingParams(max_new_tokens=10, ignore_eos=True),
                     progress=False)
    print("RESULT", json.dumps([os.environ["RANK"], out[0].token_ids]), flush=True)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print("GLOO_THREADS", sum(n.startswith(("pt_gloo", "gloo")) for n in names), flush=True)
"""


def test_torchrun_two_ranks(tmp_path: Path) -> None:
    model = tiny_models.llama()
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "run.py").write_text(SCRIPT)
    path = os.pathsep.join(p for p in (str(ROOT / "python"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(tmp_path / "run.py"), str(tmp_path / "m")],
        env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
               if "RESULT " in line]
    assert "GLOO_THREADS 0" in proc.stdout, proc.stdout[-3000:]
    assert results == [["0", tiny_models.generate_greedy(model, [1, 5, 7, 9, 11, 13], 10,
                                                         ignore_eos=True)]]
