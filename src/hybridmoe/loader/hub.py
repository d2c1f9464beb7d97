"""A model named by a Hugging Face repo id, found in the local Hugging Face cache (offline).

`resolve_model("Qwen/Qwen3-30B-A3B-GGUF", "Q4_K_M")` is the cached GGUF whose file name holds
Q4_K_M; `resolve_model("Qwen/Qwen3-30B-A3B")` the cached snapshot directory. Nothing is
downloaded: a repo that is not cached is a CheckpointError saying how to download it.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.gguf import GGUF_SUFFIX, SPLIT_NAME

REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def resolve_model(model: str, gguf_file: str | None = None) -> Path:
    """The local path of `model` (a path, or a repo id in the Hugging Face cache), and of the
    GGUF `gguf_file` in it when given (a file name, or a part of one such as a quant name)."""
    path = Path(model).expanduser()
    if not path.exists():
        if not REPO_ID.match(model):
            raise CheckpointError(f"{model}: no such file or directory")
        path = _cached_snapshot(model, gguf_file)
    return path if gguf_file is None else _gguf_in(path, gguf_file)


def _cached_snapshot(repo_id: str, gguf_file: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        include = f" --include '*{gguf_file}*'" if gguf_file else ""
        raise CheckpointError(
            f"{repo_id}: no such file or directory, and no repo of that id in the local Hugging "
            f"Face cache (hybridmoe does not download); download it with: "
            f"hf download {repo_id}{include}"
        ) from None


def _gguf_in(path: Path, gguf_file: str) -> Path:
    if path.is_file():
        raise CheckpointError(f"--gguf-file {gguf_file}: {path} is a file, not a directory")
    exact = path / gguf_file
    if exact.is_file():
        return exact
    wanted = gguf_file.lower()
    found = sorted(
        f
        for f in path.rglob(f"*{GGUF_SUFFIX}")
        if wanted in f.name.lower() and (not SPLIT_NAME.match(f.name) or "-00001-of-" in f.name)
    )
    if len(found) != 1:
        names = ", ".join(str(f.relative_to(path)) for f in found) or "none"
        raise CheckpointError(
            f"--gguf-file {gguf_file}: expected one GGUF model in {path} matching it, found {names}"
        )
    return found[0]
