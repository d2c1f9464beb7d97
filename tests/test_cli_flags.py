"""The command line's flags against the config dataclasses, in-process (no model loaded): every
config field of a command is a flag or on the command's explicit allow-list, every flag sets a
field (or is one of the command's own arguments), defaults are the dataclasses' own, and a
value given on the command line reaches its field."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from hybridmoe import cli
from hybridmoe.cluster.config import ClusterConfig
from hybridmoe.engine import EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.server.config import ServerConfig

COMMANDS = sorted(cli.COMMAND_CONFIGS)
REQUIRED = {
    "generate": ["generate", "a prompt"],
    "chat": ["chat"],
    "serve": ["serve"],
    "cluster": ["cluster"],
    "trace": ["trace", "--prompts", "p.txt", "-o", "t.npz"],
}
# What users type (README, docs): a field renamed must not rename its flag silently.
ENGINE_SPELLINGS = {
    "--model", "--dtype", "--threads", "--device", "--gpu-memory", "--no-pin-memory",
    "--prefill", "--prefill-cpu-tokens", "--decode-target", "--expert-cache-slots",
    "--expert-cache-ratio", "--max-fetch", "--no-overlap", "--cpu-threads", "--expert-format",
    "--cpu-kernel", "--dense-format",
}  # fmt: skip
SAMPLING_SPELLINGS = {"--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop"}
SPELLINGS = {
    "generate": ENGINE_SPELLINGS | SAMPLING_SPELLINGS,
    "chat": ENGINE_SPELLINGS | SAMPLING_SPELLINGS | {"--system"},
    "serve": ENGINE_SPELLINGS | {"--host", "--port", "--max-seq-len", "--max-batch"},
    "cluster": ENGINE_SPELLINGS | {"--host", "--port", "--replicas", "--policy", "--worker-urls"},
    "trace": ENGINE_SPELLINGS | SAMPLING_SPELLINGS | {"--prompts", "-o"},
}
FREE_TEXT_SAMPLES = {
    "device": "cpu",
    "host": "localhost",
    "api_key": "secret",
    "api_key_file": __file__,  # any readable file whose first line is not empty
    "gguf_file": "Q4_K_M",
}  # str fields without choices
PARSED_SAMPLES = {"max_fetch": "auto"}  # fields of more than one type (FlagDoc.parse)
TUPLE_SAMPLES = {"worker_urls": ("http://a:1", "http://b:2")}  # repeatable flags checked as URLs
SERVING = ("serve", "cluster")  # commands that build a ServerConfig and decode max_batch rows


def subparser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[command]


def flag_actions(command: str) -> dict[str, argparse.Action]:
    """dest -> action of every flag and positional of `command` but --help."""
    actions = subparser(command)._actions
    return {a.dest: a for a in actions if not isinstance(a, argparse._HelpAction)}


def config_fields(command: str) -> dict[str, str]:
    """Qualified name ("Config.field") -> field name, over every config `command` builds."""
    return {
        f"{cls.__name__}.{f.name}": f.name
        for cls in cli.COMMAND_CONFIGS[command]
        for f in dataclasses.fields(cls)
    }


@pytest.mark.parametrize("command", COMMANDS)
def test_every_config_field_is_a_flag_or_allowed(command):
    dests = set(flag_actions(command))
    missing = {
        qualified
        for qualified, name in config_fields(command).items()
        if name not in dests and qualified not in cli.NOT_FLAGS[command]
    }
    assert not missing, f"`hybridmoe {command}` has no flag for {sorted(missing)}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_maps_to_a_field(command):
    names = set(config_fields(command).values())
    strays = set(flag_actions(command)) - names - set(cli.COMMAND_ARGS[command])
    assert not strays, f"`hybridmoe {command}` flags {sorted(strays)} set no config field"


@pytest.mark.parametrize("command", COMMANDS)
def test_allow_lists_name_real_fields_and_say_why(command):
    qualified = config_fields(command)
    for entry, reason in cli.NOT_FLAGS[command].items():
        assert entry in qualified, f"NOT_FLAGS[{command!r}] names no field: {entry}"
        assert qualified[entry] not in flag_actions(command), f"{entry} is a flag after all"
        assert reason.strip()
    names = set(qualified.values())
    for dest, what in cli.COMMAND_ARGS[command].items():
        assert dest in flag_actions(command) and dest not in names, dest
        assert what.strip()


@pytest.mark.parametrize("command", COMMANDS)
def test_no_field_name_is_in_two_configs_of_a_command(command):
    # One dest would set both: a value must have one source (as max_seq_len now has).
    names = list(config_fields(command).values())
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_flag_docs_name_flags():
    flags = {dest for command in COMMANDS for dest in flag_actions(command)}
    assert not set(cli.FLAG_DOCS) - flags
    assert not {n for names in cli.EXCLUSIVE_FLAGS for n in names} - flags


@pytest.mark.parametrize("command", COMMANDS)
def test_spellings_users_type_are_kept(command):
    options = {o for a in flag_actions(command).values() for o in a.option_strings}
    assert SPELLINGS[command] <= options, sorted(SPELLINGS[command] - options)


@pytest.mark.parametrize("command", COMMANDS)
def test_defaults_are_the_dataclasses_defaults(command):
    args = cli.build_parser().parse_args(REQUIRED[command])
    one_row = {} if command in SERVING else {"max_batch": 1}  # generate/chat decode one
    assert cli._engine_config(args) == EngineConfig(progress=True, **one_row)
    if command in SERVING:
        assert cli.config_from_args(ServerConfig, args) == ServerConfig()
    if command == "cluster":
        assert cli.config_from_args(ClusterConfig, args) == ClusterConfig()
    elif command != "serve":
        assert cli._sampling_params(args) == SamplingParams()


def test_choices_are_the_config_modules_constants():
    from hybridmoe.cluster import config as cluster_config
    from hybridmoe.engine import config as engine_config
    from hybridmoe.moe import config as moe_config
    from hybridmoe.server import config as server_config

    constants = [
        value
        for module in (engine_config, moe_config, server_config, cluster_config)
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, tuple)
    ]
    for command in COMMANDS:
        for action in flag_actions(command).values():
            if action.choices is not None:
                assert any(action.choices is c for c in constants), action.option_strings


def sample_value(action: argparse.Action, hint: object) -> tuple[list[str], object]:
    """A command-line value for `action` other than its default, and what its field gets."""
    option, default = action.option_strings[0], action.default
    if hint is bool:
        return [option], not default
    if typing.get_origin(hint) is tuple:
        a, b = TUPLE_SAMPLES.get(action.dest, ("a", "b"))
        return [option, a, option, b], (a, b)
    if cli.FLAG_DOCS.get(action.dest, cli.FlagDoc()).parse is not None:
        return [option, PARSED_SAMPLES[action.dest]], PARSED_SAMPLES[action.dest]
    if action.choices is not None:
        choice = next(c for c in action.choices if c != default)
        return [option, choice], choice
    kind = cli._value_type(hint)
    if kind is str:
        return [option, FREE_TEXT_SAMPLES[action.dest]], FREE_TEXT_SAMPLES[action.dest]
    value = kind(3) if default == 2 else kind(2) if kind is int else 0.5
    return [option, str(value)], value


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_reaches_its_field(command):
    actions = flag_actions(command)
    for cls in cli.COMMAND_CONFIGS[command]:
        hints = typing.get_type_hints(cls)
        for f in cli.flag_fields(cls, command):
            argv, expected = sample_value(actions[f.name], hints[f.name])
            args = cli.build_parser().parse_args(REQUIRED[command] + argv)
            config = cli.config_from_args(cls, args)
            assert getattr(config, f.name) == expected, (command, argv)


def test_expert_cache_slots_and_ratio_exclude_each_other(capsys):
    argv = ["generate", "p", "--expert-cache-slots", "2", "--expert-cache-ratio", "0.5"]
    with pytest.raises(SystemExit) as caught:
        cli.build_parser().parse_args(argv)
    assert caught.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_switches_turn_their_field_off():
    args = cli.build_parser().parse_args(["serve", "--no-overlap", "--no-pin-memory"])
    offload = cli.config_from_args(OffloadConfig, args)
    assert (offload.overlap, offload.pin_memory) == (False, False)


def test_max_fetch_takes_an_integer_or_auto(capsys):
    parse = cli.build_parser().parse_args
    assert cli.config_from_args(OffloadConfig, parse(["serve", "--max-fetch", "3"])).max_fetch == 3
    with pytest.raises(SystemExit):
        parse(["serve", "--max-fetch", "many"])
    assert "max_fetch must be an integer >= 0 or 'auto'" in capsys.readouterr().err


@pytest.mark.parametrize("command", SERVING)
def test_flags_of_gives_the_configs_back(command):
    # `hybridmoe cluster` starts each replica with flags_of(its configs): they must round-trip.
    argv = ["--max-seq-len", "128", "--no-overlap", "--max-fetch", "auto", "--cpu-threads", "1"]
    argv += ["--max-queue", "3", "--api-key", "k", "--port", "9"]
    argv += ["--allowed-hosts", "a", "--allowed-hosts", "b"] if command == "serve" else []
    args = cli.build_parser().parse_args([command, *argv])
    engine, server = cli._engine_config(args), cli.config_from_args(ServerConfig, args)
    flags = cli.flags_of(engine, "serve") + cli.flags_of(engine.offload, "serve")
    flags += cli.flags_of(server, "serve")
    again = cli.build_parser().parse_args(["serve", *flags])
    assert cli._engine_config(again) == engine
    assert cli.config_from_args(ServerConfig, again) == server
    assert cli.flags_of(EngineConfig(), "serve") == []  # defaults need no flag
    assert "--port" not in cli.flags_of(server, "serve", skip=("host", "port"))
