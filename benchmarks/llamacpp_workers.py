"""One engine's measurements on one GGUF file, run in a process of its own (so that its peak
RSS is its own): bench_vs_llamacpp.py starts `python llamacpp_workers.py ENGINE GGUF ...`,
which calls `measure` and prints its result as one JSON line. This module imports nothing
of either engine at its top (numpy only, which both import): in a worker, each engine's
imports (torch's and hybridmoe's; llama_cpp's) run inside its load timer.

Both engines are measured alike: greedy (argmax) decoding of token ids, decode tok/s as
(N - 1) / (t(prompt + N tokens) - t(prompt + 1 token)) so that prefill and the first token are
excluded the same way; prefill tok/s as the prompt length over t(long prompt + 1 token); load
as the time from the start of the engine's imports to the first token of the first request
(import_s: the imports' part of it; near 0 where the caller imported them already). Each
result also holds the logits after the decode prompt (float32 [V]), to compare the engines'
models.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# (prompts, n tokens) -> greedy ids per prompt
Generate = Callable[[list[list[int]], int], list[list[int]]]
MISSING_LLAMA_CPP = (
    "llama-cpp-python is not installed: pip install -c constraints.txt -e '.[bench]' "
    "(it compiles llama.cpp; CMAKE_ARGS='-DGGML_NATIVE=ON' for this CPU)"
)


def prompts(batch: int, length: int) -> list[list[int]]:
    """`batch` distinct prompts of `length` ids (the same for both engines)."""
    return [[100 + (7 * b + 13 * i) % 200 for i in range(length)] for b in range(batch)]


def measure(engine: str, path: Path, threads: int, args) -> dict:
    """Load `path` with `engine`, time it, and return the figures (see the module docstring)."""
    start = time.perf_counter()
    IMPORTS[engine]()
    imported = time.perf_counter()
    generate, make_batched, logits, close = LOADERS[engine](path, threads, args)
    first_ids = generate(prompts(1, args.prompt_tokens), 1)
    result = {"load_s": time.perf_counter() - start, "import_s": imported - start}
    result["prompt_logits"] = logits(prompts(1, args.prompt_tokens)[0]).tolist()
    result["decode_tok_s"], [result["tokens"]] = _decode(generate, args, 1)
    result["prefill_tok_s"] = _prefill_tok_s(generate, args.prefill_tokens)
    if args.batch > 1:
        result["batch_decode_tok_s"], result["batch_tokens"] = _decode(
            make_batched(), args, args.batch
        )
    result["first_ids"] = first_ids[0]
    result["peak_rss_mib"] = _peak_rss_mib()
    close()
    return result


def _decode(generate: Generate, args, batch: int) -> tuple[float, list[list[int]]]:
    """Aggregate decode tok/s at `batch` prompts, and the tokens of each."""
    batch_prompts = prompts(batch, args.prompt_tokens)
    generate(batch_prompts, 2)  # warm-up at this batch size
    first_s = _timed(lambda: generate(batch_prompts, 1))
    start = time.perf_counter()
    tokens = generate(batch_prompts, args.tokens)
    full_s = time.perf_counter() - start
    return batch * (args.tokens - 1) / (full_s - first_s), tokens


def _prefill_tok_s(generate: Generate, length: int) -> float:
    prompt = prompts(1, length)
    best_s = min(_timed(lambda: generate(prompt, 1)) for _ in range(2))
    return length / best_s


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def hybridmoe_config(
    threads: int,
    batch: int,
    activation_quant: str = "auto",
    attention_kernel: str = "auto",
    huge_pages: bool = False,
):
    """The EngineConfig the bench runs hybridmoe with: `--decode-target cpu`, bf16, no prefix
    cache (llama.cpp's KV is cleared before every request, so each prefills it all); nothing
    about the file's expert format (a GGUF's experts stay in its types); `activation_quant`
    as --activation-quant (auto, hybridmoe's default, and q8: experts with integer blocks by
    integer dots, as llama.cpp computes; none: float activations),
    `attention_kernel` as --attention-kernel (auto, on, off: when the numba decode attention
    runs instead of SDPA), `huge_pages` as --huge-pages."""
    from hybridmoe.engine import EngineConfig
    from hybridmoe.moe.config import OffloadConfig

    offload = OffloadConfig(
        decode_target="cpu", cpu_threads=threads, activation_quant=activation_quant
    )
    return EngineConfig(
        dtype="bfloat16",
        threads=threads,
        max_batch=max(batch, 1),
        prefix_cache_tokens=0,
        attention_kernel=attention_kernel,
        huge_pages=huge_pages,
        offload=offload,
    )


def load_hybridmoe(path: Path, threads: int, args):
    import torch

    from hybridmoe.engine import Engine, SamplingParams

    torch.set_num_threads(threads)
    config = hybridmoe_config(
        threads, args.batch, args.activation_quant, args.attention_kernel, args.huge_pages
    )
    engine = Engine.from_pretrained(path, config)

    def generate(batch_prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return engine.generate_ids(batch_prompts, params)

    def logits(prompt: list[int]) -> np.ndarray:
        return engine.model.logits(prompt)[-1].float().numpy()

    return generate, lambda: generate, logits, engine.close


def load_llamacpp(path: Path, threads: int, args):
    try:
        import llama_cpp as ll
    except ImportError as exc:
        raise SystemExit(MISSING_LLAMA_CPP) from exc
    model = load_llama_model(ll, path, extra_buffers=not args.no_extra_buffers)
    n_ctx = max(args.prefill_tokens, args.prompt_tokens) + args.tokens + 8  # the longest
    contexts = [LlamaContext(ll, model, threads, 1, n_ctx)]

    def make_batched() -> Generate:
        contexts.append(LlamaContext(ll, model, threads, args.batch, n_ctx))
        return contexts[-1].generate

    def close() -> None:
        for context in contexts:
            context.close()
        ll.llama_model_free(model)

    return contexts[0].generate, make_batched, contexts[0].last_logits, close


def llamacpp_last_logits(path: Path, prompt: list[int], threads: int = 1) -> np.ndarray:
    """llama.cpp's logits after `prompt` on the GGUF at `path` (float32 [V])."""
    import llama_cpp as ll

    model = load_llama_model(ll, path)
    context = LlamaContext(ll, model, threads, n_seq=1, n_ctx=len(prompt) + 8)
    try:
        return context.last_logits(prompt)
    finally:
        context.close()
        ll.llama_model_free(model)


