"""ZeRO stage 3's parameters: each rank keeps 1/N of them, units are gathered just in time.

A unit is a set of parameters gathered and released together: one per child of every (outermost)
`nn.ModuleList` (a transformer block, typically), one per leaf module (`leaf_module` in the config,
or flagged with `set_z3_leaf_modules`; a leaf nested in a block takes its parameters out of the
block's unit), one for the rest of the model, and one persistent unit that is never released:
parameters below `stage3_param_persistence_threshold` and parameters shared between units (a tied
embedding and head). Each unit's parameters form their own regions of the flat layout, so gathering
a unit is one all-gather of equal shards per param group.

A unit is gathered before its forward and again before its backward (a hook on its outputs). The
first pass (forward then backward) records the order units are used in; later passes that follow it
(a) prefetch the next unit while the current one computes, when it holds at most
`stage3_prefetch_bucket_size` elements, and (b) keep a finished unit whole instead of releasing it
when it is used again within `stage3_max_reuse_distance` elements of other units (DeepSpeed's
meaning: with its default of 1e9 a small model stays gathered from its forward to its backward).
Neither prefetching nor keeping ever takes the gathered non-persistent elements above
`stage3_max_live_parameters`; a unit needed now evicts kept units first. A pass that leaves the
recorded order stops prefetching and keeping, and the next pass records again.

On CUDA a gather runs on the gather stream of `streams.CommStreams` (the shard's copy to the device
and the all-gather), so a prefetch overlaps the current unit's compute; the compute stream waits for
it only when the unit is used.

ZeRO++ (docs/zeropp.md) changes the gathers the hooks make, never the others: with qwZ each
rank's shard travels int8 block-quantized and every rank computes with the dequantized values;
with hpZ a rank keeps 1/k of each unit after its forward gather, and the unit's later hook
gathers assemble it from those pieces within a node of k ranks until the shards change. Explicit
gathers (`GatheredParameters`, saving) are exact: a unit holding dequantized values is gathered
again. With `zero_quantized_nontrainable_weights` the parameters no optimizer steps are stored
quantized (`QuantizedShard`): every gather of theirs sends the stored payload, and the
dequantized values are their values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from ..comm import all_gather_into_tensor, broadcast, get_rank
from ..common.z3_leaf_module import z3_leaf_module
from ..config.errors import ConfigError
from .flat import FlatLayout, logical_shape
from .init import ZeroParamStatus, is_init_sharded
from .init import gather as gather_init_sliced
from .init import release as release_init_sliced
from .quantize import WEIGHT_BITS, dequantize, quantize
from .streams import CommStreams

# The attribute naming the ShardedParameters that owns a parameter (how GatheredParameters finds
# what to gather; tensors cannot be dictionary keys by value).
_OWNER = "_shardspeed_shards"


# The attribute listing the parameters a module uses in its forward without owning them.
_EXTERNAL = "_shardspeed_external_parameters"


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Say that `module`'s forward uses `parameter`, which another module owns (DeepSpeed's
    function of that name). Such a parameter belongs to two gather units, so stage 3 keeps it
    whole in the persistent unit, the rule for every parameter shared between units."""
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(f"register_external_parameter takes a parameter, not {type(parameter)}")
    external = module.__dict__.setdefault(_EXTERNAL, [])
    if not any(p is parameter for p in external):
        external.append(parameter)


