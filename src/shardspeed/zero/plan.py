"""The shard plan: where every trainable parameter's bytes live, worked out once.

Other rooms contribute facts as plain values (the data-parallel place, a pipeline's segments and
tied weights, tensor-parallel replicas, expert placement, stage 3's gather units); `build_plan`
turns them into one frozen `ShardPlan`: the flat layout and its regions, which group and rank own
each region's shards, the masters' spans, the tied spans and the spans the gradient norm counts.
The stores and the optimizer read the plan and derive no layout of their own.

A region is what the optimizer steps as one tensor: the part of a param group inside one block.
Blocks are stage 3's gather units, or a pipeline stage's tied weights and chunks; otherwise there
is one block and a region is a param group. A region's place is 0 for the data-parallel group and
i + 1 for `experts[i]`'s expert-data group.

A master is one tensor the torch optimizer steps. At stage 0 it is a parameter, whole. From stage
1 on it is this rank's shard of a region, flat; or, in a region of whole tensors (the param groups
of optimizers that need them, see `flat.FlatLayout.of`), each parameter in this rank's bin, whole
and in its own shape, so that per-tensor arithmetic is the single-process one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NamedTuple

import torch
from torch import nn

from .flat import FlatLayout, logical_shape
from .partitioned import Stage3Options, Unit, plan_units


@dataclass(frozen=True)
class TiedParameters:
    """Weights that ranks outside the data-parallel group hold copies of: a pipeline's embedding
    reused as its head, or a layer norm replicated across tensor-parallel ranks.

    With `summed`, each copy's gradient is partial and they are summed over `group` before the
    step (the tied embedding; a norm under sequence parallelism); otherwise every copy already has
    the whole gradient. Only copies with `counted` add to the gradient norm, so each weight counts
    once in the model's norm.
    """

    params: tuple[nn.Parameter, ...]
    group: Any
    counted: bool
    summed: bool = True


@dataclass(frozen=True)
class ExpertParameters:
    """One mixture-of-experts layer's local experts under expert parallelism: held alike by the
    `world_size` ranks of `group` (the expert-data group; this rank is `rank` there) and by no
    other rank of the data-parallel group. `names` are what checkpoints call them: the global
    expert index, the same at every expert-parallel size."""

    params: tuple[nn.Parameter, ...]
    names: tuple[str, ...]
    group: Any
    rank: int
    world_size: int


class Master(NamedTuple):
    """One tensor the torch optimizer steps (see the module docstring)."""

    region: int
    owned: int  # its first element in owned coordinates
    start: int  # its first element in the flat layout
    numel: int
    shape: torch.Size  # flat for a shard, the parameter's own when whole
    param: int | None  # the parameter it is, when whole


class Place(NamedTuple):
    """A group of ranks that hold the same regions, and this rank's rank and the size there."""

    group: Any
    rank: int
    world: int


