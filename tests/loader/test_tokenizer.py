"""Tokenizer, streaming decode and chat templates, checked against `transformers` on local files."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from hybridmoe.demo import demo_checkpoint_dir
from hybridmoe.errors import CheckpointError
from hybridmoe.loader.tokenizer import Tokenizer

# Belt and braces: every directory below is local, and nothing may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

DEMO_DIR = demo_checkpoint_dir()  # only read
TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x * 2\n",
    "  two leading spaces and trailing  ",
    "héllo wörld — naïve café",
    "emoji 😀👍🏽 and a flag 🇯🇵",
    "日本語のテキストと中文",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi 👋"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Again, in 日本語."},
]
# Exercises raise_exception, tojson with options, loop controls, namespace, dict and the special
# token variables, the way real Hub templates do.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(turns=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% if message.get('stop') %}{% break %}{% endif %}"
    "{% endfor %}"
    "{{ messages[0] | tojson }}\n"
    "{{ dict(b=2, a='ü') | tojson(indent=2, sort_keys=True) }}\n"
    "{{ {'k': [1, 2]} | tojson(separators=(',', ':')) }}\n"
    "turns={{ ns.turns }} tools={{ tools is none }}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token }}"
)


def make_checkpoint(directory: Path, config: dict | None = None, **files: str) -> Path:
    """The demo tokenizer.json plus the given tokenizer_config.json and other files (by name)."""
    directory.mkdir(exist_ok=True)
    shutil.copy(DEMO_DIR / "tokenizer.json", directory / "tokenizer.json")
    base = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    base.pop("chat_template")
    (directory / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text)
    return directory


def hf_render(directory: Path, messages: list[dict], add_generation_prompt: bool = True) -> str:
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    return hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_DIR)


@pytest.fixture(scope="module")
def hf_demo():
    return transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))


# --- encode / decode -------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(demo, hf_demo, text):
    ids = demo.encode(text)
    assert ids == hf_demo.encode(text)
    assert demo.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_and_skipped_by_default(demo):
    ids = demo.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert demo.decode(ids) == "user\nhi"


def test_demo_special_ids(demo):
    # <|im_end|> ends a chat turn (tokenizer_config.json), <|endoftext|> a text
    # (generation_config.json)
    assert demo.eos_token_ids == frozenset({0, 2})
    assert demo.pad_token_id == 0
    assert demo.bos_token_id is None
    assert demo.vocab_size == 4096


# --- incremental decoding --------------------------------------------------------------------


def stream(decoder, ids: list[int]) -> list[str]:
    return [decoder.feed(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", TEXTS + ["🇯🇵🇯🇵🇯🇵 日本語😀😀 " * 5])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_pieces_join_to_decode(demo, text, skip_special_tokens):
    ids = demo.encode(text)
    pieces = stream(demo.incremental_decoder(skip_special_tokens), ids)
    assert "".join(pieces) == demo.decode(ids, skip_special_tokens)
    assert not any("\ufffd" in piece for piece in pieces), pieces


def test_incremental_holds_back_a_split_character(demo):
    ids = demo.encode("😀")
    assert len(ids) > 1, "test needs an emoji the demo tokenizer splits across tokens"
    pieces = stream(demo.incremental_decoder(), ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and "".join(pieces) == "😀"


def test_incremental_on_random_ids_joins_to_decode(demo):
    # Random ids make invalid UTF-8 and skipped special tokens; the join must still match.
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(demo.vocab_size) for _ in range(rng.randint(0, 30))]
        pieces = stream(demo.incremental_decoder(), ids)
        assert "".join(pieces) == demo.decode(ids), ids


# --- chat templates --------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("n_messages", [1, 2, 4])
def test_demo_chat_template_matches_transformers(demo, hf_demo, add_generation_prompt, n_messages):
    messages = CONVERSATION[:n_messages]
    expected = hf_demo.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert demo.apply_chat_template(messages, add_generation_prompt) == expected


def test_feature_template_matches_transformers(tmp_path):
    config = {
        "chat_template": FEATURE_TEMPLATE,
        # Saved as AddedToken dicts, as older transformers writes them.
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
    }
    directory = make_checkpoint(tmp_path / "ckpt", config)
    messages = CONVERSATION[:3] + [{"role": "user", "content": "stop here", "stop": True}]
    messages += [{"role": "assistant", "content": "never rendered"}]
    ours = Tokenizer.from_dir(directory).apply_chat_template(messages)
    assert ours == hf_render(directory, messages)
    assert "turns=3 tools=True" in ours and "never rendered" not in ours


def test_raise_exception_reaches_the_caller(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt", {"chat_template": FEATURE_TEMPLATE})
    with pytest.raises(ValueError, match="Unknown role: tool"):
        Tokenizer.from_dir(directory).apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_list_form_picks_default(tmp_path):
    templates = [
        {"name": "tool_use", "template": "TOOLS{{ messages[0]['content'] }}"},
        {"name": "default", "template": "DEFAULT{{ messages[0]['content'] }}"},
    ]
    directory = make_checkpoint(tmp_path / "ckpt", {"chat_template": templates})
    ours = Tokenizer.from_dir(directory).apply_chat_template(CONVERSATION)
    assert ours == hf_render(directory, CONVERSATION) == "DEFAULTYou are terse."


def test_chat_template_jinja_file_wins_over_config(tmp_path):
    jinja = "{% for m in messages %}[{{ m['role'] }}]{% generation %}{{ m['content'] }}"
    jinja += "{% endgeneration %}\n{% endfor %}"
    directory = make_checkpoint(
        tmp_path / "ckpt", {"chat_template": "FROM CONFIG"}, chat_template__jinja=jinja
    )
    ours = Tokenizer.from_dir(directory).apply_chat_template(CONVERSATION)
    assert ours == hf_render(directory, CONVERSATION)
    # trim_blocks eats the newline after a block tag, as in transformers.
    assert ours.startswith("[system]You are terse.[user]")


def test_none_fields_dropped_and_messages_untouched(tmp_path):
    template = "{% for m in messages %}{{ m['role'] }}:{{ 'tool_calls' in m }};{% endfor %}"
    directory = make_checkpoint(tmp_path / "ckpt", {"chat_template": template})
    messages = [{"role": "assistant", "content": "x", "tool_calls": None}]
    ours = Tokenizer.from_dir(directory).apply_chat_template(messages)
    assert ours == hf_render(directory, messages) == "assistant:False;"
    assert messages == [{"role": "assistant", "content": "x", "tool_calls": None}]


def test_reasoning_is_visible_under_every_name(tmp_path):
    template = "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}{% endfor %}"
    directory = make_checkpoint(tmp_path / "ckpt", {"chat_template": template})
    messages = [{"role": "assistant", "content": "x", "reasoning": "because"}]
    ours = Tokenizer.from_dir(directory).apply_chat_template(messages)
    assert ours == hf_render(directory, messages) == "because|because"


def test_missing_chat_template_is_a_checkpoint_error(tmp_path):
    tokenizer = Tokenizer.from_dir(make_checkpoint(tmp_path / "ckpt"))
    assert not tokenizer.has_chat_template
    with pytest.raises(CheckpointError, match="chat_template"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_template_syntax_error_names_the_file(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt", {"chat_template": "{% for m in messages %}"})
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json 'chat_template'"):
        Tokenizer.from_dir(directory).apply_chat_template(CONVERSATION)


# --- special ids and bad files ---------------------------------------------------------------


def test_eos_ids_merge_every_source(tmp_path):
    directory = make_checkpoint(
        tmp_path / "ckpt",
        generation_config__json=json.dumps({"eos_token_id": [5, 6]}),
        config__json=json.dumps({"eos_token_id": 7}),
    )
    assert Tokenizer.from_dir(directory).eos_token_ids == frozenset({2, 5, 6, 7})


def test_missing_tokenizer_json_names_it(tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_corrupt_file_names_it(tmp_path, name):
    directory = make_checkpoint(tmp_path / "ckpt")
    (directory / name).write_text('{"model": ')
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        Tokenizer.from_dir(directory)


def test_eos_token_not_in_vocab_names_the_field(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt", {"eos_token": "</s>"})
    with pytest.raises(CheckpointError, match="tokenizer_config.json 'eos_token'"):
        Tokenizer.from_dir(directory)