def external_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """DeepSpeed's `module.ds_external_parameters()`: (key, parameter) of those registered with
    `register_external_parameter`."""
    return [(str(id(p)), p) for p in module.__dict__.get(_EXTERNAL, [])]


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo `register_external_parameter` (before `initialize` lays the units out)."""
    external = module.__dict__.get(_EXTERNAL, [])
    module.__dict__[_EXTERNAL] = [p for p in external if p is not parameter]


@dataclass(frozen=True)
class Stage3Options:
    """The stage 3 keys of `zero_optimization`, in elements (DeepSpeed's defaults)."""

    persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    prefetch_elements: int = 50_000_000
    max_live_elements: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    leaf_classes: tuple[str, ...] = ()
    leaf_names: tuple[str, ...] = ()
    leaf_name_suffixes: tuple[str, ...] = ()
    # Entries the user wrote (not DeepSpeed's defaults): one that matches nothing is an error.
    leaf_required: tuple[str, ...] = ()
    # ZeRO++: the hooks' gathers travel int8 block-quantized (qwZ); with hpz_partition_size
    # k > 1, a unit's hook gathers after its forward run within `hpz_group`, k consecutive ranks
    # of the ZeRO group (hpZ).
    quantized_weights: bool = False
    # ZeRO++'s `zero_quantized_nontrainable_weights`: the parameters no optimizer steps are kept
    # int8 block-quantized (`QuantizedShard`), their gathers sending the stored payload.
    quantized_untrained: bool = False
    hpz_partition_size: int = 1
    hpz_group: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.hpz_partition_size > 1 and self.hpz_group is None:
            raise ValueError(
                "hpz_partition_size above 1 needs the node's group (Topology.hpz_group)"
            )

    @classmethod
    def from_config(cls, zero: Any, hpz_group: Any = None) -> Stage3Options:
        """From the validated `zero_optimization` section; `hpz_group`: this rank's group of
        `zero_hpz_partition_size` ranks (`Topology.hpz_group`), when that is above 1."""
        leaf = zero.leaf_module
        defaults = type(leaf)()
        required = [
            *(c for c in leaf.classes if c not in defaults.classes),
            *leaf.names,
            *leaf.name_suffixes,
        ]
        return cls(
            persistence_threshold=zero.stage3_param_persistence_threshold,
            model_persistence_threshold=zero.stage3_model_persistence_threshold,
            prefetch_elements=zero.stage3_prefetch_bucket_size,
            max_live_elements=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
            leaf_classes=tuple(leaf.classes),
            leaf_names=tuple(leaf.names),
            leaf_name_suffixes=tuple(leaf.name_suffixes),
            leaf_required=tuple(required),
            quantized_weights=zero.zero_quantized_weights,
            quantized_untrained=zero.zero_quantized_nontrainable_weights,
            hpz_partition_size=zero.zero_hpz_partition_size,
            hpz_group=hpz_group,
        )


@dataclass
class Unit:
    """Parameters gathered together; `modules` are where its forward hooks go (the persistent
    unit's: the model, for its first forward); `place` is the plan's place of its parameters (0:
    the data-parallel group; an expert layer's: its expert-data group), whose group gathers it."""

    params: list[nn.Parameter]
    modules: list[nn.Module] = field(default_factory=list)
    persistent: bool = False
    name: str = ""
    place: int = 0


def leaf_modules(module: nn.Module, options: Stage3Options) -> set[nn.Module]:
    """Modules named by `leaf_module` (class, name or name suffix) or flagged as leaves."""
    found: set[nn.Module] = set()
    matched: set[str] = set()
    for name, sub in module.named_modules():
        cls = type(sub)
        hits = [
            *(
                c
                for c in options.leaf_classes
                if c in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
            ),
            *(n for n in options.leaf_names if n == name),
            *(x for x in options.leaf_name_suffixes if name.endswith(x)),
        ]
        if hits or z3_leaf_module(sub):
            found.add(sub)
            matched.update(hits)
    missing = [entry for entry in options.leaf_required if entry not in matched]
    if missing:
        raise ConfigError(
            f"'zero_optimization.leaf_module' entries {missing} match no module of the model: "
            "give class names (or package.module.Class), module names from "
            "model.named_modules(), or suffixes of those names"
        )
    return found


def plan_units(
    module: nn.Module,
    params: Sequence[nn.Parameter],
    options: Stage3Options,
    place_of: dict[nn.Parameter, int] | None = None,
) -> list[Unit]:
    """Split `params` (the trainable ones) into units, in backward's order (see below). A block
    holding expert weights (`place_of`: their place) gets a unit of its own for each place, its
    experts' first (backward finishes a block's MLP before its attention); expert weights are
    never persistent."""
    place_of = place_of or {}
    leaves = leaf_modules(module, options)
    roots: list[tuple[str, nn.Module]] = []
    unit_of_module: dict[nn.Module, int] = {}

    def walk(parent: nn.Module, prefix: str, unit: int, in_block: bool, in_leaf: bool) -> None:
        for name, child in parent.named_children():
            if child in unit_of_module:
                continue  # a module registered twice belongs where it was first seen
            path = f"{prefix}{name}"
            here, block, leaf = unit, in_block, in_leaf
            if not in_leaf and (
                child in leaves or (isinstance(parent, nn.ModuleList) and not in_block)
            ):
                roots.append((path, child))
                here, block, leaf = len(roots) - 1, True, in_leaf or child in leaves
            unit_of_module[child] = here
            walk(child, f"{path}.", here, block, leaf)

    rest = -1  # resolved once every root is known
    unit_of_module[module] = rest
    walk(module, "", rest, False, False)
    rest = len(roots)
    homes: dict[nn.Parameter, set[int]] = {}
    for sub in module.modules():
        home = unit_of_module[sub] if unit_of_module[sub] >= 0 else rest
        for p in [*sub.parameters(recurse=False), *sub.__dict__.get(_EXTERNAL, ())]:
            homes.setdefault(p, set()).add(home)
    managed = set(params)
    persistent, budget = [], options.model_persistence_threshold
    for p in params:
        numel = logical_shape(p).numel()
        small = len(homes[p]) > 1 or numel <= options.persistence_threshold
        if small and numel <= budget and not place_of.get(p, 0):
            persistent.append(p)
            budget -= numel
    kept = set(persistent)
    per_root = []
    for index, (name, root) in enumerate([*roots, ("(rest of the model)", module)]):
        owned = [p for p in params if p not in kept and min(homes[p]) == index]
        places = sorted({place_of.get(p, 0) for p in owned} - {0}, reverse=True)
        per_root.append(
            [
                *(
                    Unit([p for p in owned if place_of.get(p, 0) == place], [root],
                         name=f"{name} (experts)", place=place)
                    for place in places
                ),
                Unit([p for p in owned if not place_of.get(p, 0)], [root], name=name),
            ]
        )  # fmt: skip
    # Units are laid out in the order backward finishes them: the last block first, the rest of
    # the model (its embeddings get gradients last) and the persistent unit at the end. Gradient
    # buckets are reduced in layout order, so any other order holds every bucket until the end.
    units = [
        *(unit for root_units in reversed(per_root[:-1]) for unit in root_units),
        *per_root[-1],
        # Hooked on the model itself: gathered at the first forward, as DeepSpeed gathers its
        # persistent parameters (before it they are partitioned like the rest), then kept.
        Unit(persistent, [module], persistent=True, name="(persistent)"),
    ]
    assert sum(len(u.params) for u in units) == len(managed)
    return [u for u in units if u.params or u.persistent]


class MemoryShard:
    """This rank's shard of the parameters as one flat tensor, a piece per region."""

    quantized = False

    def __init__(self, flat: torch.Tensor, offsets: list[int]) -> None:
        self.flat, self.offsets = flat, offsets
        self.dtype, self.device = flat.dtype, flat.device

    def piece(self, r: int) -> torch.Tensor:
        return self.flat[self.offsets[r] : self.offsets[r + 1]]

    def pieces(self, regions: Sequence[int]) -> torch.Tensor:
        """Consecutive `regions`' pieces as one tensor (a view: they lie side by side)."""
        return self.flat[self.offsets[regions[0]] : self.offsets[regions[-1] + 1]]

    def write(self, r: int, values: torch.Tensor) -> None:
        self.piece(r).copy_(values)

    def tensors(self) -> list[torch.Tensor]:
        return [self.flat]


class QuantizedShard:
    """This rank's shard int8 block-quantized (`zero/quantize.py`), one payload per gather unit:
    about a quarter of fp32's bytes (half of 16-bit's). A unit's gather sends its payload as it is
    stored and every rank computes with the dequantized values, which from then on are the
    parameters' values (DeepSpeed's `zero_quantized_nontrainable_weights`, for frozen weights).
    `piece` gives a dequantized copy; `write` quantizes its unit again."""

    quantized = True

    def __init__(self, exact: MemoryShard, unit_regions: Sequence[Sequence[int]]) -> None:
        self.dtype, self.device, self.offsets = exact.dtype, exact.device, exact.offsets
        self.unit_regions = [list(regions) for regions in unit_regions]
        self.unit_of = {r: u for u, regions in enumerate(self.unit_regions) for r in regions}
        # (The persistent unit may have no regions.)
        values = [exact.pieces(r) if r else exact.flat[:0] for r in self.unit_regions]
        self.numels = [v.numel() for v in values]
        self.payloads = [self._quantized(v) for v in values]

    @staticmethod
    def _quantized(values: torch.Tensor) -> torch.Tensor:
        if not values.numel():
            return values.new_empty(0, dtype=torch.uint8)
        return quantize(values, WEIGHT_BITS)

    def payload(self, u: int) -> torch.Tensor:
        return self.payloads[u]

    def unit_numel(self, u: int) -> int:
        return self.numels[u]

    def _unit_values(self, u: int) -> torch.Tensor:
        return dequantize(self.payloads[u], self.numels[u], WEIGHT_BITS, dtype=self.dtype)

    def _span(self, r: int) -> tuple[int, slice]:
        u = self.unit_of[r]
        first = self.offsets[self.unit_regions[u][0]]
        return u, slice(self.offsets[r] - first, self.offsets[r + 1] - first)

    def piece(self, r: int) -> torch.Tensor:
        u, span = self._span(r)
        return self._unit_values(u)[span]

    def write(self, r: int, values: torch.Tensor) -> None:
        u, span = self._span(r)
        unit = self._unit_values(u)
        unit[span] = values
        self.payloads[u] = self._quantized(unit)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.payloads)


