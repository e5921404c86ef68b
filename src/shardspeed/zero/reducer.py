"""Gradient averaging across the data-parallel group, in buckets, while backward still runs.

A bucket is a contiguous range of the flat gradient layout. Each parameter's post-accumulate-grad
hook marks it ready; when a bucket's parameters are all ready its collective is launched
asynchronously. Buckets launch strictly in order on every rank (as torch DDP does) so that ranks
whose hooks fire in a different order still issue the same sequence of collectives.

Two collectives, one mechanism: `all_reduce` leaves the averaged bucket on every rank (stage 0, and
ZeRO with `reduce_scatter: false`); `reduce` sends each piece of a bucket only to the rank whose
shard holds it (ZeRO's reduce-scatter, expressed as one reduce per owner so that buckets need not
align with shards). A bucket's storage is either a view into a full gradient buffer (stages 0 and
1) or allocated when its first gradient arrives and freed once `on_reduced` has taken the rank's
own part (stage 2, which never holds the full gradient).

Segments (a pipeline rank's model chunks, which separate backward passes visit) never share a
bucket; a micro-step that names a segment launches only that segment's buckets. Neither do regions
reduced over different groups (`region_groups`: a mixture of experts' expert weights, averaged only
among the ranks that hold the same experts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..comm import all_reduce, reduce
from .flat import FlatLayout


@dataclass
class _Bucket:
    start: int
    end: int
    params: int
    ready: int = 0
    buffer: torch.Tensor | None = None
    staging: torch.Tensor | None = None  # the bucket in the communication dtype, if it differs
    works: list = field(default_factory=list)
    group: int = 0  # index into the reducer's groups


@dataclass
class GradientReducer:
    """Averages gradients laid out by `layout` over `group` (or, per region, over
    `region_groups`), bucket by bucket.

    `pre_scale` multiplies a bucket before the sum and `post_scale` after it, which expresses
    DeepSpeed's prescale_gradients / gradient_predivide_factor choices.
    """

    layout: FlatLayout
    bucket_elements: int
    group: Any
    grad_dtype: torch.dtype
    comm_dtype: torch.dtype
    pre_scale: float
    post_scale: float
    collective: Literal["all_reduce", "reduce"] = "all_reduce"
    grads: torch.Tensor | None = None  # the full gradient buffer; None: buckets allocate
    device: torch.device | None = None
    on_reduced: Callable[[int, int, torch.Tensor], None] | None = None
    overlap: bool = True
    max_in_flight: int | None = None
    segment_starts: tuple[int, ...] = (0,)  # the first parameter index of each segment
    region_groups: tuple[Any, ...] = ()  # each layout region's group; empty: all `group`
    active: bool = False
    _buckets: list[_Bucket] = field(default_factory=list)
    _bucket_of: list[int] = field(default_factory=list)
    _next: int = 0
    _stop: int = 0
    _segment_buckets: list[range] = field(default_factory=list)
    _segment_params: list[range] = field(default_factory=list)
    _params: range = range(0)
    _in_flight: deque = field(default_factory=deque)
    _seen: bytearray = field(default_factory=bytearray)
    _groups: list[Any] = field(default_factory=list)
    _dst: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        starts = set(self.segment_starts)
        region_groups = self.region_groups or (self.group,) * len(self.layout.groups)
        self._groups = []
        for g in region_groups:
            if not any(g is known for known in self._groups):
                self._groups.append(g)
        region_comm = [
            next(i for i, known in enumerate(self._groups) if known is g) for g in region_groups
        ]
        first_bucket = []
        region = 0
        for index, (offset, numel) in enumerate(zip(self.layout.offsets, self.layout.numels)):
            while len(first_bucket) < len(self.segment_starts) and (
                self.segment_starts[len(first_bucket)] <= index
            ):
                first_bucket.append(len(self._buckets))
            while offset >= self.layout.groups[region][1] and region + 1 < len(region_comm):
                region += 1
            last = self._buckets[-1] if self._buckets else None
            full = last is not None and last.end - last.start >= self.bucket_elements
            other_group = last is not None and last.group != region_comm[region]
            if last is None or full or other_group or index in starts:
                last = _Bucket(offset, offset, 0, group=region_comm[region])
                self._buckets.append(last)
            last.end, last.params = offset + numel, last.params + 1
            self._bucket_of.append(len(self._buckets) - 1)
        # Padding rides with the bucket before it, so the buckets tile the whole buffer.
        for bucket, following in zip(self._buckets, self._buckets[1:]):
            bucket.end = following.start
        if self._buckets:
            self._buckets[-1].end = self.layout.total
        first_bucket += [len(self._buckets)] * (len(self.segment_starts) - len(first_bucket))
        ends = [*first_bucket[1:], len(self._buckets)]
        self._segment_buckets = [range(a, b) for a, b in zip(first_bucket, ends)]
        param_ends = [*self.segment_starts[1:], len(self.layout.offsets)]
        self._segment_params = [range(a, b) for a, b in zip(self.segment_starts, param_ends)]
        self._stop = len(self._buckets)
        self._params = range(len(self.layout.offsets))
        self._seen = bytearray(len(self.layout.offsets))
        self._dst = [
            [
                r if group is None else dist.get_global_rank(group, r)
                for r in range(dist.get_world_size(group))
            ]
            for group in self._groups
        ]

    def gradient_slot(self, index: int) -> torch.Tensor:
        """Where parameter `index`'s gradient goes in its bucket (allocating the bucket if needed)."""
        bucket = self._buckets[self._bucket_of[index]]
        if bucket.buffer is None:
            bucket.buffer = self._storage(bucket)
        offset, numel = self.layout.offsets[index], self.layout.numels[index]
        return bucket.buffer.narrow(0, offset - bucket.start, numel).view(self.layout.shapes[index])

    def _storage(self, bucket: _Bucket) -> torch.Tensor:
        if self.grads is not None:
            return self.grads[bucket.start : bucket.end]
        return torch.zeros(bucket.end - bucket.start, dtype=self.grad_dtype, device=self.device)

    def mark_ready(self, index: int) -> None:
        """Parameter `index` has its full gradient for this step; launch what is complete, in order."""
        if not self.active:
            return
        self._seen[index] = 1
        self._buckets[self._bucket_of[index]].ready += 1
        while self._next < self._stop:
            bucket = self._buckets[self._next]
            if bucket.ready < bucket.params:
                break
            self._launch(bucket)
            self._next += 1

    def finish(self) -> list[int]:
        """Launch what is left (buckets with unused parameters) and complete every bucket.

        Returns the indices of parameters that received no gradient this time.
        """
        if not self.active:
            return []
        for bucket in self._buckets[self._next : self._stop]:
            self._launch(bucket)
        while self._in_flight:
            self._complete(self._in_flight.popleft())
        self._next = self._stop
        self.active = False  # done for this step: a second call must not scale again
        return [i for i in self._params if not self._seen[i]]

    def reset(self, segment: int | None = None) -> None:
        """Start a new micro-step over one segment's buckets, or all: none launched yet."""
        buckets = range(len(self._buckets)) if segment is None else self._segment_buckets[segment]
        self._params = (
            range(len(self.layout.offsets)) if segment is None else self._segment_params[segment]
        )
        self._next, self._stop = buckets.start, buckets.stop
        for bucket in self._buckets:
            bucket.ready = 0
        self._seen = bytearray(len(self._seen))

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.buffer is None:
            bucket.buffer = self._storage(bucket)
        chunk = bucket.buffer
        if self.comm_dtype != chunk.dtype:
            bucket.staging = chunk.to(self.comm_dtype)
            chunk = bucket.staging
        if self.pre_scale != 1.0:
            chunk.mul_(self.pre_scale)
        group = self._groups[bucket.group]
        if len(self._dst[bucket.group]) == 1:
            bucket.works = []  # a group of one (experts no other rank holds): nothing to send
        elif self.collective == "all_reduce":
            bucket.works = [all_reduce(chunk, group=group, async_op=True)]
        else:
            bucket.works = [
                reduce(
                    chunk[a - bucket.start : b - bucket.start],
                    self._dst[bucket.group][rank],
                    group=group,
                    async_op=True,
                )
                for _, rank, a, b, _ in self.layout.owners(bucket.start, bucket.end)
            ]
        self._in_flight.append(bucket)
        # Without overlap a bucket is reduced before backward goes on, as DeepSpeed does.
        limit = self.max_in_flight if self.overlap else 0
        while limit is not None and len(self._in_flight) > limit:
            self._complete(self._in_flight.popleft())

    def _complete(self, bucket: _Bucket) -> None:
        for work in bucket.works:
            work.wait()
        chunk = bucket.buffer
        if bucket.staging is not None:
            chunk.copy_(bucket.staging)
        if self.post_scale != 1.0:
            chunk.mul_(self.post_scale)
        if self.on_reduced is not None:
            self.on_reduced(bucket.start, bucket.end, chunk)
        bucket.works, bucket.staging = [], None
        if self.grads is None:
            bucket.buffer = None
