"""One MoE layer's routed experts on the CPU: the fused numba kernel (fused_cpu_moe) per weight
format, against the memory's read bandwidth and the torch per-expert loop, measured side by side.

    python benchmarks/bench_cpu_moe.py [--shapes qwen3-30b-a3b mixtral gpt-oss-120b]
        [--formats bf16 q8_0 q4_0 mxfp4]
        [--reps 15] [--threads N] [--separate] [--llamacpp]

--formats takes any registered weight format (quant/formats.py), the k-quants included
(q2_k q3_k q4_k q5_k q6_k), and FORMAT+q8 for an int8-block format (q8_0+q8, q4_0+q8): its bank
with activation_quant q8 (quant/activation_q8.py: integer dot products). --no-flush keeps the
weights in cache between calls: with the `small` shape (about 1 MiB of experts a call) that
measures the kernel's compute, where int8 dots and float FMAs differ most; compare the
best-of-reps column of two formats run side by side.

--tile measures the kernel's arithmetic alone instead: the T=1 tile (4 weight rows x 1
activation row, kernels/numba_simd.py) over 16 rows of 2048 weights that stay in cache, one
thread, best of 300 calls, in ns per 256 weights; FORMAT+q8 the q8 tile (integer dots) on
activations quantised once. The best of many short calls holds up on a busy machine: run it
for two checkouts back to back to compare their loops.

Shapes: qwen3-30b-a3b (H=2048, I=768, E=128, K=8), mixtral (H=4096, I=14336, E=8, K=2) and
gpt-oss-120b (H=2880, I=2880, E=128, K=4; its experts ship as mxfp4, and 2880 is no multiple of
the k-quants' 256); 1gb (H=1024, I=512, E=64, K=8: bench_vs_llamacpp.py's ~1 GB model, short
rows). The banks hold random bytes in each format (small valid scales); the math
does not care. Before
every timed call a 512 MiB buffer is read, so the experts come from DRAM, as they do in a real
decode step where every other layer's weights went through the caches in between. That read
leaves the call's code and Python objects out of every cache too, which a decode step does
not: measured on the AMD EPYC, one q4_k+q8 call on 0.9 MB of experts took 278 µs after the
read against 61 warm, 111 after a call on another bank (the wrapper's Python 7 -> 115 µs, the
kernel's entry 52 -> 141, an empty parallel njit 2 -> 36). --warm-code calls the layer once
more after the read, untimed, on routes disjoint from the timed call's (so its experts stay
out of cache): the rows then show the experts' streaming without that fixed cost; both
engines get the same warm-up with --llamacpp.

Rows per shape and format:
  T=1          one token, K distinct random experts
  T=4 shared   four tokens routed to the same K experts: the same bytes as T=1, so time / T=1
               shows what batching tokens costs (target <= 1.5x)
  T=4 random   four tokens, each with its own K random experts (up to 4x the bytes)
  T=16 shared  sixteen tokens on the same K experts: a prefill's tiles, compute-bound
Columns: median µs per layer call; effective GB/s = bytes of the distinct experts read / time;
% of the DRAM read bandwidth measured (torch.sum over 1 GiB, 2 threads) right before that row,
and of the bank's own bytes' (torch.sum over them, as int64: this host's read rate moves ~2x
with the pages' size and placement, and the bank's pages are what the kernel reads);
x torch = the torch per-expert loop's time (bank_moe: the expert dequantised, then F.linear) /
ours; with --llamacpp, x llama.cpp = llama.cpp's MoE layer's time (ggml_moe.py: the graph
llama.cpp builds, on ggml's CPU backend from llama-cpp-python, the `bench` extra) / ours, on
the same bytes, routes and flush (> 1: ours is faster). FORMAT+q8 compares with the same
llama.cpp layer (it always quantises the activations for its integer dots).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hybridmoe.moe.cpu_experts import bank_moe, fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    experts: int
    top_k: int


SHAPES = {
    "qwen3-30b-a3b": Shape(hidden=2048, inter=768, experts=128, top_k=8),
    "mixtral": Shape(hidden=4096, inter=14336, experts=8, top_k=2),
    "gpt-oss-120b": Shape(hidden=2880, inter=2880, experts=128, top_k=4),
    # the ~1 GB model of bench_vs_llamacpp.py --shape 1gb (llamacpp_checkpoints.SHAPES)
    "1gb": Shape(hidden=1024, inter=512, experts=64, top_k=8),
    "small": Shape(hidden=1024, inter=256, experts=4, top_k=2),  # in cache with --no-flush
}
FLUSH_BYTES = 512 * 2**20
SCALE = 0.01  # the blocks' scales (mxfp4: 2^-6): keep random quants' outputs finite


def random_stored(fmt_name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A [E, rows, n] weight stored in `fmt_name`, filled one expert at a time."""
    fmt = weight_format(fmt_name)
    out = torch.empty(fmt.stored_shape(shape), dtype=fmt.storage_dtype)
    for e in range(shape[0]):
        if not fmt.is_quantized:
            out[e] = torch.randn(shape[1:], generator=g).mul_(0.02).to(fmt.storage_dtype)
            continue
        out[e] = torch.randint(0, 256, out.shape[1:], dtype=torch.uint8, generator=g)
        blocks = out[e].view(shape[1], -1, fmt.block_bytes)
        scale = torch.tensor([SCALE]).to(fmt.scale_dtype).view(torch.uint8)  # fp16 or E8M0
        for at in fmt.scale_offsets:  # d (and m / dmin): finite, so no nan/inf arithmetic
            blocks[..., at : at + scale.numel()] = scale
    return out


