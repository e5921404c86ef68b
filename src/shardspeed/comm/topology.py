"""The parallel mesh (`Topology`): who this rank is on every axis, and every process group it
talks over. `subgroup()` is the one place groups are made.

A `ProcessTopology` (DeepSpeed's class of that name) is a mesh of named axes, the last varying
fastest: with axes (pipe, data) and sizes (2, 2), ranks 0 and 1 are stage 0's two data-parallel
replicas. `Topology` is this rank's view of it: its coordinates, the data-parallel group it averages
gradients over, the pipeline group its stages form, the tensor-parallel group its split layers use,
and on request the groups a model needs: a tied weight's stages, expert layouts, runs of
data-parallel ranks for inference tensor parallelism. A Megatron-style `mpu` is honoured.
`PipelineParallelGrid` and `deepspeed.utils.groups` (`groups.py`) are DeepSpeed's faces on it.

Expert parallelism splits each data-parallel group further (`Topology.expert_groups`): runs of
`ep_size` consecutive data-parallel ranks share out a mixture-of-experts layer's experts (the expert
group, which exchanges tokens all-to-all), and the ranks at the same place in every run hold the same
experts (the expert-data group, which averages their gradients), as DeepSpeed lays them out.
DeepSpeed's `use_data_before_expert_parallelism` swaps the two: expert-data groups are the runs of
consecutive ranks and expert groups stride across them. The `expert_parallel` section carves them
from every axis whose ranks hand the experts different tokens: data x sequence under sequence
parallelism, data x tensor under AutoTP (each tensor-parallel peer dispatches a share of its
tokens; DeepSpeed's folding), so an expert group may span tensor-parallel peers.

Sequence parallelism is an axis of its own, inside data: with axes (data, sequence) and sizes
(dp, sp), as DeepSpeed's `mesh_param=(dp, sp)` lays them out, runs of `sp` consecutive ranks split
one sequence (the sequence group), and the data x sequence ranks together (the sequence-data
group) are the ones ZeRO shards over and gradients are reduced over, since every sequence rank
holds the whole model. The batch arithmetic counts `dp` replicas: the ranks of a sequence group
share their batches.
"""

from __future__ import annotations

import functools
import itertools
from collections import namedtuple
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from .comm import collective_timeout


class ProcessTopology:
    """Ranks laid out on a mesh of named axes (row-major: the last axis varies fastest)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"axes {list(axes)} and dims {list(dims)} must pair up, names unique")
        if any(d < 1 for d in dims):
            raise ValueError(f"every dimension must be at least 1, got {list(dims)}")
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self._coords = [
            self.ProcessCoord(*c) for c in itertools.product(*(range(d) for d in self.dims))
        ]
        self._ranks = {c: r for r, c in enumerate(self._coords)}

    def world_size(self) -> int:
        return len(self._coords)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        return self._coords[rank]

    def get_rank(self, **coords: int) -> int:
        if set(coords) != set(self.axes):
            raise ValueError(f"get_rank needs every axis {self.axes}, got {sorted(coords)}")
        return self._ranks[self.ProcessCoord(**coords)]

    def filter_match(self, **coords: int) -> list[int]:
        """Ranks whose coordinates match every given axis value."""
        return [
            r
            for r, c in enumerate(self._coords)
            if all(getattr(c, a) == v for a, v in coords.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on `axis` is `idx`."""
        return self.filter_match(**{axis: idx})

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups that vary along `axis` only: one list of ranks per setting of the others."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Sequence[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omit_axes
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(zip(self.axes, self.dims))})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages by data-parallel replicas (the replicas of a stage are neighbours)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor (model) parallelism, tensor-parallel ranks innermost."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _prime_factors(n: int) -> list[int]:
    """The prime factors of `n`, smallest first, repeated as often as they divide it."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"prime factors need a positive integer, got {n!r}")
    factors, p = [], 2
    while n > 1:
        if p * p > n:
            factors.append(n)
            break
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's groups for one expert-parallel size (see the module docstring)."""

    ep_size: int
    ep_rank: int
    ep_group: Any
    expert_data_rank: int
    expert_data_size: int
    expert_data_group: Any


