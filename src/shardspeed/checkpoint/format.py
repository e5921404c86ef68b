"""The checkpoint format: a JSON manifest plus safetensors files, read by byte range, never unpickled.

A tag directory holds `manifest.json` and one `rank<R>.safetensors` per writing rank. The manifest
lists every logical tensor (a parameter's fp32 value, an optimizer state, a buffer, a client tensor)
with its shape and dtype and the pieces that hold it: each piece is a run of `length` elements of
the flattened tensor, from element `start`, stored in `file` at absolute byte `offset`. Each file
is also described by its size and a CRC-32 per `chunk_bytes` block, so a reader checks exactly the
blocks it reads and `verify` checks them all. The manifest carries a sha256 of its own canonical
JSON (`checksum`), and `checkpoint_problems` validates every field a reader uses before anything is
read: load, inspect, consolidate and `verify` all go through it. See docs/checkpoint-format.md.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import struct
import weakref
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("shardspeed")

FORMAT = "shardspeed-checkpoint"
# Version 2 manifests carry `checksum`. Version 1 ones (written before it existed) are still read,
# with a warning, their fields validated like any other's.
VERSION = 2
UNCHECKSUMMED_VERSION = 1
UNCHECKSUMMED_WARNING = (
    "written by an earlier shardspeed, without a checksum: its fields are valid, but an edit of "
    "their values cannot be detected; save the state again to add one"
)
MANIFEST = "manifest.json"
# Derived from the manifest at save, so that a loading rank reads its share of it by offset.
INDEX = "index.jsonl"
INDEX_FORMAT = "shardspeed-checkpoint-index"
CHECKSUM = "checksum"
CHUNK_BYTES = 4 << 20

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked; the message names the file or tag."""


# Bytes this process read of checkpoint files, by file name (manifest, index, tensor files): the
# measure of what a rank's load costs, read as `comm_volume` is for collectives.
_bytes_read: Counter = Counter()


def bytes_read() -> dict[str, int]:
    """Bytes read of each checkpoint file (by name) since `reset_bytes_read`."""
    return dict(_bytes_read)


def reset_bytes_read() -> None:
    _bytes_read.clear()


