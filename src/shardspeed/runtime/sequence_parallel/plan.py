"""The running job's sequence-parallel plan: how a sequence is cut over the sequence group and
which attention runs over it (the config's `sequence_parallel` section). `initialize` sets it;
code that runs inside the model or the data loader (the Hugging Face attention wrapper, the
loader adapter) reads it when it runs, since accelerate builds both before `initialize`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...comm import groups
from ...comm.topology import SequenceGroups
from ...config.schema import ShardSpeedConfig


@dataclass(frozen=True)
class SequencePlan:
    """`ulysses_degree` ranks exchange heads (None: the whole sequence group, plain Ulysses; 1:
    the ring alone); `fixed_length`: every batch must have the first batch's length."""

    ulysses_degree: int | None = None
    fixed_length: bool = False

    @classmethod
    def from_config(cls, config: ShardSpeedConfig) -> SequencePlan:
        section = config.sequence_parallel
        return cls(
            section.ulysses_degree(config.sequence_parallel_size),
            not section.ulysses.seq_length_is_variable,
        )

    def ring_size(self, sp_world_size: int) -> int:
        """Ring blocks the sequence is cut into over `sp_world_size` sequence ranks."""
        return sp_world_size // (self.ulysses_degree or sp_world_size)

    def groups(self) -> SequenceGroups:
        """This rank's Ulysses and ring groups on the current mesh."""
        topology = groups._current()
        return topology.sequence_split(self.ulysses_degree or topology.sp_world_size)


_plan = SequencePlan()


def use_plan(plan: SequencePlan) -> None:
    """Run by `plan` from now on (`initialize` calls this)."""
    global _plan
    _plan = plan


def current_plan() -> SequencePlan:
    return _plan
