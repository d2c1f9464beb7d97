"""llama.cpp's MoE layer alone: the ggml graph llama.cpp builds for a routed-expert layer
(llm_graph_context::build_moe_ffn: mul_mat_id of gate and of up, swiglu, mul_mat_id of down,
the route weights multiplied in, the top-k outputs summed), on the ggml CPU backend that
`llama-cpp-python` (the optional `bench` extra) ships, through ctypes.

bench_cpu_moe.py --llamacpp times it beside our fused kernel on the same bytes (GGUF block
layouts are the same as ours: every format we load from a GGUF file is its blocks as stored),
the same routes and the same cache flush, so the ratio is the two MoE layers' alone. The
activations are float32 as llama.cpp's; it quantises them itself for its integer dots (q8_K
for the k-quants, q8_0 for q4_0 / q8_0), as it does in a decode step.

Only ggml's public C API is used (ggml.h, ggml-cpu.h of the installed version): contexts,
tensors, the graph, a persistent thread pool as llama.cpp keeps, ggml_graph_plan and
ggml_graph_compute.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

GGML_TYPES = {  # our format name -> enum ggml_type (ggml.h)
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "q2_k": 10,
    "q3_k": 11,
    "q4_k": 12,
    "q5_k": 13,
    "q6_k": 14,
    "bf16": 30,
    "mxfp4": 39,
}
_F32, _I32 = 0, 26
_MAX_THREADS = 512  # GGML_MAX_N_THREADS


class _InitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


class _ThreadpoolParams(ctypes.Structure):
    _fields_ = [
        ("cpumask", ctypes.c_bool * _MAX_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


class _Cplan(ctypes.Structure):
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


def _libraries():
    """(libggml-base, libggml-cpu) from the installed llama_cpp package, with their
    signatures; ImportError when llama-cpp-python is not installed."""
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {
        (base, "ggml_init"): (p, [_InitParams]),
        (base, "ggml_free"): (None, [p]),
        (base, "ggml_new_tensor_2d"): (p, [p, i32, i64, i64]),
        (base, "ggml_new_tensor_3d"): (p, [p, i32, i64, i64, i64]),
        (base, "ggml_get_data"): (p, [p]),
        (base, "ggml_nbytes"): (ctypes.c_size_t, [p]),
        (base, "ggml_mul_mat_id"): (p, [p, p, p, p]),
        (base, "ggml_swiglu_split"): (p, [p, p, p]),
        (base, "ggml_mul"): (p, [p, p, p]),
        (base, "ggml_add"): (p, [p, p, p]),
        (base, "ggml_view_2d"): (p, [p, p, i64, i64, ctypes.c_size_t, ctypes.c_size_t]),
        (base, "ggml_new_graph"): (p, [p]),
        (base, "ggml_build_forward_expand"): (None, [p, p]),
        (base, "ggml_threadpool_params_default"): (_ThreadpoolParams, [i32]),
        (cpu, "ggml_cpu_init"): (None, []),
        (cpu, "ggml_threadpool_new"): (p, [ctypes.POINTER(_ThreadpoolParams)]),
        (cpu, "ggml_threadpool_free"): (None, [p]),
        (cpu, "ggml_graph_plan"): (_Cplan, [p, i32, p]),
        (cpu, "ggml_graph_compute"): (i32, [p, ctypes.POINTER(_Cplan)]),
    }
    for (lib, name), (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return base, cpu


def available() -> bool:
    try:
        _libraries()
    except (ImportError, OSError, AttributeError):
        return False
    return True


class GgmlMoeLayer:
    """One routed-expert layer on ggml's CPU backend: experts [E, rows, n] as stored (our
    bank's bytes copied in), T tokens of `hidden` floats, top-k routes; call(x, ids, weights)
    -> y [T, hidden] (numpy float32)."""

    def __init__(self, fmt_name, gate, up, down, tokens, top_k, threads):
        import numpy as np

        self.ctx = self.pool = None
        if fmt_name not in GGML_TYPES:
            raise ValueError(f"no ggml type for format {fmt_name!r}")
        self.base, self.cpu = _libraries()
        self.cpu.ggml_cpu_init()
        qtype = GGML_TYPES[fmt_name]
        experts, inter, hidden = down.shape[0], gate.shape[1], down.shape[1]
        weight_bytes = sum(t.numel() * t.element_size() for t in (gate, up, down))
        overhead = 64 * 2**20 + 64 * tokens * top_k * (hidden + 2 * inter)
        self.ctx = self.base.ggml_init(_InitParams(weight_bytes + overhead, None, False))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        b = self.base
        tensors = []
        for source, n, rows in ((gate, hidden, inter), (up, hidden, inter), (down, inter, hidden)):
            t = b.ggml_new_tensor_3d(self.ctx, qtype, n, rows, experts)
            data = source.contiguous().view(-1)
            nbytes = data.numel() * data.element_size()
            if b.ggml_nbytes(t) != nbytes:
                raise ValueError(
                    f"{fmt_name}: ggml's tensor holds {b.ggml_nbytes(t)} bytes, the bank's "
                    f"{nbytes}: not the same block layout"
                )
            ctypes.memmove(b.ggml_get_data(t), data.data_ptr(), nbytes)
            tensors.append(t)
        w_gate, w_up, w_down = tensors
        x = b.ggml_new_tensor_3d(self.ctx, _F32, hidden, 1, tokens)
        ids = b.ggml_new_tensor_2d(self.ctx, _I32, top_k, tokens)
        weights = b.ggml_new_tensor_3d(self.ctx, _F32, 1, top_k, tokens)
        gate_out = b.ggml_mul_mat_id(self.ctx, w_gate, x, ids)  # [I, K, T]
        up_out = b.ggml_mul_mat_id(self.ctx, w_up, x, ids)
        act = b.ggml_swiglu_split(self.ctx, gate_out, up_out)
        down_out = b.ggml_mul_mat_id(self.ctx, w_down, act, ids)  # [H, K, T]
        weighted = b.ggml_mul(self.ctx, down_out, weights)
        row, token = hidden * 4, hidden * 4 * top_k  # nb[1], nb[2] of the float32 [H, K, T]
        views = [
            b.ggml_view_2d(self.ctx, weighted, hidden, tokens, token, k * row) for k in range(top_k)
        ]
        out = views[0]
        for view in views[1:]:
            out = b.ggml_add(self.ctx, out, view)
        self.graph = b.ggml_new_graph(self.ctx)
        b.ggml_build_forward_expand(self.graph, out)
        params = b.ggml_threadpool_params_default(threads)
        self.pool = self.cpu.ggml_threadpool_new(ctypes.byref(params))
        self.plan = self.cpu.ggml_graph_plan(self.graph, threads, self.pool)
        self.work = (ctypes.c_uint8 * max(1, self.plan.work_size))()
        self.plan.work_data = ctypes.cast(self.work, ctypes.c_void_p)
        self._inputs = [
            self._array(x, np.float32, (tokens, hidden)),
            self._array(ids, np.int32, (tokens, top_k)),
            self._array(weights, np.float32, (tokens, top_k)),
        ]
        self._y = self._array(out, np.float32, (tokens, hidden))

    def _array(self, tensor, dtype, shape):
        import numpy as np

        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        buf = (ctypes.c_uint8 * size).from_address(self.base.ggml_get_data(tensor))
        return np.frombuffer(buf, dtype=dtype).reshape(shape)

    def set_inputs(self, x, ids, weights) -> None:
        """x [T, hidden], ids [T, K] and weights [T, K]: torch tensors or arrays."""
        for into, value in zip(self._inputs, (x, ids, weights), strict=True):
            into[:] = value.numpy() if hasattr(value, "numpy") else value

    def compute(self):
        """Runs the graph on the inputs set; y [T, hidden] (a view of ggml's output)."""
        status = self.cpu.ggml_graph_compute(self.graph, ctypes.byref(self.plan))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute returned status {status}")
        return self._y

    def close(self) -> None:
        if self.pool:
            self.cpu.ggml_threadpool_free(self.pool)
            self.pool = None
        if self.ctx:
            self.base.ggml_free(self.ctx)
            self.ctx = None

    def __del__(self):
        if hasattr(self, "ctx"):
            self.close()
