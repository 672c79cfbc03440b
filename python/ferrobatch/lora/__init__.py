"""Multi-LoRA: PEFT adapters loaded beside the base model and applied per request, requests of
different adapters (and without one) sharing a step (`adapter`: one adapter's weights;
`manager`: the engine's adapters, the per-step rows of each, and the cap on active ones)."""
