"""A 2-rank engine leaves nothing to the resource tracker: a script that builds one, closes
it, builds a second and exits without closing it (the group's exit handler stops it) ends
without "leaked semaphore objects" on stderr. The spawned worker made one (tqdm's lock,
taken by transformers' loading bars) and left through `os._exit`, which skipped the
multiprocessing exit hook that unlinks it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tiny_models

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from ferrobatch import Engine, SamplingParams

if __name__ == "__main__":
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    config = dict(num_blocks=32, page_size=4)
    with Engine(sys.argv[1], tensor_parallel_size=2, config=config) as e:
        out = e.generate([[1, 5, 7, 9]], sp, progress=False)[0]
        print("CLOSED", list(out.token_ids), flush=True)
    e = Engine(sys.argv[1], tensor_parallel_size=2, config=config)
    out = e.generate([[1, 5, 7, 9]], sp, progress=False)[0]
    print("OPEN", list(out.token_ids), flush=True)
"""


def _run_script(tmp_path: Path, script: str, timeout: float) -> subprocess.CompletedProcess:
    """`script` run as a fresh Python process (not under torchrun) on the saved tiny model
    at `tmp_path / "m"`."""
    (tmp_path / "run.py").write_text(script)
    path = os.pathsep.join(p for p in (str(ROOT / "python"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "m")],
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_no_leaked_semaphores_at_exit(tmp_path: Path) -> None:
    model = tiny_models.llama()
    model.save_pretrained(tmp_path / "m")
    proc = _run_script(tmp_path, SCRIPT, 300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want = str(tiny_models.generate_greedy(model, [1, 5, 7, 9], 4, ignore_eos=True))
    assert f"CLOSED {want}" in proc.stdout and f"OPEN {want}" in proc.stdout, proc.stdout
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-3000:]
    assert "resource_tracker" not in proc.stderr, proc.stderr[-3000:]


UNGUARDED = """
import sys
from ferrobatch import Engine

with Engine(sys.argv[1], tensor_parallel_size=2, config=dict(num_blocks=32, page_size=4)):
    pass
"""


def test_a_worker_that_dies_while_starting_is_reported_at_once(tmp_path: Path) -> None:
    # a script without the __main__ guard: the spawned worker, importing it, fails during
    # its bootstrap; rank 0 says so within seconds (it used to wait out the 600 s start-up
    # timeout in the group's rendezvous)
    tiny_models.llama().save_pretrained(tmp_path / "m")
    proc = _run_script(tmp_path, UNGUARDED, 120)
    assert proc.returncode != 0
    assert "TPWorkerError" in proc.stderr and '__name__ == "__main__"' in proc.stderr, \
        proc.stderr[-3000:]
