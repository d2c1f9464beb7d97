"""The engine's import leaves out what only some requests need: jinja (a chat template's first
render loads it: loader/chat_jinja.py) and llguidance (a constrained request's grammar:
engine/constraints.py). Each loads on first use and then works (the chat-template and
constraint tests check what they compute)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
import hybridmoe.engine
from hybridmoe.engine.constraints import Grammar
from hybridmoe.loader.chat_template import ChatTemplate

lazy = ("jinja2", "llguidance")
before = [m for m in lazy if m in sys.modules]
template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", "t", {})
text = template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
grammar = Grammar("json_object", "").llguidance_grammar()
after = [m for m in lazy if m in sys.modules]
print(json.dumps({"before": before, "after": after, "text": text, "grammar": bool(grammar)}))
"""


def test_jinja_and_llguidance_load_on_first_use() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] == []
    assert result["after"] == ["jinja2", "llguidance"]
    assert result["text"] == "<user>hi"
    assert result["grammar"]