# -- writing --------------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensor_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write `tensors` as one safetensors file, fsync it, and describe it for the manifest.

    Returns {"bytes", "chunk_bytes", "crc32": [...], "tensors": {key: (absolute byte offset, dtype)}}.
    """
    from safetensors.torch import save_file

    if any(t.device.type == "meta" for t in tensors.values()):
        _write_with_holes(path, tensors)
    else:
        save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    header, data_start = read_header(path)
    crcs = []
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            crcs.append(zlib.crc32(block))
    return {
        "bytes": path.stat().st_size,
        "chunk_bytes": CHUNK_BYTES,
        "crc32": crcs,
        "tensors": {
            key: (data_start + entry["data_offsets"][0], entry["dtype"])
            for key, entry in header.items()
            if key != "__metadata__"
        },
    }


def _write_with_holes(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A dry run's file (`shardspeed.planning`, on meta tensors): the safetensors header a real
    save writes, host tensors' bytes (RNG states, scalars), and a hole (no disk used) where each
    meta tensor's bytes would be, so that the file has its real size and layout."""
    entries, end = {}, 0
    for key, t in sorted(tensors.items()):
        size = t.numel() * t.element_size()
        entries[key] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [end, end + size],
        }
        end += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors aligns the data to 8 bytes
    start = 8 + len(header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for key, t in sorted(tensors.items()):
            if t.device.type != "meta" and t.numel():
                f.seek(start + entries[key]["data_offsets"][0])
                f.write(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
        f.truncate(start + end)


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON next to `path`, fsync, and rename over it: readers see the old or the new file."""
    _write_atomic(path, json.dumps(value, indent=1, sort_keys=True).encode())


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """ "sha256:<hex>" of the manifest's canonical JSON (sorted keys, no spaces), less `checksum`."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write `directory/manifest.json` atomically with its checksum, taken over the JSON a reader
    will parse (tuples become lists, dict keys strings), so the reader computes the same; and,
    before it, the index derived from that JSON (`manifest_index`)."""
    value = json.loads(json.dumps(manifest))
    value[CHECKSUM] = manifest_checksum(value)
    _write_atomic(directory / INDEX, manifest_index(value))
    write_json_atomic(directory / MANIFEST, value)


def rank_of_file(name: str) -> int | None:
    """The saving rank of a file named `rank<R>.safetensors` (or a later part of it,
    `rank<R>-<i>.safetensors`), else None."""
    stem = name.split(".")[0].split("-")[0]
    return int(stem[4:]) if stem.startswith("rank") and stem[4:].isdigit() else None


# The index's tables, in file order after its first line; each row is one JSON value padded with
# spaces to the table's width, so that row i lies at a known offset.
_TABLES = ("ranks", "files", "pieces")


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def manifest_index(manifest: dict[str, Any]) -> bytes:
    """`index.jsonl` of a manifest (as parsed): what one rank of a load reads, by offset, instead
    of the whole manifest, whose `files`, `ranks` and pieces grow with the world.

    Line 1: `{"format", "tables": {table: [rows, row bytes]}, "manifest": ...}`, the manifest less
    `checksum`, `files` and `ranks`, each tensor with `rows` ([first, count] of its pieces) in
    place of `pieces`. Then the tables, each row a fixed-width line: `ranks` (per saving rank its
    entry of `ranks`, or null, and the rows of its files), `files` (`[name, bytes, chunk_bytes, crc32]`, by name) and
    `pieces` (`[file row, byte offset, start, length]`, by tensor name then start, empty ones
    left out). A function of the manifest alone, so that a reader can check an index is its own.
    """
    names = sorted(manifest["files"])
    file_rows = {name: i for i, name in enumerate(names)}
    rows: dict[str, list[Any]] = {
        "files": [
            [n, *(manifest["files"][n][k] for k in ("bytes", "chunk_bytes", "crc32"))]
            for n in names
        ],
        "ranks": [],
        "pieces": [],
    }
    owned: dict[int, list[int]] = {}
    for name in names:
        owned.setdefault(rank_of_file(name), []).append(file_rows[name])
    # A rank's files hold its RNG tensors, and rank 0's the shared state's: a row for each rank
    # with RNG states, and for rank 0 (an imported checkpoint has its files and no RNG states).
    states = manifest["ranks"]
    for r in range(max(len(states), 1 if 0 in owned else 0)):
        rows["ranks"].append(
            {"entry": states[r] if r < len(states) else None, "files": owned.get(r, [])}
        )
    tensors = {}
    for name in sorted(manifest["tensors"]):
        entry = manifest["tensors"][name]
        pieces = sorted((p for p in entry["pieces"] if p[3]), key=lambda p: p[2])
        tensors[name] = {k: v for k, v in entry.items() if k != "pieces"}
        tensors[name]["rows"] = [len(rows["pieces"]), len(pieces)]
        rows["pieces"] += [[file_rows[p[0]], p[1], p[2], p[3]] for p in pieces]
    skipped = (CHECKSUM, "files", "ranks", "tensors")
    body = {k: v for k, v in manifest.items() if k not in skipped}
    tables, lines = {}, []
    for table in _TABLES:
        texts = [_compact(row) for row in rows[table]]
        width = max(map(len, texts), default=0) + 1
        tables[table] = [len(texts), width]
        lines += [text.ljust(width - 1) + "\n" for text in texts]
    head = {"format": INDEX_FORMAT, "tables": tables, "manifest": {**body, "tensors": tensors}}
    return (_compact(head) + "\n" + "".join(lines)).encode()


def index_checksum(head: bytes) -> str:
    """What the ranks of a load compare: "sha256:<hex>" of the index's first line."""
    return "sha256:" + hashlib.sha256(head).hexdigest()


STALE_INDEX_WARNING = (
    f"does not match {MANIFEST} (the manifest was edited after the save?): every rank of a load "
    f"reads the whole {MANIFEST} instead; save the state again to write a matching index"
)


def check_index(
    path: Path, manifest: dict[str, Any], warn: Callable[[str], None] = logger.warning
) -> str | None:
    """The checksum of tag directory `path`'s index when it is the one its validated `manifest`
    gives, else None: there is none (written before indexes existed), or it does not match (the
    manifest was edited after the save), which is passed to `warn`; a load then reads the
    manifest on every rank."""
    try:
        stored = (path / INDEX).read_bytes()
    except FileNotFoundError:
        return None
    _bytes_read[INDEX] += len(stored)
    expected = manifest_index(manifest)
    if stored != expected:
        warn(f"{path / INDEX} {STALE_INDEX_WARNING}")
        return None
    return index_checksum(expected[: expected.index(b"\n") + 1])


# -- reading --------------------------------------------------------------------------------------


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the absolute byte where its data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: truncated (no safetensors header)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise CheckpointError(f"{path}: corrupt safetensors header (length {size})")
        text = f.read(size)
    try:
        return json.loads(text), 8 + size
    except ValueError as err:
        raise CheckpointError(f"{path}: corrupt safetensors header ({err})") from err


@dataclass(frozen=True)
class Piece:
    """`length` elements of a flattened logical tensor from element `start`, at `offset` in `file`."""

    file: str
    offset: int
    start: int
    length: int
    dtype: str

    def to_json(self) -> list:
        return [self.file, self.offset, self.start, self.length, self.dtype]

    @classmethod
    def from_json(cls, value: list) -> Piece:
        return cls(*value)


def tensor_file(directory: Path, name: Any) -> Path:
    """`directory/name` for a file name read from a manifest or index, refused (naming it) unless it
    is one plain name of a file inside `directory`: no `..`, no absolute path, no separator, no
    symbolic link leading out."""
    plain = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )
    path = directory / name if plain else None
    if path is None or (
        path.exists() and Path(os.path.realpath(path)).parent != Path(os.path.realpath(directory))
    ):
        raise CheckpointError(
            f"{directory}: file name {name!r} does not name a file inside the checkpoint directory "
            "(refused: a checkpoint reads only its own files)"
        )
    return path


def check_tag_name(name: str, root: Path, what: str | None = None) -> None:
    """Refuse a tag (or what `latest` names) that is not one directory name inside `root`."""
    if name in ("", ".", "..") or "/" in name or os.sep in name or "\0" in name:
        what = what or f"tag '{name}'"
        raise CheckpointError(
            f"{what} is not a directory inside {root}: a checkpoint tag is one directory name "
            "(not empty, '.' or '..', and no '/')"
        )


def _size_mismatch(path: Path, size: int, expected: int) -> str:
    return f"{path}: {size} bytes, the manifest says {expected} (truncated or replaced)"


def _crc_mismatch(path: Path, start: int, end: int) -> str:
    return f"{path}: checksum mismatch in bytes {start}..{end} (the file is corrupt)"


class ByteReader:
    """Reads byte ranges of the files of one directory, checking each CRC-32 block it touches."""

    def __init__(self, directory: Path, files: dict[str, dict[str, Any]] | None) -> None:
        self.directory = directory
        self.files = files  # None: no checksums (a foreign file, such as a Hugging Face export)
        self._checked: set[tuple[str, int]] = set()
        self._sizes_checked: set[str] = set()
        self._paths: dict[str, Path] = {}
        self._headers: dict[str, tuple[dict[str, Any], int]] = {}

    def path(self, name: str) -> Path:
        if name not in self._paths:
            if self.files is not None and name not in self.files:
                raise CheckpointError(f"{self.directory / MANIFEST}: file {name!r} is not listed")
            self._paths[name] = tensor_file(self.directory, name)
        return self._paths[name]

    def header(self, name: str) -> tuple[dict[str, Any], int]:
        """File `name`'s safetensors header (its blocks checked) and the byte where data starts."""
        if name not in self._headers:
            (size,) = struct.unpack("<Q", self._read(name, 0, 8))
            if size > 100 << 20:
                raise CheckpointError(
                    f"{self.path(name)}: corrupt safetensors header (length {size})"
                )
            try:
                header = json.loads(self._read(name, 8, size))
            except ValueError as err:
                raise CheckpointError(
                    f"{self.path(name)}: corrupt safetensors header ({err})"
                ) from err
            if not isinstance(header, dict):
                raise CheckpointError(f"{self.path(name)}: corrupt safetensors header")
            self._headers[name] = header, 8 + size
        return self._headers[name]

    def read(self, name: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of file `name`: tensor data (headers are read apart,
        so what a rank reads of tensors can be counted here)."""
        return self._read(name, offset, length)

    def _read(self, name: str, offset: int, length: int) -> bytes:
        path = self.path(name)
        if not path.exists():
            raise CheckpointError(f"{path}: missing")
        _bytes_read[name] += length
        if self.files is None:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
            if len(data) != length:
                raise CheckpointError(
                    f"{path}: truncated (wanted bytes {offset}..{offset + length})"
                )
            return data
        info = self.files[name]
        if name not in self._sizes_checked:
            size = path.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(_size_mismatch(path, size, info["bytes"]))
            self._sizes_checked.add(name)
        chunk = info["chunk_bytes"]
        first, last = offset // chunk, (offset + length - 1) // chunk
        if all((name, i) in self._checked for i in range(first, last + 1)):
            # Blocks are checked once, when first read whole; later reads take just their bytes.
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(length)
        with open(path, "rb") as f:
            f.seek(first * chunk)
            blocks = f.read((last - first + 1) * chunk)
        for i in range(first, last + 1):
            if (name, i) in self._checked:
                continue
            block = blocks[(i - first) * chunk : (i - first + 1) * chunk]
            if zlib.crc32(block) != info["crc32"][i]:
                raise CheckpointError(_crc_mismatch(path, i * chunk, i * chunk + len(block)))
            self._checked.add((name, i))
        start = offset - first * chunk
        return blocks[start : start + length]


def verify_files(directory: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Every problem with the files of a tag: missing, wrong size, or a block whose CRC differs
    (`files` as validated by `checkpoint_problems`)."""
    problems = []
    for name, info in sorted(files.items()):
        path = directory / name
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        if path.stat().st_size != info["bytes"]:
            problems.append(_size_mismatch(path, path.stat().st_size, info["bytes"]))
            continue
        with open(path, "rb") as f:
            for i, expected in enumerate(info["crc32"]):
                block = f.read(info["chunk_bytes"])
                if zlib.crc32(block) != expected:
                    start = i * info["chunk_bytes"]
                    problems.append(_crc_mismatch(path, start, start + len(block)))
    return problems


@dataclass(frozen=True)
class Split:
    """How a tensor-parallel parameter is cut: along `dim`, into `parts` ranks' pieces, each of
    which holds its 1/parts of each of `stride` equal sub-blocks (a fused q|k|v weight: 3)."""

    dim: int
    parts: int
    stride: int = 1

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's piece, in rank order."""
        blocks = [p.chunk(self.stride, self.dim) for p in pieces]
        return torch.cat([b[j] for j in range(self.stride) for b in blocks], self.dim)

    def piece(self, whole: torch.Tensor, index: int) -> torch.Tensor:
        """Rank `index`'s piece of the whole tensor."""
        blocks = whole.chunk(self.stride, self.dim)
        return torch.cat([b.chunk(self.parts, self.dim)[index] for b in blocks], self.dim)

    def whole_shape(self, piece_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(piece_shape)
        shape[self.dim] *= self.parts
        return tuple(shape)


class TensorSource:
    """Logical tensors assembled from pieces; `read(name, start, length)` reads only what it needs.

    A tensor saved by tensor-parallel ranks is stored as one logical tensor per rank's piece;
    `splits` (`{name: {"dim", "stride", "parts": [piece names]}}`) makes the whole one readable
    under its own name, joined on first read.
    """

    def __init__(
        self,
        reader: ByteReader,
        tensors: dict[str, dict[str, Any]],
        splits: dict[str, dict[str, Any]] | None = None,
        pieces: Callable[[str, int, int], list[list[Any]]] | None = None,
    ) -> None:
        """`pieces(name, start, length)`: the pieces of `name` holding those elements (from an
        index); without it, `tensors` lists every tensor's pieces."""
        self.reader = reader
        self._pieces = pieces or (lambda name, start, length: self.tensors[name]["pieces"])
        self.tensors = dict(tensors)
        self.splits: dict[str, tuple[Split, list[str]]] = {}
        for name, info in (splits or {}).items():
            split = Split(info["dim"], len(info["parts"]), info["stride"])
            self.splits[name] = (split, info["parts"])
            first = tensors[info["parts"][0]]
            self.tensors[name] = {
                "shape": list(split.whole_shape(tuple(first["shape"]))),
                "dtype": first["dtype"],
            }
        self._joined: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.tensors if n.startswith(prefix)]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.tensors[name]["dtype"]]

    def whole(self, name: str) -> torch.Tensor:
        """The tensor `name` entire, joined from its pieces when it was saved split (cached)."""
        if name not in self.splits:
            return self.read_whole(name)
        if name not in self._joined:
            split, parts = self.splits[name]
            self._joined[name] = split.join([self.read_whole(p) for p in parts])
        return self._joined[name]

    def read_piece(
        self, name: str, split: Split | None, index: int, start: int, length: int
    ) -> torch.Tensor:
        """Elements [start, start + length) of rank `index`'s piece of `name` under `split`
        (the whole tensor with None), whatever split it was saved with."""
        if split is None and name not in self.splits:
            return self.read(name, start, length)
        key = f"{name}#{split}#{index}"
        if key not in self._joined:
            whole = self.whole(name)
            self._joined[key] = (whole if split is None else split.piece(whole, index)).reshape(-1)
        return self._joined[key][start : start + length]

    def numel(self, name: str) -> int:
        return int(torch.Size(self.shape(name)).numel())

    def read(self, name: str, start: int = 0, length: int | None = None) -> torch.Tensor:
        """Elements [start, start + length) of the flattened tensor `name`, in its stored dtype."""
        if name not in self.tensors:
            raise CheckpointError(f"the checkpoint has no tensor '{name}'")
        if name in self.splits:
            length = self.numel(name) - start if length is None else length
            return self.whole(name).reshape(-1)[start : start + length]
        entry = self.tensors[name]
        length = self.numel(name) - start if length is None else length
        dtype = DTYPES[entry["dtype"]]
        out = torch.empty(length, dtype=dtype)
        filled = 0
        for piece in map(Piece.from_json, self._pieces(name, start, length)):
            lo, hi = max(start, piece.start), min(start + length, piece.start + piece.length)
            if lo >= hi:
                continue
            stored = DTYPES[piece.dtype]
            size = stored.itemsize
            data = self.reader.read(
                piece.file, piece.offset + (lo - piece.start) * size, (hi - lo) * size
            )
            values = torch.frombuffer(bytearray(data), dtype=stored)
            out[lo - start : hi - start] = values.to(dtype)
            filled += hi - lo
        if filled != length:
            raise CheckpointError(
                f"the checkpoint's pieces of '{name}' cover {filled} of the {length} elements asked for"
            )
        return out

    def read_whole(self, name: str) -> torch.Tensor:
        return self.read(name).view(self.shape(name))


class StoredTensors:
    """Tensors stored whole under their own key in some file of a tag (client state, RNG states).
    Headers are read as keys are looked for, the files in `first` before the others, so a reader
    that names where its keys are reads no other file's header."""

    def __init__(self, reader: ByteReader, first: Sequence[str] = ()) -> None:
        self.reader = reader
        listed = list(reader.files or {})
        self._unread = [*(n for n in first if n in listed), *(n for n in listed if n not in first)]
        self._where: dict[str, tuple[str, int, dict[str, Any]]] = {}

    def get(self, key: str) -> torch.Tensor:
        while key not in self._where and self._unread:
            name = self._unread.pop(0)
            header, start = self.reader.header(name)
            for k, entry in header.items():
                if k != "__metadata__":
                    self._where.setdefault(k, (name, start, entry))
        if key not in self._where:
            raise CheckpointError(f"{self.reader.directory}: no stored tensor '{key}'")
        name, start, entry = self._where[key]
        lo, hi = entry["data_offsets"]
        data = self.reader.read(name, start + lo, hi - lo) if hi > lo else b""
        flat = torch.frombuffer(bytearray(data), dtype=DTYPES[entry["dtype"]]) if data else None
        if flat is None:
            return torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
        return flat.view(entry["shape"])


class ManifestIndex:
    """A tag's `index.jsonl` (`manifest_index`) as one rank of a load reads it: the first line
    (the manifest's part that does not grow with the world), then only the rows it asks for, by
    offset. `files` fills with the files of the rows read, for the `ByteReader`. Trusted as the
    manifest rank 0 validated once its first line's checksum equals rank 0's."""

    def __init__(self, path: Path) -> None:
        self.path = path / INDEX
        self._fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)
        head = b""
        while not head.endswith(b"\n"):
            block = os.pread(self._fd, 4096, len(head))
            _bytes_read[INDEX] += len(block)
            if not block:
                raise CheckpointError(f"{self.path}: truncated (no first line)")
            head += block[: block.find(b"\n") + 1 or len(block)]
        self.checksum = index_checksum(head)
        value = json.loads(head)
        self.manifest: dict[str, Any] = value["manifest"]
        self._tables, offset = {}, len(head)
        for table in _TABLES:
            rows, width = value["tables"][table]
            self._tables[table] = (offset, rows, width)
            offset += rows * width
        self._rows: dict[tuple[str, int], Any] = {}
        self._file_names: dict[int, str] = {}
        self.files: dict[str, dict[str, Any]] = {}

    def _row(self, table: str, i: int) -> Any:
        if (table, i) not in self._rows:
            offset, _, width = self._tables[table]
            data = os.pread(self._fd, width, offset + i * width)
            _bytes_read[INDEX] += len(data)
            self._rows[table, i] = json.loads(data)
        return self._rows[table, i]

    def _file(self, row: int) -> str:
        if row not in self._file_names:
            name, size, chunk, crcs = self._row("files", row)
            self.files[name] = {"bytes": size, "chunk_bytes": chunk, "crc32": crcs}
            self._file_names[row] = name
        return self._file_names[row]

    def rank(self, rank: int) -> tuple[dict[str, Any] | None, list[str]]:
        """What saving rank `rank` left: its entry of the manifest's `ranks` (None when the
        save had fewer ranks) and the names of its files."""
        if rank >= self._tables["ranks"][1]:
            return None, []
        row = self._row("ranks", rank)
        return row["entry"], [self._file(i) for i in row["files"]]

    def pieces(self, name: str, start: int, length: int) -> list[list[Any]]:
        """The pieces of tensor `name` that hold elements [start, start + length): its rows
        (sorted by start, covering it once) searched from where an even split puts `start`,
        so a regular layout costs a row or two whatever the number of rows."""
        entry = self.manifest["tensors"][name]
        first, count = entry["rows"]
        if not count or not length:
            return []
        numel = math.prod(entry["shape"])
        lo, hi = 0, count  # the row holding `start` lies in [lo, hi)
        i, probes = min(count - 1, start * count // max(numel, 1)), 0
        while True:
            _, _, begin, size = self._row("pieces", first + i)
            if begin > start:
                hi = i
            elif begin + size <= start:
                lo = i + 1
            else:
                break
            if lo >= hi:
                return []
            probes += 1
            # The neighbour first (an even split is off by one at most), then halves.
            i = (hi - 1 if begin > start else lo) if probes == 1 else (lo + hi) // 2
        found = []
        while i < count and (row := self._row("pieces", first + i))[2] < start + length:
            found.append([self._file(row[0]), row[1], row[2], row[3], entry["dtype"]])
            i += 1
        return found


# -- the manifest, validated ----------------------------------------------------------------------

_NONE = type(None)
_JSON_TYPES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    dict: "an object",
    list: "a list",
    _NONE: "null",
    object: "a value",
}
# Every section a reader uses, with its JSON type.
_SECTIONS: dict[str, tuple[type, ...]] = {
    "format": (str,),
    "version": (int,),
    "tag": (str,),
    "written_by": (dict,),
    "aliases": (dict,),
    "files": (dict,),
    "tensors": (dict,),
    "splits": (dict,),
    "ranks": (list,),
    "optimizer": (dict,),
    "loss_scaler": (dict,),
    "lr_scheduler": (dict, _NONE),
    "counters": (dict,),
    "data_loader": (dict, _NONE),
    "client_state": (object,),
}
_WRITTEN_BY = {
    "world_size": int,
    "dp_world_size": int,
    "zero_stage": int,
    "model_dtype": str,
    "exclude_frozen_parameters": bool,
}
# A load sets these engine attributes from `counters`; nothing else may be named there.
COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps", "_first_micro_step")
_DYNAMIC_SCALER = {
    "cur_scale": float,
    "cur_iter": int,
    "last_overflow_iter": int,
    "cur_hysteresis": int,
}
_DATA_LOADER = {"epoch": int, "passes": int, "samples_consumed": int, "in_pass": bool}


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    """isinstance for JSON values: a bool is no int, an int is a float."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds or object in kinds
    return any(
        isinstance(value, int | float) if k is float else isinstance(value, k) for k in kinds
    )


def _count(value: Any) -> bool:
    return _is(value, int) and value >= 0


def parse_manifest(path: Path) -> Any:
    """The JSON of tag directory `path`'s manifest, not yet validated."""
    file = path / MANIFEST
    try:
        text = file.read_bytes()
        _bytes_read[MANIFEST] += len(text)
        return json.loads(text)
    except FileNotFoundError as err:
        raise CheckpointError(f"{file}: missing (no checkpoint there)") from err
    except ValueError as err:
        raise CheckpointError(
            f"{file}: not JSON ({err}): the manifest is corrupt; load another tag"
        ) from err


