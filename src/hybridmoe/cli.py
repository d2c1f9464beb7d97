"""Command line: `hybridmoe generate|chat|serve|cluster` and the planning commands
`trace|plan|bench-hw`.

The planning commands live in cli_planning.py; `trace` takes the flags `generate` takes.

A command's flags are the fields of its configs (COMMAND_CONFIGS), one flag per field:
`--max-seq-len` sets EngineConfig.max_seq_len (argparse dest = the field's name), with the
field's default; a boolean field that is on by default is switched off by `--no-<name>`.
FLAG_DOCS adds help texts and the config modules' choices; NOT_FLAGS names the fields that are
deliberately no flag, and why. The configs are built from the parsed flags by field name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from hybridmoe import cli_planning
from hybridmoe.cli_chat import chat_loop
from hybridmoe.cluster.config import ROUTING_POLICIES, ClusterConfig
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.config import (
    ATTENTION_KERNELS,
    DEFAULT_MAX_SEQ_LEN,
    DENSE_FORMAT_CHOICES,
    DTYPE_CHOICES,
    PREFIX_BLOCK_TOKENS,
)
from hybridmoe.errors import HybridMoeError
from hybridmoe.kernels.compile_progress import compile_progress
from hybridmoe.moe.config import (
    ACTIVATION_QUANTS,
    CPU_KERNEL_CHOICES,
    DECODE_TARGETS,
    EXPERT_FORMATS,
    PREFILL_CHOICES,
    OffloadConfig,
    parse_max_fetch,
)
from hybridmoe.platform.base import DEVICE_HELP
from hybridmoe.server.config import REASONING_FORMAT_CHOICES, ServerConfig

COMMAND_CONFIGS: dict[str, tuple[type, ...]] = {
    "generate": (EngineConfig, OffloadConfig, SamplingParams),
    "chat": (EngineConfig, OffloadConfig, SamplingParams),
    "serve": (EngineConfig, OffloadConfig, ServerConfig),
    "cluster": (EngineConfig, OffloadConfig, ServerConfig, ClusterConfig),
    "trace": (EngineConfig, OffloadConfig, SamplingParams),
}
# Flags of a command that set no config field (dest -> what it is).
COMMAND_ARGS: dict[str, dict[str, str]] = {
    "generate": {"model": "the checkpoint to load", "prompt": "the text to complete"},
    "chat": {"model": "the checkpoint to load", "system": "the chat's system message"},
    "serve": {"model": "the checkpoint to load"},
    "cluster": {"model": "the checkpoint every replica loads"},
    "trace": {
        "model": "the checkpoint to load",
        "prompts": "a text file, one prompt per line",
        "output": "the .npz trace to write",
    },
}
# Config fields that are deliberately no flag ("Config.field" -> why), per command.
_ENGINE_NO_FLAG = {
    "EngineConfig.progress": "the command line always shows the loading progress bars",
    "EngineConfig.offload": "a nested config: OffloadConfig's own fields are the flags",
}
_DECODE_NO_FLAG = {
    **_ENGINE_NO_FLAG,
    "EngineConfig.max_batch": "requests decoded together; generate and chat decode one (1)",
    "SamplingParams.ignore_eos": "an API extension for benchmarks; the CLI stops at EOS",
    "SamplingParams.logprobs": "an API field (serve's logprobs); the CLI prints text",
    "SamplingParams.grammar": "an API field (serve's response_format and tools)",
    "SamplingParams.stop_token_ids": "set by serve's reasoning format (harmony's end tokens)",
    "SamplingParams.skip_special_tokens": "set by serve's reasoning format (harmony reads them)",
}
_SERVE_NO_FLAG = {
    **_ENGINE_NO_FLAG,
    "ServerConfig.shutdown_timeout_s": "the fixed grace README promises (5 s)",
}
NOT_FLAGS: dict[str, dict[str, str]] = {
    "generate": _DECODE_NO_FLAG,
    "chat": _DECODE_NO_FLAG,
    "trace": _DECODE_NO_FLAG,
    "serve": _SERVE_NO_FLAG,
    "cluster": {
        **_SERVE_NO_FLAG,
        "ServerConfig.allowed_hosts": "the router in front checks no Host header, and replicas "
        "see the router's (loopback): README says to set --api-key instead",
    },
}


@dataclasses.dataclass(frozen=True)
class FlagDoc:
    help: str | None = None
    choices: tuple[str, ...] | None = None  # a config module's constant, never a literal here
    parse: typing.Callable[[str], object] | None = None  # for a field of more than one type


# Help texts by field name; a switch's text says what the switch (`--no-overlap`) does.
FLAG_DOCS: dict[str, FlagDoc] = {
    "dtype": FlagDoc(choices=DTYPE_CHOICES),
    "dense_format": FlagDoc(
        "store attention, dense-MLP and shared-expert projections and the output head "
        "quantised (the head of q4_0 in q8_0); auto: as loaded",
        DENSE_FORMAT_CHOICES,
    ),
    "attention_kernel": FlagDoc(
        "CPU decode attention by one numba kernel a layer instead of torch's SDPA (10-30x "
        "faster at a long context): auto where it computes SDPA's bits (bfloat16 on a machine "
        "whose SDPA it reproduces, checked at the first decode step); on: also elsewhere "
        "(within SDPA's rounding, not its bits: greedy tokens may differ at a near-tie); off",
        ATTENTION_KERNELS,
    ),
    "gguf_file": FlagDoc(
        "the GGUF in --model's directory or Hugging Face repo: its file name or a part of it "
        "such as Q4_K_M"
    ),
    "huge_pages": FlagDoc(
        "copy a GGUF's weights onto transparent huge pages at load (Linux): faster CPU "
        "decode, the file's size in RAM instead of memory-mapped"
    ),
    "device": FlagDoc(DEVICE_HELP),
    "gpu_memory": FlagDoc(
        "GiB of device memory to use; expert slots fill what the dense weights and KV "
        "cache leave (default: the device's free memory)"
    ),
    "max_seq_len": FlagDoc(
        "KV positions per request, prompt + completion "
        f"(default: the model's context window, at most {DEFAULT_MAX_SEQ_LEN})"
    ),
    "max_batch": FlagDoc(
        "requests decoded together; each holds a KV-cache row of --max-seq-len positions"
    ),
    "prefix_cache_tokens": FlagDoc(
        "prompt tokens whose KV is kept for later requests that share a prefix, in blocks of "
        f"{PREFIX_BLOCK_TOKENS} (0 = off; default: --max-seq-len)"
    ),
    "pin_memory": FlagDoc(
        "keep expert banks in pageable host memory (slower fetches; for systems that "
        "refuse to page-lock that much)"
    ),
    "prefill": FlagDoc(
        "where prefill's routed experts run: stream layers to the accelerator, the CPU, "
        "or auto (cpu up to --prefill-cpu-tokens tokens)",
        PREFILL_CHOICES,
    ),
    "decode_target": FlagDoc("where routed experts run at decode (see README)", DECODE_TARGETS),
    "expert_cache_ratio": FlagDoc(
        "expert cache size as a share of all routed experts (default: 0.25 on the cpu "
        "device; on an accelerator, as many as --gpu-memory leaves room for)"
    ),
    "max_fetch": FlagDoc(
        "hybrid: misses fetched per layer call, or auto (balanced against the CPU per call)",
        parse=parse_max_fetch,
    ),
    "overlap": FlagDoc("hybrid: wait for the CPU before the accelerator"),
    "cpu_threads": FlagDoc("threads computing CPU experts (default: every usable core)"),
    "expert_format": FlagDoc(
        "routed experts' weight format, quantised at load (default: the model's dtype)",
        EXPERT_FORMATS,
    ),
    "activation_quant": FlagDoc(
        "q8: q8_0/q4_0 experts and dense projections quantise their input activations per "
        "32-block, q2_k ... q6_k per 256-block, and take integer dot products (llama.cpp's "
        "arithmetic; every target alike); none: float32 activations; auto: q8 where a layer's "
        "expert formats allow it, and for every dense projection in such a format",
        ACTIVATION_QUANTS,
    ),
    "cpu_kernel": FlagDoc(
        "CPU expert kernel: numba (fast) or torch (the reference)", CPU_KERNEL_CHOICES
    ),
    "temperature": FlagDoc("0 = greedy"),
    "top_k": FlagDoc("0 = off"),
    "stop": FlagDoc("stop string (repeatable)"),
    "host": FlagDoc("address to listen on (default: loopback)"),
    "port": FlagDoc("0 = any free port"),
    "api_key": FlagDoc("require 'Authorization: Bearer <key>' on /v1 requests"),
    "api_key_file": FlagDoc("read the --api-key from this file's first line (not shown by ps)"),
    "allowed_hosts": FlagDoc(
        "Host header name to accept (repeatable; '*' = any; default: the --host name, plus "
        "localhost/127.0.0.1/[::1] on loopback)"
    ),
    "max_body_bytes": FlagDoc("larger request bodies are refused with 413"),
    "max_queue": FlagDoc(
        "requests waiting for a slot beyond which new ones get 503 (default: no cap)"
    ),
    "request_timeout_s": FlagDoc("cancel a request still running after this many seconds"),
    "read_timeout_s": FlagDoc("close a connection whose request is not fully sent within this"),
    "keep_alive_timeout_s": FlagDoc("close an idle keep-alive connection after this"),
    "max_connections": FlagDoc("open connections beyond which requests get 503"),
    "reasoning_format": FlagDoc(
        "how chat replies' reasoning is split into reasoning_content: harmony (gpt-oss), think "
        "(<think>...</think>), none, or auto (by the chat template)",
        REASONING_FORMAT_CHOICES,
    ),
    "replicas": FlagDoc("`hybridmoe serve` replicas to start on this machine"),
    "policy": FlagDoc(
        "how the router spreads requests: cache_aware keeps a shared prompt prefix on one replica",
        ROUTING_POLICIES,
    ),
    "replica_base_port": FlagDoc("replica i listens on 127.0.0.1:BASE+i (0 = any free ports)"),
    "stats_port": FlagDoc("port of the cluster's /v1/stats, on --host (0 = any free port)"),
    "worker_urls": FlagDoc(
        "URL of a `hybridmoe serve` on another machine to route to as well (repeatable)"
    ),
    "health_check_interval_s": FlagDoc("seconds between the router's /health probes"),
    "restart_delay_s": FlagDoc("seconds before a replica that exited is started again"),
}
EXCLUSIVE_FLAGS = (("expert_cache_slots", "expert_cache_ratio"),)  # one cache size
C = typing.TypeVar("C")


def flag_fields(config_cls: type, command: str) -> list[dataclasses.Field]:
    """The fields of `config_cls` that are flags of `command`."""
    skipped = NOT_FLAGS[command]
    fields = dataclasses.fields(config_cls)
    return [f for f in fields if f"{config_cls.__name__}.{f.name}" not in skipped]


def _field_default(f: dataclasses.Field) -> object:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _value_type(hint: object) -> type:
    """int for `int | None`, str for `str`, ...: what a flag's text converts to."""
    types = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    if len(types) != 1 or types[0] not in (int, float, str):
        raise TypeError(f"no flag for a field of type {hint}")
    return types[0]


