"""Command line: `hybridmoe generate` and `hybridmoe chat`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.config import DTYPE_CHOICES
from hybridmoe.errors import HybridMoeError
from hybridmoe.moe.config import CPU_KERNEL_CHOICES, DECODE_TARGETS, EXPERT_FORMATS, OffloadConfig

ENGINE_DEFAULTS = EngineConfig()
OFFLOAD_DEFAULTS = OffloadConfig()
SAMPLING_DEFAULTS = SamplingParams()


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="checkpoint directory (default: the embedded demo model)", default=None
    )
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=ENGINE_DEFAULTS.dtype)
    parser.add_argument("--threads", type=int, default=ENGINE_DEFAULTS.threads)
    d = OFFLOAD_DEFAULTS
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
        help="expert cache size as a share of all routed experts",
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


def _load_engine(args: argparse.Namespace) -> Engine:
    offload = OffloadConfig(
        decode_target=args.decode_target,
        expert_cache_slots=args.expert_cache_slots,
        expert_cache_ratio=args.expert_cache_ratio,
        max_fetch=args.max_fetch,
        overlap=not args.no_overlap,
        cpu_threads=args.cpu_threads,
        expert_format=args.expert_format,
        cpu_kernel=args.cpu_kernel,
    )
    config = EngineConfig(dtype=args.dtype, threads=args.threads, progress=True, offload=offload)
    model_dir = args.model
    if model_dir is None:
        from hybridmoe.demo import demo_checkpoint_dir

        model_dir = demo_checkpoint_dir()
    return Engine.from_pretrained(model_dir, config)


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


COMMANDS = {"generate": run_generate, "chat": run_chat}


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