class _Problems:
    """Problems found in one manifest, each naming the manifest file and the field."""

    def __init__(self, path: Path) -> None:
        self.file = path / MANIFEST
        self.lines: list[str] = []

    def add(self, field: str, message: str) -> None:
        self.lines.append(f"{self.file}: {field}: {message}")

    def typed(self, field: str, value: Any, kind: type | tuple[type, ...]) -> bool:
        if _is(value, kind):
            return True
        kinds = kind if isinstance(kind, tuple) else (kind,)
        names = " or ".join(_JSON_TYPES[k] for k in kinds)
        self.add(field, f"is {json.dumps(value)[:60]}, not {names}")
        return False


def checkpoint_problems(path: Path, manifest: Any, every_block: bool = False) -> list[str]:
    """Everything wrong with the checkpoint in tag directory `path` whose manifest is `manifest`.

    The one validation that load, inspect, consolidate and `verify` share: the checksum (version 2),
    every section a reader uses and its type, file names (plain names inside `path`), each file's
    size and the CRC-32 blocks of its safetensors header (`every_block`: all its blocks), and every
    piece: in a listed file, inside one stored tensor of the same dtype, the pieces of a tensor
    covering it exactly once; tensor-parallel splits; optimizer states matching their parameters.
    What needs the model (shapes, optimizer states a load needs) is checked at load.
    """
    found = _Problems(path)
    if not isinstance(manifest, dict):
        found.add("(top level)", "is not a JSON object")
        return found.lines
    version = manifest.get("version")
    if manifest.get("format") != FORMAT or version not in (UNCHECKSUMMED_VERSION, VERSION):
        found.add(
            "format, version",
            f"{manifest.get('format')!r} version {version!r} is not a {FORMAT} manifest of "
            f"version {UNCHECKSUMMED_VERSION} or {VERSION} (written by another program or a newer "
            "shardspeed?)",
        )
        return found.lines
    if CHECKSUM in manifest or version != UNCHECKSUMMED_VERSION:
        if CHECKSUM not in manifest:
            found.add(CHECKSUM, f"missing, which a version {version} manifest always has")
        elif manifest[CHECKSUM] != manifest_checksum(manifest):
            found.add(
                CHECKSUM,
                f"{str(manifest[CHECKSUM])[:80]!r} does not match the manifest's content "
                f"({manifest_checksum(manifest)}): the manifest was edited or is corrupt",
            )
    sections = {}
    for key, kind in _SECTIONS.items():
        if key not in manifest:
            found.add(key, "missing")
        elif found.typed(key, manifest[key], kind):
            sections[key] = manifest[key]
    _check_state(found, sections)
    files = _check_files(found, path, sections.get("files", {}))
    damaged: set[str] = set()
    if every_block:
        for line in verify_files(path, files):
            found.lines.append(line)
            damaged.update(n for n in files if line.startswith(f"{path / n}:"))
    ranges = _stored_ranges(found, path, {n: i for n, i in files.items() if n not in damaged})
    tensors = _check_tensors(found, sections.get("tensors", {}), files, ranges)
    splits = _check_splits(found, sections.get("splits", {}), tensors)
    parts = {n: names for n, (_, names) in splits.items()}
    frozen = _frozen_names(sections.get("tensors", {}), tensors, parts, ranges)
    whole = sections.get("optimizer", {}).get("whole_states", {})
    _check_optimizer_states(
        found, tensors, splits, frozen, whole if isinstance(whole, dict) else {}
    )
    return found.lines