@dataclass(frozen=True)
class SequenceGroups:
    """A sequence group cut in two (`Topology.sequence_split`): this rank's Ulysses group (heads
    exchanged all-to-all) and ring group (key/value blocks passed around), with sizes and ranks.
    A group of size 1 is never used; the larger one may be the whole sequence group."""

    ulysses_size: int
    ulysses_rank: int
    ulysses_group: Any
    ring_size: int
    ring_rank: int
    ring_group: Any


@dataclass(frozen=True)
class Topology:
    """The parallel mesh: this rank's place on every axis, and every process group it talks over.

    Axes: data (replicas that take their own batches), sequence (ranks that split one sequence;
    with data, the sequence-data group that ZeRO shards over and gradients are reduced over: the
    data-parallel group when there is one rank per sequence), pipeline (stages), tensor (layers
    split), and expert (carved out of data, one layout per `ep_size`). The model-parallel group (pipeline x tensor: the ranks
    whose parameters together make one model) serves gradient norms. Groups the axes imply are
    made when the mesh is built; those that depend on a model (expert sizes, the stages a tied
    weight spans, runs of data-parallel ranks for inference tensor parallelism, the one-rank
    group) are made on first request, once per mesh, and handed out again after. Every group
    comes from here, through `subgroup()`.

    A group of None means the default (world) group. `mesh` is set when the ranks form a
    `ProcessTopology`. The Megatron `mpu` methods (`get_data_parallel_group()`, ...) are offered,
    so a Topology serves wherever DeepSpeed takes an `mpu`.
    """

    rank: int
    world_size: int
    dp_rank: int
    dp_world_size: int
    dp_group: Any
    stage: int = 0
    num_stages: int = 1
    pipe_group: Any = None
    tp_rank: int = 0
    tp_world_size: int = 1
    tp_group: Any = None
    mp_group: Any = None
    sp_rank: int = 0
    sp_world_size: int = 1
    sp_group: Any = None  # read when sp_world_size > 1
    sdp_group: Any = None  # read when sp_world_size > 1
    mesh: ProcessTopology | None = field(default=None, compare=False)
    # Groups made on request, by what was asked (collective the first time, so cached).
    _requested: dict[tuple[Any, ...], Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls, mpu: Any = None, tensor_parallel: int = 1, sequence_parallel: int = 1
    ) -> Topology:
        """From a user's `mpu`, or the world's mesh with `tensor_parallel` ranks per layer (data x
        tensor; 0 or 1: none) or `sequence_parallel` ranks per sequence (data x sequence); the
        same mesh, groups and all, for every call with the same sizes in one world."""
        if mpu is not None:
            topology = _from_mpu(mpu)
            if tensor_parallel > 1 or sequence_parallel not in (1, topology.sp_world_size):
                raise ValueError(
                    "pass an mpu or ask for tensor or sequence parallelism in the config "
                    "('tensor_parallel.autotp_size', 'sequence_parallel_size'), not both"
                )
            return topology
        return _world_mesh(max(tensor_parallel, 1), sequence_parallel)

    @classmethod
    def world(cls) -> Topology:
        """The whole world as one data-parallel group (built once per process group)."""
        return _world_mesh(1, 1)

    @classmethod
    def from_mesh(cls, mesh: ProcessTopology) -> Topology:
        """Groups for a mesh of (pipe, data, sequence, model) axes. Collective the first time (every rank makes
        every group, in order); later calls with the same mesh return the same groups, so a
        script can ask for them before building its tensor-parallel layers."""
        cached = getattr(mesh, "_shardspeed_topology", None)
        if cached is not None:
            return cached
        rank, world = dist.get_rank(), dist.get_world_size()
        if mesh.world_size() != world:
            raise ValueError(
                f"the topology {mesh} has {mesh.world_size()} ranks, the world {world}"
            )
        unknown = set(mesh.axes) - {"pipe", "data", "sequence", "model"}
        if unknown:
            raise ValueError(f"axes {sorted(unknown)} of {mesh} are not supported")
        coord = mesh.get_coord(rank)._asdict()
        dp_group = subgroup(mesh.get_axis_comm_lists("data"))
        pipe_group = subgroup(mesh.get_axis_comm_lists("pipe"))
        tp_group = subgroup(mesh.get_axis_comm_lists("model"))
        # A replica (pipe x model, for the norm) and a sequence-data group (data x sequence) each
        # fix the other axes.
        mp_group = subgroup(_varying(mesh, ("pipe", "model")))
        sequenced = mesh.get_dim("sequence") > 1
        sp_group = subgroup(mesh.get_axis_comm_lists("sequence")) if sequenced else None
        sdp_group = subgroup(_varying(mesh, ("data", "sequence"))) if sequenced else None
        topology = cls(
            rank=rank,
            world_size=world,
            dp_rank=coord.get("data", 0),
            dp_world_size=max(mesh.get_dim("data"), 1),
            dp_group=dp_group,
            stage=coord.get("pipe", 0),
            num_stages=max(mesh.get_dim("pipe"), 1),
            pipe_group=pipe_group,
            tp_rank=coord.get("model", 0),
            tp_world_size=max(mesh.get_dim("model"), 1),
            tp_group=tp_group,
            mp_group=mp_group,
            sp_rank=coord.get("sequence", 0),
            sp_world_size=max(mesh.get_dim("sequence"), 1),
            sp_group=sp_group,
            sdp_group=sdp_group,
            mesh=mesh,
        )
        mesh._shardspeed_topology = topology
        return topology

    def _requested_group(self, key: tuple[Any, ...], rank_lists: Callable[[], list]) -> Any:
        """The group made for `key` from `rank_lists()` (collective the first time)."""
        if key not in self._requested:
            self._requested[key] = subgroup(rank_lists())
        return self._requested[key]

    def _data_lists(self) -> list[list[int]]:
        """The global ranks of every data-parallel group, in data-parallel rank order."""
        if self.mesh is not None:
            return self.mesh.get_axis_comm_lists("data") or [[r] for r in range(self.world_size)]
        if self.dp_world_size == self.world_size:
            return [list(range(self.world_size))]
        raise ValueError(
            "subgroups of the data-parallel group (expert parallelism, the hybrid engine's "
            "inference tensor parallelism) need the groups laid out by shardspeed (a config's "
            "tensor_parallel, or a pipeline's topology), not a user's mpu"
        )

    def data_parallel_runs(self, size: int) -> tuple[Any, int]:
        """(group, this rank's index in it) of `size` consecutive data-parallel ranks: inference
        tensor parallelism (the hybrid engine's, and `init_inference`'s over the world's mesh)."""
        if size < 1 or self.dp_world_size % size:
            raise ValueError(f"{size} must divide the data-parallel size {self.dp_world_size}")
        group = self._requested_group(("runs", size), lambda: _runs(self._data_lists(), size))
        return group, self.dp_rank % size

    def hpz_group(self, size: int) -> tuple[Any, int]:
        """(group, this rank's index in it) of `size` consecutive ranks of the sequence-data
        group, which ZeRO shards over: a "node" of ZeRO++'s hierarchical partitioning
        (`zero_hpz_partition_size`). Collective the first time for each size."""
        world = self.get_sequence_data_parallel_world_size()
        if size < 1 or world % size:
            raise ValueError(
                f"'zero_optimization.zero_hpz_partition_size' {size} must divide the "
                f"data-parallel size {world}"
            )
        if self.sp_world_size == 1:
            return self.data_parallel_runs(size)
        if self.mesh is None:
            raise ValueError("hierarchical partitioning needs the groups laid out by shardspeed")
        lists = _varying(self.mesh, ("data", "sequence"))
        group = self._requested_group(("hpz", size), lambda: _runs(lists, size))
        return group, self.get_sequence_data_parallel_rank() % size

    def expert_groups(
        self,
        ep_size: int,
        data_before_expert: bool = False,
        over_sequence: bool = False,
        over_tensor: bool = False,
    ) -> ExpertGroups:
        """The expert and expert-data groups for `ep_size` (collective the first time for each
        size: every rank makes every group, in order). `data_before_expert`: DeepSpeed's
        `use_data_before_expert_parallelism` layout (see the module docstring).
        `over_sequence`: carved from the sequence-data group (data x sequence ranks, which hold
        different tokens for the MLPs) instead of the data group; `over_tensor`: carved from the
        data x tensor ranks (AutoTP's peers each take a share of their tokens for the experts,
        DeepSpeed's folding); each the same as the data group without that axis."""
        axes = ["data"]
        if over_sequence and self.sp_world_size > 1:
            axes.append("sequence")
        if over_tensor and self.tp_world_size > 1:
            axes.append("model")
        world = self.dp_world_size * (self.sp_world_size if "sequence" in axes else 1)
        world *= self.tp_world_size if "model" in axes else 1
        if ep_size < 1 or world % ep_size:
            what = "data-parallel size" if axes == ["data"] else "ranks it spreads over"
            raise ValueError(f"ep_size {ep_size} must divide the {what} {world}")
        lists = self._data_lists if axes == ["data"] else functools.partial(self._axes_lists, axes)
        rank = next(ranks.index(self.rank) for ranks in lists() if self.rank in ranks)
        replicas = world // ep_size
        # Each data-parallel group is cut into runs of consecutive ranks, and the ranks at one
        # place in every run: expert groups are the runs (ep_size long) by default, the places
        # (runs replicas long) under data_before_expert.
        if data_before_expert:
            expert_lists, replica_lists, run_length = _strides, _runs, replicas
            ep_rank, replica_rank = divmod(rank, replicas)
        else:
            expert_lists, replica_lists, run_length = _runs, _strides, ep_size
            replica_rank, ep_rank = divmod(rank, ep_size)
        key = ("experts", ep_size, data_before_expert, *axes)
        ep_group = self._requested_group(
            (*key, "expert"), lambda: expert_lists(lists(), run_length)
        )
        expert_data_group = self._requested_group(
            (*key, "expert-data"), lambda: replica_lists(lists(), run_length)
        )
        return ExpertGroups(ep_size, ep_rank, ep_group, replica_rank, replicas, expert_data_group)

    def _axes_lists(self, axes: Sequence[str]) -> list[list[int]]:
        """The global ranks that vary along `axes` (mesh axis names) only, in rank order."""
        if self.mesh is None:
            raise ValueError(
                "expert parallelism with sequence or tensor parallelism needs the groups laid out "
                "by shardspeed (a config's sequence_parallel_size or tensor_parallel.autotp_size, "
                "or register_with_transformers), not an mpu's"
            )
        return _varying(self.mesh, tuple(axes))

    def sequence_split(self, ulysses_degree: int) -> SequenceGroups:
        """The sequence group cut for hybrid sequence parallelism: runs of `ulysses_degree`
        consecutive sequence ranks exchange heads (Ulysses), and the ranks at the same place in
        every run pass key/value blocks around a ring. A degree of the sequence size is Ulysses
        alone (ring of one), 1 is the ring alone. Collective the first time for each degree."""
        size = self.sp_world_size
        if ulysses_degree < 1 or size % ulysses_degree:
            raise ValueError(
                f"the Ulysses degree {ulysses_degree} must divide the sequence-parallel size {size}"
            )
        ring_size = size // ulysses_degree
        if size == 1:
            return SequenceGroups(1, 0, None, 1, 0, None)
        lists = self.mesh.get_axis_comm_lists("sequence") if self.mesh is not None else None
        if lists is None:
            raise ValueError(
                "hybrid sequence parallelism needs the sequence groups laid out by shardspeed"
            )
        ring_rank, ulysses_rank = divmod(self.sp_rank, ulysses_degree)
        ulysses_group = (
            self.sp_group
            if ring_size == 1
            else self._requested_group(
                ("ulysses", ulysses_degree), lambda: _runs(lists, ulysses_degree)
            )
        )
        ring_group = (
            self.sp_group
            if ulysses_degree == 1
            else self._requested_group(
                ("ring", ulysses_degree), lambda: _strides(lists, ulysses_degree)
            )
        )
        return SequenceGroups(
            ulysses_degree, ulysses_rank, ulysses_group, ring_size, ring_rank, ring_group
        )

    def tie_group(self, stages: Sequence[int]) -> tuple[Any, int]:
        """(group, source) for a weight tied across pipeline `stages`: one group per data-parallel
        replica and tensor rank, holding its ranks at those stages (None for a rank at none of
        them), and the global rank at the first stage in this rank's pipeline, which broadcasts
        the initial values and alone counts the tie in the gradient norm. Collective the first
        time for each set of stages."""
        if self.mesh is None or "pipe" not in self.mesh.axes:
            raise ValueError("tied pipeline weights need a mesh with a 'pipe' axis")
        stages = tuple(stages)
        pipelines = self.mesh.get_axis_comm_lists("pipe")
        group = self._requested_group(
            ("tie", stages), lambda: [[ranks[s] for s in stages] for ranks in pipelines]
        )
        return group, self.stage_rank(stages[0])

    def self_group(self) -> Any:
        """A group holding this rank alone (collective the first time: every rank makes one)."""
        return self._requested_group(("self",), lambda: [[r] for r in range(self.world_size)])

    def stage_rank(self, stage: int) -> int:
        """The global rank of `stage` in this rank's pipeline (same data and tensor index)."""
        if self.mesh is None:
            return self.rank
        coords = self.mesh.get_coord(self.rank)._asdict()
        return self.mesh.get_rank(**{**coords, "pipe": stage})

    def model_parallel_rank(self, stage: int, tp_rank: int) -> int:
        """The global rank holding (`stage`, `tp_rank`) in this rank's data-parallel replica."""
        if self.mesh is None:
            return self.rank
        coords = self.mesh.get_coord(self.rank)._asdict()
        coords.update({"pipe": stage} if "pipe" in coords else {})
        coords.update({"model": tp_rank} if "model" in coords else {})
        return self.mesh.get_rank(**coords)

    # -- the Megatron `mpu` interface --------------------------------------------------------------

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_world_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp_world_size

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_pipe_parallel_rank(self) -> int:
        return self.stage

    def get_pipe_parallel_world_size(self) -> int:
        return self.num_stages

    def get_pipe_parallel_group(self) -> Any:
        return self.pipe_group

    # With one rank per sequence, the sequence group is this rank alone and the sequence-data
    # group is the data-parallel group.

    def get_sequence_parallel_rank(self) -> int:
        return self.sp_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp_world_size

    def get_sequence_parallel_group(self) -> Any:
        return self.sp_group if self.sp_world_size > 1 else self.self_group()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self.sdp_group) if self.sp_world_size > 1 else self.dp_rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dp_world_size * self.sp_world_size

    def get_sequence_data_parallel_group(self) -> Any:
        return self.sdp_group if self.sp_world_size > 1 else self.dp_group


