"""DeepSpeed's `deepspeed.utils.zero_to_fp32` functions, for shardspeed checkpoints.

Same names, signatures and defaults as DeepSpeed 0.19.8, so scripts that call them keep working:

    from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir)  # on CPU
    model.load_state_dict(state_dict)

and as a command, like DeepSpeed's script:

    python -m shardspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--tag T] [--max_shard_size S]

`get_optim_files` and `get_model_state_files` list a DeepSpeed tag directory's `.pt` files in rank
order, as DeepSpeed's do (shardspeed reads those files in `shardspeed.checkpoint.deepspeed`).

Differences: any shardspeed checkpoint works (every ZeRO stage, any world size, nothing
unpickled); output files are always safetensors (shardspeed writes no pickles), whatever
`safe_serialization` says; `lazy_mode=True` returns `LazyTensor`s that read their bytes on
`.contiguous()`, as DeepSpeed's pseudo tensors do.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.cli import size_argument
from ..checkpoint.consolidate import (
    consolidate,
    fp32_state_dict,
    lazy_state_dict,
    materialize,
)
from ..checkpoint.deepspeed import get_checkpoint_files, get_model_state_files, get_optim_files
from ..checkpoint.format import CheckpointError

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_checkpoint_files",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "main",
    "to_torch_tensor",
]

logger = logging.getLogger("shardspeed")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_told_safetensors_only = False


def _dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.").lower()
        if name in _DTYPES:
            return _DTYPES[name]
    raise ValueError(f"dtype {dtype!r}: use float32, float16 or bfloat16")


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Any]:
    """The model's whole state dict from a checkpoint, on CPU: trainable parameters in fp32
    (their masters), frozen parameters and buffers as stored, tied names sharing one tensor.

    `checkpoint_dir` holds the tag directories (`tag=None`: the one `latest` names). With
    `lazy_mode` the values are `LazyTensor`s: `.contiguous()` reads one from disk.
    """
    if lazy_mode:
        return lazy_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    return fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)


def to_torch_tensor(
    state_dict: dict[str, Any], return_empty_tensor: bool = False, dtype: Any = None
) -> dict[str, torch.Tensor]:
    """Lazy values read into tensors (names sharing one keep sharing); `dtype` casts floating ones."""
    if dtype is not None:
        dtype = _dtype(dtype)
    if not return_empty_tensor:
        return materialize(state_dict, dtype)
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, value in state_dict.items():
        if id(value) not in done:
            target = dtype if dtype is not None and value.dtype.is_floating_point else value.dtype
            done[id(value)] = torch.empty(value.shape, dtype=target)
        out[name] = done[id(value)]
    return out


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    dtype: Any = torch.float32,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the checkpoint's whole state dict into `output_dir` as safetensors, in Hugging
    Face's layout (`model.safetensors`, or shards of at most `max_shard_size` plus
    `model.safetensors.index.json`); floating-point tensors cast to `dtype`.

    `safe_serialization=False` (DeepSpeed's default, meaning `pytorch_model.bin`) still writes
    safetensors: shardspeed never writes pickles. A tied weight is written once, under its first
    name; `from_pretrained` ties it back, and `safetensors.torch.load_model` accepts its absence.
    """
    global _told_safetensors_only
    if not safe_serialization and not _told_safetensors_only:
        logger.warning(
            "shardspeed writes safetensors only: writing model.safetensors, not pytorch_model.bin "
            "(safe_serialization=False has no pickle format to choose here)"
        )
        _told_safetensors_only = True
    consolidate(
        checkpoint_dir,
        output_dir,
        tag=tag,
        max_shard_size=max_shard_size,
        exclude_frozen_parameters=exclude_frozen_parameters,
        dtype=_dtype(dtype),
    )


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's older name and signature)."""
    convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        dtype=torch.float32,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None
) -> torch.nn.Module:
    """Move `model` to CPU, load the checkpoint's fp32 weights into it, and return it.

    Like DeepSpeed, the load is not strict (missing or unexpected names are logged). Use a plain
    model: one wrapped by an engine at stage 3 holds only shards, which a whole tensor cannot fill.
    """
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    result = model.load_state_dict(state_dict, strict=False)
    if result.missing_keys or result.unexpected_keys:
        logger.warning(
            f"loading {checkpoint_dir} into {type(model).__name__}: missing "
            f"{result.missing_keys[:10]}, unexpected {result.unexpected_keys[:10]}"
        )
    return model


def main(argv: list[str] | None = None) -> int:
    """`python -m shardspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR`, as DeepSpeed's script."""
    parser = argparse.ArgumentParser(
        prog="python -m shardspeed.utils.zero_to_fp32",
        description="Write a shardspeed checkpoint's whole fp32 weights as safetensors files.",
    )
    parser.add_argument(
        "checkpoint_dir", help="the save directory holding the tags (e.g. path/checkpoint-12)"
    )
    parser.add_argument("output_dir", help="where to write model.safetensors (or its shards)")
    parser.add_argument(
        "--max_shard_size",
        type=size_argument,
        default="5GB",
        help='largest file before the weights are split into shards, e.g. "5GB" or "500MB"',
    )
    parser.add_argument(
        "--safe_serialization",
        action="store_true",
        help="accepted for compatibility: the output is always safetensors",
    )
    parser.add_argument("-t", "--tag", default=None, help="the tag to convert (default: latest)")
    parser.add_argument(
        "--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters"
    )
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for compatibility")
    args = parser.parse_args(argv)
    try:
        written = consolidate(
            args.checkpoint_dir,
            args.output_dir,
            tag=args.tag,
            max_shard_size=args.max_shard_size,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except (CheckpointError, OSError) as err:
        print(f"zero_to_fp32: error: {err}", file=sys.stderr)
        return 2
    for name in written:
        print(Path(args.output_dir) / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
