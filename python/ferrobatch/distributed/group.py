"""The tensor-parallel process group: who the ranks are, how they start and stop.

Rank 0 is the engine (the Rust scheduler, sampling, the API); ranks 1..N-1 only run the
model. `TPGroup.spawn` starts the other ranks as `torch.multiprocessing` spawn processes
(each builds the same engine and enters `worker.serve`); `TPGroup.join_env` joins a group
``torchrun`` started (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` in the environment).
Backend gloo on CPU, NCCL on CUDA (one device per rank: ``cuda:LOCAL_RANK``).

Every collective has a timeout (``FERROBATCH_TP_TIMEOUT`` seconds, default 60): a rank
that hangs makes the others' collectives fail instead of blocking forever. Start-up (the
rendezvous, each rank loading its shard, the construction probes' collectives) runs under
the longer ``FERROBATCH_TP_START_TIMEOUT`` (default 600 s): a slow import or load is not a
hang; `TPGroup.steady` switches to the collective timeout once the engine is built. On rank 0 a
watchdog thread checks the spawned workers' liveness every half second; when one dies it
calls the engine's failure callback (every waiting caller gets the error) and the group is
shut down. While the engine is idle the watchdog broadcasts a no-op now and then, so the
workers' wait for the next step never reaches the collective timeout.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from ferrobatch.errors import FieldError

logger = logging.getLogger("ferrobatch")

_CURRENT: TPGroup | None = None


def current() -> TPGroup | None:
    """The group this process belongs to (set by `spawn`, `join_env` or a worker)."""
    return _CURRENT


def collective_timeout() -> float:
    """Seconds a collective may wait for the other ranks (``FERROBATCH_TP_TIMEOUT``)."""
    return float(os.environ.get("FERROBATCH_TP_TIMEOUT", "60"))


def startup_timeout() -> float:
    """Seconds the ranks may take to meet while the engine is built
    (``FERROBATCH_TP_START_TIMEOUT``, never below the collective timeout)."""
    return max(collective_timeout(), float(os.environ.get("FERROBATCH_TP_START_TIMEOUT", "600")))


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died, hung or failed; the engine cannot step any more."""


