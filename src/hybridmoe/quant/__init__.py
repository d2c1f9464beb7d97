"""Weight formats: how expert matrices are stored on the CPU.

`formats` is the registry (`weight_format("q8_0")`), one module per format registers into it
(`dense` for f32 and bf16, `q8_0`, `q4_0`). `q8_0` and `q4_0` hold the torch reference
(de)quantisation of GGUF's block formats, byte for byte as ggml lays them out, so that GGUF
tensors can be used without conversion and every fast kernel has a reference to be checked
against. Importing the package fills the registry, whichever module of it is imported first.
"""

# Importing a format's module registers it, so this order is the registry's (CLI choices).
# isort: off
from hybridmoe.quant import dense, q8_0, q4_0  # noqa: F401
# isort: on