class PipelineParallelGrid:
    """DeepSpeed's grid: the groups of a (pipe, data[, model]) mesh, with DeepSpeed's `mpu`
    methods, over `Topology.from_mesh` (which makes the groups, once per mesh).

    Without a topology the world size's prime factors are dealt to pipe and data in turn, the
    first to pipe, as DeepSpeed does. Collective: every rank builds the grid. The model-parallel
    group is DeepSpeed's (pipe x model: the ranks holding one replica, for overflow checks and
    norms); the slice group is the tensor-parallel one.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        if process_group is not None:
            raise ValueError(
                "PipelineParallelGrid(process_group=...) is not supported: a grid spans the "
                "whole world; pass only topology"
            )
        if topology is None:
            world = dist.get_world_size()
            num_pp = num_dp = 1
            for i, prime in enumerate(_prime_factors(world)):
                if i % 2:
                    num_dp *= prime
                else:
                    num_pp *= prime
            topology = PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)
        missing = {"pipe", "data"} - set(topology.get_axis_names())
        if missing:
            raise ValueError(
                f"a pipeline grid needs the axes {sorted(missing)}; {topology} lacks them"
            )
        self._mesh = topology
        self.topo = Topology.from_mesh(topology)
        self.global_rank = self.topo.rank
        self.world_size = self.topo.world_size
        self.pipe_parallel_size = self.topo.num_stages
        self.data_parallel_size = self.topo.dp_world_size
        self.model_parallel_size = self.slice_parallel_size = self.topo.tp_world_size
        self.stage_id = self.topo.stage
        self.data_parallel_id = self.topo.dp_rank
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.dp_group = self._ranks_with(topology.get_axis_comm_lists("data"))
        self.pp_group = self._ranks_with(topology.get_axis_comm_lists("pipe"))
        self._replica = topology.filter_match(data=self.data_parallel_id)
        if "model" in topology.get_axis_names():
            self.slice_group = self._ranks_with(topology.get_axis_comm_lists("model"))
            self._slice_proc_group = self.topo.tp_group
        else:  # a group of one each: None would mean the world to a collective
            self.slice_group = [self.global_rank]
            self._slice_proc_group = self.topo.self_group()

    def _ranks_with(self, rank_lists: list[list[int]]) -> list[int]:
        return next(ranks for ranks in rank_lists if self.global_rank in ranks)

    def _is_grid_valid(self) -> bool:
        return self._mesh.world_size() == dist.get_world_size()

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **coords: int) -> int:
        """The global rank of `stage_id` at this rank's other coordinates, or those given."""
        mine = self._mesh.get_coord(self.global_rank)._asdict()
        return self._mesh.get_rank(**{**mine, "pipe": stage_id, **coords})

    def topology(self) -> ProcessTopology:
        return self._mesh

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.topo.pipe_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.topo.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group)

    def get_model_parallel_rank(self) -> int:
        return self._replica.index(self.global_rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self._replica)

    def get_model_parallel_group(self) -> Any:
        return self.topo.mp_group

    def get_slice_parallel_rank(self) -> int:
        return self.topo.tp_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self._slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size


