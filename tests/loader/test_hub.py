"""A model named by a Hugging Face repo id resolves from the local cache only (a cache laid out
here by hand, as huggingface_hub writes it); one that is not cached says how to download it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.hub import resolve_model


def _cache(root: Path, repo_id: str, files: list[str]) -> Path:
    """The layout huggingface_hub keeps: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    for name in files:
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(b"GGUF")
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def test_repo_id_and_quant_name_resolve_from_the_cache(hub_cache: Path) -> None:
    files = ["Qwen3-Q4_K_M.gguf", "Qwen3-Q8_0.gguf", "BF16/Qwen3-BF16-00001-of-00002.gguf"]
    snapshot = _cache(hub_cache, "Org/Model-GGUF", files)
    assert resolve_model("Org/Model-GGUF", "Q4_K_M") == snapshot / "Qwen3-Q4_K_M.gguf"
    assert resolve_model("Org/Model-GGUF", "bf16") == snapshot / files[2]
    assert resolve_model("Org/Model-GGUF") == snapshot
    with pytest.raises(CheckpointError, match="matching it, found none"):
        resolve_model("Org/Model-GGUF", "Q5_K_M")


def test_repo_not_in_cache_says_how_to_download(hub_cache: Path) -> None:
    with pytest.raises(
        CheckpointError, match="no repo of that id in the local Hugging Face cache.*download"
    ):
        resolve_model("Org/Missing-GGUF", "Q4_K_M")
