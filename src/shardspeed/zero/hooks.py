"""DeepSpeed's stage-3 hook surface, as libraries reach into it (`optimizer.parameter_offload`,
DeepSpeed's `DeepSpeedZeRoOffload`): TRL generates from weights gathered with
`GatheredParameters`, and takes the gather hooks off for that time so that the forward passes of
generation do not gather and release units; afterwards it puts them back and invalidates the
recorded order of units. The parameter and module attributes it touches on the way
(`ds_active_sub_modules`, `ds_external_parameters()`) are set here too.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

from torch import nn

from .partitioned import ShardedParameters, external_parameters


class ParameterOffload:
    """The hooks of `sharded` (the stage-3 parameters of `module`) as DeepSpeed names them.

    `forward_hooks` are the handles of the gather hooks (removing them and emptying the list, as
    TRL does, stops gathering on use); `backward_hooks` is empty, since the hooks that gather a
    unit again for its backward are made by each forward and go with its graph;
    `_register_deepspeed_module` puts the gather hooks back; `param_coordinator` (this object)
    answers `is_invalid_trace()` and `_invalidate_trace()` about the recorded order of units."""

    def __init__(self, sharded: ShardedParameters, module: nn.Module) -> None:
        self.module = module
        self._sharded = sharded
        self.backward_hooks: list[Any] = []
        self.param_coordinator = self
        for p in sharded.params:
            p.ds_active_sub_modules = set()
        for m in module.modules():
            m.ds_external_parameters = MethodType(external_parameters, m)

    @property
    def forward_hooks(self) -> list[Any]:
        return self._sharded.hook_handles

    @forward_hooks.setter
    def forward_hooks(self, handles: list[Any]) -> None:
        self._sharded.hook_handles[:] = handles

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Put the gather hooks back on the units' modules (any still there are replaced)."""
        if module is not self.module:
            raise ValueError(
                "parameter_offload._register_deepspeed_module takes the engine's module: its "
                "hooks are laid out by gather unit"
            )
        self._sharded.register_hooks()

    def is_invalid_trace(self) -> bool:
        return not self._sharded.traces_recorded()

    def _invalidate_trace(self) -> None:
        self._sharded.forget_traces()