def _from_mpu(mpu: Any) -> Topology:
    """A user's Megatron `mpu`: its data-parallel group, and its model-parallel one if it has it;
    or a sequence-parallel one (DeepSpeed's `parallel_state_sp`, with sequence groups only): the
    world's data x sequence mesh, which must hold the same sequence groups."""
    if not hasattr(mpu, "get_data_parallel_group") and hasattr(mpu, "get_sequence_parallel_group"):
        mesh = _world_mesh(1, mpu.get_sequence_parallel_world_size())
        given = dist.get_process_group_ranks(mpu.get_sequence_parallel_group())
        if given != dist.get_process_group_ranks(mesh.sp_group):
            raise ValueError(
                f"the mpu's sequence-parallel group holds ranks {given}; shardspeed's sequence "
                "groups are runs of consecutive ranks, as DeepSpeed's"
            )
        return mesh
    tp_size = mpu.get_model_parallel_world_size() if hasattr(mpu, "get_model_parallel_group") else 1
    return Topology(
        dist.get_rank() if dist.is_initialized() else 0,
        dist.get_world_size() if dist.is_initialized() else 1,
        mpu.get_data_parallel_rank(),
        mpu.get_data_parallel_world_size(),
        mpu.get_data_parallel_group(),
        tp_rank=mpu.get_model_parallel_rank() if tp_size > 1 else 0,
        tp_world_size=tp_size,
        tp_group=mpu.get_model_parallel_group() if tp_size > 1 else None,
        mp_group=mpu.get_model_parallel_group() if tp_size > 1 else None,
    )


