"""Weight formats: how expert matrices are stored on the CPU.

`formats` is the registry (`weight_format("q8_0")`), one module per format registers into it
(`dense` for f32, bf16 and f16, `q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, the k-quants
`q2_k` ... `q6_k`, and `mxfp4`). Each holds the torch reference (de)quantisation of a GGUF
block format, byte for byte as ggml lays it out (the k-quants: dequantisation only; mxfp4 also
from Hugging Face's `*_blocks` / `*_scales`, mxfp4_hf.py), so that GGUF tensors
can be used without conversion and every fast kernel has a reference to be checked against.
Importing the package fills the registry, whichever module of it is imported first.
"""

# Importing a format's module registers it, so this order is the registry's (CLI choices).
# isort: off
from hybridmoe.quant import dense, q8_0, q4_0, q4_1, q5_0, q5_1  # noqa: F401
from hybridmoe.quant import q2_k, q3_k, q4_k, q5_k, q6_k  # noqa: F401
from hybridmoe.quant import mxfp4  # noqa: F401
# isort: on
