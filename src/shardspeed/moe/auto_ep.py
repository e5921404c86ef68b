"""DeepSpeed's AutoEP: the config's `expert_parallel` section applied to a Hugging Face MoE model.

Each MoE block of the model (by preset, by `moe_layer_pattern`, or found from the structure: a
module whose `experts` child holds fused expert tensors behind transformers' experts interface)
keeps its router and shared experts as they are; its experts module becomes expert-parallel over
the mesh's expert group (`expert_parallel.shard_experts`). The model's own router decides, so the
section's routing keys (`score_func`, `top_k`, `route_norm`, `route_scale`,
`routed_scaling_factor`, `num_expert_groups`, `num_limited_groups`, `score_apply`) may only
describe the model's routing: a value that would change it is refused naming the key and the
model's value. Presets are data (`PRESETS`): DeepSpeed's families and GPT-OSS, OLMoE and GLM-4-MoE.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..comm import ExpertGroups
from ..config.errors import ConfigError
from .balance import routing_bias
from .expert_parallel import expert_tensors, shard_experts

_KEY = "expert_parallel"


@dataclass(frozen=True)
class Preset:
    """A model family's MoE block: the model types it covers, the child names of its router
    and shared experts, its scoring, and the model config attributes its routing reads (a bool
    for `route_norm` where the family always or never normalises)."""

    model_types: tuple[str, ...]
    router: str = "gate"
    score_func: str = "softmax"
    route_norm: bool | str = "norm_topk_prob"
    route_scale: str | None = None  # the config attribute scaling routed weights
    groups: tuple[str, str] | None = None  # config attributes: expert groups, groups kept
    shared: tuple[str, ...] = field(default_factory=tuple)  # shared experts (and their gate)
    # How a balancing bias reaches the router's choice (balance.py), None: not offered.
    selection: str | None = "softmax"


PRESETS: dict[str, Preset] = {
    "mixtral": Preset(("mixtral",), route_norm=True),
    "qwen2_moe": Preset(("qwen2_moe",), shared=("shared_expert", "shared_expert_gate")),
    "qwen3_moe": Preset(("qwen3_moe", "qwen2_moe")),  # DeepSpeed's covers both
    "qwen3_5_moe": Preset(("qwen3_5_moe",), shared=("shared_expert", "shared_expert_gate")),
    "deepseek_v2": Preset(
        ("deepseek_v2",),
        route_scale="routed_scaling_factor",
        groups=("n_group", "topk_group"),
        shared=("shared_experts",),
        selection=None,  # group-limited softmax routing: no biased choice offered yet
    ),
    "deepseek_v3": Preset(
        ("deepseek_v3",),
        score_func="sigmoid",
        route_scale="routed_scaling_factor",
        groups=("n_group", "topk_group"),
        shared=("shared_experts",),
        selection="correction",  # its router's own e_score_correction_bias
    ),
    "glm4_moe": Preset(
        ("glm4_moe",),
        score_func="sigmoid",
        route_scale="routed_scaling_factor",
        groups=("n_group", "topk_group"),
        shared=("shared_experts",),
        selection="correction",
    ),
    "gpt_oss": Preset(  # softmax of the top k logits
        ("gpt_oss",), router="router", route_norm=True, selection="logits"
    ),
    "olmoe": Preset(("olmoe",)),
}
_TOP_K = "num_experts_per_tok"


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block found: its module name, the block, its experts module, expert count."""

    name: str
    block: nn.Module
    experts: nn.Module
    count: int


def apply_expert_parallel(
    model: nn.Module,
    section: Any,
    groups: ExpertGroups | None,
    grouped_mm: bool | None = None,
    token_peers: Any = None,
) -> list[MoEBlock]:
    """Make every MoE block of `model` expert-parallel over `groups` as the `expert_parallel`
    `section` says; return the blocks. Nothing happens when the section is off. `token_peers`:
    the tensor-parallel group when the expert groups span it (`shard_experts`)."""
    if not section.enabled:
        return []
    config = getattr(model, "config", None)
    preset = _preset(section, config)
    blocks = _find_blocks(model, section, preset)
    _check_structure(blocks, section, preset, config)
    _check_routing(section, preset, config, blocks[0])
    size = section.autoep_size
    for block in blocks:
        if block.count % size:
            divisors = [d for d in range(1, block.count + 1) if block.count % d == 0]
            raise ConfigError(
                f"'{_KEY}.autoep_size' is {size}, which does not divide the {block.count} "
                f"experts of '{block.name}': use one of {divisors}"
            )
    replicas = section.hot_expert_replicas
    if replicas and size == 1:
        raise ConfigError(
            f"'{_KEY}.hot_expert_replicas' is {replicas}, but at 'autoep_size' 1 every rank "
            "holds every expert: there is nothing to copy; remove the key or raise autoep_size"
        )
    fewest = min(block.count for block in blocks)
    if replicas >= fewest:
        raise ConfigError(
            f"'{_KEY}.hot_expert_replicas' is {replicas}; the blocks have {fewest} experts, so "
            f"it must be below {fewest} (copying every expert would leave nothing to exchange)"
        )
    if section.rebalance_interval and size == 1:
        raise ConfigError(
            f"'{_KEY}.rebalance_interval' is {section.rebalance_interval}, but at 'autoep_size' "
            "1 every rank holds every expert: there is nothing to move; remove the key"
        )
    if section.validate_folding_routing and token_peers is None:
        raise ConfigError(
            f"'{_KEY}.validate_folding_routing' checks that tensor-parallel peers route alike, "
            "and this run has no AutoTP ('tensor_parallel.autotp_size' > 1): remove the key"
        )
    implementation = _implementation(section.use_grouped_mm if grouped_mm is None else grouped_mm)
    for block in blocks:
        shard_experts(
            block.experts, groups, implementation, token_peers, section.validate_folding_routing
        )
    if section.load_balance_coeff is not None:
        _add_routing_biases(blocks, section, preset, config)
    return blocks