def _flag_type(parse: typing.Callable[[str], object]) -> typing.Callable[[str], object]:
    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _add_flag(parser: argparse._ActionsContainer, f: dataclasses.Field, hint: object) -> None:
    doc = FLAG_DOCS.get(f.name, FlagDoc())
    name, default = f.name.replace("_", "-"), _field_default(f)
    if hint is bool:  # a switch away from the default
        action = "store_false" if default else "store_true"
        option = f"--no-{name}" if default else f"--{name}"
        parser.add_argument(option, dest=f.name, action=action, default=default, help=doc.help)
    elif typing.get_origin(hint) is tuple:  # repeatable
        parser.add_argument(
            f"--{name}", dest=f.name, action="append", default=list(default), help=doc.help
        )
    else:
        parser.add_argument(
            f"--{name}",
            dest=f.name,
            type=_flag_type(doc.parse) if doc.parse else _value_type(hint),
            choices=doc.choices,
            default=default,
            help=doc.help,
        )


def _add_config_flags(parser: argparse.ArgumentParser, command: str) -> None:
    groups: dict[str, argparse._ActionsContainer] = {}
    for names in EXCLUSIVE_FLAGS:
        group = parser.add_mutually_exclusive_group()
        groups.update(dict.fromkeys(names, group))
    for config_cls in COMMAND_CONFIGS[command]:
        hints = typing.get_type_hints(config_cls)
        for f in flag_fields(config_cls, command):
            _add_flag(groups.get(f.name, parser), f, hints[f.name])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridmoe", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete a prompt, streaming the text")
    generate.add_argument("prompt")
    chat = commands.add_parser("chat", help="interactive chat using the checkpoint's template")
    chat.add_argument("--system", default=None, help="system message")
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    cluster = commands.add_parser(
        "cluster", help="replicas of `serve` behind one endpoint (needs hybridmoe[cluster])"
    )
    trace = commands.add_parser("trace", help="record the router's choices while decoding")
    trace.add_argument("--prompts", required=True, help="text file, one prompt per line")
    trace.add_argument("-o", "--output", required=True, help="the .npz trace to write")
    cli_planning.add_parsers(commands)
    for command, sub in (
        ("generate", generate),
        ("chat", chat),
        ("serve", serve),
        ("cluster", cluster),
        ("trace", trace),
    ):
        sub.add_argument(
            "--model",
            help="checkpoint: a directory, a .gguf file, or a Hugging Face repo id in the local "
            "cache (default: the embedded demo model)",
            default=None,
        )
        _add_config_flags(sub, command)
    return parser