class SwappedShard:
    """This rank's shard of the parameters in swap files, one per region (`offload_param` nvme).

    `piece` reads a region into a fresh host buffer; `write` (and `write_async`) store one.
    """

    quantized = False

    def __init__(self, swapper: Any, sizes: list[int], dtype: torch.dtype) -> None:
        self.swapper, self.sizes = swapper, sizes
        self.dtype, self.device = dtype, torch.device("cpu")
        for r, size in enumerate(sizes):
            swapper.reserve(self.key(r), size * dtype.itemsize)

    @staticmethod
    def key(r: int) -> str:
        return f"param.{r}"

    def read_async(self, r: int) -> tuple[torch.Tensor, Any]:
        from .swap import aligned_empty

        buffer = aligned_empty(self.sizes[r], self.dtype)
        return buffer, self.swapper.read(self.key(r), buffer)

    def piece(self, r: int) -> torch.Tensor:
        buffer, done = self.read_async(r)
        done.result()
        return buffer

    def pieces(self, regions: Sequence[int]) -> torch.Tensor:
        """Consecutive `regions`' pieces as one tensor."""
        return torch.cat([self.piece(r) for r in regions])

    def write_async(self, r: int, values: torch.Tensor) -> Any:
        # Files are written from host memory: a device tensor (a gathered unit, the initial
        # shard built on the GPU) comes over first.
        return self.swapper.write(self.key(r), values.detach().to("cpu").contiguous())

    def write(self, r: int, values: torch.Tensor) -> None:
        self.write_async(r, values).result()

    def tensors(self) -> list[torch.Tensor]:
        return []


