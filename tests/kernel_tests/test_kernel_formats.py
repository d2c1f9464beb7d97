"""The fused kernel is generated from the weight-format registry: one entry point per
registered format, each compiled from that format's KernelFormat, and the on-disk cache is
named by every source the kernels are compiled from."""

from __future__ import annotations

import inspect

from hybridmoe.kernels import numba_moe
from hybridmoe.kernels.numba_simd import KernelFormatType
from hybridmoe.quant.formats import WEIGHT_FORMATS


def test_every_registered_format_has_an_entry_point() -> None:
    assert list(numba_moe.FUSED_MOE) == list(WEIGHT_FORMATS)
    names = [kernel.py_func.__name__ for kernel in numba_moe.FUSED_MOE.values()]
    assert names == [f"fused_moe_{name}" for name in WEIGHT_FORMATS]  # one cache file each


def test_each_format_is_its_own_numba_type() -> None:
    types = [KernelFormatType(fmt.kernel) for fmt in WEIGHT_FORMATS.values()]
    assert len(set(types)) == len(types)
    assert (
        KernelFormatType(WEIGHT_FORMATS["q8_0"].kernel) == types[list(WEIGHT_FORMATS).index("q8_0")]
    )


def test_the_cache_is_named_by_every_format_module_with_kernel_ir() -> None:
    sources = numba_moe.kernel_sources()
    for fmt in WEIGHT_FORMATS.values():
        assert inspect.getfile(fmt.kernel.dequantize_block_ir) in sources
        if fmt.kernel.load_weight_ir is not None:
            assert inspect.getfile(fmt.kernel.load_weight_ir) in sources
    assert numba_moe.__file__ in sources and sources == sorted(set(sources))
