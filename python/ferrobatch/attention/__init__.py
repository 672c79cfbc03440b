"""Paged attention over ferrobatch's KV cache, plugged into transformers' attention interface.

Modules: ``kv_cache`` (`PagedKVCache`), ``paged_step`` (`PagedStep`: per-step metadata of the
SDPA path, `build_step`), ``kernel_step`` (`KernelStep`: per-step metadata of the GPU kernels),
``forward`` (`paged_attention_forward`, the attention function every layer calls), ``sdpa``
(attention of packed rows through SDPA), ``kernels`` (the GPU kernels and the CPU decode
kernel), ``context`` (the thread's ferrobatch forward, delegation to the model's own
attention), ``registry`` (registration with transformers, switching a model's configs),
``rope`` (per-request rope factors).
"""