class _Gathering(NamedTuple):
    """A unit being gathered: its buffer, the collective's work, the rows it gathers into when
    they need putting in place once it is done (several regions, or a quantized payload per
    row), and this rank's pieces as the collective reads them (a copy on the gather stream when
    the shard is elsewhere, held until that stream has waited for the collective). `numel`:
    elements per row; `quantized`: rows are payloads to dequantize; `hooked`: a gather for the
    module hooks; `secondary`: one over the hpZ node, from the secondary pieces."""

    buffer: torch.Tensor
    works: list
    rows: torch.Tensor | None
    inputs: list[torch.Tensor]
    numel: int
    quantized: bool
    hooked: bool
    secondary: bool


class _Trace:
    """The order units were used in during one pass (a forward and its backward)."""

    def __init__(self) -> None:
        self.units: list[int] = []
        self.recording = True
        self.valid = True
        self.cursor = 0

    def begin(self) -> None:
        if self.recording and self.units:
            self.recording = False
        elif not self.valid:
            self.units, self.recording = [], True
        self.cursor, self.valid = 0, True

    def advance(self, u: int) -> None:
        if self.recording:
            self.units.append(u)
        elif self.valid and self.cursor < len(self.units) and self.units[self.cursor] == u:
            self.cursor += 1
        else:
            self.valid = False

    def upcoming(self) -> list[int]:
        """Units still to be used this pass, in order (empty while recording or off the trace)."""
        return self.units[self.cursor :] if self.valid and not self.recording else []


