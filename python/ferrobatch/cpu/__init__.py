"""CPU building blocks with no dependency on the rest of the package: numpy views of tensors
(`arrays`), the compiled kernels' wrappers (`amx_ops`, `f32_ops`, `fused_ops`,
`quant_ops` for GGUF quantized weights, `onednn` for oneDNN's private ops) and torch's
thread control (`threads`). Everything above may import from here; nothing here imports
from above."""
