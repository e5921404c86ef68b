"""DeepSpeed checkpoints in: read a DeepSpeed 0.14-0.19 checkpoint directory once, without running
its pickles' code, and write it as a shardspeed checkpoint (safetensors and a manifest).

What is read, per layout DeepSpeed writes (`<dir>/<tag>/`):

- ZeRO 0: `mp_rank_00_model_states.pt`, its `module` and `optimizer` (a torch optimizer's state
  dict, or with fp16 / bf16 the wrapper's `fp32_groups_flat` and flat optimizer states).
- ZeRO 1 and 2: `mp_rank_<mp>_model_states.pt` (`param_shapes`: the parameters of each group) and
  one `[bf16_]zero_pp_rank_<r>_mp_rank_<mp>_optim_states.pt` per data-parallel rank: each rank's
  contiguous partition of every group's flat fp32 masters and Adam states
  (`single_partition_of_fp32_groups`, `base_optimizer_state`), where `param_slice_mappings`
  says which parameter each span of the partition belongs to.
- ZeRO 3: per rank `zero_pp_rank_<r>_mp_rank_00_model_states.pt` and `..._optim_states.pt`: every
  parameter cut into world-size slices of ceil(numel / world) elements, each rank's slices of all
  parameters one after another (`fp32_flat_groups`, per sub-group).
- Pipelines: `layer_<idx>-model_states.pt` (a layer's weights, named `<idx>.<name>`) and the files
  above per stage (`mp_rank_<stage>`).
- Universal checkpoints (`ds_to_universal` output, found through `latest_universal`):
  `zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt` whole, `zero/optimizer_state.pt`.
- AutoEP (the `expert_parallel` section) at ZeRO 1 and 2: the experts' param group is each
  expert group's run of experts (`w1`, `w2`, `w3` of its local experts) partitioned over the
  ranks holding that run; `ds_autoep_layers` names the blocks. The runs are joined and the names
  turned back into the Hugging Face model's (`_from_autoep`).

The `.pt` files are read with `torch.load(weights_only=True)`, which builds only tensors and plain
containers; the few DeepSpeed classes its checkpoints hold (`ALLOWED`: the loss scaler, the ZeRO
stage enum, `fragment_address`) are read into plain stand-ins by name, DeepSpeed not imported. A
file that needs any other class is refused, naming the file and the class. Tensor-parallel
checkpoints (several `mp_rank_*` without a pipeline) need `ds_to_universal` first.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .format import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    check_tag_name,
    write_manifest,
    write_tensor_file,
)
from .values import encode

logger = logging.getLogger("shardspeed")

LATEST = "latest"

# -- DeepSpeed's names --------------------------------------------------------------------------------
# What DeepSpeed calls its files and the keys this reader takes from them, under DeepSpeed's own
# names (`deepspeed.checkpoint.constants`), so code written against those names reads the same.

# Keys of `*_optim_states.pt`.
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_FLAT_GROUPS = "fp32_flat_groups"  # ZeRO 3
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"  # ZeRO 1 and 2
BASE_OPTIMIZER_STATE = "base_optimizer_state"
PARAM_GROUPS = "param_groups"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
ZERO_STAGE = "zero_stage"
LOSS_SCALER = "loss_scaler"
# Keys of `*_model_states.pt`.
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
DS_VERSION = "ds_version"
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
AUTOEP_LAYERS = "ds_autoep_layers"  # AutoEP's MoE blocks: paths, expert placement, ep size
# Universal checkpoints: `zero/<name>/fp32.pt` holds {PARAM: tensor}.
FP32_WEIGHT_KEY = "fp32"
PARAM = "param"
# File names: `mp_rank_00_model_states.pt`, `[bf16_]zero_pp_rank_0_mp_rank_00_optim_states.pt`,
# `layer_01-model_states.pt`.
MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
MODEL_FILE_SUFFIX = "_model_states.pt"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
LAYER_FILE_PREFIX = "layer_"


def get_model_ckpt_name_for_rank(base_folder: str | os.PathLike, mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank `mp_rank_str` ("00") in DeepSpeed tag
    directory `base_folder` (ZeRO 0 to 2, and universal checkpoints)."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def _natural_key(text: str) -> list[int | str]:
    """Sorts rank 10 after rank 9: the digit runs of `text` compare as numbers."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", text))]