@dataclass(frozen=True, eq=False)
class ShardPlan:
    """Where each parameter's bytes live (see the module docstring).

    At stage 0 each master is one parameter, whole; from stage 1 on it is this rank's shard of one
    region. "Owned" coordinates index the gradients this rank steps: the whole layout at stage 0,
    its shards side by side otherwise.
    """

    stage: int
    places: tuple[Place, ...]
    params: tuple[nn.Parameter, ...]
    param_names: tuple[str, ...]
    region_params: tuple[tuple[nn.Parameter, ...], ...]
    region_group: tuple[int, ...]  # each region's optimizer param group
    region_place: tuple[int, ...]
    param_region: tuple[int, ...]
    units: tuple[Unit, ...]  # stage 3's gather units (empty below stage 3)
    unit_regions: tuple[range, ...]
    layout: FlatLayout
    shard_ranges: tuple[tuple[int, int], ...]  # this rank's [start, end) of each region
    segment_starts: tuple[int, ...]  # the first parameter of each segment
    ties: tuple[tuple[tuple[int, int], TiedParameters], ...]  # owned span of each tie
    norm_spans: tuple[tuple[int, int, float], ...]  # owned spans the norm counts, with weights
    norm_over_dp: bool  # whether squares are summed over the data-parallel group
    region_whole: tuple[bool, ...] = ()  # regions laid out in bins of whole tensors
    masters: tuple[Master, ...] = ()

    @property
    def sharded(self) -> bool:
        return self.stage >= 1

    def shard_sizes(self) -> list[int]:
        return [e - s for s, e in self.shard_ranges]

    def owned_span(self, regions: range) -> tuple[int, int]:
        """[start, end) of consecutive `regions` in owned coordinates."""
        if not self.sharded:
            return self.layout.groups[regions.start][0], self.layout.groups[regions.stop - 1][1]
        sizes = self.shard_sizes()
        start = sum(sizes[: regions.start])
        return start, start + sum(sizes[regions.start : regions.stop])

    def master_views(self, owned: torch.Tensor) -> list[torch.Tensor]:
        """`owned` (owned coordinates) cut into one view per master, in the master's shape."""
        return [owned.narrow(0, m.owned, m.numel).view(m.shape) for m in self.masters]

    def master_numel(self, k: int) -> int:
        return self.masters[k].numel

    def fragments(self, i: int) -> list[tuple[int, int, int, int]]:
        """Where this rank holds parameter `i`'s master values: (master, first element in the
        flattened parameter, offset in the master, length)."""
        whole = self._param_master.get(i)
        if whole is not None:
            return [(whole, 0, 0, self.layout.numels[i])]
        r = self.param_region[i]
        k = self._region_master.get(r)
        if k is None:  # a whole tensor in another rank's bin
            return []
        offset, numel = self.layout.offsets[i], self.layout.numels[i]
        s, e = self.shard_ranges[r]
        lo, hi = max(s, offset), min(e, offset + numel)
        return [(k, lo - offset, lo - s, hi - lo)] if lo < hi else []

    @cached_property
    def _param_master(self) -> dict[int, int]:
        return {m.param: k for k, m in enumerate(self.masters) if m.param is not None}

    @cached_property
    def _region_master(self) -> dict[int, int]:
        return {m.region: k for k, m in enumerate(self.masters) if m.param is None}

    def fragment_group(self, i: int) -> tuple[Any, int]:
        """(group, size) over which parameter `i`'s fragments make it whole; size 1 when whole."""
        if not self.sharded:
            return None, 1
        group, _, world = self.places[self.region_place[self.param_region[i]]]
        return group, world

    def master_pieces(self) -> list[list[tuple[str, int, int, int]]]:
        """For each master, the parameter elements it holds, padding left out: (parameter name,
        first element in the flattened parameter, offset in the master, length)."""
        pieces: list[list[tuple[str, int, int, int]]] = [[] for _ in self.masters]
        for i, name in enumerate(self.param_names):
            for k, start, offset, length in self.fragments(i):
                pieces[k].append((name, start, offset, length))
        return pieces

    def writes_master(self, k: int, first_replica: bool) -> bool:
        """Whether this rank writes master `k` to a checkpoint: sharded, every rank its own;
        unsharded, one copy each (`first_replica`: this rank first holds the data-parallel
        group's weights; expert weights' first holder is their group's rank 0)."""
        if self.sharded:
            return True
        place = self.region_place[self.masters[k].region]
        return first_replica if place == 0 else self.places[place].rank == 0

    def flat_position(self, owned: int) -> int:
        """The flat layout's index of owned element `owned`."""
        if not self.sharded:
            return owned
        for s, e in self.shard_ranges:
            if owned < e - s:
                return s + owned
            owned -= e - s
        return self.layout.total

    def param_at(self, position: int) -> str:
        """The name of the parameter at flat index `position` ('?' for padding)."""
        for name, offset, numel in zip(self.param_names, self.layout.offsets, self.layout.numels):
            if offset <= position < offset + numel:
                return name
        return "?"

    def whole_tensor_summary(self) -> str | None:
        """What stepping whole tensors costs here, for the log (None: every region is flat)."""
        regions = [r for r, whole in enumerate(self.region_whole) if whole]
        if not regions or not self.sharded:
            return None
        groups = sorted({self.region_group[r] for r in regions})
        first = {r: sum(len(p) for p in self.region_params[:r]) for r in regions}
        held = sum(self.layout.shard_size(r) for r in regions)
        numel = sum(
            sum(self.layout.numels[first[r] : first[r] + len(self.region_params[r])])
            for r in regions
        )
        even = -(-numel // self.layout.shards[regions[0]])
        return (
            f"optimizer param group(s) {', '.join(map(str, groups))} are stepped on whole "
            f"tensors: each rank's shard of them holds {held} elements where an even split "
            f"would be {even} ({100 * (held - even) / max(even, 1):.1f}% padding)"
        )

    def place_runs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """[start, end) of the layout cut into runs of regions of one place: (start, end, place)."""
        runs: list[tuple[int, int, int]] = []
        for (r_start, r_end), place in zip(self.layout.groups, self.region_place):
            lo, hi = max(r_start, start), min(r_end, end)
            if lo >= hi:
                continue
            if runs and runs[-1][2] == place and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], hi, place)
            else:
                runs.append((lo, hi, place))
        return runs