def flags_of(config: object, command: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags of `command` that give `config` back (its flag fields that differ from their
    defaults, but those in `skip`): the inverse of config_from_args."""
    hints = typing.get_type_hints(type(config))
    argv: list[str] = []
    for f in flag_fields(type(config), command):
        value, default = getattr(config, f.name), _field_default(f)
        if f.name in skip or value == default:
            continue
        option = f"--{f.name.replace('_', '-')}"
        if hints[f.name] is bool:
            argv.append(f"--no-{f.name.replace('_', '-')}" if default else option)
        elif typing.get_origin(hints[f.name]) is tuple:
            argv += [text for item in value for text in (option, str(item))]
        elif value is None:
            raise ValueError(f"{type(config).__name__}.{f.name}=None has no flag of {command}")
        else:
            argv += [option, str(value)]
    return argv


def config_from_args(config_cls: type[C], args: argparse.Namespace, **given: object) -> C:
    """`config_cls` from the flags `args.command` parsed, by field name. `given` sets fields
    that are no flag; the others that are no flag keep their defaults."""
    values = {f.name: getattr(args, f.name) for f in flag_fields(config_cls, args.command)}
    return config_cls(**values, **given)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return config_from_args(SamplingParams, args)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    offload = config_from_args(OffloadConfig, args)
    # generate and chat decode one sequence: a KV cache (and on a GPU its planned memory) of one
    # row, not max_batch rows of max_seq_len positions
    one_row = {"max_batch": 1} if args.command in ("generate", "chat", "trace") else {}
    return config_from_args(EngineConfig, args, progress=True, offload=offload, **one_row)


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model is None:
        from hybridmoe.demo import require_demo_checkpoint

        return require_demo_checkpoint()
    return Path(args.model)


def _load_engine(args: argparse.Namespace) -> Engine:
    """The engine of the command's flags; for the commands that time a request or answer a
    person at once (generate, chat, trace) warmed up first (Engine.warm_up: a first run's
    kernel compilation shows its progress there instead of inside the first request and its
    tok/s figures, one counter for the load's and the warm-up's); `serve` warms up itself,
    while it already listens."""
    with compile_progress():
        engine = Engine.from_pretrained(_model_dir(args), _engine_config(args))
        if args.command in ("generate", "chat", "trace"):
            try:
                engine.warm_up()
            except BaseException:
                engine.close()
                raise
    return engine


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
        chat_loop(engine, args.system, params)


def run_serve(args: argparse.Namespace) -> None:
    from hybridmoe.server.run import serve  # the web stack, only when serving

    config = config_from_args(ServerConfig, args)
    model_dir = _model_dir(args)
    model_id = Path(os.path.abspath(model_dir)).name  # clients name the model by its directory
    with _load_engine(args) as engine:
        serve(engine, config, model_id)


def run_cluster(args: argparse.Namespace) -> None:
    from hybridmoe.cluster.run import run_cluster as run  # the supervisor, only when asked

    cluster, server = config_from_args(ClusterConfig, args), config_from_args(ServerConfig, args)
    engine = _engine_config(args)  # checked here, before any replica loads it
    model_dir = Path(os.path.abspath(_model_dir(args)))
    replica_flags = [
        *flags_of(engine, "serve"),
        *flags_of(engine.offload, "serve"),
        *flags_of(server, "serve", skip=("host", "port")),  # the front's; replicas: loopback
    ]
    serve_argv = [sys.executable, "-m", "hybridmoe", "serve", "--model", str(model_dir)]
    argv = serve_argv + replica_flags
    run(cluster, server.host, server.port, argv, model_dir.name, server.api_key)


def run_trace(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    with _load_engine(args) as engine:
        cli_planning.run_trace(engine, args, params)


COMMANDS = {
    "generate": run_generate,
    "chat": run_chat,
    "serve": run_serve,
    "cluster": run_cluster,
    "trace": run_trace,
}
COMMANDS.update(cli_planning.COMMANDS)  # plan, bench-hw: no engine flags


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