def _add_routing_biases(
    blocks: list[MoEBlock], section: Any, preset: Preset | None, config: Any
) -> None:
    """Give each block's router the bias `load_balance_coeff` moves (moe/balance.py), kept on
    its experts module as `routing_bias`."""
    if preset is None or preset.selection is None:
        family = getattr(config, "model_type", None) or "this model"
        raise ConfigError(
            f"'{_KEY}.load_balance_coeff': auxiliary-loss-free balancing is offered for the "
            f"routers of {sorted(n for n, p in PRESETS.items() if p.selection)}, not for "
            f"{family}'s: remove the key"
        )
    routing = _model_routing(preset, config)
    router_name = section.router_pattern or preset.router
    for block in blocks:
        router = getattr(block.block, router_name)
        block.experts.routing_bias = routing_bias(router, preset.selection, routing["route_norm"])


def _preset(section: Any, config: Any) -> Preset | None:
    model_type = getattr(config, "model_type", None)
    if section.preset_model is not None:
        preset = PRESETS[section.preset_model]
        if model_type is not None and model_type not in preset.model_types:
            raise ConfigError(
                f"'{_KEY}.preset_model' is '{section.preset_model}', for model types "
                f"{list(preset.model_types)}, but this model's config says '{model_type}': "
                "pick its family's preset, or leave the key out to detect it"
            )
        return preset
    for preset in PRESETS.values():
        if model_type in preset.model_types:
            return preset
    return None


def _is_experts(module: nn.Module) -> int:
    """The expert count of an experts module behind transformers' interface (its own tensors
    fused with the expert first, called with hidden states, expert indices and weights), else
    0."""
    tensors = expert_tensors(module)
    if not tensors or any(p.dim() < 2 for _, p in tensors):
        return 0
    count = tensors[0][1].shape[0]
    if count < 2 or any(p.shape[0] != count for _, p in tensors):
        return 0
    try:
        parameters = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return 0
    return count if len(parameters) >= 4 else 0  # self, hidden states, indices, weights


def _find_blocks(model: nn.Module, section: Any, preset: Preset | None) -> list[MoEBlock]:
    child = section.expert_pattern or "experts"
    pattern = re.compile(section.moe_layer_pattern) if section.moe_layer_pattern else None
    found = []
    for name, module in model.named_modules():
        if pattern is not None and not pattern.fullmatch(name):
            continue
        experts = getattr(module, child, None)
        count = _is_experts(experts) if isinstance(experts, nn.Module) else 0
        if count:
            found.append(MoEBlock(name, module, experts, count))
        elif pattern is not None:
            raise ConfigError(
                f"'{_KEY}.moe_layer_pattern' matches '{name}', which has no '{child}' child "
                "holding fused expert tensors: narrow the pattern, or set "
                f"'{_KEY}.expert_pattern' to the child's name"
            )
    if not found:
        what = type(model).__name__
        known = ", ".join(PRESETS)
        raise ConfigError(
            f"'{_KEY}' is enabled, but {what} has no MoE block with an '{child}' child holding "
            "fused expert tensors (transformers' experts interface, transformers 5): set "
            f"'{_KEY}.preset_model' (one of {known}) for a supported family, or "
            f"'{_KEY}.moe_layer_pattern' and '{_KEY}.expert_pattern' to name the blocks and "
            "their experts; a model built from DeepSpeed's MoE layer needs no section"
        )
    del preset
    return found


