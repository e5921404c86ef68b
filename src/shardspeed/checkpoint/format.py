"""The checkpoint format: a JSON manifest plus safetensors files, read by byte range, never unpickled.

A tag directory holds `manifest.json` and one `rank<R>.safetensors` per writing rank. The manifest
lists every logical tensor (a parameter's fp32 value, an optimizer state, a buffer, a client tensor)
with its shape and dtype and the pieces that hold it: each piece is a run of `length` elements of
the flattened tensor, from element `start`, stored in `file` at absolute byte `offset`. Each file
is also described by its size and a CRC-32 per `chunk_bytes` block, so a reader checks exactly the
blocks it reads and `verify` checks them all. See docs/checkpoint-format.md.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = "shardspeed-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
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

    contiguous = {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
    save_file(contiguous, str(path))
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


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON next to `path`, fsync, and rename over it: readers see the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


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


class ByteReader:
    """Reads byte ranges of the files of one directory, checking each CRC-32 block it touches."""

    def __init__(self, directory: Path, files: dict[str, dict[str, Any]] | None) -> None:
        self.directory = directory
        self.files = files  # None: no checksums (a foreign file, such as a Hugging Face export)
        self._checked: set[tuple[str, int]] = set()
        self._sizes_checked: set[str] = set()

    def read(self, name: str, offset: int, length: int) -> bytes:
        path = self.directory / name
        if not path.exists():
            raise CheckpointError(f"{path}: missing")
        if self.files is None:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
            if len(data) != length:
                raise CheckpointError(
                    f"{path}: truncated (wanted bytes {offset}..{offset + length})"
                )
            return data
        info = self.files.get(name)
        if info is None:
            raise CheckpointError(f"{path}: not listed in the manifest")
        if name not in self._sizes_checked:
            size = path.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(
                    f"{path}: {size} bytes, the manifest says {info['bytes']} (truncated or replaced)"
                )
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
                raise CheckpointError(
                    f"{path}: checksum mismatch in bytes {i * chunk}..{i * chunk + len(block)} "
                    "(the file is corrupt)"
                )
            self._checked.add((name, i))
        start = offset - first * chunk
        return blocks[start : start + length]


def verify_files(directory: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Every problem with the files of a tag: missing, wrong size, or a block whose CRC differs."""
    problems = []
    for name, info in sorted(files.items()):
        path = directory / name
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        if path.stat().st_size != info["bytes"]:
            problems.append(
                f"{path}: {path.stat().st_size} bytes, the manifest says {info['bytes']}"
            )
            continue
        with open(path, "rb") as f:
            for i, expected in enumerate(info["crc32"]):
                block = f.read(info["chunk_bytes"])
                if zlib.crc32(block) != expected:
                    start = i * info["chunk_bytes"]
                    problems.append(
                        f"{path}: checksum mismatch in bytes {start}..{start + len(block)}"
                    )
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
    ) -> None:
        self.reader = reader
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
        for piece in map(Piece.from_json, entry["pieces"]):
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
    """Tensors stored whole under their own key in some file of a tag (client state, RNG states)."""

    def __init__(self, reader: ByteReader) -> None:
        self.reader = reader
        self._where: dict[str, tuple[str, int, dict[str, Any]]] | None = None

    def get(self, key: str) -> torch.Tensor:
        if self._where is None:
            self._where = {}
            for name in self.reader.files or {}:
                header, start = read_header(self.reader.directory / name)
                for k, entry in header.items():
                    if k != "__metadata__":
                        self._where[k] = (name, start, entry)
        if key not in self._where:
            raise CheckpointError(f"{self.reader.directory}: no stored tensor '{key}'")
        name, start, entry = self._where[key]
        lo, hi = entry["data_offsets"]
        data = self.reader.read(name, start + lo, hi - lo) if hi > lo else b""
        flat = torch.frombuffer(bytearray(data), dtype=DTYPES[entry["dtype"]]) if data else None
        if flat is None:
            return torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
        return flat.view(entry["shape"])


def read_manifest(path: Path) -> dict[str, Any]:
    """A tag's manifest, checked to be one this version reads."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{file}: missing") from err
    except ValueError as err:
        raise CheckpointError(f"{file}: corrupt ({err})") from err
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{file}: not a {FORMAT} version {VERSION} manifest "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})"
        )
    return manifest