class ShardedParameters:
    """Gathers and releases units of parameters kept as shards in `store` (this rank's 1/N)."""

    def __init__(
        self,
        units: list[Unit],
        layout: FlatLayout,
        unit_regions: list[range],
        store: MemoryShard | SwappedShard | QuantizedShard,
        params: list[nn.Parameter],
        groups: Sequence[Any],
        options: Stage3Options | None = None,
        device: torch.device | None = None,
        streams: CommStreams | None = None,
        trained: bool = True,
    ) -> None:
        """`groups`: the group of each place of the plan (a unit is gathered over its place's).
        `trained` false: no gradients arrive to say that a unit's backward is done (frozen
        parameters); the gradients of its modules' inputs say it instead."""
        self.trained = trained
        self.units, self.layout, self.unit_regions = units, layout, unit_regions
        self.store, self.group = store, groups[0]
        self.unit_groups = [groups[unit.place] for unit in units]
        # Where gathered units live: the training device, also when `offload_param` keeps the
        # shard in host memory or in swap files (each gather then copies this rank's piece over).
        self.device = device or store.device
        self.streams = streams or CommStreams.for_device(self.device)
        self.options = options or Stage3Options()
        self.index = {p: i for i, p in enumerate(params)}
        self.params = params
        self.numel = [self.span(u)[1] - self.span(u)[0] for u in range(len(units))]
        largest = max(
            (u for u in range(len(units)) if not units[u].persistent),
            key=lambda u: self.numel[u],
            default=None,
        )
        if largest is not None and self.numel[largest] > self.options.max_live_elements:
            raise ConfigError(
                f"'zero_optimization.stage3_max_live_parameters' is "
                f"{self.options.max_live_elements}, but the gather unit '{units[largest].name}' "
                f"alone holds {self.numel[largest]} elements: raise the limit to at least that, "
                "or split the model into smaller units with 'zero_optimization.leaf_module'"
            )
        self.buffers: dict[int, torch.Tensor] = {}  # units whole now
        self._whole_copies: dict[int, torch.Tensor] = {}  # each unit's buffer, storage kept
        self._kept: set[int] = set()  # finished units kept whole because they are reused soon
        self._empty = torch.empty(0, dtype=store.dtype, device=self.device)
        self._pending: list[int] = [len(u.params) for u in units]
        self.unit_of = [0] * len(params)
        for u, unit in enumerate(units):
            for p in unit.params:
                self.unit_of[self.index[p]] = u
        self.after_write: Callable[[], None] | None = None
        # Forwards with and without autograd use units in different orders: one trace each.
        self._traces = {True: _Trace(), False: _Trace()}
        self.trace = self._traces[True]
        self._in_flight: dict[int, _Gathering] = {}  # units being gathered
        # ZeRO++ (see `_launch`): units whose whole copy holds dequantized values (qwZ), and
        # each unit's secondary pieces with the units whose pieces are current (hpZ).
        self._lossy: set[int] = set()
        self._secondary: dict[int, torch.Tensor] = {}
        self._secondary_valid: set[int] = set()
        hpz = self.options.hpz_partition_size
        self._node_rank = dist.get_rank(self.options.hpz_group) if hpz > 1 else 0
        self.peak_gathered_bytes = 0
        self.peak_live_elements = 0  # what stage3_max_live_parameters bounds
        for p in params:
            setattr(p, _OWNER, self)
            p.data = self._empty  # the whole values now live only as shards (and units on demand)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        for i, p in enumerate(params):  # DeepSpeed's record of the whole tensor, which PEFT reads
            p.ds_shape, p.ds_numel = self.layout.shapes[i], self.layout.numels[i]
            p.ds_persist = units[self.unit_of[i]].persistent
        self.hook_handles: list[Any] = []
        self.register_hooks()

    def register_hooks(self) -> None:
        """Put the gather hooks on the units' modules (the ones there before are removed first):
        at start-up, and when a caller that took them off for a while puts them back."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles[:] = []
        for u, unit in enumerate(self.units):
            for m in unit.modules:
                pre = m.register_forward_pre_hook(self._pre_forward(u), with_kwargs=True)
                self.hook_handles.append(pre)
                self.hook_handles.append(m.register_forward_hook(self._post_forward(u)))

    def traces_recorded(self) -> bool:
        """Whether an order of units has been recorded (prefetching follows it)."""
        return any(trace.units for trace in self._traces.values())

    def forget_traces(self) -> None:
        """Record the units' order afresh at the next passes (the model was run another way)."""
        self._traces = {True: _Trace(), False: _Trace()}
        self.trace = self._traces[True]

    def strip_hooks(self, copy: nn.Module) -> None:
        """Remove the gather hooks from a deep copy of the model (`copy.deepcopy` copies a
        module's hook dictionaries, and these hooks would gather this model's shards)."""
        ids = {handle.id for handle in self.hook_handles}
        for module in copy.modules():
            for hooks in (
                module._forward_pre_hooks,
                module._forward_pre_hooks_with_kwargs,
                module._forward_hooks,
            ):
                for hook_id in ids & hooks.keys():
                    del hooks[hook_id]
            for hook_id in ids & module._forward_hooks_always_called.keys():
                del module._forward_hooks_always_called[hook_id]

    def span(self, u: int) -> tuple[int, int]:
        regions = self.unit_regions[u]
        return self.layout.groups[regions[0]][0], self.layout.groups[regions[-1]][1]

    def begin_pass(self, grad_enabled: bool) -> None:
        """A forward starts (the engine calls this): follow, or record, the trace of its kind."""
        self.trace = self._traces[grad_enabled]
        self.trace.begin()

    def live_elements(self) -> int:
        """Elements of non-persistent units that are whole or being gathered."""
        live = [*self.buffers, *self._in_flight]
        return sum(self.numel[u] for u in live if not self.units[u].persistent)

    def gather(self, u: int, exact: bool = True) -> None:
        """Make unit `u`'s parameters whole on every rank (a no-op if they already are).

        `exact` false: a gather for the module hooks, which ZeRO++ may make lossy (qwZ) or
        node-local (hpZ). An exact gather of a unit whose whole copy is lossy gathers it again.
        """
        self._kept.discard(u)
        exact = exact or self.units[u].persistent  # DeepSpeed gathers those unquantized
        if u in self._in_flight:
            self._land(u)
        if u in self.buffers and (not exact or u not in self._lossy):
            return
        if u not in self.buffers and not self.units[u].persistent:
            self._make_room(self.numel[u])
        self.buffers.pop(u, None)  # a lossy copy is gathered again, exactly, into its storage
        self._launch(u, hooked=not exact)
        self._land(u)

    def _land(self, u: int) -> None:
        """Wait for unit `u`'s collective and make its parameters views of the whole copy."""
        gathering = self._in_flight.pop(u)
        with self.streams.on(self.streams.gather):
            for work in gathering.works:
                work.wait()
        # From here on the unit is read on the compute stream; the gather stream is past the
        # collectives, so the pieces they read (`gathering.inputs`) may go.
        self.streams.current().wait_stream(self.streams.gather)
        buffer, rows = gathering.buffer, gathering.rows
        start, _ = self.span(u)
        if gathering.quantized:
            rows = dequantize(rows, gathering.numel, WEIGHT_BITS, dtype=buffer.dtype)
        if rows is not None:
            self.layout.place_gathered(rows, self._regions_with_elements(u), buffer, start)
        self.buffers[u] = buffer
        # A quantized store's values are the dequantized ones: gathered from it, a unit is exact.
        from_store = self.store.quantized and not gathering.secondary
        if gathering.quantized and not from_store:
            self._lossy.add(u)
        else:
            self._lossy.discard(u)
        if gathering.hooked and not gathering.secondary and self.options.hpz_partition_size > 1:
            self._keep_secondary(u)
        self._note_live()
        for p in self.units[u].params:
            i = self.index[p]
            offset = self.layout.offsets[i] - start
            p.data = buffer.narrow(0, offset, self.layout.numels[i]).view(self.layout.shapes[i])
            p.ds_status = ZeroParamStatus.AVAILABLE

    def _keep_secondary(self, u: int) -> None:
        """hpZ: keep this rank's 1/k of each region of unit `u`'s whole copy (its place in the
        node picks which), the pieces the node gathers for the unit's backward."""
        start, _ = self.span(u)
        k, j = self.options.hpz_partition_size, self._node_rank
        buffer = self.buffers[u]
        pieces = []
        for r in self._regions_with_elements(u):
            r_start, r_end = self.layout.groups[r]
            size = (r_end - r_start) // k
            pieces.append(buffer[r_start - start + j * size :][:size])
        kept = self._secondary.get(u)
        if kept is None:
            kept = self._secondary[u] = buffer.new_empty(self.numel[u] // k)
        torch.cat(pieces, out=kept)
        self._secondary_valid.add(u)

    def secondaries(self) -> list[torch.Tensor]:
        """hpZ's secondary pieces this rank holds (1/k of every unit used so far)."""
        return list(self._secondary.values())

    def _unit_buffer(self, u: int, numel: int) -> torch.Tensor:
        """Unit `u`'s whole-copy buffer: one storage for the unit's life, sized to 0 when released."""
        buffer = self._whole_copies.get(u)
        if buffer is None:
            buffer = torch.empty(numel, dtype=self.store.dtype, device=self.device)
            self._whole_copies[u] = buffer
        else:
            buffer.untyped_storage().resize_(numel * buffer.element_size())
        return buffer

    def _make_room(self, elements: int) -> None:
        """Release kept units until `elements` more fit under stage3_max_live_parameters."""
        for v in sorted(self._kept):
            if self.live_elements() + elements <= self.options.max_live_elements:
                return
            self.release(v)

    def _regions_with_elements(self, u: int) -> list[int]:
        return [r for r in self.unit_regions[u] if self.layout.shard_size(r)]

    def _launch(self, u: int, hooked: bool = False) -> None:
        """Start gathering unit `u`: one collective for the unit, its regions' shards (which lie
        side by side in the store) as one, each rank's pieces put in place once it is done.

        A gather for the hooks (`hooked`) uses ZeRO++ where configured, as DeepSpeed does: with
        a current secondary copy (hpZ) it gathers the k secondary pieces over the node instead
        of the shards over the whole group; with qwZ what travels is the pieces block-quantized
        to int8, and every rank, the owner too, uses the dequantized values so replicas agree.
        """
        start, end = self.span(u)
        # The buffers are allocated on the compute stream, which reads them (see streams.py).
        buffer = self._unit_buffer(u, end - start)
        regions = self._regions_with_elements(u)
        secondary = hooked and u in self._secondary_valid
        stored = self.store.quantized and not secondary  # the stored payload goes as it is
        quantized = bool(regions) and (stored or (hooked and self.options.quantized_weights))
        group, ranks = (
            (self.options.hpz_group, self.options.hpz_partition_size)
            if secondary
            else (self.unit_groups[u], self.layout.shards[regions[0]] if regions else 1)
        )
        rows, inputs, works, numel = None, [], [], 0
        with self.streams.side(self.streams.gather):
            if regions and stored:
                sent = self.store.payload(u).to(self.device, non_blocking=True)
                numel = self.store.unit_numel(u)
            elif regions:  # (an empty persistent unit has none)
                mine = (
                    self._secondary[u]
                    if secondary
                    else self.store.pieces(regions).to(self.device, non_blocking=True)
                )
                numel = mine.numel()
                sent = quantize(mine, WEIGHT_BITS) if quantized else mine
            if regions:
                inputs.append(sent)
                if quantized or len(regions) > 1:
                    rows = buffer.new_empty(ranks, sent.numel(), dtype=sent.dtype)
                    out = rows.view(-1)
                else:
                    # One region is the ranks' pieces in rank order: gather in place.
                    r_start, r_end = self.layout.groups[regions[0]]
                    out = buffer[r_start - start : r_end - start]
                works.append(all_gather_into_tensor(out, sent, group=group, async_op=True))
        self._in_flight[u] = _Gathering(
            buffer, works, rows, inputs, numel, quantized, hooked, secondary
        )
        self._note_live()

    def _note_live(self) -> None:
        # A unit gathered as one also holds its rows until they are put in place.
        in_flight = [t for g in self._in_flight.values() for t in (g.buffer, g.rows)]
        buffers = [*self.buffers.values(), *(t for t in in_flight if t is not None)]
        live = sum(b.numel() * b.element_size() for b in buffers)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)
        self.peak_live_elements = max(self.peak_live_elements, self.live_elements())

    def _prefetch(self) -> None:
        """Start gathering the next unit the trace will need, if it fits both limits.

        One unit in flight at a time: units are coarse (a whole block), so one ahead is enough to
        hide a gather behind a block's compute, and memory stays one unit above the working set.
        """
        if self._in_flight:
            return
        for v in self.trace.upcoming():
            if v in self.buffers:
                continue
            fits = self.live_elements() + self.numel[v] <= self.options.max_live_elements
            if self.numel[v] <= self.options.prefetch_elements and fits:
                self._launch(v, hooked=True)
            return

    def _reused_soon(self, u: int) -> bool:
        """Whether `u` is used again before `stage3_max_reuse_distance` elements of other units."""
        traversed = 0
        for v in self.trace.upcoming():
            if traversed >= self.options.max_reuse_distance:
                return False
            if v == u:
                return self.live_elements() <= self.options.max_live_elements
            traversed += self.numel[v]
        return False

    def _finished(self, u: int) -> None:
        """Unit `u` is not needed right now: keep it if it is reused soon, else release it."""
        if self._reused_soon(u):
            self._kept.add(u)
        else:
            self.release(u)

    def release(self, u: int) -> None:
        """Drop unit `u`'s whole copy (persistent units stay)."""
        self._kept.discard(u)
        if self.units[u].persistent or u not in self.buffers:
            return
        self._lossy.discard(u)
        for p in self.units[u].params:
            p.data = self._empty
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        # Autograd may still hold views of the unit (a Linear saves its weight's transpose):
        # freeing the storage itself, not just our reference, is what returns the memory. The
        # pre-backward hook refills this same storage before those views are read again.
        self.buffers.pop(u).untyped_storage().resize_(0)

    def refresh_persistent(self) -> None:
        """Re-gather the persistent unit after the shards changed (the optimizer stepped, a load),
        exactly (DeepSpeed gathers persistent parameters unquantized), if it was gathered: before
        the first forward it stays partitioned, as DeepSpeed's does. hpZ's secondary pieces are
        stale."""
        self._secondary_valid.clear()
        for u, unit in enumerate(self.units):
            if unit.persistent and u in self.buffers:
                self.buffers.pop(u)
                self.gather(u)

    def start_backward_accounting(self) -> None:
        self._pending = [len(u.params) for u in self.units]

    def gradient_done(self, index: int) -> None:
        """Parameter `index` has its gradient: its unit is finished once all of them have."""
        u = self.unit_of[index]
        self._pending[u] -= 1
        if self._pending[u] == 0:
            self._finished(u)

    def release_all(self) -> None:
        """End of a step's backward: drop every non-persistent copy, prefetched ones included."""
        for u in list(self._in_flight):
            self._land(u)
        for u in range(len(self.units)):
            self.release(u)

    def _use(self, u: int) -> None:
        self.trace.advance(u)
        self.gather(u, exact=False)
        self._prefetch()

    def _pre_forward(self, u: int) -> Callable:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            self._use(u)
            if self.trained or not torch.is_grad_enabled():
                return
            inputs = [
                t
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if inputs:
                # Once the inputs' gradients are whole, this module's backward no longer needs
                # the unit. Inputs that need no gradient leave it to `release_all`.
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, lambda grads: self._finished(u), mode="all"
                )

        return hook

    def _post_forward(self, u: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tensors = [
                t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                # Before this unit's backward runs, its parameters must be whole again.
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grad: self._use(u), mode="any"
                )
            self._finished(u)

        return hook

    def write_back(self, u: int) -> None:
        """Copy this rank's part of unit `u`'s (modified) whole copy back into its shard."""
        start, _ = self.span(u)
        buffer = self.buffers[u]
        self._secondary_valid.discard(u)
        rank = _group_rank(self.unit_groups[u])
        for r in self.unit_regions[u]:
            r_start, _ = self.layout.groups[r]
            size = self.layout.shard_size(r)
            self.store.write(r, buffer[r_start - start + rank * size :][:size])
        if self.after_write is not None:
            self.after_write()


def _group_rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None else get_rank()


class GatheredParameters:
    """Make ZeRO-3 parameters whole inside the block, as `deepspeed.zero.GatheredParameters`.

    Collective: every rank of the parameters' group enters it. With `modifier_rank`, that rank's
    changes are broadcast on exit and written back into every rank's shard (and fp32 master);
    without, changes are dropped. It serves the engine's stage-3 parameters and, before
    `initialize`, those `zero.Init` sliced. Other tensors (whole parameters, buffers) are left alone.
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        del fwd_module  # parameters are gathered by unit, so no module needs to know about them
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.targets: dict[ShardedParameters, set[int]] = {}
        self.init_sliced: list[torch.Tensor] = []
        for p in params:
            owner = getattr(p, _OWNER, None)
            if owner is not None:
                self.targets.setdefault(owner, set()).add(owner.unit_of[owner.index[p]])
            elif is_init_sharded(p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                self.init_sliced.append(p)
        self._opened: list[tuple[ShardedParameters, int]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for owner, units in self.targets.items():
            for u in sorted(units):
                if u not in owner.buffers:
                    self._opened.append((owner, u))
                owner.gather(u)
        gather_init_sliced(self.init_sliced)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        release_init_sliced(self.init_sliced, self.modifier_rank if exc[0] is None else None)
        if self.modifier_rank is not None and exc[0] is None:
            for owner, units in self.targets.items():
                for u in sorted(units):
                    src, group = self.modifier_rank, owner.unit_groups[u]
                    if group is not None:
                        src = dist.get_global_rank(group, src)
                    broadcast(owner.buffers[u], src=src, group=group)
                    owner.write_back(u)
        for owner, u in self._opened:
            owner.release(u)
        self._opened = []
