"""Defaults that more than one module (or the CLI's help) depends on, stated once.

The `ContinuousBatchingConfig` field defaults live on the dataclass itself; the values here
are what the engine uses when a field is left None, and the sizes of the CUDA-graph cache.
"""

from __future__ import annotations

GiB = 2**30

# KV cache size when `num_blocks` and `max_memory_percent` are None (`engine.memory`): on
# CUDA a share of free device memory; on CPU a share of available RAM, capped, because RAM is
# shared with the rest of the machine (never the reference's 60% of RAM).
CUDA_MEMORY_PERCENT = 0.9
CPU_MEMORY_PERCENT = 0.25
CPU_MEMORY_CAP = 4 * GiB

# Step-time budget (ms) for prefill chunks while other requests wait, when
# `max_step_ms` is left at its default (CPU only; see `ContinuousBatchingConfig.max_step_ms`
# and docs/benchmarks.md, "Long prompts beside running streams", for the measurement:
# 500 kept a long prompt's time to first token beside a stream; 250 made it 2.4x).
MAX_STEP_MS = 500.0

# Share of the cache held in reserve for decodes when `safety_margin` is None, by scheduler.
SAFETY_MARGIN = {"fifo": 0.15, "prefill_first": 0.0}

# Graph cache bound. Graphs share one memory pool (about the largest captured step's
# activations); each adds its static inputs (a few int32 arrays of the padded shape) and its
# output (hidden states [N_pad, hidden]), so 32 graphs of the largest bucket cost a few MiB
# beyond the pool.
DEFAULT_MAX_GRAPHS = 32
# A decode shape gets its CUDA graph on its n-th step (the ones before run eager).
CAPTURE_AFTER = 2
# CUDA-graph shape padding (tokens) when `q_/kv_padding_interval_size` are 0.
DEFAULT_Q_INTERVAL = 8
DEFAULT_KV_INTERVAL = 256