def replica_ties(
    params: Iterable[nn.Parameter],
    stage_ties: Sequence[TiedParameters],
    group: Any,
    rank: int,
    world: int,
) -> list[TiedParameters]:
    """The weights that ranks outside the data-parallel group hold copies of, for `build_plan`:
    a pipeline's `stage_ties`, counted in the norm on the first rank of the tensor-parallel
    `group` (this rank is `rank` of `world`) unless split across it (`tensor_model_parallel`);
    then, under tensor parallelism, the trainable parameters every tensor-parallel rank holds
    whole: summed when `sequence_parallel` leaves each copy's gradient partial."""
    first = rank == 0
    ties = []
    for tie in stage_ties:
        split = all(getattr(p, "tensor_model_parallel", False) for p in tie.params)
        ties.append(replace(tie, counted=tie.counted and (split or first)))
    if world == 1:
        return ties
    taken = {p for tie in ties for p in tie.params}
    rest = [p for p in params if p.requires_grad and p not in taken]
    partial = [p for p in rest if getattr(p, "sequence_parallel", False)]
    whole = [
        p
        for p in rest
        if not getattr(p, "sequence_parallel", False)
        and not getattr(p, "tensor_model_parallel", False)
    ]
    if partial:
        ties.append(TiedParameters(tuple(partial), group, first))
    if whole:
        ties.append(TiedParameters(tuple(whole), group, first, summed=False))
    return ties


def build_plan(
    module: nn.Module,
    groups: Sequence[Sequence[nn.Parameter]],
    *,
    stage: int,
    data: Place,
    segments: Sequence[Sequence[nn.Parameter]] = (),
    ties: Sequence[TiedParameters] = (),
    experts: Sequence[ExpertParameters] = (),
    stage3: Stage3Options | None = None,
    sub_group_size: int = 1_000_000_000,
    whole_groups: Sequence[bool] = (),
) -> ShardPlan:
    """The plan for `groups` of `module`'s parameters (an optimizer's param groups, from
    `managed_groups`) at ZeRO `stage` (the stage actually run: the caller lowers it where one
    rank has nothing to shard). `whole_groups[g]`: param group `g`'s optimizer needs whole
    tensors."""
    groups = [list(group) for group in groups]
    places = (data, *(Place(e.group, e.rank, e.world_size) for e in experts))
    units: list[Unit] = []
    if stage == 3:
        assert not segments, "initialize refuses ZeRO stage 3 with a pipeline"
        place_of = {p: i + 1 for i, e in enumerate(experts) for p in e.params}
        params = [p for g in groups for p in g]
        units = plan_units(module, params, stage3 or Stage3Options(), place_of)
        blocks = _Blocks()
        for unit in units:
            blocks.add(unit.params, 0, None, unit.place)
    else:
        order = {p: i for i, p in enumerate(module.parameters())}
        blocks = _blocks(groups, segments, ties, experts, order)
    regions, region_group, block_regions = _regions(groups, blocks.params)
    if stage >= 1:
        # sub_group_size: no master tensor (what the optimizer steps, and offload swaps) is larger than this,
        # whole parameters permitting.
        regions, region_group, block_regions = _split_regions(
            regions, region_group, block_regions, sub_group_size
        )
    region_place = [0] * len(regions)
    for span, place in zip(block_regions, blocks.place):
        for r in span:
            region_place[r] = place
    params = [p for region in regions for p in region]
    names = {p: n for n, p in module.named_parameters()}
    names.update((p, n) for e in experts for p, n in zip(e.params, e.names))
    region_whole = [bool(whole_groups) and whole_groups[g] for g in region_group]
    shards = [places[p].world for p in region_place] if stage else 1
    layout = FlatLayout.of(regions, shards, region_whole)
    first_param = [0]
    for region in regions:
        first_param.append(first_param[-1] + len(region))
    plan = ShardPlan(
        stage=stage,
        places=places,
        params=tuple(params),
        param_names=tuple(names[p] for p in params),
        region_params=tuple(map(tuple, regions)),
        region_group=tuple(region_group),
        region_place=tuple(region_place),
        param_region=tuple(r for r, region in enumerate(regions) for _ in region),
        units=tuple(units),
        unit_regions=tuple(block_regions) if units else (),
        layout=layout,
        shard_ranges=tuple(
            layout.shard(r, places[p].rank if stage else 0) for r, p in enumerate(region_place)
        ),
        segment_starts=tuple(
            first_param[block_regions[blocks.segment.index(s)].start]
            for s in range(max(blocks.segment) + 1)
        ),
        ties=(),
        norm_spans=(),
        # Expert weights make the norm a sum over the data-parallel group even unsharded.
        norm_over_dp=stage >= 1 or bool(experts),
        region_whole=tuple(region_whole),
    )
    plan = replace(plan, masters=_masters(plan))
    return _with_norm(plan, blocks, block_regions, ties)


