"""Hugging Face safetensors weights (one file, or shards with `model.safetensors.index.json`) read
straight into an engine at any ZeRO stage: each rank reads only the bytes of its own shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .engine_state import load_parameters
from .format import ByteReader, CheckpointError, Piece, TensorSource, read_header

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def hf_source(path: str | Path) -> TensorSource:
    """The tensors of a Hugging Face checkpoint (a directory, a .safetensors file, or an index)."""
    path = Path(path)
    if path.is_dir():
        path = path / INDEX if (path / INDEX).exists() else path / SINGLE
    if not path.exists():
        raise CheckpointError(f"{path}: no {SINGLE} or {INDEX} there")
    directory = path.parent
    if path.name.endswith(".json"):
        files = sorted(set(json.loads(path.read_text())["weight_map"].values()))
    else:
        files = [path.name]
    tensors: dict[str, dict[str, Any]] = {}
    for name in files:
        header, data_start = read_header(directory / name)
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            numel = 1
            for size in entry["shape"]:
                numel *= size
            offset = data_start + entry["data_offsets"][0]
            piece = Piece(name, offset, 0, numel, entry["dtype"]).to_json()
            described = {"shape": entry["shape"], "dtype": entry["dtype"], "pieces": [piece]}
            tensors[f"param/{key}"] = described
            tensors[f"buffer/{key}"] = described
    return TensorSource(ByteReader(directory, None), tensors)


def load_hf_weights(engine: Any, path: str | Path, strict: bool = True) -> None:
    """Load Hugging Face weights into `engine`'s model (collective only in the final publish).

    Names must match `model.named_parameters()` (a model built from the same config class);
    second names of tied weights and buffers may be present. With `strict`, a missing or
    unknown parameter is an error naming it.
    """
    load_parameters(engine, hf_source(path), strict, f"Hugging Face weights {path}")
