"""GgufFile: one GGUF model (a single file, or a split set `-00001-of-0000N.gguf`), its metadata
and its tensors, memory-mapped (gguf_read.py parses the header; gguf-py's GGUFReader is its
reference).

Every problem with the files is a one-line CheckpointError naming the file and what is wrong:
wrong magic, an unsupported version, a truncated or corrupt file, a missing split part, a
missing or mistyped metadata key. Tensor data stays in the mapping (opened copy-on-write, so a
view handed to torch is writable without ever touching the file): every tensor of a file is a
view of one torch tensor over its whole mapping, so tensors stored back to back are adjacent
in one storage (kernels/projection.stack_rows then stacks a layer's q, k and v without a copy).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridmoe.errors import CheckpointError, UnsupportedConfigError

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # what gguf's GGUFReader reads
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")
_MISSING = object()


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the model: its ggml type name ("Q8_0", "F32", ...), its logical shape in
    numpy order (GGUF stores dims reversed), and its stored data as a torch view of the mapping
    (uint8 [..., row_bytes] for block formats, the float itself for F32/F16)."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: torch.Tensor
    path: Path


def find_gguf_files(path: Path) -> list[Path]:
    """The files of the GGUF model at `path`: a .gguf file, the first part of a split set (all
    parts then), or a directory holding exactly one such model. CheckpointError otherwise."""
    if path.is_dir():
        return find_gguf_files(_only_model_in(path))
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    split = SPLIT_NAME.match(path.name)
    if split is None:
        return [path]
    part, count = int(split["part"]), int(split["count"])
    if part != 1:
        first = path.with_name(f"{split['stem']}-00001-of-{split['count']}{GGUF_SUFFIX}")
        raise CheckpointError(f"{path} is part {part} of {count} of a split GGUF; give {first}")
    parts = [
        path.with_name(f"{split['stem']}-{i:05d}-of-{split['count']}{GGUF_SUFFIX}")
        for i in range(1, count + 1)
    ]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(
            f"{path}: split GGUF of {count} parts is missing {', '.join(missing)}"
        )
    return parts


def _only_model_in(directory: Path) -> Path:
    files = sorted(directory.glob(f"*{GGUF_SUFFIX}"))
    models = [f for f in files if not SPLIT_NAME.match(f.name) or "-00001-of-" in f.name]
    if len(models) != 1:
        found = ", ".join(f.name for f in models) or "none"
        raise CheckpointError(
            f"{directory}: expected one GGUF model, found {found}; give the .gguf file itself"
        )
    return models[0]


def is_gguf(path: Path) -> bool:
    """Whether `path` names a GGUF model: a .gguf file, or a directory of them without a
    config.json (a Hugging Face checkpoint directory)."""
    if path.is_dir():
        return not (path / "config.json").exists() and any(path.glob(f"*{GGUF_SUFFIX}"))
    return path.suffix == GGUF_SUFFIX


HUGE_PAGE_MODES = ("none", "streamed", "all")  # what GgufFile moves onto huge pages


class GgufFile:
    """The metadata (from the first part) and the tensors (of every part) of one GGUF model."""

    def __init__(self, path: str | Path, huge_pages: str = "none", progress: bool = False):
        """`huge_pages` (HUGE_PAGE_MODES): "all", every part's mapping moved onto transparent
        huge pages (loader/huge_pages.py; CheckpointError where the system cannot), a progress
        bar with `progress`; "streamed", the pages of the tensors every decode step reads
        whole, where the system has huge pages (for dense weights the host computes on:
        _move_streamed_to_huge_pages), moved by a thread of its own while the load goes on
        (wait_for_huge_pages); "none", all mapped from the file."""
        if huge_pages not in HUGE_PAGE_MODES:
            raise ValueError(f"huge_pages must be one of {HUGE_PAGE_MODES}, got {huge_pages!r}")
        self.paths = find_gguf_files(Path(path))
        self.path = self.paths[0]
        readers = [_open_reader(p) for p in self.paths]
        self.fields = readers[0].fields  # key -> GgufField
        self._check_split(readers)
        self._mover: threading.Thread | None = None
        if huge_pages == "all":
            _move_to_huge_pages(readers, self.paths, progress)
        elif huge_pages == "streamed":
            self._mover = _move_streamed_to_huge_pages(readers)
        self.tensors: dict[str, GgufTensor] = {}
        for reader, part in zip(readers, self.paths, strict=True):
            whole = torch.from_numpy(reader.mapped)  # uint8 [file bytes], one storage
            for tensor in reader.tensors:
                self.tensors[tensor.name] = _tensor(tensor, part, whole)

    def wait_for_huge_pages(self) -> None:
        """Returns once the streamed tensors' move onto huge pages is over (at once where
        none runs). Nothing else needs to wait: a move keeps every address and byte."""
        if self._mover is not None:
            self._mover.join()

    @property
    def architecture(self) -> str:
        return self.require("general.architecture", str)

    def has(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, kind: type = int, default: Any = None) -> Any:
        """Metadata `key` as `kind` (int, float, str, bool or list), `default` when absent."""
        if key not in self.fields:
            return default
        field = self.fields[key]
        value = field.value
        if kind is float and field.types == (_float32_type(),):
            value = float(str(np.float32(value)))  # the decimal the writer was given: 1e-06
        return self._typed(key, value, kind)

    def require(self, key: str, kind: type = int) -> Any:
        """Metadata `key` as `kind`; UnsupportedConfigError naming the key when it is absent."""
        value = self.get(key, kind, _MISSING)
        if value is _MISSING:
            raise UnsupportedConfigError(f"{self.path}: metadata key '{key}' is missing")
        return value

    def _typed(self, key: str, value: Any, kind: type) -> Any:
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            shown = f"{len(value)} values" if isinstance(value, list) else repr(value)
            raise UnsupportedConfigError(
                f"{self.path}: metadata key '{key}' must be {kind.__name__}, got {shown}"
            )
        return value

    def _check_split(self, readers: list) -> None:
        """For a split set: every part says it is part i of n, and they hold the tensors the
        first part counts."""
        count = len(readers)
        if count == 1 and "split.count" not in self.fields:
            return
        for i, (reader, part) in enumerate(zip(readers, self.paths, strict=True)):
            no, total = _field(reader, "split.no"), _field(reader, "split.count")
            if (no, total) != (i, count):
                raise CheckpointError(
                    f"{part}: metadata says split part {no} of {total}, its name says part "
                    f"{i + 1} of {count} (split.no counts from 0)"
                )
        expected = _field(readers[0], "split.tensors.count")
        found = sum(len(r.tensors) for r in readers)
        if expected is not None and expected != found:
            raise CheckpointError(
                f"{self.path}: split set holds {found} tensors, its metadata counts {expected}"
            )


def _float32_type():
    from gguf import GGUFValueType

    return GGUFValueType.FLOAT32


def _field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.value


def _move_to_huge_pages(readers, paths: list[Path], progress: bool) -> None:
    """Each part's mapping onto huge pages, before any tensor is made of it."""
    from tqdm import tqdm

    from hybridmoe.loader.huge_pages import huge_pages_supported, move_to_huge_pages

    if not huge_pages_supported():
        raise CheckpointError(
            "--huge-pages: this system has no transparent huge pages (Linux, with "
            "/sys/kernel/mm/transparent_hugepage/enabled not [never])"
        )
    total = sum(reader.mapped.nbytes for reader in readers)
    with tqdm(
        total=total, desc="huge pages", unit="B", unit_scale=True, disable=not progress
    ) as bar:
        for reader, path in zip(readers, paths, strict=True):
            if not move_to_huge_pages(reader.mapped, bar.update):
                raise CheckpointError(
                    f"{path}: --huge-pages: the kernel refused to move the mapping"
                )


