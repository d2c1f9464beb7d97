"""Writing a float weight into a bank's rows in a format, in place: what stacking a checkpoint's
experts into an ExpertBank and converting a bank go through, one expert matrix at a time.

Q8_0 and Q4_0 on the host go straight through the numba quantiser into the bank's rows (read
once from the memory-mapped matrix as stored, written once: no temporary, no copy); every other
format through its quantiser and one copy.
"""

from __future__ import annotations

import torch

from hybridmoe.quant.formats import WeightFormat
from hybridmoe.quant.q4_0 import quantize_q4_0
from hybridmoe.quant.q8_0 import quantize_q8_0

# the formats whose host quantiser (kernels/numba_quantize.py) also writes into given rows
_WRITES_IN_PLACE = {quantize_q8_0: "q8_0", quantize_q4_0: "q4_0"}


def quantize_into(fmt: WeightFormat, w: torch.Tensor, out: torch.Tensor) -> None:
    """out = `fmt`'s stored form of float w [..., n]: out is fmt.stored_shape(w.shape) in
    fmt.storage_dtype (e.g. an expert's rows of a bank), the bytes fmt.quantize(w) gives.
    ValueError as fmt.quantize raises it (out then holds unspecified bytes)."""
    name = _WRITES_IN_PLACE.get(fmt.quantize)
    on_host = w.device.type == "cpu" and out.device.type == "cpu"
    if name is not None and on_host and out.is_contiguous():
        from hybridmoe.kernels.numba_quantize import quantize

        quantize(name, w, out)
        return
    out.copy_(fmt.quantize(w))
