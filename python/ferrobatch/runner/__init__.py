"""Execution of one `StepPlan` through a transformers model over the paged KV cache.

Modules: ``model_runner`` (`ModelRunner`: inputs, the forward, the step's attention metadata),
``graph_steps`` (decode-only steps through CUDA graphs), ``output_head`` (logits: the split
head and the fastest CPU product for it), ``greedy_head`` (the int8 greedy screen),
``activations`` and ``cpu_linear`` (packed half-precision linears on CPU), ``lean_layers``
(Llama-style decoder layers through the fused kernels of `ferrobatch.cpu.fused_ops`),
``patches`` (what ferrobatch changes in transformers while it runs a model).
"""