def _check_state(found: _Problems, sections: dict[str, Any]) -> None:
    """The JSON state a load restores: writer facts, counters, optimizer, scaler, loader, RNG."""
    written_by = sections.get("written_by")
    if written_by is not None:
        for key, kind in _WRITTEN_BY.items():
            found.typed(f"written_by.{key}", written_by.get(key), kind)
        if written_by.get("model_dtype") not in DTYPES:
            found.add("written_by.model_dtype", f"unknown dtype {written_by.get('model_dtype')!r}")
    for key, value in sections.get("counters", {}).items():
        if key not in COUNTERS:
            found.add(f"counters.{key}", f"unknown counter (known: {', '.join(COUNTERS)})")
        elif not _count(value):
            found.add(f"counters.{key}", f"is {value!r}, not a count")
    optimizer = sections.get("optimizer")
    if optimizer is not None:
        found.typed("optimizer.type", optimizer.get("type"), str)
        groups = optimizer.get("groups")
        if found.typed("optimizer.groups", groups, list):
            for g, group in enumerate(groups):
                if found.typed(f"optimizer.groups[{g}]", group, dict):
                    found.typed(f"optimizer.groups[{g}].hyper", group.get("hyper"), dict)
                    found.typed(f"optimizer.groups[{g}].scalars", group.get("scalars"), dict)
    scaler = sections.get("loss_scaler")
    if scaler is not None and scaler.get("dynamic"):
        for key, kind in _DYNAMIC_SCALER.items():
            found.typed(f"loss_scaler.{key}", scaler.get(key), kind)
    if sections.get("data_loader") is not None:
        for key, kind in _DATA_LOADER.items():
            found.typed(f"data_loader.{key}", sections["data_loader"].get(key), kind)
    for r, rank in enumerate(sections.get("ranks", [])):
        if found.typed(f"ranks[{r}]", rank, dict) and found.typed(
            f"ranks[{r}].rng", rank.get("rng"), dict
        ):
            for key in ("torch", "python"):
                if key not in rank["rng"]:
                    found.add(f"ranks[{r}].rng.{key}", "missing")
    for alias, saved in sections.get("aliases", {}).items():
        found.typed(f"aliases[{alias!r}]", saved, str)


