"""Weight formats: how expert matrices are stored on the CPU.

`formats` is the registry (`weight_format("q8_0")`); `q8_0` and `q4_0` hold the torch reference
(de)quantisation of GGUF's block formats, byte for byte as ggml lays them out, so that GGUF
tensors can be used without conversion and every fast kernel has a reference to be checked
against.
"""
