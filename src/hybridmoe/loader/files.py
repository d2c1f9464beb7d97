"""Small file readers shared by the loader modules (no torch import here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridmoe.errors import CheckpointError


def read_json_object(path: Path, required: bool = True) -> dict[str, Any]:
    """The JSON object in `path`; {} if it is absent and not required. Raises CheckpointError
    naming the file if it is required and missing, or is not a JSON object."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: file not found")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