def _check_files(found: _Problems, path: Path, files: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The well-formed entries of `files`, whose names are plain names inside `path`."""
    good = {}
    for name, info in files.items():
        field = f"files[{name!r}]"
        try:
            tensor_file(path, name)
        except CheckpointError:
            found.add(
                field,
                "does not name a file inside the tag directory (refused: no `..`, absolute path, "
                "separator, or symbolic link leading out)",
            )
            continue
        if not found.typed(field, info, dict):
            continue
        kinds = {"bytes": int, "chunk_bytes": int, "crc32": list}
        if not all(found.typed(f"{field}.{k}", info.get(k), kind) for k, kind in kinds.items()):
            continue
        if info["bytes"] < 8 or info["chunk_bytes"] <= 0:
            found.add(
                field, f"bytes {info['bytes']}, chunk_bytes {info['chunk_bytes']}: impossible"
            )
            continue
        blocks = math.ceil(info["bytes"] / info["chunk_bytes"])
        crcs = info["crc32"]
        if len(crcs) != blocks or not all(_is(c, int) and 0 <= c < 1 << 32 for c in crcs):
            found.add(f"{field}.crc32", f"is not {blocks} CRC-32 values, one per block")
            continue
        good[name] = info
    return good


def _stored_ranges(found: _Problems, path: Path, files: dict[str, dict[str, Any]]) -> dict:
    """Per file whose header reads, its stored tensors' byte ranges: sorted
    [(start, end, dtype, key)]. The header's own blocks are checked first."""
    reader = ByteReader(path, files)
    ranges = {}
    for name in files:
        try:
            header, data_start = reader.header(name)
            entries = []
            for key, entry in header.items():
                if key != "__metadata__":
                    lo, hi = entry["data_offsets"]
                    entries.append((data_start + lo, data_start + hi, entry["dtype"], key))
            ranges[name] = sorted(entries)
        except CheckpointError as err:
            found.lines.append(str(err))
        except (KeyError, TypeError, IndexError, ValueError):
            found.lines.append(f"{path / name}: corrupt safetensors header")
    return ranges


def _check_tensors(
    found: _Problems,
    tensors: dict[str, Any],
    files: dict[str, dict[str, Any]],
    ranges: dict[str, list[tuple[int, int, str, str]]],
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape, dtype and pieces; returns {name: (shape, dtype)} of the good ones."""
    good = {}
    for name, entry in tensors.items():
        field = f"tensors[{name!r}]"
        if not found.typed(field, entry, dict):
            continue
        shape, dtype = entry.get("shape"), entry.get("dtype")
        if not (
            found.typed(f"{field}.shape", shape, list) and found.typed(f"{field}.dtype", dtype, str)
        ):
            continue
        if not all(_count(n) for n in shape):
            found.add(f"{field}.shape", f"{shape} is not a list of sizes")
            continue
        if dtype not in DTYPES:
            found.add(f"{field}.dtype", f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
            continue
        pieces = entry.get("pieces")
        if found.typed(f"{field}.pieces", pieces, list) and _check_pieces(
            found, field, pieces, math.prod(shape), dtype, files, ranges
        ):
            good[name] = tuple(shape), dtype
    return good


def _check_pieces(
    found: _Problems,
    field: str,
    pieces: list[Any],
    numel: int,
    dtype: str,
    files: dict[str, dict[str, Any]],
    ranges: dict[str, list[tuple[int, int, str, str]]],
) -> bool:
    """Whether every piece is well placed and together they cover the `numel` elements once."""
    before = len(found.lines)
    covered = []
    itemsize = DTYPES[dtype].itemsize
    for i, raw in enumerate(pieces):
        where = f"{field}.pieces[{i}]"
        if not (isinstance(raw, list) and len(raw) == 5):
            found.add(where, "is not [file, byte offset, start, length, dtype]")
            continue
        file, offset, start, length, piece_dtype = raw
        if file not in files:
            found.add(where, f"file {file!r} is not a listed, well-formed file of the tag")
            continue
        if not all(_count(n) for n in (offset, start, length)):
            found.add(where, f"byte offset, start and length {raw[1:4]} are not counts")
            continue
        if piece_dtype != dtype:
            found.add(where, f"dtype {piece_dtype!r} is not the tensor's {dtype!r}")
            continue
        end = offset + length * itemsize
        if end > files[file]["bytes"]:
            found.add(
                where,
                f"bytes {offset}..{end} lie past the end of {file} ({files[file]['bytes']} bytes)",
            )
            continue
        covered.append((start, start + length))
        if length == 0 or file not in ranges:
            continue
        stored = ranges[file]
        k = bisect.bisect_right(stored, (offset, math.inf)) - 1
        if k < 0 or not (stored[k][0] <= offset and end <= stored[k][1]):
            found.add(where, f"bytes {offset}..{end} are not inside one tensor stored in {file}")
        elif stored[k][2] != dtype or (offset - stored[k][0]) % itemsize:
            found.add(
                where,
                f"bytes {offset}..{end} lie in {file}'s {stored[k][2]} tensor {stored[k][3]!r}, "
                f"not on a {dtype} element",
            )
    if len(found.lines) > before:
        return False
    covered.sort()
    position = 0
    for lo, hi in covered:
        if hi == lo:
            continue
        if lo != position:
            break
        position = hi
    if position != numel or sum(hi - lo for lo, hi in covered) != numel:
        found.add(f"{field}.pieces", f"do not cover its {numel} elements exactly once")
        return False
    return True


def _check_splits(
    found: _Problems, splits: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]]
) -> dict[str, tuple[tuple[int, ...], list[str]]]:
    """Each split's parts exist with one shape and dtype, and `dim`/`stride` fit that shape;
    returns {name: (whole shape, parts)} of the good ones."""
    good = {}
    for name, split in splits.items():
        field = f"splits[{name!r}]"
        if not found.typed(field, split, dict):
            continue
        dim, stride, parts = split.get("dim"), split.get("stride"), split.get("parts")
        if not (
            found.typed(f"{field}.dim", dim, int)
            and found.typed(f"{field}.stride", stride, int)
            and found.typed(f"{field}.parts", parts, list)
        ):
            continue
        if name in tensors:
            found.add(field, "names a tensor that is also stored whole")
        elif not parts or not all(isinstance(p, str) and p in tensors for p in parts):
            found.add(f"{field}.parts", f"{parts} are not all valid tensors of the checkpoint")
        elif len({tensors[p] for p in parts}) != 1:
            found.add(f"{field}.parts", "differ in shape or dtype")
        elif not (0 <= dim < len(shape := tensors[parts[0]][0]) and stride >= 1):
            found.add(
                field, f"dim {dim}, stride {stride} do not fit the parts' shape {list(shape)}"
            )
        elif shape[dim] % stride:
            found.add(field, f"stride {stride} does not divide the parts' size {shape[dim]}")
        else:
            whole = list(shape)
            whole[dim] *= len(parts)
            good[name] = tuple(whole), parts
    return good


def _frozen_names(
    raw: dict[str, Any],
    tensors: dict[str, tuple[tuple[int, ...], str]],
    splits: dict[str, list[str]],
    ranges: dict[str, list[tuple[int, int, str, str]]],
) -> set[str]:
    """Parameters saved frozen: each piece stored inside a writer's `frozen.` tensor (the whole
    parameter, or at stage 3 each rank's shard of it; a tensor-parallel one, every part so).
    `raw`: the manifest's tensors section, `tensors` its valid entries, `splits` the parts of
    each valid split."""
    frozen_spans = {
        file: sorted((start, end) for start, end, _, key in stored if key.startswith("frozen."))
        for file, stored in ranges.items()
    }

    def inside_frozen(piece: list[Any]) -> bool:
        spans = frozen_spans[piece[0]]
        at = bisect.bisect_right(spans, (piece[1], math.inf)) - 1
        return at >= 0 and spans[at][0] <= piece[1] < spans[at][1]

    def stored_frozen(logical: str) -> bool:
        # Pieces in files whose header does not read (reported on their own) do not decide.
        readable = [p for p in raw.get(logical, {}).get("pieces", []) if p[0] in frozen_spans]
        return logical in tensors and bool(readable) and all(map(inside_frozen, readable))

    names = {n for n in tensors if stored_frozen(n)}
    names |= {n for n, parts in splits.items() if all(map(stored_frozen, parts))}
    return {n[len("param/") :] for n in names if n.startswith("param/")}


def _check_optimizer_states(
    found: _Problems,
    tensors: dict[str, tuple[tuple[int, ...], str]],
    splits: dict[str, tuple[tuple[int, ...], list[str]]],
    frozen: set[str],
    whole_states: dict[str, list[str]],
) -> None:
    """Each `optim/<state>/<name>` has a `param/<name>` of its shape, and every parameter saved
    as trained (not frozen) has every state: a missing entry was deleted, and must not load as
    zeros. A parameter in `whole_states` (an optimizer stepped on whole tensors, such as
    Adafactor, keeps states of other shapes) has exactly the states listed for it."""
    shapes = {n: shape for n, (shape, _) in tensors.items() if not n.startswith("tp/")}
    shapes.update((n, shape) for n, (shape, _) in splits.items())
    states = set()
    for name, shape in shapes.items():
        if not name.startswith("optim/"):
            continue
        state, _, param = name[len("optim/") :].partition("/")
        if param not in whole_states:
            states.add(state)
        if not state or not param:
            found.add(f"tensors[{name!r}]", "is not named optim/<state>/<parameter>")
        elif param in whole_states and f"param/{param}" in shapes:
            if state not in whole_states[param]:
                found.add(f"tensors[{name!r}]", f"is not a state listed for '{param}'")
        elif shapes.get(f"param/{param}") != shape:
            found.add(
                f"tensors[{name!r}]",
                f"has shape {list(shape)}, its parameter 'param/{param}' "
                f"{list(shapes[f'param/{param}']) if f'param/{param}' in shapes else 'is missing'}",
            )
    trained = sorted(
        n[len("param/") :]
        for n in shapes
        if n.startswith("param/") and n[len("param/") :] not in frozen
    )
    for param in trained:
        for state in sorted(whole_states.get(param, states)):
            if f"optim/{state}/{param}" not in shapes:
                found.add(
                    f"tensors['optim/{state}/{param}']",
                    f"missing: the optimizer state '{state}' of trained parameter '{param}'",
                )


def read_manifest(path: Path) -> dict[str, Any]:
    """Tag directory `path`'s manifest, refused with a `CheckpointError` listing what is wrong
    unless `checkpoint_problems` finds nothing."""
    manifest = parse_manifest(path)
    problems = checkpoint_problems(path, manifest)
    if problems:
        tag = manifest.get("tag") if isinstance(manifest, dict) else None
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise CheckpointError(
            f"checkpoint {tag if isinstance(tag, str) else path.name!r} cannot be read: "
            f"{'; '.join(problems[:5])}{more}. Load another tag, or restore this one from a "
            f"copy (`shardspeed-ckpt verify {path}` lists every problem)"
        )
    if CHECKSUM not in manifest:
        logger.warning(f"{path / MANIFEST}: {UNCHECKSUMMED_WARNING}")
    return manifest


def frozen_parameter_names(path: Path, manifest: dict[str, Any]) -> set[str]:
    """Parameters saved frozen in tag directory `path`, whose validated manifest is `manifest`."""
    tensors = {n: (tuple(e["shape"]), e["dtype"]) for n, e in manifest["tensors"].items()}
    parts = {n: split["parts"] for n, split in manifest["splits"].items()}
    ranges = _stored_ranges(_Problems(path), path, manifest["files"])
    return _frozen_names(manifest["tensors"], tensors, parts, ranges)