def streamed_whole(name: str, names: set[str]) -> bool:
    """Whether a decode step reads tensor `name` whole (of a file holding `names`): every
    tensor but the routed experts' (`blk.N.ffn_*_exps.*`: a step reads the routed ones) and the
    token embeddings where an output head of its own exists (a step reads one row of them)."""
    if "_exps." in name:
        return False
    return name != "token_embd.weight" or "output.weight" not in names


def _move_streamed_to_huge_pages(readers) -> threading.Thread | None:
    """The pages of the tensors every decode step reads whole (streamed_whole: attention, the
    head, norms, routers, shared experts) moved onto huge pages, where the system has them:
    each run of such tensors in file order as one range, its whole pages (huge_pages.
    move_ranges_to_huge_pages); every page holding a routed expert's bytes stays mapped from
    the file. A copy of what the step reads anyway, RSS that was the file's pages.

    The copy runs in a thread of its own, returned (None where the system has no huge pages):
    its time (0.1-0.2 s for 164 MiB on a VM, most of it the first touch of new memory) passes
    while the load goes on. Nothing waits for it: the move keeps every address and every
    byte (mremap swaps the pages under the kernel's lock on the mapping, so a read during it
    sees the file's bytes or the copy's, the same), and the thread holds the mappings, so
    none is unmapped under it. A move that fails leaves the file's pages, as one refused."""
    from hybridmoe.loader.huge_pages import huge_pages_supported

    if not huge_pages_supported():
        return None
    names = {tensor.name for reader in readers for tensor in reader.tensors}
    moves = []  # (a part's mapping, its [start, end) byte ranges of consecutive streamed tensors)
    for reader in readers:
        base = reader.mapped.ctypes.data
        runs: list[list[int]] = []
        previous = False
        for tensor in sorted(reader.tensors, key=lambda t: t.data.ctypes.data):
            start = tensor.data.ctypes.data - base
            streamed = streamed_whole(tensor.name, names)
            if streamed and previous:
                runs[-1][1] = start + tensor.data.nbytes
            elif streamed:
                runs.append([start, start + tensor.data.nbytes])
            previous = streamed
        moves.append((reader.mapped, runs))
    mover = threading.Thread(target=_move_runs, args=(moves,), name="hybridmoe-huge-pages")
    mover.start()
    return mover


