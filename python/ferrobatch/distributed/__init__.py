"""Tensor parallelism over torch.distributed (``Engine(..., tensor_parallel_size=N)``).

* `group` — the process group: workers spawned by the engine or joined from ``torchrun``,
  the liveness watchdog, shutdown.
* `shard` — loading a checkpoint sharded by transformers' own tensor-parallel plan, and the
  checks that refuse what cannot be sharded.
* `broadcast` — a step plan packed into one int32 tensor (plus a fixed header) and back.
* `runner` — `TPRunner`: rank 0's runner, which sends each step to the other ranks first.
* `worker` — the loop the other ranks run: receive a step, run the same forward.
"""