def _masters(plan: ShardPlan) -> tuple[Master, ...]:
    """The tensors the optimizer steps, in owned order (see the module docstring)."""
    layout = plan.layout
    if not plan.sharded:
        return tuple(
            Master(plan.param_region[i], offset, offset, numel, shape, i)
            for i, (offset, numel, shape) in enumerate(
                zip(layout.offsets, layout.numels, layout.shapes)
            )
        )
    masters, owned, first = [], 0, 0
    for r, (region, (s, e)) in enumerate(zip(plan.region_params, plan.shard_ranges)):
        if not plan.region_whole[r]:
            masters.append(Master(r, owned, s, e - s, torch.Size([e - s]), None))
        for i in range(first, first + len(region)):
            offset = layout.offsets[i]
            if plan.region_whole[r] and s <= offset < e:
                shape = layout.shapes[i]
                masters.append(Master(r, owned + offset - s, offset, layout.numels[i], shape, i))
        owned, first = owned + e - s, first + len(region)
    return tuple(masters)


def _with_norm(
    plan: ShardPlan, blocks: _Blocks, block_regions: list[range], ties: Sequence[TiedParameters]
) -> ShardPlan:
    """`plan` with each tie's owned span (the same elements on every rank of the tie: its block is
    laid out alike there) and the spans the norm counts, each with the weight its squares carry
    in the sum over the data-parallel group: 1 for shards; unsharded with expert weights, 1 / the
    number of ranks holding the same copy."""
    tied = (
        _pieces_of_ties(plan, ties)
        if plan.units
        else tuple(
            (plan.owned_span(block_regions[b]), ties[t])
            for b, t in enumerate(blocks.tie)
            if t is not None
        )
    )
    uncounted = sorted(span for span, tie in tied if not tie.counted)
    total = plan.layout.total if not plan.sharded else plan.layout.shard_numel()
    unsharded = not plan.sharded and len(plan.places) > 1
    weights = [1.0 / place.world if unsharded else 1.0 for place in plan.places]
    placed = [
        (*plan.owned_span(span), place)
        for span, place in zip(block_regions, blocks.place)
        if len(span)
    ]
    spans = []
    for start, end in _complement(uncounted, total):
        for a, b, place in placed:
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                spans.append((lo, hi, weights[place]))
    return replace(plan, ties=tied, norm_spans=tuple(_merged(spans)))


def _pieces_of_ties(
    plan: ShardPlan, ties: Sequence[TiedParameters]
) -> tuple[tuple[tuple[int, int], TiedParameters], ...]:
    """Stage 3: tied weights sit inside the gather units, which are laid out alike on the ranks
    of a tie (tensor-parallel peers hold slices of one size): each piece of them this rank owns,
    in owned coordinates, in order."""
    index = {p: i for i, p in enumerate(plan.params)}
    pieces = []
    for tie in ties:
        for param in tie.params:
            if param not in index:
                continue  # frozen: nothing to sum or count
            for k, _, offset, length in plan.fragments(index[param]):
                start = plan.masters[k].owned + offset
                pieces.append(((start, start + length), tie))
    return tuple(sorted(pieces, key=lambda piece: piece[0]))


