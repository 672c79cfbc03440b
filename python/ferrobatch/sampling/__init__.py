"""How tokens are chosen: per-request parameters, the batched sampler, guided decoding, and
prompt logprobs.

Modules: ``params`` (`SamplingParams`), ``sampler`` (`Sampler`, `SamplingState`), ``guided``
(structured outputs through llguidance), ``prompt_logprobs`` (logprobs of prompt tokens).
"""