def _check_structure(
    blocks: list[MoEBlock], section: Any, preset: Preset | None, config: Any
) -> None:
    """What the section names must exist on every block: the router, shared experts, weights."""
    block = blocks[0]
    router = section.router_pattern or (preset.router if preset else None)
    if router is not None and not isinstance(getattr(block.block, router, None), nn.Module):
        key = "router_pattern" if section.router_pattern else "preset_model"
        raise ConfigError(
            f"'{_KEY}.{key}' names the router '{router}', which '{block.name}' does not have"
        )
    names = dict(expert_tensors(block.experts))
    for key in ("expert_w1", "expert_w2", "expert_w3"):
        value = getattr(section, key)
        if value is not None and value not in names:
            raise ConfigError(
                f"'{_KEY}.{key}' is '{value}', which '{block.name}.{section.expert_pattern or 'experts'}'"
                f" does not hold (it holds {sorted(names)})"
            )
    if section.has_shared_experts is not None or section.shared_experts_pattern:
        wanted = [
            p for p in (section.shared_experts_pattern, section.shared_experts_gate_pattern) if p
        ]
        wanted = wanted or list(preset.shared if preset else ())
        present = all(isinstance(getattr(block.block, n, None), nn.Module) for n in wanted)
        if section.has_shared_experts is False and preset and preset.shared:
            raise ConfigError(
                f"'{_KEY}.has_shared_experts' is false, but '{block.name}' has shared experts "
                f"({', '.join(preset.shared)}): they stay in the block and run on every rank; "
                "remove the key"
            )
        if section.has_shared_experts is not False and not (wanted and present):
            raise ConfigError(
                f"'{_KEY}.shared_experts_pattern': '{block.name}' has no shared experts named "
                f"{wanted}: correct the names or remove the keys"
            )
    for key, attribute, value in (
        ("num_experts_attr", section.num_experts_attr, block.count),
        ("top_k_attr", section.top_k_attr, None),
    ):
        if attribute is None:
            continue
        if config is None or not hasattr(config, attribute):
            raise ConfigError(
                f"'{_KEY}.{key}' is '{attribute}', which the model's config does not have"
            )
        if value is not None and getattr(config, attribute) != value:
            raise ConfigError(
                f"'{_KEY}.{key}': the model's config says {attribute} = "
                f"{getattr(config, attribute)}, but '{block.name}' holds {value} experts"
            )


def _model_routing(preset: Preset | None, config: Any) -> dict[str, Any]:
    """What the model's own router does, as the section's keys say it (what is known)."""
    if preset is None or config is None:
        return {}
    norm = preset.route_norm
    routing: dict[str, Any] = {
        "score_func": preset.score_func,
        "score_apply": "post",
        "route_norm": norm if isinstance(norm, bool) else bool(getattr(config, norm, False)),
        "route_scale": float(getattr(config, preset.route_scale, 1.0) or 1.0)
        if preset.route_scale
        else 1.0,
    }
    if hasattr(config, _TOP_K):
        routing["top_k"] = getattr(config, _TOP_K)
    if preset.groups is not None:
        routing["num_expert_groups"] = getattr(config, preset.groups[0], None)
        routing["num_limited_groups"] = getattr(config, preset.groups[1], None)
    else:
        routing["num_expert_groups"] = routing["num_limited_groups"] = None
    return routing


def _check_routing(section: Any, preset: Preset | None, config: Any, block: MoEBlock) -> None:
    """Routing keys the section sets must agree with the model's router, which EP leaves as it
    is; a key whose model value is not known cannot be honoured and is refused."""
    model = _model_routing(preset, config)
    given = section.model_fields_set
    asked: dict[str, Any] = {}
    for key in ("score_func", "score_apply", "top_k"):
        if key in given and getattr(section, key) != "auto":
            asked[key] = getattr(section, key)
    for key in ("route_norm", "num_expert_groups", "num_limited_groups"):
        if key in given and getattr(section, key) is not None:
            asked[key] = getattr(section, key)
    if "route_scale" in given:
        asked["route_scale"] = float(section.route_scale)
    if "routed_scaling_factor" in given and section.routed_scaling_factor != "auto":
        asked["route_scale"] = float(section.routed_scaling_factor)
    for key, value in asked.items():
        if key not in model:
            raise ConfigError(
                f"'{_KEY}.{key}' is {value!r}, but shardspeed cannot tell the routing of "
                f"'{block.name}' ({type(block.block).__name__}): its own router runs unchanged "
                f"under expert parallelism; remove the key (or set '{_KEY}.preset_model')"
            )
        if model[key] != value:
            raise ConfigError(
                f"'{_KEY}.{key}' is {value!r}, but the model's router uses {model[key]!r}: "
                "expert parallelism keeps the model's own routing, so the result stays the "
                "model's; remove the key or set the model's value"
            )


def _implementation(grouped_mm: bool) -> str:
    """transformers' experts implementation for the local experts: its grouped matmul where the
    installed transformers has one (torch's kernel where the device has it, its own fallback
    otherwise), else the model's per-expert loop."""
    if not grouped_mm:
        return "eager"
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without the experts interface's implementations
        return "eager"
    return "grouped_mm" if "grouped_mm" in ALL_EXPERTS_FUNCTIONS else "eager"
