"""Gradient averaging across the data-parallel group, in buckets, while backward still runs.

A bucket is a contiguous range of the flat gradient buffer. Each parameter's post-accumulate-grad
hook marks it ready; when a bucket's parameters are all ready its all-reduce is launched
asynchronously. Buckets launch strictly in order on every rank (as torch DDP does) so that ranks
whose hooks fire in a different order still issue the same sequence of collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm import all_reduce


@dataclass
class _Bucket:
    start: int
    end: int
    size: int  # parameters in the bucket
    ready: int = 0
    work: Any = None
    staging: torch.Tensor | None = None  # the bucket in the communication dtype, if it differs


@dataclass
class GradientReducer:
    """Averages `grads` (a flat buffer) over `group`, bucket by bucket.

    `pre_scale` multiplies a bucket before the sum and `post_scale` after it, which expresses
    DeepSpeed's prescale_gradients / gradient_predivide_factor choices; plain averaging is
    pre 1/world, post 1 (what torch DDP does).
    """

    grads: torch.Tensor
    param_ranges: Sequence[tuple[int, int]]
    bucket_elements: int
    group: Any
    comm_dtype: torch.dtype
    pre_scale: float
    post_scale: float
    overlap: bool = True
    active: bool = False
    _buckets: list[_Bucket] = field(default_factory=list)
    _bucket_of: list[int] = field(default_factory=list)
    _next: int = 0

    def __post_init__(self) -> None:
        for start, end in self.param_ranges:
            last = self._buckets[-1] if self._buckets else None
            if last is None or last.end - last.start >= self.bucket_elements:
                last = _Bucket(start, end, 0)
                self._buckets.append(last)
            last.end, last.size = end, last.size + 1
            self._bucket_of.append(len(self._buckets) - 1)
        if self._buckets:
            self._buckets[-1].end = self.grads.numel()  # padding rides with the last bucket

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def mark_ready(self, index: int) -> None:
        """Parameter `index` has its full gradient for this step; launch what is complete, in order."""
        if not (self.active and self.overlap):
            return
        bucket = self._buckets[self._bucket_of[index]]
        bucket.ready += 1
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if bucket.ready < bucket.size:
                break
            self._launch(bucket)
            self._next += 1

    def finish(self) -> None:
        """Launch every bucket not yet launched (unused parameters, or overlap off), wait for all."""
        if not self.active:
            return
        for bucket in self._buckets[self._next :]:
            self._launch(bucket)
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if bucket.staging is not None:
                chunk = self.grads[bucket.start : bucket.end]
                chunk.copy_(bucket.staging)
                if self.post_scale != 1.0:
                    chunk.mul_(self.post_scale)
            elif self.post_scale != 1.0:
                self.grads[bucket.start : bucket.end].mul_(self.post_scale)
            bucket.ready, bucket.work, bucket.staging = 0, None, None
        self._next = len(self._buckets)
        self.active = False  # done for this step: a second call must not scale again

    def reset(self) -> None:
        """Start a new micro-step: no bucket launched yet."""
        self._next = 0
        for bucket in self._buckets:
            bucket.ready = 0

    def _launch(self, bucket: _Bucket) -> None:
        chunk = self.grads[bucket.start : bucket.end]
        if self.comm_dtype != chunk.dtype:
            bucket.staging = chunk.to(self.comm_dtype)
            chunk = bucket.staging
        if self.pre_scale != 1.0:
            chunk.mul_(self.pre_scale)
        bucket.work = all_reduce(chunk, group=self.group, async_op=True)
