"""Command line: `hybridmoe generate`, `hybridmoe chat` and `hybridmoe serve`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.config import DTYPE_CHOICES
from hybridmoe.errors import HybridMoeError
from hybridmoe.moe.config import (
    CPU_KERNEL_CHOICES,
    DECODE_TARGETS,
    EXPERT_FORMATS,
    PREFILL_CHOICES,
    OffloadConfig,
)
from hybridmoe.platform.base import DEVICE_HELP
from hybridmoe.server.config import ServerConfig

ENGINE_DEFAULTS = EngineConfig()
OFFLOAD_DEFAULTS = OffloadConfig()
SAMPLING_DEFAULTS = SamplingParams()
SERVER_DEFAULTS = ServerConfig()


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="checkpoint directory (default: the embedded demo model)", default=None
    )
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=ENGINE_DEFAULTS.dtype)
    parser.add_argument("--threads", type=int, default=ENGINE_DEFAULTS.threads)
    parser.add_argument("--device", default=ENGINE_DEFAULTS.device, help=DEVICE_HELP)
    parser.add_argument(
        "--gpu-memory",
        type=float,
        default=ENGINE_DEFAULTS.gpu_memory,
        help="GiB of device memory to use; expert slots fill what the dense weights and KV "
        "cache leave (default: the device's free memory)",
    )
    d = OFFLOAD_DEFAULTS
    parser.add_argument(
        "--no-pin-memory",
        action="store_true",
        help="keep expert banks in pageable host memory (slower fetches; for systems that "
        "refuse to page-lock that much)",
    )
    parser.add_argument(
        "--prefill",
        choices=PREFILL_CHOICES,
        default=d.prefill,
        help="where prefill's routed experts run: stream layers to the accelerator, the CPU, "
        "or auto (cpu up to --prefill-cpu-tokens tokens)",
    )
    parser.add_argument("--prefill-cpu-tokens", type=int, default=d.prefill_cpu_tokens)
    parser.add_argument(
        "--decode-target",
        choices=DECODE_TARGETS,
        default=d.decode_target,
        help="where routed experts run at decode (see README)",
    )
    slots = parser.add_mutually_exclusive_group()
    slots.add_argument("--expert-cache-slots", type=int, default=d.expert_cache_slots)
    slots.add_argument(
        "--expert-cache-ratio",
        type=float,
        default=d.expert_cache_ratio,
        help="expert cache size as a share of all routed experts (default: 0.25 on the cpu "
        "device; on an accelerator, as many as --gpu-memory leaves room for)",
    )
    parser.add_argument(
        "--max-fetch", type=int, default=d.max_fetch, help="hybrid: misses fetched per layer"
    )
    parser.add_argument(
        "--no-overlap", action="store_true", help="hybrid: wait for the CPU before the accelerator"
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=d.cpu_threads,
        help="threads computing CPU experts (default: every usable core)",
    )
    parser.add_argument(
        "--expert-format",
        choices=EXPERT_FORMATS,
        default=d.expert_format,
        help="routed experts' weight format, quantised at load (default: the model's dtype)",
    )
    parser.add_argument(
        "--cpu-kernel",
        choices=CPU_KERNEL_CHOICES,
        default=d.cpu_kernel,
        help="CPU expert kernel: numba (fast) or torch (the reference)",
    )


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    d = SAMPLING_DEFAULTS
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=d.top_p)
    parser.add_argument("--top-k", type=int, default=d.top_k, help="0 = off")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    d = SERVER_DEFAULTS
    parser.add_argument("--host", default=d.host, help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=d.port, help="0 = any free port")
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=d.max_seq_len,
        help="KV positions per request, prompt + completion "
        "(default: the model's context window, at most 4096)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=ENGINE_DEFAULTS.max_batch,
        help="requests decoded together; each holds a KV-cache row of --max-seq-len positions",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridmoe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete a prompt, streaming the text")
    generate.add_argument("prompt")
    chat = commands.add_parser("chat", help="interactive chat using the checkpoint's template")
    chat.add_argument("--system", default=None, help="system message")
    for sub in (generate, chat):
        _add_engine_flags(sub)
        _add_sampling_flags(sub)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_engine_flags(serve)
    _add_server_flags(serve)
    return parser


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _engine_config(
    args: argparse.Namespace,
    max_batch: int = ENGINE_DEFAULTS.max_batch,
    max_seq_len: int | None = None,
) -> EngineConfig:
    offload = OffloadConfig(
        decode_target=args.decode_target,
        expert_cache_slots=args.expert_cache_slots,
        expert_cache_ratio=args.expert_cache_ratio,
        max_fetch=args.max_fetch,
        overlap=not args.no_overlap,
        cpu_threads=args.cpu_threads,
        expert_format=args.expert_format,
        cpu_kernel=args.cpu_kernel,
        pin_memory=not args.no_pin_memory,
        prefill=args.prefill,
        prefill_cpu_tokens=args.prefill_cpu_tokens,
    )
    return EngineConfig(
        dtype=args.dtype,
        threads=args.threads,
        max_batch=max_batch,
        progress=True,
        offload=offload,
        device=args.device,
        gpu_memory=args.gpu_memory,
        max_seq_len=max_seq_len,
    )


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model is None:
        from hybridmoe.demo import require_demo_checkpoint

        return require_demo_checkpoint()
    return Path(args.model)


def _load_engine(
    args: argparse.Namespace,
    max_batch: int = ENGINE_DEFAULTS.max_batch,
    max_seq_len: int | None = None,
) -> Engine:
    config = _engine_config(args, max_batch, max_seq_len)
    return Engine.from_pretrained(_model_dir(args), config)


def _stream(engine: Engine, prompt: str | list[int], params: SamplingParams) -> str:
    pieces = []
    for piece in engine.stream(prompt, params):
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(engine.stats.summary(), file=sys.stderr)
    return "".join(pieces)


def run_generate(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    with _load_engine(args) as engine:
        _stream(engine, args.prompt, params)


def run_chat(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    with _load_engine(args) as engine:
        _chat_loop(engine, args, params)


def _chat_loop(engine: Engine, args: argparse.Namespace, params: SamplingParams) -> None:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: type a message, /exit or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if user.strip() in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": user})
        prompt = engine.require_tokenizer().apply_chat_template(messages)
        # the template already holds every special token the model expects
        reply = _stream(engine, engine.encode(prompt, add_special_tokens=False), params)
        messages.append({"role": "assistant", "content": reply})


def run_serve(args: argparse.Namespace) -> None:
    from hybridmoe.server.run import serve  # the web stack, only when serving

    config = ServerConfig(host=args.host, port=args.port, max_seq_len=args.max_seq_len)
    model_dir = _model_dir(args)
    model_id = Path(os.path.abspath(model_dir)).name  # clients name the model by its directory
    with _load_engine(args, args.max_batch, args.max_seq_len) as engine:
        serve(engine, config, model_id)


COMMANDS = {"generate": run_generate, "chat": run_chat, "serve": run_serve}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (HybridMoeError, ValueError) as exc:
        print(f"hybridmoe: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