def release_mesh_groups() -> None:
    """Free the process groups the device meshes of transformers' tensor-parallel plan
    still hold after `destroy_process_group` (their `_pg_registry`; DTensor parameters
    and DTensor's sharding caches keep the meshes alive).

    A gloo group destroyed while the interpreter finalizes can abort the process
    ("terminate called without an active exception": a torchrun rank 0 in CI; a 2-rank
    script that keeps a mesh alive to its exit, 4 to 8 exits in 30), so the groups go now,
    with their threads, while Python is still whole."""
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
    gc.collect()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TPGroup:
    """One process's view of the tensor-parallel group."""

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 procs: list[Any] | None = None, owns_group: bool = True) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = _backend(device)
        self.procs = procs or []  # spawned workers (rank 0 of a spawned group only)
        self.owns_group = owns_group
        self.from_env = False  # joined from torchrun (a rank > 0 then serves and exits)
        self.lock = threading.Lock()  # one collective sequence at a time (steps, no-ops)
        self.last_send = time.monotonic()
        self.failed: BaseException | None = None
        self.closed = False
        self._on_failure: Callable[[BaseException], None] | None = None
        self._watchdog: threading.Thread | None = None
        self._reap_lock = threading.Lock()  # one thread reaps (two waitpid calls race)

    # ------------------------------------------------------------------ start

    @staticmethod
    def device_for(local_rank: int, device: str | torch.device | None) -> torch.device:
        """CUDA ranks take ``cuda:local_rank``; anything else runs on the CPU."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    @classmethod
    def init(cls, rank: int, world_size: int, init_method: str, device: torch.device,
             procs: list[Any] | None = None) -> TPGroup:
        """Join the default process group (a timeout on every collective); become current."""
        global _CURRENT
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            _backend(device), init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=startup_timeout()),
        )
        _CURRENT = cls(rank, world_size, device, procs)
        return _CURRENT

    @classmethod
    def spawn(cls, world_size: int, device: str | torch.device | None,
              target: Callable[..., None], args: tuple[Any, ...]) -> TPGroup:
        """Start ranks 1..N-1 as spawn processes running
        ``target(rank, world_size, init_method, device, *args)`` (`worker.main`) and join as
        rank 0 (`target` and `args` are pickled: module-level functions and classes)."""
        dev = cls.device_for(0, device)
        if dev.type == "cuda" and torch.cuda.device_count() < world_size:
            raise FieldError(
                f"tensor_parallel_size={world_size} needs {world_size} CUDA devices, "
                f"{torch.cuda.device_count()} visible", field="tensor_parallel_size")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        procs = []
        for rank in range(1, world_size):
            p = ctx.Process(target=target, name=f"ferrobatch-tp{rank}", daemon=True,
                            args=(rank, world_size, init_method, device, *args))
            p.start()
            procs.append(p)
        try:
            group = cls._join_watching(world_size, init_method, dev, procs)
        except BaseException:
            for p in procs:
                p.kill()
                p.join(5)
            raise
        atexit.register(group.shutdown)
        return group

    @classmethod
    def _join_watching(cls, world_size: int, init_method: str, dev: torch.device,
                       procs: list[Any]) -> TPGroup:
        """Rank 0's `init` (it blocks until every rank has joined), run while the workers are
        watched: one that exits first is a `TPWorkerError` at once, not a wait of the whole
        start-up timeout."""
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = cls.init(0, world_size, init_method, dev, procs)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                joined["error"] = exc

        thread = threading.Thread(target=join, name="ferrobatch-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = [p for p in procs if not p.is_alive()]
            if dead and thread.is_alive():
                p = dead[0]
                raise TPWorkerError(
                    f"tensor-parallel worker {p.name} exited with code {p.exitcode} before "
                    "it joined the group. The workers are spawned processes that import the "
                    "main module: a script that builds an Engine with tensor_parallel_size > "
                    "1 needs its code under `if __name__ == \"__main__\":`")
        if "error" in joined:
            raise joined["error"]
        return joined["group"]

    @classmethod
    def join_env(cls, world_size: int, device: str | torch.device | None) -> TPGroup:
        """Join the group of a ``torchrun`` launch (env:// init); its WORLD_SIZE must be N."""
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            raise FieldError(
                f"tensor_parallel_size={world_size} but torchrun started {env_world} ranks "
                "(WORLD_SIZE)", field="tensor_parallel_size")
        rank = int(os.environ["RANK"])
        dev = cls.device_for(int(os.environ.get("LOCAL_RANK", rank)), device)
        if dist.is_initialized():
            global _CURRENT
            _CURRENT = cls(rank, world_size, dev, owns_group=False)
        else:
            cls.init(rank, world_size, "env://", dev)
        assert _CURRENT is not None
        _CURRENT.from_env = True
        return _CURRENT

    def steady(self) -> None:
        """The engine is built: collectives from now on time out after
        `collective_timeout()` (start-up ran under `startup_timeout()`). Every rank calls
        this at the same point; a group this engine did not create keeps its own timeout."""
        if self.owns_group and dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(
                datetime.timedelta(seconds=collective_timeout()))

    # ------------------------------------------------------------------ rank 0

    def watch(self, on_failure: Callable[[BaseException], None], noop: Callable[[], None]) -> None:
        """Rank 0: start the watchdog (worker liveness; idle no-ops to the workers)."""
        self._on_failure = on_failure
        self._noop = noop
        self._watchdog = threading.Thread(target=self._watch, name="ferrobatch-tp-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        idle = collective_timeout() / 4
        while not self.closed and self.failed is None:
            time.sleep(0.5)
            dead = [p for p in self.procs if not p.is_alive()]
            if self.closed:  # (after the liveness check: STOP comes after `closed`)
                return
            if dead:
                p = dead[0]
                self.fail(TPWorkerError(
                    f"tensor-parallel worker {p.name} (pid {p.pid}) exited with code "
                    f"{p.exitcode}; the engine is shut down"))
                return
            if time.monotonic() - self.last_send > idle and self.lock.acquire(blocking=False):
                try:
                    if not self.closed and self.failed is None:
                        self._noop()
                except BaseException as exc:  # noqa: BLE001 - reported to every caller
                    self.lock.release()
                    self.fail(TPWorkerError(f"tensor-parallel group failed: {exc}"))
                    return
                self.lock.release()

    def fail(self, exc: BaseException) -> None:
        """Record the group's failure, tell the engine, stop the workers."""
        if self.failed is not None:
            return
        self.failed = exc
        logger.error("ferrobatch: %s", exc)
        if self._on_failure is not None:
            try:
                self._on_failure(exc)
            except Exception:  # noqa: BLE001
                logger.exception("ferrobatch: reporting the tensor-parallel failure failed")
        self.kill_workers()

    def kill_workers(self, grace: float = 0.0) -> None:
        """Terminate the spawned workers (after `grace` seconds for a clean exit) and reap
        them: no zombies."""
        with self._reap_lock:
            self._kill_workers(grace)

    def _kill_workers(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive() and self.failed is None:
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)

    def shutdown(self, stop: Callable[[], None] | None = None) -> None:
        """Stop the group: `stop` (rank 0: tell the workers to exit) unless it failed, then
        reap the workers and leave the process group. Idempotent."""
        global _CURRENT
        if self.closed:
            return
        self.closed = True  # the watchdog stops watching: the workers are about to exit
        if stop is not None and self.failed is None:
            try:
                with self.lock:
                    stop()
            except Exception:  # noqa: BLE001 - a dead group: nothing to tell
                logger.warning("ferrobatch: telling the tensor-parallel workers to stop failed")
        self.kill_workers(grace=10.0 if self.failed is None else 0.0)
        if self.owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                logger.warning("ferrobatch: leaving the tensor-parallel group failed",
                               exc_info=True)
            release_mesh_groups()
        if _CURRENT is self:
            _CURRENT = None
