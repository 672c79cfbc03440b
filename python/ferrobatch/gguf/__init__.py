"""GGUF files as a model source, matrices kept quantized in memory.

Modules: ``formats`` (the tensor types kept quantized, `QuantWeight`, the reference
dequantization), ``reader`` (a file's metadata and tensor table, tensors as views of one
memory map), ``arch`` (the supported architectures: config fix-ups, tensor processors,
refusals), ``modules`` (`QuantLinear`, `QuantEmbedding`, the kernel / reference backends),
``loader`` (`load_gguf`: plan and refuse first, then fill), ``quantize`` (quantize a float
checkpoint's linears on load).
"""