def make_bank(shape: Shape, fmt_name: str, separate: bool = False) -> ExpertBank:
    """Random experts, gate and up stacked in one gate_up, or when `separate` in two tensors
    (as a GGUF file's ffn_gate_exps / ffn_up_exps); FORMAT+q8: with q8 activations."""
    fmt_name, plus, quant = fmt_name.partition("+")
    bank = _random_bank(shape, fmt_name, separate)
    return bank.with_activation_quant(quant) if plus else bank


def _random_bank(shape: Shape, fmt_name: str, separate: bool) -> ExpertBank:
    g = torch.Generator().manual_seed(0)
    fmt = weight_format(fmt_name)
    down = random_stored(fmt_name, (shape.experts, shape.hidden, shape.inter), g)
    if separate:
        gate, up = (
            random_stored(fmt_name, (shape.experts, shape.inter, shape.hidden), g) for _ in "gu"
        )
        return ExpertBank(gate=gate, up=up, down=down, fmt=fmt)
    gate_up = random_stored(fmt_name, (shape.experts, 2 * shape.inter, shape.hidden), g)
    return ExpertBank(gate_up, down, fmt)


class Memory:
    """DRAM read bandwidth, and a cache flush, from plain torch reads."""

    def __init__(self) -> None:
        self.flush_buffer = torch.ones(FLUSH_BYTES // 4)
        self.bw_buffer = torch.ones(2**30 // 4)

    flushes = True
    best = 0.0  # the best call's seconds of the last time_calls

    def flush(self) -> None:
        if self.flushes:
            self.flush_buffer.sum()

    def read_gbps(self, reps: int = 3, buffers: list[torch.Tensor] | None = None) -> float:
        """GB/s of torch.sum over `buffers` (default the 1 GiB buffer), best of `reps`."""
        buffers = [self.bw_buffer] if buffers is None else buffers
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for buffer in buffers:
                buffer.sum()
            times.append(time.perf_counter() - start)
        return sum(b.nbytes for b in buffers) / min(times) / 1e9


def bank_words(bank: ExpertBank) -> list[torch.Tensor]:
    """The bank's own bytes as int64 tensors (whole 8-byte words; torch sums int64 as fast as
    float32, and random bytes as float32 would hold denormals and NaNs): the same pages, and so
    the same page size and placement, as the kernel reads."""
    words = []
    for tensor in bank.tensors():
        flat = tensor.reshape(-1).view(torch.uint8)
        words.append(flat[: flat.numel() // 8 * 8].view(torch.int64))
    return words


def routes(shape: Shape, tokens: int, shared: bool, g: torch.Generator):
    rows = 1 if shared else tokens
    ids = torch.stack(
        [torch.randperm(shape.experts, generator=g)[: shape.top_k] for _ in range(rows)]
    )
    ids = ids.expand(tokens, -1).contiguous()
    return ids, torch.rand(tokens, shape.top_k, generator=g)


def disjoint_routes(shape: Shape, ids: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Routes of ids' shape whose experts are none of ids' (each token's drawn from the rest,
    distinct within the token)."""
    free = torch.ones(shape.experts, dtype=torch.bool)
    free[ids.flatten()] = False
    rest = free.nonzero().flatten()
    rows = [rest[torch.randperm(len(rest), generator=g)[: ids.shape[1]]] for _ in range(len(ids))]
    return torch.stack(rows).to(ids.dtype)


def time_calls(
    fn, bank, shape, tokens, shared, reps, memory, seed=1, warm_code=False
) -> tuple[float, float]:
    """(median seconds per call, median bytes of distinct experts read per call); the best
    call's seconds in memory.best."""
    (seconds,), nbytes = time_interleaved(
        (fn,), bank, shape, tokens, shared, reps, memory, seed, warm_code
    )
    return seconds, nbytes


def time_interleaved(fns, bank, shape, tokens, shared, reps, memory, seed=1, warm_code=False):
    """([median seconds per call of each fn], median bytes of distinct experts read per call):
    each rep draws its routes and calls every fn on them in turn, each after a flush, so a
    drift of the machine falls on every fn alike; the first fn's best call in memory.best. A
    fn with a `prepare(x, ids, weights, bank)` attribute has it called before the flush,
    untimed. `warm_code`: after the flush each fn is called once more, untimed, on routes of
    other experts (disjoint_routes), then prepared again."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, shape.hidden, generator=g)
    prepares = [getattr(fn, "prepare", None) for fn in fns]
    warm = routes(shape, tokens, shared, g)
    for fn, prepare in zip(fns, prepares, strict=True):  # compile / warm up
        if prepare is not None:
            prepare(x, *warm, bank)
        fn(x, *warm, bank)
    seconds, nbytes = [[] for _ in fns], []
    for _ in range(reps):
        ids, weights = routes(shape, tokens, shared, g)
        for fn, prepare, times in zip(fns, prepares, seconds, strict=True):
            if prepare is not None:  # the call's inputs handed over untimed, before the flush
                prepare(x, ids, weights, bank)
            memory.flush()
            if warm_code:
                other = disjoint_routes(shape, ids, g)
                if prepare is not None:
                    prepare(x, other, weights, bank)
                fn(x, other, weights, bank)
                if prepare is not None:
                    prepare(x, ids, weights, bank)
            start = time.perf_counter()
            fn(x, ids, weights, bank)
            times.append(time.perf_counter() - start)
        nbytes.append(len(set(ids.flatten().tolist())) * bank.expert_nbytes)
    memory.best = min(seconds[0])
    return [statistics.median(times) for times in seconds], statistics.median(nbytes)


def tile_ns(fmt_name: str, rows: int = 16, weights: int = 2048, calls: int = 300) -> float:
    """Best ns per 256 weights of the 4x1 tile on `rows` cached rows of `weights` (--tile);
    FORMAT+q8: the q8 tile (numba_simd_q8.tile_dot_q8) on activations quantised once."""
    import numba
    import numpy as np

    from hybridmoe.kernels.numba_moe_q8 import group_sums, quantize_rows
    from hybridmoe.kernels.numba_simd import tile_dot
    from hybridmoe.kernels.numba_simd_q8 import tile_dot_q8

    fmt_name, q8 = fmt_name.removesuffix("+q8"), fmt_name.endswith("+q8")
    fmt = weight_format(fmt_name)
    kernel, g = fmt.kernel, torch.Generator().manual_seed(0)
    w = random_stored(fmt_name, (1, rows, weights), g).view(torch.uint8).reshape(-1).numpy()
    x = torch.randn(weights, generator=g).numpy()
    row_bytes, offs, out = w.size // rows, torch.zeros(1, dtype=torch.int64).numpy(), x[:4] * 0
    width = kernel.block_weights
    xq, xd = np.empty(weights, np.int8), np.empty(weights // width, np.float32)
    xs = np.empty(weights // 16, np.int16)
    if q8:
        quantize_rows(x, weights, xq, xd, width)
        group_sums(xq, weights, xs)

    @numba.njit(nogil=True)
    def loop(w, x, offs, out, reps):
        for _ in range(reps):
            for t in range(rows // 4):
                at = t * 4 * row_bytes
                if q8:
                    tile_dot_q8(
                        kernel, 4, 1, w, at, row_bytes, weights // width, xq, xd, xs, offs, 0,
                        out, 0, 4,
                    )  # fmt: skip
                else:
                    tile_dot(kernel, 4, 1, w, at, row_bytes, weights // 32, x, offs, 0, out, 0, 4)

    reps = 20
    loop(w, x, offs, out, reps)  # compile
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        loop(w, x, offs, out, reps)
        best = min(best, time.perf_counter() - start)
    return best / (reps * rows * weights / 256) * 1e9


@contextmanager
def llamacpp_layer(bank, fmt_name, shape, tokens, args):
    """A call(x, ids, weights, bank) of llama.cpp's MoE layer (ggml_moe.py) on the bank's
    bytes for `tokens` tokens, as time_calls takes ours."""
    from ggml_moe import GgmlMoeLayer

    threads = args.threads or torch.get_num_threads()
    fmt_name = fmt_name.partition("+")[0]  # llama.cpp quantises the activations itself
    layer = GgmlMoeLayer(fmt_name, bank.gate, bank.up, bank.down, tokens, shape.top_k, threads)

    def call(x, ids, weights, _bank):
        return layer.compute()

    # the inputs written untimed: through numpy views here, where llama.cpp copies them in C
    # (measured after a 512 MiB read: ~85 µs of this harness's Python, ggml's call ~110 µs)
    call.prepare = lambda x, ids, weights, _bank: layer.set_inputs(x, ids, weights)
    try:
        yield call
    finally:
        layer.close()


def bench_format(name, shape, fmt_name, args, memory) -> dict[str, float]:
    start = time.perf_counter()
    bank = make_bank(shape, fmt_name, args.separate)
    layout = "gate, up separate" if args.separate else "gate_up stacked"
    print(
        f"  {fmt_name}: bank of {bank.nbytes >> 20} MiB ({layout}) built in "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )
    ours = lambda x, ids, w, b: fused_cpu_moe(x, ids, w, b, threads=args.threads)  # noqa: E731
    results = {}
    for label, tokens, shared in (
        ("T=1", 1, True),
        ("T=4 shared", 4, True),
        ("T=4 random", 4, False),
        ("T=16 shared", 16, True),
    ):
        bw = memory.read_gbps()
        own = memory.read_gbps(buffers=bank_words(bank))
        versus = ""
        if args.llamacpp:  # interleaved call by call with ours, on the same routes
            with llamacpp_layer(bank, fmt_name, shape, tokens, args) as theirs:
                (t_ours, t_llama), nbytes = time_interleaved(
                    (ours, theirs), bank, shape, tokens, shared, args.reps, memory,
                    warm_code=args.warm_code,
                )  # fmt: skip
            versus += f"   x llama.cpp {t_llama / t_ours:5.2f}"
        else:
            t_ours, nbytes = time_calls(
                ours, bank, shape, tokens, shared, args.reps, memory, warm_code=args.warm_code
            )
        best = memory.best
        if args.torch_reps:
            t_torch, _ = time_calls(bank_moe, bank, shape, tokens, shared, args.torch_reps, memory)
            versus += f"   x torch {t_torch / t_ours:5.1f}"
        gbps = nbytes / t_ours / 1e9
        results[label] = t_ours
        print(
            f"  {fmt_name:7} {label:11} {t_ours * 1e6:9.0f} µs (best {best * 1e6:7.0f}) "
            f"{gbps:6.1f} GB/s "
            f"{gbps / bw:5.0%} of {bw:4.1f} GB/s, {gbps / own:4.0%} of its own {own:4.1f}"
            f"{versus}",
            flush=True,
        )
    print(
        f"  {fmt_name:5} T=4 shared / T=1: {results['T=4 shared'] / results['T=1']:.2f}x "
        "(target <= 1.5x)",
        flush=True,
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=[
            *WEIGHT_FORMATS,
            *(f"{n}+q8" for n, f in WEIGHT_FORMATS.items() if f.has_integer_dots),
        ],
        default=["bf16", "q8_0", "q4_0"],
    )
    parser.add_argument("--no-flush", action="store_true", help="weights stay in cache")
    parser.add_argument("--tile", action="store_true", help="the T=1 tile's compute alone")
    parser.add_argument(
        "--warm-code",
        action="store_true",
        help="after each flush, an untimed call on other experts warms the call's code",
    )
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--torch-reps", type=int, default=3, help="0: no torch loop")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default all)")
    parser.add_argument(
        "--llamacpp",
        action="store_true",
        help="time llama.cpp's MoE layer beside ours (ggml_moe.py; needs the bench extra)",
    )
    parser.add_argument(
        "--separate", action="store_true", help="banks holding gate and up as two tensors"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.tile:
        for fmt_name in args.formats:
            ns = tile_ns(fmt_name)
            print(f"  {fmt_name:7} T=1 tile {ns:6.1f} ns per 256 weights (best of 300)", flush=True)
        return
    memory = Memory()
    memory.flushes = not args.no_flush
    print(f"torch threads {torch.get_num_threads()}, kernel threads {args.threads or 'all'}")
    if args.llamacpp and os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        # llama-cpp-python's ggml computes on OpenMP threads, ours on numba's OpenMP layer:
        # both pools then sleep between calls (measured: 1.5-2.3x slower layer calls)
        print("warning: OMP_WAIT_POLICY=PASSIVE slows both engines' calls; unset it to compare")
    for name in args.shapes:
        shape = SHAPES[name]
        print(f"{name}: H={shape.hidden} I={shape.inter} E={shape.experts} K={shape.top_k}")
        for fmt_name in args.formats:
            bench_format(name, shape, fmt_name, args, memory)


if __name__ == "__main__":
    main()