def _matching(directory: Path, pattern: str) -> list[Path]:
    """The files in `directory` that `pattern` matches, in rank order."""
    return sorted(Path(directory).glob(pattern), key=lambda path: _natural_key(path.name))


def get_checkpoint_files(checkpoint_dir: str | os.PathLike, glob_pattern: str) -> list[str]:
    """The files in `checkpoint_dir` that `glob_pattern` matches, in rank order (numbers in the
    names compared as numbers); FileNotFoundError when there are none."""
    files = _matching(Path(checkpoint_dir), glob_pattern)
    if not files:
        raise FileNotFoundError(f"no {glob_pattern} files in directory {str(checkpoint_dir)!r}")
    return [str(path) for path in files]


def get_optim_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """A DeepSpeed tag directory's optimizer-states files, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*" + OPTIM_FILE_SUFFIX)


def get_model_state_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """A DeepSpeed tag directory's model-states files, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*" + MODEL_FILE_SUFFIX)


class _Record:
    """A plain stand-in for an allowed DeepSpeed object: its pickled attributes, nothing else."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):  # (dict, slots) from classes with __slots__
            state = {**(state[0] or {}), **(state[1] or {})}
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class _LossScaler(_Record):
    pass


class _FragmentAddress(_Record):
    pass


def _zero_stage(value: int) -> int:
    return int(value)


# The DeepSpeed classes a checkpoint may hold, by the name pickled, and what they are read as.
ALLOWED = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _LossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
    "deepspeed.utils.tensor_fragment.fragment_address": _FragmentAddress,
}

# model_states keys that are DeepSpeed's bookkeeping; any other top-level key is client state.
_BOOKKEEPING = {
    "module",
    BUFFER_NAMES,
    "optimizer",
    PARAM_SHAPES,
    FROZEN_PARAM_SHAPES,
    "shared_params",
    FROZEN_PARAM_FRAGMENTS,
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    CHECKPOINT_PARALLEL_DIMS,
    "ds_config",
    DS_VERSION,
    UNIVERSAL_CHECKPOINT_INFO,
    AUTOEP_LAYERS,
    "num_experts",
}
# Torch optimizer hyperparameters carried over (DeepSpeed's groups also hold its own keys).
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov")


def read_pt(path: Path) -> Any:
    """A DeepSpeed `.pt` file's contents, unpickling nothing but tensors, containers and `ALLOWED`."""
    allowed = [(stand_in, name) for name, stand_in in ALLOWED.items()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(error))
        if found is None:
            raise CheckpointError(
                f"{path}: cannot be read as a DeepSpeed checkpoint file ({error})"
            ) from error
        raise CheckpointError(
            f"{path} holds an object of class {found.group(1)}, which reading would have to "
            f"execute code to build; only tensors, plain containers and {', '.join(ALLOWED)} are "
            "read from DeepSpeed checkpoints. Convert it where you trust its code, or drop that "
            "object from the checkpoint"
        ) from None


@dataclass
class DeepSpeedState:
    """What a DeepSpeed checkpoint holds, as whole tensors by parameter name."""

    params: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 masters
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # state -> name -> t
    groups: list[dict[str, Any]] = field(default_factory=list)  # hyper, scalars
    loss_scaler: dict[str, Any] = field(
        default_factory=lambda: {"dynamic": False, "cur_scale": 1.0}
    )
    lr_scheduler: dict[str, Any] | None = None
    counters: dict[str, int] = field(default_factory=dict)
    client_state: dict[str, Any] = field(default_factory=dict)
    written_by: dict[str, Any] = field(default_factory=dict)


def is_deepspeed_checkpoint(tag_dir: Path) -> bool:
    """Whether `tag_dir` is a DeepSpeed checkpoint tag (and not a shardspeed one)."""
    if (tag_dir / MANIFEST).exists() or not tag_dir.is_dir():
        return False
    return (
        any(tag_dir.glob("*model_states.pt")) or (tag_dir / "zero" / "optimizer_state.pt").exists()
    )


