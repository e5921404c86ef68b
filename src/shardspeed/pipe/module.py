"""`PipelineModule`: a list of layers cut into stages, each rank building only its own.

As in DeepSpeed, `layers` mixes `LayerSpec`s (built lazily, only where they run), ready modules and
plain callables; each layer takes one argument (a tensor or a tuple) and returns the next. Parameters
are named by global layer index ("<index>.<name>"), so a stage's state dict, and its checkpoints,
line up with the same layers in any other partitioning, pipelined or not.

A `TiedLayerSpec` key names one module shared by several layers (an embedding reused as the output
head). Each stage that uses it builds it once, under the index of the key's first layer; its
parameters start equal on every such stage and their gradients are summed across them before each
step (the optimizer does that, given `tied_parameters()`). DeepSpeed keeps only the
`tied_weight_attr` weights in step and lets a tied module's other parameters drift apart; here the
whole module is shared, so its copies always agree and its checkpoint names are unambiguous.

With `virtual_stages` v > 1 (a shardspeed extension for the interleaved schedule) the layers are cut
into p*v parts and rank r holds parts r, r+p, ...: its model chunks.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpointing import checkpoint
from ..comm import Topology
from ..comm.topology import PipeDataParallelTopology, ProcessTopology
from ..zero.optimizer import TiedParameters

logger = logging.getLogger("shardspeed")


class LayerSpec:
    """A layer to build later, on the stage that runs it: `typename(*args, **kwargs)`."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError(f"LayerSpec needs a torch.nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{type(self).__name__}({self.typename.__name__}, {', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared with every other `TiedLayerSpec` of the same `key`.

    `forward_fn(module, input)` replaces `module(input)` where given (a head that multiplies by the
    embedding's weight); `tied_weight_attr` names the weights kept equal across stages.
    """

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )


class PipelineModule(nn.Module):
    """DeepSpeed's `PipelineModule` (see the module docstring). Needs the process group already
    initialised (`shardspeed.init_distributed()`): building it makes the pipeline's groups."""

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable = checkpoint,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
        virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "PipelineModule needs the process group: call shardspeed.init_distributed() first"
            )
        if activation_checkpoint_interval < 0:
            raise ValueError("activation_checkpoint_interval must be 0 (off) or positive")
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages must be at least 1, got {virtual_stages}")
        mesh = _mesh(num_stages, topology)
        self.layer_specs = list(layers)
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = (
            list(checkpointable_layers) if checkpointable_layers is not None else None
        )
        self.dynamic_shape = dynamic_shape
        self.virtual_stages = virtual_stages

        self.topo = Topology.from_mesh(mesh)
        self.num_stages = self.topo.num_stages
        self.stage_id = self.topo.stage
        self.parts = partition_layers(
            self.layer_specs, self.num_stages * virtual_stages, partition_method
        )
        # chunk c of this rank is virtual stage c * p + stage: layers parts[vs] .. parts[vs + 1]
        self.chunk_ranges = [
            range(self.parts[vs], self.parts[vs + 1])
            for vs in range(self.stage_id, self.num_stages * virtual_stages, self.num_stages)
        ]
        self.tied_modules: dict[str, nn.Module] = {}
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.chunk_funcs = [[self._build(i) for i in span] for span in self.chunk_ranges]
        self._ties = self._index_ties()
        self._synchronize_tied_weights()
        if self.topo.rank == 0:
            logger.info("pipeline partition %s (%s)", self.parts, partition_method)

    # -- building -------------------------------------------------------------------------------

    def _build(self, index: int) -> Callable:
        spec = self.layer_specs[index]
        if self.seed_layers:
            (self.seed_fn or torch.manual_seed)(self.base_seed + index)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                module = spec.build()
                self.tied_modules[spec.key] = module
                self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                self.add_module(str(self._first_index(spec.key)), module)
            module = self.tied_modules[spec.key]
            return functools.partial(spec.forward_fn, module) if spec.forward_fn else module
        if isinstance(spec, LayerSpec):
            spec = spec.build()
        if isinstance(spec, nn.Module):
            self.add_module(str(index), spec)
            return spec
        if not callable(spec):
            raise TypeError(
                f"layer {index} is neither a LayerSpec, a module nor callable: {spec!r}"
            )
        return spec

    def _first_index(self, key: str) -> int:
        return next(
            i
            for i, s in enumerate(self.layer_specs)
            if isinstance(s, TiedLayerSpec) and s.key == key
        )

    def stage_owner(self, layer_index: int) -> int:
        """The pipeline rank that runs layer `layer_index`."""
        for vs in range(len(self.parts) - 1):
            if self.parts[vs] <= layer_index < self.parts[vs + 1]:
                return vs % self.num_stages
        raise IndexError(f"layer {layer_index} is outside 0..{len(self.layer_specs) - 1}")

    def _index_ties(self) -> list[TiedParameters]:
        """The tied weights this rank holds, each with the mesh's group over the stages sharing it
        (collective: every rank asks for every tie's group, in key order)."""
        ties = []
        keys = sorted({s.key for s in self.layer_specs if isinstance(s, TiedLayerSpec)})
        self._tie_sources: list[int] = []
        for key in keys:
            stages = sorted(
                {
                    self.stage_owner(i)
                    for i, s in enumerate(self.layer_specs)
                    if isinstance(s, TiedLayerSpec) and s.key == key
                }
            )
            if len(stages) < 2:
                continue  # one stage holds every use: nothing to keep in step
            group, first = self.topo.tie_group(stages)
            if key in self.tied_modules:
                module = self.tied_modules[key]
                for name in self.tied_weight_attrs[key]:
                    if not isinstance(_attr(module, name), nn.Parameter):
                        raise TypeError(f"tied_weight_attr {name!r} of {key!r} is no parameter")
                # Every parameter of the shared module, not only tied_weight_attr: the others
                # would drift apart between the copies (as in DeepSpeed) under one name.
                params = tuple(module.parameters())
                ties.append(TiedParameters(params, group, counted=self.topo.rank == first))
                self._tie_sources.append(first)
        return ties

    def _synchronize_tied_weights(self) -> None:
        with torch.no_grad():
            for tie, source in zip(self._ties, self._tie_sources):
                for p in tie.params:
                    dist.broadcast(p.data, src=source, group=tie.group)

    def tied_parameters(self) -> list[TiedParameters]:
        """The tied weights this rank shares with other stages, with the groups that sum them."""
        return list(self._ties)

    def chunk_parameters(self) -> list[list[nn.Parameter]]:
        """The parameters of each of this rank's chunks (a tied module counts with its first use)."""
        seen: set[nn.Parameter] = set()
        chunks = []
        for funcs in self.chunk_funcs:
            params = []
            for f in funcs:
                module = f.args[0] if isinstance(f, functools.partial) else f
                if isinstance(module, nn.Module):
                    params += [p for p in module.parameters() if p not in seen]
                    seen.update(module.parameters())
            chunks.append(params)
        return chunks

    # -- running --------------------------------------------------------------------------------

    def forward(self, inputs: Any, chunk: int = 0) -> Any:
        """Run chunk `chunk`'s layers (the only chunk unless `virtual_stages` > 1)."""
        funcs = self.chunk_funcs[chunk]
        interval = self.activation_checkpoint_interval
        if interval == 0 or not self.training:
            return _run(funcs, inputs)
        x = inputs
        for start in range(0, len(funcs), interval):
            span = funcs[start : start + interval]
            if self._checkpointable(span):
                args = x if isinstance(x, tuple) else (x,)
                x = self.activation_checkpoint_func(_RangeRunner(span), *args)
            else:
                x = _run(span, x)
        return x

    def _checkpointable(self, funcs: list[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    # -- DeepSpeed's accessors ------------------------------------------------------------------

    def topology(self) -> ProcessTopology:
        return self.topo.mesh

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> list[int]:
        return list(self.parts)

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ValueError("the activation checkpoint interval must be 0 (off) or positive")
        self.activation_checkpoint_interval = interval


class _RangeRunner:
    """A layer range as one function of unpacked arguments (what checkpoint functions call)."""

    def __init__(self, funcs: list[Callable]) -> None:
        self.funcs = funcs

    def __call__(self, *inputs: Any) -> Any:
        return _run(self.funcs, inputs[0] if len(inputs) == 1 else inputs)


def _run(funcs: list[Callable], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


def _attr(module: nn.Module, dotted: str) -> nn.Parameter:
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _mesh(num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
    world = dist.get_world_size()
    if topology is not None:
        if num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise ValueError(
                f"num_stages={num_stages} but the topology has {topology.get_dim('pipe')} stages"
            )
        return topology
    if num_stages is None:
        raise ValueError("PipelineModule needs num_stages or topology")
    if num_stages < 1 or world % num_stages:
        raise ValueError(f"num_stages ({num_stages}) must divide the world size ({world})")
    return PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)


# -- partitioning ---------------------------------------------------------------------------------


def partition_layers(layers: Sequence[Any], num_parts: int, method: str) -> list[int]:
    """Part boundaries (num_parts + 1 layer indices) by DeepSpeed's methods: "parameters" balances
    trainable parameter counts, "uniform" layer counts, "type:<regex>" the layers whose class name
    matches (case-insensitive)."""
    name = method.lower()
    if name == "uniform":
        return partition_uniform(len(layers), num_parts)
    if name == "parameters":
        return partition_balanced([_trainable_count(layer) for layer in layers], num_parts)
    if name.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [int(bool(pattern.search(_layer_name(layer)))) for layer in layers]
        if not any(weights):
            raise ValueError(f"partition_method {method!r}: no layer's class name matches")
        return partition_balanced(weights, num_parts)
    raise ValueError(
        f"partition_method {method!r} is not supported: use 'parameters', 'uniform' or "
        "'type:<regex>' ('profile' is not implemented, as in DeepSpeed)"
    )


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal counts, the first parts taking one more when they do not divide."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Contiguous parts whose weights spread least (heaviest minus lightest), by dynamic programming
    over (items, parts); ties go to the later cut, which gives DeepSpeed 0.19.8's partitions."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[i][j]: (spread, heaviest, lightest, cut) for the first i items in j parts
    best = [[(inf, inf, inf, 0)] * (num_parts + 1) for _ in range(n + 1)]
    best[0][0] = (0, 0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(i):
                _, heavy, light, _ = best[k][j - 1]
                part = prefix[i] - prefix[k]
                hi, lo = max(heavy, part), min(light, part)
                if hi - lo <= best[i][j][0]:
                    best[i][j] = (hi - lo, hi, lo, k)
    cuts = [n]
    for j in range(num_parts, 0, -1):
        cuts.append(best[cuts[-1]][j][3])
    return cuts[::-1]


def _trainable_count(layer: Any) -> int:
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # counted without allocating: every rank counts every layer
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _layer_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", "")