_QUIET = {}  # the log callback, kept alive while llama.cpp holds it


def load_llama_model(ll, path: Path, extra_buffers: bool = True):
    """llama.cpp's model of the GGUF at `path` (memory-mapped, llama.cpp's defaults; without
    `extra_buffers`, its use_extra_bufts off: no repacked or AMX weights, what `--no-repack`
    gives its own tools); its log lines go nowhere (a failure is still a RuntimeError here)."""
    if not _QUIET:
        _QUIET["callback"] = ll.llama_log_callback(lambda level, text, user_data: None)
        ll.llama_log_set(_QUIET["callback"], ctypes.c_void_p(0))
    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.use_extra_bufts = extra_buffers
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


class LlamaContext:
    """A llama.cpp context of `n_seq` sequences of up to `n_ctx` tokens each, decoding greedily
    through the C API (llama_batch / llama_decode), one sequence per prompt."""

    def __init__(self, ll, model, threads: int, n_seq: int, n_ctx: int):
        self.ll = ll
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx * n_seq
        params.n_batch = params.n_ubatch = max(n_ctx, 512)
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        self.batch = ll.llama_batch_init(params.n_batch, 0, n_seq)

    def generate(self, batch_prompts: list[list[int]], n: int) -> list[list[int]]:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        entries = [(s, pos, t) for s, p in enumerate(batch_prompts) for pos, t in enumerate(p)]
        out: list[list[int]] = [[] for _ in batch_prompts]
        last = self._decode(entries, [len(p) for p in batch_prompts])
        for step in range(n):
            for s, row in enumerate(last):
                out[s].append(self._argmax(row))
            if step + 1 < n:
                entries = [(s, len(p) + step, out[s][-1]) for s, p in enumerate(batch_prompts)]
                last = self._decode(entries, [1] * len(batch_prompts))
        return out

    def last_logits(self, prompt: list[int]) -> np.ndarray:
        """The logits after `prompt` (float32 [V], a copy)."""
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        [row] = self._decode([(0, pos, t) for pos, t in enumerate(prompt)], [len(prompt)])
        return self._logits(row).copy()

    def _decode(self, entries: list[tuple[int, int, int]], lengths: list[int]) -> list[int]:
        """Decode (seq, pos, token) entries; the batch rows whose logits are each sequence's
        last (the entries are grouped by sequence, `lengths` per sequence)."""
        b = self.batch
        ends = set(np.cumsum(lengths) - 1)
        for i, (seq, pos, token) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = i in ends
        b.n_tokens = len(entries)
        status = self.ll.llama_decode(self.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return sorted(int(i) for i in ends)

    def _argmax(self, row: int) -> int:
        return int(self._logits(row).argmax())

    def _logits(self, row: int) -> np.ndarray:
        """A view of llama.cpp's logits of batch row `row` (float32 [V])."""
        pointer = ctypes.cast(
            self.ll.llama_get_logits_ith(self.ctx, row), ctypes.POINTER(ctypes.c_float)
        )
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)


def import_hybridmoe() -> None:
    import torch  # noqa: F401

    import hybridmoe.engine  # noqa: F401


def import_llamacpp() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise SystemExit(MISSING_LLAMA_CPP) from exc


LOADERS = {"hybridmoe": load_hybridmoe, "llama.cpp": load_llamacpp}
IMPORTS = {"hybridmoe": import_hybridmoe, "llama.cpp": import_llamacpp}


def parse_worker_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's arguments (sys.argv's when None): ENGINE GGUF and the run's flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=sorted(LOADERS))
    parser.add_argument("gguf", type=Path)
    for flag in ("--threads", "--tokens", "--prompt-tokens", "--batch", "--prefill-tokens"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--activation-quant", choices=("auto", "none", "q8"), default="auto")
    parser.add_argument("--attention-kernel", default="auto")
    parser.add_argument("--huge-pages", action="store_true")
    parser.add_argument("--no-extra-buffers", action="store_true", help="llama.cpp's")
    return parser.parse_args(argv)


def main() -> None:
    """The worker: `measure` ENGINE on GGUF, its result printed as one JSON line."""
    args = parse_worker_args()
    print(json.dumps(measure(args.engine, args.gguf, args.threads, args)))


if __name__ == "__main__":
    main()