def deepspeed_tag_dir(load_dir: Path, tag: str | None) -> Path | None:
    """The DeepSpeed tag directory `load_dir` and `tag` name (`latest`, else `latest_universal`),
    or None when they name no DeepSpeed checkpoint."""
    named_by = None
    if tag is None:
        for pointer in (LATEST, "latest_universal"):
            if (load_dir / pointer).exists():
                tag = (load_dir / pointer).read_text().strip()
                named_by = f"{load_dir / pointer} names '{tag}', which"
                break
        else:
            return None
    tag = str(tag)
    check_tag_name(tag, load_dir, named_by)
    path = load_dir / tag
    return path if is_deepspeed_checkpoint(path) else None


# -- reading ----------------------------------------------------------------------------------------


def read_deepspeed(tag_dir: Path) -> DeepSpeedState:
    """Everything a DeepSpeed checkpoint tag holds, whole."""
    tag_dir = Path(tag_dir)
    if (tag_dir / "zero" / "optimizer_state.pt").exists():
        return _read_universal(tag_dir)
    models = _matching(tag_dir, f"{MODEL_FILE_PREFIX}*{MODEL_FILE_SUFFIX}")
    layers = _matching(tag_dir, f"{LAYER_FILE_PREFIX}*-model_states.pt")
    if len(models) > 1 and not layers:
        raise CheckpointError(
            f"{tag_dir} is a tensor-parallel DeepSpeed checkpoint ({len(models)} model-parallel "
            "ranks): convert it with DeepSpeed's ds_to_universal and load the universal one"
        )
    if models:
        first = read_pt(models[0])
        stage = _stage_of(tag_dir, first)
        state = DeepSpeedState()
        _bookkeeping(state, first, tag_dir)
        if stage == 0:
            for path in models:
                _read_stage0(state, read_pt(path) if path != models[0] else first)
        else:
            for s, path in enumerate(models):
                _read_stage12(state, read_pt(path) if s else first, tag_dir, s)
        for path in layers:
            _read_layer(state, path)
        if first.get(AUTOEP_LAYERS):
            _from_autoep(state, first)
        state.written_by = {"zero_stage": stage, "pipeline_stages": len(models)}
        return state
    ranks = _stage3_models(tag_dir)
    if not ranks:
        raise CheckpointError(f"{tag_dir}: no DeepSpeed model-states file there")
    state = DeepSpeedState()
    first = read_pt(ranks[0])
    _bookkeeping(state, first, tag_dir)
    _read_stage3(state, first, tag_dir, len(ranks))
    if first.get(AUTOEP_LAYERS):
        _from_autoep(state, first)
    state.written_by = {"zero_stage": 3, "pipeline_stages": 1}
    return state


def _stage_of(tag_dir: Path, model_states: dict) -> int:
    optim = _matching(tag_dir, f"*{ZERO_FILE_PREFIX}*{OPTIM_FILE_SUFFIX}")
    if not optim:
        return 0
    stage = read_pt(optim[0])[OPTIMIZER_STATE_DICT].get(ZERO_STAGE, 2)
    return int(stage)