# The world's meshes by (tensor, sequence) parallel size, each with the default group it was built in: a new
# process group (after destroy and init) builds afresh, and holding the old one keeps its identity
# from being reused meanwhile.
_world_meshes: dict[tuple[int, int], tuple[Any, Topology]] = {}


def _world_mesh(tensor_parallel: int, sequence_parallel: int) -> Topology:
    """The world as data x `tensor_parallel` or data x `sequence_parallel` (the inner ranks
    neighbours), validated and built once per process group; data parallelism alone uses the
    default group itself."""
    if not dist.is_initialized():
        if tensor_parallel > 1 or sequence_parallel > 1:
            raise ValueError(
                "tensor and sequence parallelism need the process group: call "
                "shardspeed.init_distributed()"
            )
        return Topology(0, 1, 0, 1, None)
    built = _world_meshes.get((tensor_parallel, sequence_parallel))
    if built is not None and built[0] is dist.group.WORLD:
        return built[1]
    rank, world = dist.get_rank(), dist.get_world_size()
    if tensor_parallel < 1 or world % tensor_parallel:
        raise ValueError(
            f"tensor_parallel.autotp_size {tensor_parallel} must divide the world size {world}"
        )
    if sequence_parallel < 1 or world % sequence_parallel:
        raise ValueError(
            f"sequence_parallel_size {sequence_parallel} must divide the world size {world}"
        )
    if tensor_parallel > 1 and sequence_parallel > 1:
        raise ValueError(
            "sequence_parallel_size and tensor_parallel.autotp_size do not combine: choose one"
        )
    if sequence_parallel > 1:
        layout = ProcessTopology(
            ["data", "sequence"], [world // sequence_parallel, sequence_parallel]
        )
        mesh = Topology.from_mesh(layout)
    elif tensor_parallel > 1:
        layout = PipeModelDataParallelTopology(1, tensor_parallel, world // tensor_parallel)
        mesh = Topology.from_mesh(layout)
    else:
        mesh = Topology(rank, world, rank, world, None)
    _world_meshes[(tensor_parallel, sequence_parallel)] = (dist.group.WORLD, mesh)
    return mesh


def _varying(mesh: ProcessTopology, axes: Sequence[str]) -> list[list[int]]:
    """One list per setting of the axes not in `axes`: the ranks that vary along `axes` only."""
    fixed_axes = [a for a in mesh.axes if a not in axes]
    settings = itertools.product(*(range(mesh.get_dim(a)) for a in fixed_axes))
    return [mesh.filter_match(**dict(zip(fixed_axes, values))) for values in settings]


def _runs(lists: list[list[int]], size: int) -> list[list[int]]:
    """Each list cut into runs of `size` consecutive entries."""
    return [ranks[i : i + size] for ranks in lists for i in range(0, len(ranks), size)]


def _strides(lists: list[list[int]], size: int) -> list[list[int]]:
    """From each list, the entries at each place in its runs of `size`."""
    return [ranks[j::size] for ranks in lists for j in range(size)]


def subgroup(rank_lists: Sequence[Sequence[int]]) -> Any:
    """Make one process group per rank list (collective, same order everywhere); return the one
    holding this rank, or None when no list does."""
    rank, mine = dist.get_rank(), None
    timeout = collective_timeout()  # torch would give a new group its default, not the world's
    for ranks in rank_lists:
        group = dist.new_group(ranks=list(ranks), timeout=timeout)
        if rank in ranks:
            mine = group
    return mine