def managed_groups(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
    """Each optimizer group's trainable parameters, in reverse model order (roughly backward order).

    Frozen parameters get no gradient; the optimizer may list them but they stay out of the buffers.
    """
    order = {p: i for i, p in enumerate(module.parameters())}
    groups, seen = [], set()
    for group in optimizer.param_groups:
        trainable = [p for p in group["params"] if p.requires_grad]
        missing = [p for p in trainable if p not in order]
        if missing:
            raise ValueError(
                "the optimizer holds parameters that are not in the model passed to initialize(); "
                "build the optimizer from model.parameters()"
            )
        if seen.intersection(trainable):
            raise ValueError("a parameter appears in two optimizer param groups")
        seen.update(trainable)
        groups.append(sorted(trainable, key=order.__getitem__, reverse=True))
    if not seen:
        raise ValueError("the optimizer has no trainable parameters")
    return groups


@dataclass
class _Blocks:
    """Blocks of parameters, each with its segment, tie (an index into the ties, or None) and
    place."""

    params: list[list[nn.Parameter]] = field(default_factory=list)
    segment: list[int] = field(default_factory=list)
    tie: list[int | None] = field(default_factory=list)
    place: list[int] = field(default_factory=list)

    def add(self, params: list[nn.Parameter], segment: int, tie: int | None, place: int) -> None:
        self.params.append(params)
        self.segment.append(segment)
        self.tie.append(tie)
        self.place.append(place)


def _regions(
    groups: list[list[nn.Parameter]], blocks: list[list[nn.Parameter]]
) -> tuple[list[list[nn.Parameter]], list[int], list[range]]:
    """(regions, each region's param group, each block's regions): block-major, a region per
    param group in each block."""
    regions, region_group, block_regions = [], [], []
    for block in blocks:
        first = len(regions)
        members = set(block)
        for g, group in enumerate(groups):
            regions.append([p for p in group if p in members])
            region_group.append(g)
        block_regions.append(range(first, len(regions)))
    assert sum(map(len, regions)) == sum(map(len, groups))
    return regions, region_group, block_regions


def _blocks(
    groups: list[list[nn.Parameter]],
    segments: Sequence[Sequence[nn.Parameter]],
    ties: Sequence[TiedParameters],
    experts: Sequence[ExpertParameters],
    model_order: dict[nn.Parameter, int],
) -> _Blocks:
    """For every segment its tied weights, one block per tie, then the rest of it, cut where it
    passes between the data-parallel group's weights and an expert layer's, so that blocks keep
    roughly backward order. Without segments, all parameters are one segment."""
    managed = [p for group in groups for p in group]
    managed_set = set(managed)
    segments = [[p for p in s if p in managed_set] for s in segments] or [managed]
    seen = [p for s in segments for p in s]
    if len(seen) != len(set(seen)) or set(seen) != managed_set:
        raise ValueError("segments must hold every parameter the optimizer steps exactly once")
    tie_of = {p: t for t, tie in enumerate(ties) for p in tie.params}
    place_of = {p: i + 1 for i, e in enumerate(experts) for p in e.params}
    if set(place_of) - managed_set:
        raise ValueError("expert parameters must be trainable parameters the optimizer steps")
    if set(place_of) & set(tie_of):
        raise ValueError("expert parameters cannot also be tied or replicated weights")
    blocks = _Blocks()
    for s, segment in enumerate(segments):
        members = set(segment)
        for t, tie in enumerate(ties):
            tied = [p for p in tie.params if p in members]
            if tied:
                blocks.add(tied, s, t, 0)
        rest = [p for p in segment if p not in tie_of]
        if experts:
            rest.sort(key=lambda p: -model_order[p])
        runs: list[list[nn.Parameter]] = []
        for p in rest:
            if not runs or place_of.get(p, 0) != place_of.get(runs[-1][0], 0):
                runs.append([])
            runs[-1].append(p)
        for run in runs or [[]]:
            blocks.add(run, s, None, place_of.get(run[0], 0) if run else 0)
    return blocks


def _split_regions(
    regions: list[list[nn.Parameter]],
    region_group: list[int],
    block_regions: list[range],
    limit: int,
) -> tuple[list[list[nn.Parameter]], list[int], list[range]]:
    """Split each region into runs of whole parameters holding at most `limit` elements each."""
    out, out_group, out_blocks = [], [], []
    for span in block_regions:
        first = len(out)
        for r in span:
            run, size = [], 0
            for p in regions[r]:
                numel = logical_shape(p).numel()
                if run and size + numel > limit:
                    out.append(run)
                    out_group.append(region_group[r])
                    run, size = [], 0
                run.append(p)
                size += numel
            out.append(run)
            out_group.append(region_group[r])
        out_blocks.append(range(first, len(out)))
    return out, out_group, out_blocks


def _merged(spans: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """Sorted spans with adjacent ones of equal weight joined."""
    out: list[tuple[int, int, float]] = []
    for a, b, w in sorted(spans):
        if out and out[-1][1] == a and out[-1][2] == w:
            out[-1] = (out[-1][0], b, w)
        else:
            out.append((a, b, w))
    return out


def _complement(spans: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """The parts of [0, total) outside the sorted, disjoint `spans`."""
    out, cursor = [], 0
    for start, end in spans:
        if start > cursor:
            out.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < total:
        out.append((cursor, total))
    return out