def _bookkeeping(state: DeepSpeedState, model_states: dict, tag_dir: Path) -> None:
    config = model_states.get("ds_config") or {}
    micro = config.get("train_micro_batch_size_per_gpu") or 1
    dp = model_states.get("dp_world_size") or 1
    total = config.get("train_batch_size") or micro * dp
    steps = int(model_states.get("global_steps", 0))
    state.counters = {
        "global_steps": steps,
        "global_samples": int(model_states.get("global_samples", 0)),
        "skipped_steps": int(model_states.get("skipped_steps", 0)),
        "micro_steps": steps * max(1, total // (micro * dp)),
        "_first_micro_step": 0,
    }
    state.lr_scheduler = model_states.get("lr_scheduler")
    state.client_state = {k: v for k, v in model_states.items() if k not in _BOOKKEEPING}
    module = model_states.get("module") or {}
    for name in model_states.get(BUFFER_NAMES) or []:
        if name in module:
            state.buffers[name] = module[name]
    state.written_by["dp_world_size"] = dp
    logger.info(
        "reading DeepSpeed %s checkpoint %s (step %d)",
        model_states.get(DS_VERSION, "?"),
        tag_dir,
        steps,
    )


def _hyper(group: dict) -> dict[str, Any]:
    return {k: group[k] for k in _HYPER if k in group}


def _scalar_step(states: list[dict]) -> dict[str, Any]:
    steps = [float(s["step"]) for s in states if "step" in s]
    return {"step": max(steps)} if steps else {}


def _loss_scaler(source: Any, optimizer_state: dict) -> dict[str, Any]:
    """DeepSpeed's loss-scaler object (or its flat fields) as shardspeed's scaler state."""
    values = dict(source.__dict__) if isinstance(source, _Record) else {}
    for key in ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window"):
        if key in optimizer_state and key not in values:
            values[key] = optimizer_state[key]
    dynamic = bool(values.get("dynamic", optimizer_state.get("dynamic_loss_scale", False)))
    out = {"dynamic": dynamic, "cur_scale": float(values.get("cur_scale", 1.0))}
    if dynamic:
        for key in ("cur_iter", "last_overflow_iter", "cur_hysteresis"):
            if key in values:
                out[key] = int(values[key])
    return out


def _module_params(model_states: dict) -> list[str]:
    """The names of the module's parameters in order (its state dict less the buffers)."""
    buffers = set(model_states.get(BUFFER_NAMES) or [])
    return [n for n in (model_states.get("module") or {}) if n not in buffers]


def _read_stage0(state: DeepSpeedState, model_states: dict) -> None:
    module = model_states["module"]
    optimizer = model_states.get("optimizer") or {}
    names = _module_params(model_states)
    if "fp32_groups_flat" in optimizer:  # fp16 / bf16: a wrapper around flat fp32 groups
        inner = optimizer[OPTIMIZER_STATE_DICT]
        offset_names = iter(names)
        for g, flat in enumerate(optimizer["fp32_groups_flat"]):
            group = inner[PARAM_GROUPS][g]
            group_state = inner["state"].get(group["params"][0], {})
            start = 0
            while start < flat.numel():
                name = next(offset_names)
                numel = module[name].numel()
                state.params[name] = flat[start : start + numel].view(module[name].shape).float()
                for key, value in group_state.items():
                    if torch.is_tensor(value) and value.numel() == flat.numel():
                        piece = value[start : start + numel].view(module[name].shape)
                        state.states.setdefault(key, {})[name] = piece.float()
                start += numel
            state.groups.append({"hyper": _hyper(group), "scalars": _scalar_step([group_state])})
        state.loss_scaler = _loss_scaler(None, optimizer)
        return
    index = 0
    by_index = {}
    for group in optimizer.get(PARAM_GROUPS, []):
        for param_id in group["params"]:
            by_index[param_id] = names[index]
            index += 1
    for name in names:
        state.params[name] = module[name].float()
    for group in optimizer.get(PARAM_GROUPS, []):
        found = []
        for param_id in group["params"]:
            param_state = optimizer["state"].get(param_id, {})
            found.append(param_state)
            for key, value in param_state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state.states.setdefault(key, {})[by_index[param_id]] = value.float()
        state.groups.append({"hyper": _hyper(group), "scalars": _scalar_step(found)})


def _optim_files(tag_dir: Path, mp: int) -> list[Path]:
    pattern = f"*{ZERO_FILE_PREFIX}*_{MODEL_FILE_PREFIX}{mp:02d}{OPTIM_FILE_SUFFIX}"
    files = _matching(tag_dir, pattern)
    if not files:
        raise CheckpointError(f"{tag_dir}: no optimizer-states files for model-parallel rank {mp}")
    return files


def _read_stage12(state: DeepSpeedState, model_states: dict, tag_dir: Path, mp: int) -> None:
    shapes = model_states[PARAM_SHAPES]
    ranks = [read_pt(p)[OPTIMIZER_STATE_DICT] for p in _optim_files(tag_dir, mp)]
    first = ranks[0]
    if any(any(pads) for r in ranks for pads in r.get(PARAM_ALIGNMENT_PADDINGS, [])):
        raise CheckpointError(
            f"{tag_dir}: parameter alignment paddings are not read; convert it with DeepSpeed's "
            "ds_to_universal first"
        )
    autoep = model_states.get(AUTOEP_LAYERS) or []
    for g, names in enumerate(shapes):
        group = first[BASE_OPTIMIZER_STATE][PARAM_GROUPS][g]
        rank_states = [r[BASE_OPTIMIZER_STATE]["state"].get(g, {}) for r in ranks]
        keys = [k for k, v in rank_states[0].items() if torch.is_tensor(v) and v.dim() > 0]
        ep = autoep[0]["ep_size"] if autoep and group.get("moe") else 1
        # AutoEP's expert group: rank r holds its expert group's run `r % ep` of the experts,
        # partitioned over the ranks holding the same run (DeepSpeed's consecutive expert groups).
        runs: dict[str, list[dict[str, torch.Tensor]]] = {name: [] for name in names}
        for run in range(ep):
            members = [r for r in range(len(ranks)) if r % ep == run]
            tensors = _group_tensors(
                [ranks[r] for r in members], [rank_states[r] for r in members], g, names, keys
            )
            for name, found in tensors.items():
                runs[name].append(found)
        for name in names:
            pieces = runs[name]
            state.params[name] = torch.cat([piece[""] for piece in pieces]).float()
            for key in keys:
                value = torch.cat([piece[key] for piece in pieces]).float()
                state.states.setdefault(key, {})[name] = value
        if mp == 0:  # a pipeline's stages each hold their part of the same param groups
            state.groups.append({"hyper": _hyper(group), "scalars": _scalar_step(rank_states)})
    state.loss_scaler = _loss_scaler(first.get(LOSS_SCALER), first)
    module = model_states.get("module") or {}
    trained = {n for group in shapes for n in group}
    for name in _module_params(model_states):
        if name not in trained:
            state.frozen[name] = module[name]


def _group_tensors(
    ranks: list[dict], rank_states: list[dict], g: int, names: dict, keys: list[str]
) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter of group `g` whole from `ranks`' partitions of it: its fp32 master ("")
    and its per-element states `keys`, in the parameter's shape."""
    partitions = [r[SINGLE_PARTITION_OF_FP32_GROUPS][g] for r in ranks]
    spans = _spans(ranks, g, names, partitions)
    out = {}
    for name, shape in names.items():
        pieces = spans[name]
        numel = math.prod(shape)
        whole = torch.cat([partitions[r][a:b] for r, a, b in pieces])
        if whole.numel() != numel:
            raise CheckpointError(
                f"the pieces of {name!r} hold {whole.numel()} elements, its shape "
                f"{tuple(shape)} {numel}"
            )
        out[name] = {"": whole.view(tuple(shape))}
        for key in keys:
            value = torch.cat([rank_states[r][key][a:b] for r, a, b in pieces])
            out[name][key] = value.view(tuple(shape))
    return out


def _from_autoep(state: DeepSpeedState, model_states: dict) -> None:
    """A DeepSpeed AutoEP checkpoint under the Hugging Face model's names: each MoE block's
    `router.gate.*` is its router's (`<block>.<router>.*`, the alias `gate.gate.*` dropped), and
    the experts' `w1`, `w3` (gate and up, per expert) and `w2` are the fused `gate_up_proj`
    ([gate; up] on the second dimension) and `down_proj`, whole over all experts."""
    config = (model_states.get("ds_config") or {}).get("expert_parallel") or {}
    router = config.get("router_pattern") or "gate"
    # AutoEP puts the experts in a param group of their own; in the Hugging Face model they are
    # parameters like the others, so the groups are one when their settings are.
    if len({repr(g["hyper"]) for g in state.groups}) == 1:
        state.groups = state.groups[:1]
    for layer in model_states.get(AUTOEP_LAYERS) or []:
        block, experts = layer["module_path"], layer["expert_key_prefix"]
        renames = {f"{block}.router.gate.": f"{block}.{router}."}
        dropped = f"{block}.gate.gate."
        for table in (state.params, state.frozen, *state.states.values()):
            for name in [n for n in table if n.startswith(dropped)]:
                del table[name]
            for name in list(table):
                for old, new in renames.items():
                    if name.startswith(old):
                        table[new + name[len(old) :]] = table.pop(name)
            gate, up, down = (table.pop(f"{experts}.{w}", None) for w in ("w1", "w3", "w2"))
            if gate is not None:
                table[f"{experts}.gate_up_proj"] = gate if up is None else torch.cat([gate, up], 1)
            if down is not None:
                table[f"{experts}.down_proj"] = down


def _spans(
    ranks: list[dict], g: int, names: dict, partitions: list[torch.Tensor]
) -> dict[str, list[tuple[int, int, int]]]:
    """Each parameter's (rank, start, end) pieces of group `g`'s partitions, in rank order."""
    spans: dict[str, list[tuple[int, int, int]]] = {name: [] for name in names}
    mappings = [r.get(PARAM_SLICE_MAPPINGS) for r in ranks]
    if all(m is not None for m in mappings):
        for r, mapping in enumerate(mappings):
            for name, address in mapping[g].items():
                start, numel = int(address.start), int(address.numel)
                spans[name].append((r, start, start + numel))
        return spans
    # Older checkpoints: the group's parameters lie end to end over the ranks' partitions.
    sizes = [p.numel() for p in partitions]
    offset = 0
    for name, shape in names.items():
        numel = math.prod(shape)
        end = offset + numel
        base = 0
        for r, size in enumerate(sizes):
            lo, hi = max(offset, base), min(end, base + size)
            if lo < hi:
                spans[name].append((r, lo - base, hi - base))
            base += size
        offset = end
    return spans


def _read_stage3(state: DeepSpeedState, model_states: dict, tag_dir: Path, world: int) -> None:
    shapes = model_states[PARAM_SHAPES]
    ranks = [read_pt(p)[OPTIMIZER_STATE_DICT] for p in _optim_files(tag_dir, 0)]
    if len(ranks) != world:
        raise CheckpointError(
            f"{tag_dir}: {world} model-states files but {len(ranks)} optimizer ones"
        )
    flats = [torch.cat(list(r[FP32_FLAT_GROUPS])) for r in ranks]
    inner = [r[OPTIMIZER_STATE_DICT] for r in ranks]
    sub_groups = sorted(inner[0]["state"])
    keys = (
        [
            k
            for k, v in inner[0]["state"][sub_groups[0]].items()
            if torch.is_tensor(v) and v.dim() > 0
        ]
        if sub_groups
        else []
    )
    stacked = {
        key: [torch.cat([r["state"][s][key] for s in sub_groups]) for r in inner] for key in keys
    }
    runs = _expert_runs(tag_dir, ranks, model_states)
    offset = 0
    for g, names in enumerate(shapes):
        group = inner[0][PARAM_GROUPS][min(g, len(inner[0][PARAM_GROUPS]) - 1)]
        # Each run of experts (AutoEP's experts group) is partitioned over the ranks holding it;
        # every other parameter over the whole world.
        holders = runs if group.get("moe") and runs else [list(range(world))]
        for name, shape in names.items():
            numel = math.prod(shape)
            part = -(-numel // len(holders[0]))
            pieces = {"": flats, **stacked}
            for key, per_rank in pieces.items():
                whole = torch.cat(
                    [
                        torch.cat([per_rank[r][offset : offset + part] for r in run])[:numel]
                        for run in holders
                    ]
                )
                # Runs join on the first (expert) dimension.
                joined = (len(holders) * shape[0], *shape[1:]) if len(holders) > 1 else shape
                value = whole.view(tuple(joined)).float()
                if key:
                    state.states.setdefault(key, {})[name] = value
                else:
                    state.params[name] = value
            offset += part
        found = [inner[0]["state"][s] for s in sub_groups]
        state.groups.append({"hyper": _hyper(group), "scalars": _scalar_step(found)})
    state.loss_scaler = _loss_scaler(ranks[0].get(LOSS_SCALER), ranks[0])
    frozen_shapes = model_states.get(FROZEN_PARAM_SHAPES) or {}
    if frozen_shapes:
        fragments = [read_pt(p).get(FROZEN_PARAM_FRAGMENTS) or {} for p in _stage3_models(tag_dir)]
        for name, shape in frozen_shapes.items():
            numel = math.prod(shape)
            whole = torch.cat([f[name].reshape(-1) for f in fragments])[:numel]
            state.frozen[name] = whole.view(tuple(shape))


def _expert_runs(tag_dir: Path, ranks: list[dict], model_states: dict) -> list[list[int]]:
    """AutoEP at ZeRO 3: the ranks holding each run of experts, runs in expert order, each in
    its partition order ([] without AutoEP). Each rank's model-states file says its run
    (`ep_rank`); its optimizer file the ranks it partitions that run with."""
    if not model_states.get(AUTOEP_LAYERS):
        return []
    runs: dict[int, list[int]] = {}
    for r, path in enumerate(_stage3_models(tag_dir)):
        layers = model_states[AUTOEP_LAYERS] if r == 0 else read_pt(path)[AUTOEP_LAYERS]
        if layers[0].get("checkpoint_format") != "zero3_partitioned":
            raise CheckpointError(
                f"{tag_dir}: an AutoEP ZeRO 3 checkpoint in the format "
                f"{layers[0].get('checkpoint_format')!r}; shardspeed reads DeepSpeed 0.19's "
                "'zero3_partitioned' one: convert it with DeepSpeed's ds_to_universal"
            )
        partition = next(
            g
            for g in ranks[r].get("ds_zero_partition_groups", [])
            if "autoep_expert" in g["families"]
        )
        runs.setdefault(layers[0]["ep_rank"], list(partition["partition_ranks"]))
    return [runs[e] for e in sorted(runs)]


def _stage3_models(tag_dir: Path) -> list[Path]:
    return _matching(tag_dir, f"{ZERO_FILE_PREFIX}*_{MODEL_FILE_PREFIX}00{MODEL_FILE_SUFFIX}")


def _read_layer(state: DeepSpeedState, path: Path) -> None:
    index = int(re.match(rf"{LAYER_FILE_PREFIX}(\d+)-", path.name).group(1))
    for key, value in read_pt(path).items():
        name = f"{index}.{key}"
        if name not in state.params and torch.is_tensor(value):
            state.frozen[name] = value


def _read_universal(tag_dir: Path) -> DeepSpeedState:
    state = DeepSpeedState()
    first = Path(get_model_ckpt_name_for_rank(tag_dir, "00"))
    model_states = read_pt(first) if first.exists() else {}
    _bookkeeping(state, model_states, tag_dir)
    optimizer = read_pt(tag_dir / "zero" / "optimizer_state.pt")
    shapes = model_states.get(PARAM_SHAPES) or [
        {p.name: None for p in sorted((tag_dir / "zero").iterdir()) if p.is_dir()}
    ]
    steps = []
    for names in shapes:
        for name in names:
            folder = tag_dir / "zero" / name
            state.params[name] = _universal_tensor(folder / f"{FP32_WEIGHT_KEY}.pt").float()
            for file in sorted(folder.glob("*.pt")):
                if file.stem in (FP32_WEIGHT_KEY, "step"):
                    continue
                state.states.setdefault(file.stem, {})[name] = _universal_tensor(file).float()
            if (folder / "step.pt").exists():
                steps.append({"step": read_pt(folder / "step.pt")})
    for g, group in enumerate(optimizer.get(PARAM_GROUPS, [{}] * len(shapes))):
        if g < len(shapes):
            state.groups.append({"hyper": _hyper(group), "scalars": _scalar_step(steps)})
    state.loss_scaler = _loss_scaler(optimizer.get(LOSS_SCALER), optimizer)
    state.written_by = {"zero_stage": int(optimizer.get(ZERO_STAGE, 0)), "pipeline_stages": 1}
    return state


def _universal_tensor(path: Path) -> torch.Tensor:
    value = read_pt(path)
    return value[PARAM] if isinstance(value, dict) else value


# -- writing ----------------------------------------------------------------------------------------


def write_shardspeed(state: DeepSpeedState, dst: Path, tag: str) -> Path:
    """Write `state` as shardspeed checkpoint `<dst>/<tag>` (one tensor file) and point `latest`
    at it; returns the tag directory. The directory appears whole or not at all."""
    dst.mkdir(parents=True, exist_ok=True)
    partial = dst / f".{tag}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    logical: dict[str, tuple[str, torch.Tensor]] = {}
    for kind, prefix, values in (
        ("param", "master", state.params),
        ("param", "frozen", state.frozen),
        ("buffer", "buffer", state.buffers),
    ):
        for name, value in values.items():
            key = f"{prefix}.{name}"
            tensors[key] = value.detach().reshape(-1)
            logical[f"{kind}/{name}"] = (key, value)
    for state_name, values in state.states.items():
        for name, value in values.items():
            key = f"optim.{state_name}.{name}"
            tensors[key] = value.detach().reshape(-1)
            logical[f"optim/{state_name}/{name}"] = (key, value)
    extra: dict[str, torch.Tensor] = {}
    shared = {
        "optimizer": {
            "type": "AdamW",
            "groups": [
                {"hyper": encode(g["hyper"], extra, "extra."), "scalars": g["scalars"]}
                for g in state.groups
            ],
        },
        "loss_scaler": encode(state.loss_scaler, extra, "extra."),
        "lr_scheduler": encode(state.lr_scheduler, extra, "extra."),
        "counters": state.counters,
        "data_loader": None,
        "client_state": encode(state.client_state, extra, "client.", "client_state"),
    }
    file = "rank00000.safetensors"
    described = write_tensor_file(partial / file, {**tensors, **extra})
    where = described.pop("tensors")
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "written_by": {
            "world_size": 1,
            "dp_world_size": 1,
            "pipeline_stages": 1,
            "tensor_parallel": 1,
            "zero_stage": state.written_by.get("zero_stage", 0),
            "model_dtype": "F32",
            "exclude_frozen_parameters": False,
            "imported_from": "deepspeed",
        },
        "aliases": {},
        "files": {file: described},
        "tensors": {
            name: {
                "shape": list(value.shape),
                "dtype": where[key][1],
                "pieces": [[file, where[key][0], 0, value.numel(), where[key][1]]],
            }
            for name, (key, value) in logical.items()
        },
        "splits": {},
        "ranks": [],
        **shared,
    }
    write_manifest(partial, manifest)
    final = dst / tag
    if final.exists():
        raise CheckpointError(f"{final} exists already: import into an empty place")
    partial.rename(final)
    (dst / LATEST).write_text(tag)
    return final


def import_deepspeed(src: str | Path, dst: str | Path, tag: str | None = None) -> Path:
    """`shardspeed-ckpt import-deepspeed SRC DST`: DeepSpeed checkpoint `SRC` (its `latest`, or
    `tag`) as shardspeed checkpoint `DST/<tag>`; returns that directory."""
    src, dst = Path(src), Path(dst)
    tag_dir = deepspeed_tag_dir(src, tag)
    if tag_dir is None:
        raise CheckpointError(f"{src}: no DeepSpeed checkpoint there (looked for latest and {tag})")
    return write_shardspeed(read_deepspeed(tag_dir), dst, tag_dir.name)


@contextmanager
def imported(load_dir: Path, tag: str | None) -> Iterator[tuple[Path, str] | None]:
    """A DeepSpeed checkpoint at `load_dir` converted into a temporary shardspeed one, as
    (directory, tag), for the time of a load; None when `load_dir` holds no DeepSpeed one."""
    tag_dir = deepspeed_tag_dir(load_dir, tag)
    if tag_dir is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="shardspeed-import-") as tmp:
        write_shardspeed(read_deepspeed(tag_dir), Path(tmp), tag_dir.name)
        yield Path(tmp), tag_dir.name
