"""The engine: requests in, the scheduler's plans through the runner, outputs out.

Modules: ``llm_engine`` (`Engine`: the public API, the engine loop), ``model_checks`` (what a
model's config says, what the engine refuses), ``probes`` (the construction probes), ``request``
(request intake: prompts, sampling, per-request state), ``stepper`` (one synchronous step:
plan, execute, sample, update), ``pipeline`` (the async pipeline: plan N+1 while N runs),
``routing`` (outputs to their listeners), ``detok`` (incremental detokenization), ``outputs``
(`RequestOutput`), ``memory`` (KV cache sizing from free memory).
"""