def _move_runs(moves) -> None:
    """move_ranges_to_huge_pages over each part's runs (the streamed move's thread); a
    failure is logged and leaves the mapping as it was."""
    from hybridmoe.loader.huge_pages import move_ranges_to_huge_pages

    try:
        for mapped, runs in moves:
            move_ranges_to_huge_pages(mapped, runs)
    except Exception as exc:  # noqa: BLE001  (an optimisation: the mapping stays usable)
        log.warning("dense weights left on the file's pages (huge-page move failed: %s)", exc)


def _open_reader(path: Path):
    """The GgufHeader of `path` (gguf_read), after checking magic and version first (for
    clear errors)."""
    from hybridmoe.loader.gguf_read import CorruptGguf, read_gguf  # imports gguf-py: on use

    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{path}: truncated GGUF file ({len(head)} bytes)")
    if head[:4] != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (starts with {head[:4]!r}, not b'GGUF')")
    version = int.from_bytes(head[4:], "little")
    if version not in SUPPORTED_VERSIONS:
        raise CheckpointError(
            f"{path}: GGUF version {version} is not supported (readable: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))})"
        )
    try:
        return read_gguf(path)
    except CorruptGguf as exc:
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({exc})") from exc


def _tensor(tensor, path: Path, whole: torch.Tensor) -> GgufTensor:
    """The GgufTensor of gguf_read's `tensor`: its data as a view of `whole` (the file's
    mapping as uint8), in the dtype and shape of tensor.data (the same bytes); a view of its
    own storage where its offset is no multiple of its item size (torch cannot view such
    bytes of `whole` as that dtype; numpy can)."""
    shape = tuple(reversed(tensor.dims))
    array = tensor.data
    if tensor.offset % array.itemsize:
        return GgufTensor(
            tensor.name, tensor.tensor_type.name, shape, torch.from_numpy(array), path
        )
    dtype = torch.from_numpy(array[:0]).dtype
    data = whole[tensor.offset : tensor.offset + array.nbytes].view(dtype).view(array.shape)
    return GgufTensor(tensor.name, tensor.tensor_type.name, shape, data, path)
