"""hybridmoe (`--decode-target cpu`) against llama.cpp (llama-cpp-python) on the same GGUF files,
side by side in one run: decode and prefill tok/s, their ratio, each engine's share of the DRAM
read bandwidth measured in the same run, load time to the first token and peak RSS.

    pip install -c constraints.txt -e '.[bench]'   # llama-cpp-python: compiles llama.cpp
    python benchmarks/bench_vs_llamacpp.py --shape qwen3-30b-a3b-4l --rounds 4
    python benchmarks/bench_vs_llamacpp.py --shape 1gb --formats q4_k q4_k_m q5_k q6_k

The checkpoint (random weights, llamacpp_checkpoints.SHAPES) is written once as safetensors and
converted to one GGUF per expert format (experts bf16 / q8_0 / q4_0 quantised from it, or
q4_k / q5_k / q6_k / q4_k_m as seeded random blocks; the other matrices bf16, norms and routers
F32 as llama.cpp's converter keeps them); both engines load the same file and decode greedily
from token ids, hybridmoe without its prefix cache, and the report compares their logits after
the prompt and their greedy tokens, per round. llama.cpp runs through its
C API (llama_batch, one sequence id per prompt for the batched rows). Each measurement runs in
a fresh process (so its peak RSS is its own; llamacpp_workers.py's main, which imports
nothing of either engine before the load timer starts: each engine's imports, torch's for
hybridmoe, count in its load, as they do for a user); the two engines alternate which goes
first. The workers write Python's bytecode cache (PYTHONDONTWRITEBYTECODE is dropped for
them): the untimed warm-up compiles the source tree's modules once, as an install does, not
every measured run.

A round is one (format, threads) pair of both engines; before it the bench records
/proc/loadavg and, over a 1 s pause of its own, how many cores other processes keep busy. A
round is busy when those exceed --busy-cores: the 1-minute load average (printed beside it)
cannot tell, since the bench's own previous run keeps it near its thread count on a quiet
machine. Figures and ratios come from quiet rounds only; when no round was quiet, the table
says BUSY and its figures are from all rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from llamacpp_checkpoints import (
    EXPERT_FORMATS,
    SHAPES,
    bytes_read_per_token,
    checkpoint_bytes,
    ensure_files,
)
from llamacpp_workers import MISSING_LLAMA_CPP

ENGINES = ("hybridmoe", "llama.cpp")
DEFAULT_DIR = Path("~/.cache/hybridmoe/bench-vs-llamacpp").expanduser()
WORKER = Path(__file__).with_name("llamacpp_workers.py")


@dataclass
class Round:
    """Both engines on one file at one thread count, with the machine's state before."""

    fmt: str
    threads: int
    loadavg: float  # 1-minute load average before the round
    others_cores: float  # cores other processes kept busy over the 1 s pause before it
    dram_gbps: float  # read bandwidth measured just before it
    busy: bool
    results: dict[str, dict]  # engine -> measure()'s figures


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b-4l")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="checkpoints, reused")
    parser.add_argument(
        "--formats", nargs="+", choices=EXPERT_FORMATS, default=["bf16", "q8_0", "q4_0"]
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="decoded per request")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=384)
    parser.add_argument("--batch", type=int, default=4, help="aggregate decode; 1: skip it")
    parser.add_argument(
        "--activation-quant",
        choices=("auto", "none", "q8"),
        default="auto",
        help="hybridmoe's --activation-quant (q8, and auto's choice for these formats: integer "
        "dots for q8_0, q4_0, q2_k ... q6_k; none: float activations)",
    )
    parser.add_argument(
        "--attention-kernel",
        choices=("auto", "on", "off"),
        default="auto",
        help="hybridmoe's --attention-kernel (when the numba decode attention runs, not SDPA)",
    )
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="hybridmoe's --huge-pages (its GGUF copied onto transparent huge pages at load)",
    )
    parser.add_argument(
        "--llamacpp-no-extra-buffers",
        action="store_true",
        help="llama.cpp without its extra buffer types (repacked and AMX weights; its "
        "`--no-repack`): its AMX matmul crashes on some files on an Intel Xeon",
    )
    parser.add_argument(
        "--busy-cores", type=float, default=0.5, help="others' cores that make a round busy"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every round here")
    parser.add_argument(
        "--report", type=Path, default=None, help="only print the tables of a --json file"
    )
    return parser.parse_args()


def others_cores(pause_s: float = 1.0) -> float:
    """Cores kept busy by other processes while this one sleeps `pause_s` (/proc/stat)."""

    def busy_total() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = values[3] + values[4]  # idle + iowait
        return sum(values) - idle, sum(values)

    busy0, total0 = busy_total()
    time.sleep(pause_s)
    busy1, total1 = busy_total()
    cores = os.cpu_count() or 1
    return cores * (busy1 - busy0) / max(total1 - total0, 1)


def dram_read_gbps(threads: int) -> float:
    """Best of 3 torch.sum over 1 GiB of float32 at `threads` threads (what a decode step's
    weight reads can at best stream)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(2**28, dtype=torch.float32)
    x.sum()
    best_s = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best_s = min(best_s, time.perf_counter() - start)
    return x.nbytes / best_s / 1e9


def run_worker(engine: str, path: Path, threads: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, str(WORKER), engine, str(path), "--threads", str(threads)]
    command += ["--tokens", str(args.tokens), "--prompt-tokens", str(args.prompt_tokens)]
    command += ["--batch", str(args.batch), "--prefill-tokens", str(args.prefill_tokens)]
    command += ["--activation-quant", args.activation_quant]
    command += ["--attention-kernel", args.attention_kernel]
    command += ["--huge-pages"] if args.huge_pages else []
    command += ["--no-extra-buffers"] if args.llamacpp_no_extra_buffers else []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{engine} on {path.name}, {threads} threads failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm_up(files: dict[str, Path], args: argparse.Namespace) -> None:
    """One short untimed run of each engine on each file: numba's compile cache and the page
    cache are then as warm for round 1 as for the rounds after it."""
    short = argparse.Namespace(**{**vars(args), "tokens": 3, "prefill_tokens": 16})
    for fmt in args.formats:
        for engine in ENGINES:
            run_worker(engine, files[fmt], max(args.threads), short)
    print("warm-up done", flush=True)


def run_rounds(files: dict[str, Path], args: argparse.Namespace) -> list[Round]:
    rounds = []
    for r in range(args.rounds):
        order = ENGINES if r % 2 == 0 else ENGINES[::-1]
        for fmt in args.formats:
            for threads in args.threads:
                loadavg = float(Path("/proc/loadavg").read_text().split()[0])
                others = others_cores()
                gbps = dram_read_gbps(max(args.threads))
                busy = others > args.busy_cores
                results = {e: run_worker(e, files[fmt], threads, args) for e in order}
                rounds.append(Round(fmt, threads, loadavg, others, gbps, busy, results))
                _print_round(r, rounds[-1])
    return rounds


def _print_round(index: int, r: Round) -> None:
    rates = "  ".join(f"{e} {r.results[e]['decode_tok_s']:.1f}" for e in ENGINES)
    state = f"load {r.loadavg:.2f}, others {r.others_cores:.2f} cores, {r.dram_gbps:.1f} GB/s"
    mark = "BUSY" if r.busy else "quiet"
    print(f"round {index + 1} {r.fmt} {r.threads}t: {state} [{mark}]  {rates} tok/s", flush=True)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _chosen(rounds: list[Round]) -> tuple[list[Round], bool]:
    """The quiet rounds, or all of them (and True: the figures are busy) when none was."""
    quiet = [r for r in rounds if not r.busy]
    return (quiet, False) if quiet else (rounds, True)


def _row(label: str, rounds: list[Round], key: str, bytes_per_token: int | None = None) -> str:
    """A table row: both engines' medians of `key`, the median ratio, and with
    `bytes_per_token` each engine's share of the measured bandwidth limit."""
    chosen, busy = _chosen(rounds)
    ours = _median([r.results["hybridmoe"][key] for r in chosen])
    theirs = _median([r.results["llama.cpp"][key] for r in chosen])
    ratio = _median([r.results["hybridmoe"][key] / r.results["llama.cpp"][key] for r in chosen])
    cells = [label, f"{ours:.1f} tok/s", f"{theirs:.1f} tok/s", f"{ratio:.2f}"]
    if bytes_per_token is not None:
        gbps = _median([r.dram_gbps for r in chosen]) * 1e9
        ours_pct, theirs_pct = (100 * bytes_per_token * rate / gbps for rate in (ours, theirs))
        cells.append(f"{ours_pct:.0f} % / {theirs_pct:.0f} %")
    cells.append(f"{len(chosen)} {'BUSY' if busy else 'quiet'}")
    return "| " + " | ".join(cells) + " |"


def _table(title: str, columns: list[str], rows: list[str]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    print("\n".join(rows))


def report(rounds: list[Round], files: dict[str, Path], args: argparse.Namespace) -> None:
    groups: dict[tuple[str, int], list[Round]] = {}
    for r in rounds:
        groups.setdefault((r.fmt, r.threads), []).append(r)
    labels = {key: f"{key[0]}, {key[1]}t" for key in groups}
    engines = ["experts, threads", "hybridmoe `--decode-target cpu`", "llama.cpp", "ratio"]
    share = "share of the bandwidth limit (ours / llama.cpp)"
    per_token = {fmt: bytes_read_per_token(files[fmt]) for fmt in args.formats}
    rows = [_row(labels[k], g, "decode_tok_s", per_token[k[0]]) for k, g in groups.items()]
    title = f"Decode, batch 1 ({args.tokens} tokens after a {args.prompt_tokens}-token prompt)"
    _table(title, [*engines, share, "rounds"], rows)
    if args.batch > 1:
        rows = [_row(labels[k], g, "batch_decode_tok_s") for k, g in groups.items()]
        _table(f"Decode, {args.batch} prompts batched (aggregate)", [*engines, "rounds"], rows)
    rows = [_row(labels[k], g, "prefill_tok_s") for k, g in groups.items()]
    _table(f"Prefill of a {args.prefill_tokens}-token prompt", [*engines, "rounds"], rows)
    rows = [_load_row(labels[k], g) for k, g in groups.items()]
    columns = ["experts, threads", "hybridmoe load (imports)", "llama.cpp load (imports)"]
    _table("Load to the first token, peak RSS", [*columns, "hybridmoe RSS", "llama.cpp RSS"], rows)
    read = ", ".join(f"{fmt} {n / 1e6:.1f} MB" for fmt, n in per_token.items())
    gbps = _median([r.dram_gbps for r in _chosen(rounds)[0]])
    print(f"\nbytes read per token: {read}; DRAM read limit {gbps:.1f} GB/s (median)")
    _report_tokens(rounds)


def _load_row(label: str, rounds: list[Round]) -> str:
    """Each engine's median load to the first token, with the part of it its imports took
    (rounds recorded before import_s was: the load alone)."""
    chosen, _ = _chosen(rounds)
    load_s, import_s, rss_mib = (
        [_median([r.results[e].get(key, float("nan")) for r in chosen]) for e in ENGINES]
        for key in ("load_s", "import_s", "peak_rss_mib")
    )
    loads = (f"{s:.2f} s ({i:.2f} s)" for s, i in zip(load_s, import_s, strict=True))
    cells = [label, *loads, *(f"{m:.0f} MiB" for m in rss_mib)]
    return "| " + " | ".join(cells) + " |"


def _report_tokens(rounds: list[Round]) -> None:
    """Per round, how alike the engines' models are: the logits after the decode prompt (finite,
    largest difference relative to the largest logit) and the greedy tokens (random weights
    make near-ties, and the engines sum in other orders, so a divergence is reported, not
    failed)."""
    print()
    for r in rounds:
        ours, theirs = (r.results[e]["tokens"] for e in ENGINES)
        first = first_divergence(ours, theirs)
        same = "same greedy tokens" if first is None else f"first divergence at token {first}"
        print(f"{r.fmt}, {r.threads}t: {_logits_agreement(r)}; {same} ({len(ours)} tokens)")


def _logits_agreement(r: Round) -> str:
    if any("prompt_logits" not in r.results[e] for e in ENGINES):
        return "logits not recorded"
    ours, theirs = (np.asarray(r.results[e]["prompt_logits"]) for e in ENGINES)
    finite = [e for e, x in zip(ENGINES, (ours, theirs), strict=True) if np.isfinite(x).all()]
    if len(finite) < len(ENGINES):
        return f"LOGITS NOT FINITE (finite: {', '.join(finite) or 'neither'})"
    relative = np.abs(ours - theirs).max() / np.abs(theirs).max()
    return f"logits finite, max |difference| {100 * relative:.1f} % of max |logit|"


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first index where the token lists differ (a length difference counts), or None."""
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if first is None and len(ours) != len(theirs):
        return min(len(ours), len(theirs))
    return first


def _require_llama_cpp() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit(MISSING_LLAMA_CPP) from None


def main() -> None:
    args = parse_args()
    if not args.report:
        _require_llama_cpp()
    shape = SHAPES[args.shape]
    print(f"shape {args.shape}: {shape.total_params / 1e9:.2f} G params, "
          f"{checkpoint_bytes(shape) / 2**30:.2f} GiB bf16; {os.cpu_count()} cores")  # fmt: skip
    if args.llamacpp_no_extra_buffers:
        print("llama.cpp without its extra buffer types (no repacked or AMX weights)")
    files = ensure_files(args.shape, args.dir, tuple(args.formats))
    if args.report:
        rounds = [Round(**row) for row in json.loads(args.report.read_text())]
    else:
        warm_up(files, args)
        rounds = run_rounds(files, args)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rounds], indent=1))
    report(rounds, files, args)


if __name__ == "__main__":
    main()
