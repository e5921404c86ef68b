"""Automatic tensor parallelism (DeepSpeed's AutoTP): split an existing model's attention and MLP
linears by name, in place, keeping each rank's slice of the loaded weights.

Column layers (q, k, v, the MLP's first linears) keep their slice of the outputs, that is their
heads; row layers (the output projections) take those slices and all-reduce. Everything else
stays whole on every rank. Built-in rules know Hugging Face GPT-2, Llama-like (Llama, Mistral,
Qwen2) and BERT-like models; a `policy` names the layers of any other model.

What the transformers (5.x) attention modules need: they reshape with -1 heads and `head_dim`, so
only GPT-2's `split_size` (the width of each of q, k, v in `c_attn`'s output) must shrink; the head
counts stored on the module are shrunk too, for code that reads them. Inside the modules known to
feed one input to all their column layers (`_SHARED_INPUT`), that input enters the tensor region
once, in a pre-hook, rather than once per layer; under sequence parallelism this is also what gives
the attention module the whole sequence its reshapes expect.

Sequence parallelism: the blocks (the `nn.ModuleList` holding the split layers) run on sequence
shards (dim -2: the sequence of [batch, seq, hidden]) between the attention and MLP modules; the
first block's input is scattered and the last block's output gathered, so the rest of the model
is unchanged. Their replicated parameters get `sequence_parallel = True`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .layers import (
    ColumnParallelLinear,
    Group,
    RowParallelLinear,
    enter_tensor_region,
)
from .mappings import gather_from_sequence_region, scatter_to_sequence_region, world_size

# Module-name patterns (searched) of the layers to split, per model family. A pattern also matches
# a module whose weight's name it matches (DeepSpeed's layer_specs name parameters).
FAMILIES: dict[str, dict[str, list[str]]] = {
    "gpt2": {  # Conv1D layers; c_attn is q|k|v fused, split per part
        "column": [r"(^|\.)attn\.c_attn$", r"(^|\.)mlp\.c_fc$"],
        "row": [r"(^|\.)attn\.c_proj$", r"(^|\.)mlp\.c_proj$"],
    },
    "llama": {  # also Mistral, Qwen2
        "column": [r"self_attn\.(q|k|v)_proj$", r"mlp\.(gate|up)_proj$"],
        "row": [r"self_attn\.o_proj$", r"mlp\.down_proj$"],
    },
    "bert": {  # also RoBERTa; cross-attention ("crossattention.") stays whole
        "column": [r"(^|\.)attention\.self\.(query|key|value)$", r"(^|\.)intermediate\.dense$"],
        "row": [r"(^|\.)attention\.output\.dense$", r"(^|\.)layer\.\d+\.output\.dense$"],
    },
}
BUILTIN_POLICY: dict[str, list[str]] = {
    kind: [p for family in FAMILIES.values() for p in family[kind]] for kind in ("column", "row")
}
_ALIASES = {"qwen2": "llama"}  # DeepSpeed's preset_model names

# Modules whose forward feeds its first input (hidden_states) to every column layer it holds.
_SHARED_INPUT = frozenset(
    f"{family}{part}"
    for family in ("GPT2", "Llama", "Mistral", "Qwen2", "Qwen3", "Qwen2Moe", "Qwen3Moe", "Mixtral")
    for part in ("Attention", "MLP")
) | {"BertSelfAttention", "BertIntermediate", "RobertaSelfAttention", "RobertaIntermediate"}
_HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads")
_WIDTHS = ("split_size", "all_head_size")  # GPT-2's q/k/v width; BERT's (not read in forward)
_HEAD_DIMS = ("head_dim", "attention_head_size")

Policy = str | Mapping[str, Sequence[str]] | Sequence[Mapping[str, Any] | Any]


def auto_tensor_parallel(
    model: nn.Module, group: Group, policy: Policy | None = None, sequence_parallel: bool = False
) -> nn.Module:
    """Split `model`'s attention and MLP linears over `group` (the tensor-parallel group, the
    engine topology's `tp_group`), in place; returns the model. `sequence_parallel`: the blocks
    between them run on sequence shards.

    `policy`: None (the built-in rules), a family name ("gpt2", "llama", "qwen2", "bert"),
    {"column": [pattern, ...], "row": [pattern, ...]}, or DeepSpeed's
    `tensor_parallel.partition_config.layer_specs` shape, [{"patterns": [...],
    "partition_type": "column" | "row"}, ...], where the first spec that matches wins. Patterns
    are regular expressions searched in module names (or their weights' names, such as
    r"\\.o_proj\\.weight$"). Column layers split their outputs (q, k, v, the MLP's first linears),
    row layers their inputs (the projections back to the hidden size).
    """
    plan = _plan(model, _rules(policy), policy)
    size = world_size(group)
    columns: dict[str, list[str]] = {}  # parent module: its column layers
    for name, kind in plan.items():
        if kind == "column":
            columns.setdefault(_parent_name(name), []).append(name)
    per_head = [
        p for parent, names in columns.items() for p in _check_heads(model, parent, names, size)
    ]
    shared = {parent for parent in columns if _feeds_all_columns(model.get_submodule(parent))}
    layers = {}
    for name, kind in plan.items():
        module = model.get_submodule(name)
        try:
            if kind == "column":
                layers[name] = ColumnParallelLinear.from_linear(
                    module,
                    group,
                    sequence_parallel=sequence_parallel,
                    stride=_stride(name, module),
                    input_in_region=_parent_name(name) in shared,
                )
            else:
                layers[name] = RowParallelLinear.from_linear(
                    module, group, sequence_parallel=sequence_parallel
                )
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
    blocks = _blocks(model, plan) if sequence_parallel else []
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    for parent in columns:
        _shrink(model.get_submodule(parent), size)
    for param in per_head:
        # Whole on every rank, its gradient covering this rank's heads only: summed over the
        # group before the step, as Megatron's mark for such weights says.
        param.sequence_parallel = True
    for parent in shared:
        hook = functools.partial(_enter_region, group=group, sequence_parallel=sequence_parallel)
        model.get_submodule(parent).register_forward_pre_hook(hook, with_kwargs=True)
    if blocks:
        _shard_sequence(model, blocks, shared, group)
    return model


def policy_from_layer_specs(specs: Sequence[Mapping[str, Any] | Any]) -> dict[str, list[str]]:
    """DeepSpeed's `partition_config.layer_specs` as a {"column": [...], "row": [...]} policy
    (patterns on parameter names match the module holding the parameter)."""
    policy: dict[str, list[str]] = {"column": [], "row": []}
    for kind, pattern in _spec_rules(specs):
        policy[kind].append(pattern)
    return policy


# -- which layers -------------------------------------------------------------------------------


def _rules(policy: Policy | None) -> list[tuple[str, str]]:
    """(kind, pattern) pairs, first match wins."""
    if policy is None:
        policy = BUILTIN_POLICY
    if isinstance(policy, str):
        family = _ALIASES.get(policy, policy)
        if family not in FAMILIES:
            names = sorted([*FAMILIES, *_ALIASES])
            raise ValueError(f"unknown policy {policy!r}: one of {names}, or rules")
        policy = FAMILIES[family]
    if isinstance(policy, Mapping):
        unknown = set(policy) - {"column", "row"}
        if unknown:
            raise ValueError(f"a policy's keys are 'column' and 'row', not {sorted(unknown)}")
        return [(kind, p) for kind in ("column", "row") for p in policy.get(kind, ())]
    return _spec_rules(policy)


def _spec_rules(specs: Sequence[Mapping[str, Any] | Any]) -> list[tuple[str, str]]:
    rules = []
    for spec in specs:
        read = spec.get if isinstance(spec, Mapping) else functools.partial(getattr, spec)
        kind, patterns = read("partition_type", None), read("patterns", None)
        if kind not in ("column", "row") or not patterns or isinstance(patterns, str):
            raise ValueError(
                f"a layer spec needs 'patterns' (a list of regular expressions) and "
                f"'partition_type' 'column' or 'row', got {spec!r}"
            )
        for key in ("shape", "partition_dim"):
            if read(key, None) is not None:
                raise ValueError(f"layer spec {key!r} is not supported: {spec!r}")
        rules += [(kind, p) for p in patterns]
    return rules


def _linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _plan(model: nn.Module, rules: list[tuple[str, str]], policy: Policy | None) -> dict[str, str]:
    """{module name: "column" | "row"} of the linears the rules match."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if not _linear_like(module):
            continue
        for kind, pattern in rules:
            if re.search(pattern, name) or re.search(pattern, f"{name}.weight"):
                plan[name] = kind
                break
    if plan and set(plan.values()) == {"column", "row"}:
        return plan
    linears = [n for n, m in model.named_modules() if _linear_like(m)]
    shown = ", ".join(linears[:12]) + (
        f", ... ({len(linears)} in all)" if len(linears) > 12 else ""
    )
    if policy is None:
        what = "no layer matches the built-in rules (Hugging Face GPT-2, Llama-like, BERT-like)"
    else:
        what = f"the policy matches {'no layer' if not plan else 'only ' + ', '.join(plan)}"
    raise ValueError(
        f"automatic tensor parallelism of {type(model).__name__}: {what}; it needs column and "
        f"row layers. Its linear layers: {shown or 'none'}. Give a policy naming them: "
        "auto_tensor_parallel(model, group, policy={'column': [r'attn\\.q$', ...], 'row': "
        "[r'attn\\.out$', ...]}) (column: layers whose outputs are split, such as q, k, v and "
        "the MLP's first linear; row: the projections back to the hidden size), or the config's "
        "tensor_parallel.partition_config.layer_specs"
    )


def _parent_name(name: str) -> str:
    return name.rpartition(".")[0]


def _stride(name: str, module: nn.Module) -> int:
    """GPT-2's c_attn is q|k|v fused (k|v in cross-attention): each part is split on its own."""
    nf, nx = getattr(module, "nf", None), getattr(module, "nx", None)
    if name.endswith("c_attn") and nf and nx and nf % nx == 0:
        return nf // nx
    return 1


# -- attention modules --------------------------------------------------------------------------


def _head_dim(module: nn.Module) -> int | None:
    return next((v for a in _HEAD_DIMS if isinstance(v := getattr(module, a, None), int)), None)


def _check_heads(
    model: nn.Module, parent_name: str, columns: list[str], size: int
) -> list[nn.Parameter]:
    """Heads are split whole: each rank's slice of each of q, k, v must be whole heads, and an
    attention module's other parameters must act on each head alike. Returns those (their
    gradients are partial: each rank's covers its heads)."""
    parent = model.get_submodule(parent_name)
    head_dim = _head_dim(parent)
    for name in columns:
        layer = model.get_submodule(name)
        out_dim = 1 if type(layer).__name__ == "Conv1D" else 0
        width = layer.weight.shape[out_dim] // _stride(name, layer)
        if head_dim and width % head_dim == 0 and (width // head_dim) % size:
            raise ValueError(
                f"{name}: {width // head_dim} attention heads of size {head_dim} do not split "
                f"over {size} tensor-parallel ranks (the head count must divide by the group size)"
            )
    for attr in _HEAD_COUNTS:
        count = getattr(parent, attr, None)
        if isinstance(count, int) and count % size:
            raise ValueError(
                f"{parent_name}.{attr} = {count} heads do not split over {size} tensor-parallel "
                "ranks (the head count must divide by the group size)"
            )
    if not head_dim:
        return []
    others = {
        n: p
        for n, p in parent.named_parameters()
        if not _linear_like(parent.get_submodule(_parent_name(n)))
    }
    # A norm applied to each head alike (Qwen3's q_norm/k_norm, of head_dim weights) works on
    # this rank's heads as on all; one over the whole width (OLMoE's), or one value per head
    # (GPT-OSS's sinks), would need every head.
    across = [n for n, p in others.items() if p.dim() != 1 or p.numel() != head_dim]
    if across:
        raise ValueError(
            f"{parent_name} holds parameters besides its linears ({', '.join(across)}) that "
            "span its heads and would see only this rank's: such attention modules are not "
            "supported"
        )
    return list(others.values())


def _feeds_all_columns(module: nn.Module) -> bool:
    known = type(module).__name__ in _SHARED_INPUT
    return known and not getattr(module, "is_cross_attention", False)


def _shrink(module: nn.Module, size: int) -> None:
    """The head counts and widths an attention module stores become this rank's."""
    for attr in (*_HEAD_COUNTS, *_WIDTHS):
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(module, attr, value // size)


def _enter_region(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    group: Group,
    sequence_parallel: bool,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Pre-hook: the module's input (first argument or `hidden_states`) enters the tensor region
    once for all its column layers."""
    if args:
        return (enter_tensor_region(args[0], group, sequence_parallel), *args[1:]), kwargs
    if "hidden_states" not in kwargs:
        raise TypeError(f"{type(module).__name__} called without its input (hidden_states)")
    kwargs["hidden_states"] = enter_tensor_region(kwargs["hidden_states"], group, sequence_parallel)
    return args, kwargs


# -- sequence parallelism -----------------------------------------------------------------------


def _blocks(model: nn.Module, plan: dict[str, str]) -> list[str]:
    """The names of the blocks of the outermost nn.ModuleList holding every split layer; each
    block must hold some (the stretch between the first and last block runs on shards)."""
    for list_name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        prefix = f"{list_name}." if list_name else ""
        if not all(name.startswith(prefix) for name in plan):
            continue
        blocks = [f"{prefix}{i}" for i in range(len(module))]
        empty = [b for b in blocks if not any(name.startswith(f"{b}.") for name in plan)]
        if empty:
            raise ValueError(
                f"sequence parallelism runs the blocks of {list_name} on sequence shards, and "
                f"{', '.join(empty)} hold no split layer"
            )
        return blocks
    raise ValueError(
        "sequence parallelism needs the split layers inside one nn.ModuleList of blocks"
    )


def _shard_sequence(model: nn.Module, blocks: list[str], shared: set[str], group: Group) -> None:
    first, last = model.get_submodule(blocks[0]), model.get_submodule(blocks[-1])
    first.register_forward_pre_hook(
        functools.partial(_scatter_input, group=group), with_kwargs=True
    )
    last.register_forward_hook(functools.partial(_gather_output, group=group))
    for block in blocks:
        for name, module in model.get_submodule(block).named_modules(prefix=block):
            # Inside a shared-input module the whole sequence is back (its layers are split).
            if any(name == s or name.startswith(f"{s}.") for s in shared):
                continue
            if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
                for param in module.parameters(recurse=False):
                    param.sequence_parallel = True  # it works on this rank's tokens only


def _scatter_input(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], group: Group
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (scatter_to_sequence_region(args[0], group), *args[1:]), kwargs
    kwargs["hidden_states"] = scatter_to_sequence_region(kwargs["hidden_states"], group)
    return args, kwargs


def _gather_output(module: nn.Module, args: tuple[Any, ...], output: Any, group: Group) -> Any:
    # What follows the blocks is replicated: each rank's gradient is whole (partial_grad False).
    if isinstance(output, torch.Tensor):
        return gather_from_sequence_region(output, group, partial_grad=False)
    return (gather_from_sequence_region(output[0], group, partial_grad=False), *output[1:])
