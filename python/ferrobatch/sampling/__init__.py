"""How tokens are chosen: per-request parameters, the batched sampler, guided decoding, and
prompt logprobs.

Modules: ``params`` (`SamplingParams`), ``sampler`` (`Sampler`, `SamplingState`), ``guided``
(structured outputs through llguidance), ``grammar`` (the grammar fields' checks, no torch),
``prompt_logprobs`` (logprobs of prompt tokens).
"""
