"""Who this rank is, and every process group it talks over: the one place groups are made.

A `ProcessTopology` (DeepSpeed's class of that name) is a mesh of named axes, the last varying
fastest: with axes (pipe, data) and sizes (2, 2), ranks 0 and 1 are stage 0's two data-parallel
replicas. `Topology` is this rank's view of it: its coordinates, the data-parallel group it averages
gradients over and the pipeline group its stages form. A Megatron-style `mpu`
(get_data_parallel_*) is honoured. Tensor and expert axes join in later issues.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


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


@dataclass(frozen=True)
class Topology:
    """This rank's place: global rank and size, data-parallel rank/size/group, pipeline stage.

    A group of None means the default (world) group. `mesh` is set when the ranks form a
    `ProcessTopology` (a pipelined model).
    """

    rank: int
    world_size: int
    dp_rank: int
    dp_world_size: int
    dp_group: Any
    stage: int = 0
    num_stages: int = 1
    pipe_group: Any = None
    mesh: ProcessTopology | None = field(default=None, compare=False)

    @classmethod
    def build(cls, mpu: Any = None) -> Topology:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if mpu is None:
            return cls(rank, world, rank, world, None)
        return cls(
            rank,
            world,
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
            mpu.get_data_parallel_group(),
        )

    @classmethod
    def from_mesh(cls, mesh: ProcessTopology) -> Topology:
        """Groups for a (pipe, data) mesh. Collective: every rank makes every group, in order."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if mesh.world_size() != world:
            raise ValueError(
                f"the topology {mesh} has {mesh.world_size()} ranks, the world {world}"
            )
        unknown = set(mesh.axes) - {"pipe", "data"}
        if any(mesh.get_dim(a) > 1 for a in unknown):
            raise ValueError(
                f"axes {sorted(unknown)} of {mesh} are not supported yet (tensor parallelism is "
                "issue 8); use PipeDataParallelTopology"
            )
        coord = mesh.get_coord(rank)
        dp_group = subgroup(mesh.get_axis_comm_lists("data"))
        pipe_group = subgroup(mesh.get_axis_comm_lists("pipe"))
        return cls(
            rank,
            world,
            coord.data,
            mesh.get_dim("data"),
            dp_group,
            coord.pipe,
            mesh.get_dim("pipe"),
            pipe_group,
            mesh,
        )

    def stage_rank(self, stage: int) -> int:
        """The global rank of `stage` in this rank's pipeline (same data-parallel index)."""
        if self.mesh is None:
            return self.rank
        coords = self.mesh.get_coord(self.rank)._asdict()
        return self.mesh.get_rank(**{**coords, "pipe": stage})


def subgroup(rank_lists: Sequence[Sequence[int]]) -> Any:
    """Make one process group per rank list (collective, same order everywhere); return the one
    holding this rank, or None when no list does."""
    rank, mine = dist.get_rank(), None
    for ranks in rank_lists:
        group = dist.new_group(ranks=list(ranks))
        if rank in ranks:
            mine = group
    return mine
