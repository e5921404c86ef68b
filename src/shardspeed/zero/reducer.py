"""Gradient averaging across the data-parallel group, in buckets, while backward still runs.

A bucket is a contiguous range of the flat gradient layout. Each parameter's post-accumulate-grad
hook marks it ready; when a bucket's parameters are all ready its collective is launched
asynchronously. Buckets launch strictly in order on every rank (as torch DDP does) so that ranks
whose hooks fire in a different order still issue the same sequence of collectives.

Two collectives, one mechanism: `all_reduce` leaves the averaged bucket on every rank (stage 0, and
ZeRO with `reduce_scatter: false`); `reduce` sends each piece of a bucket only to the rank whose
shard holds it (ZeRO's reduce-scatter). Where the backend does that faster as one
`reduce_scatter_tensor` (`reduces_by_scatter`: NCCL, not gloo), sharded buckets end where regions
end, and a bucket whose pieces line up with the shards (one per rank, equal, in rank order: a whole
region) goes out as one; any other as one `reduce` per owner. There the shard plan makes no region
larger than a bucket (`optimizer._largest_region`), so each region is one bucket and one
reduce-scatter, however many ranks own pieces of it. Who owns which piece is worked out once, when
the buckets are laid out.

ZeRO++'s quantized gradients (qgZ, `quantized`) change `reduce`: each rank quantizes each owner's
part of a bucket to int4 in blocks (`quantize.BLOCK` values and one fp32 scale each), one
`all_to_all_single` with split sizes carries the parts (a bucket that one rank owns goes to that
rank only), and each owner dequantizes the N copies of its part and sums them in fp32. For M
gradient elements a rank sends M * (0.5 + 4 / BLOCK) bytes a step (each part rounded up to whole
blocks), against M * b for the reduce of b-byte gradients; each copy errs by at most half its
block's step, and a non-finite gradient makes its whole block non-finite, so overflow checks still
see it. As in DeepSpeed 0.19.8 (which removed LoCo), no error feedback carries the quantization
error into the next step.

A bucket's storage is either a view into a full gradient buffer (stages 0 and 1) or, when there is
none (stages 2 and 3, which never hold the full gradient), a buffer taken from a small pool when
its first gradient arrives and returned once `on_reduced` has taken the rank's own pieces. The pool
keeps at most `max_in_flight + 1` buffers between steps, so no micro-step allocates; its buffers
are not zeroed: gradients are copied (not added) into their slots, and what no gradient wrote
(padding, parameters unused this micro-step) is zeroed at launch.

Segments (a pipeline rank's model chunks, which separate backward passes visit) never share a
bucket; a micro-step that names a segment launches only that segment's buckets. Neither do regions
reduced over different groups (`region_groups`: a mixture of experts' expert weights, averaged only
among the ranks that hold the same experts).

On CUDA a bucket's reduction runs on the reduce stream of `streams.CommStreams`, after the compute
stream has written its gradients; the compute stream waits for it before a pooled buffer is filled
again and, in `finish`, before the step reads the gradients.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..comm import all_reduce, all_to_all_single, reduce, reduce_scatter_tensor
from ..comm.comm import backend_of
from .flat import FlatLayout
from .quantize import GRADIENT_BITS, dequantize, payload_bytes, quantize
from .streams import CommStreams

# On gloo (CPU, 2 ranks, the wrapped collectives) one reduce per owner beat reduce_scatter_tensor:
# 44 ms against 68 ms for a bucket of 10.6M fp32 elements, 7.2 against 9.3 ms for 2M.
_GLOO_SCATTERS = False


def reduces_by_scatter(group: Any) -> bool:
    """Whether a bucket whose pieces line up with the shards goes out as one reduce-scatter rather
    than one reduce per owner: the one place this choice is made, per backend."""
    return backend_of(group) != "gloo" or _GLOO_SCATTERS


def _joined(chunk: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The `spans` of `chunk` end to end: one owner's part of a bucket (a view if one piece)."""
    if len(spans) == 1:
        return chunk[spans[0][0] : spans[0][1]]
    return torch.cat([chunk[lo:hi] for lo, hi in spans])


def _payload(spans: Sequence[tuple[int, int]]) -> int:
    """Bytes of the quantized part made of `spans`."""
    return payload_bytes(sum(hi - lo for lo, hi in spans), GRADIENT_BITS)


@dataclass
class _Bucket:
    start: int
    end: int
    first: int  # the index of its first parameter
    params: int
    ready: int = 0
    buffer: torch.Tensor | None = None
    storage: torch.Tensor | None = None  # the pooled tensor `buffer` is a view of, if any
    staging: torch.Tensor | None = None  # the bucket in the communication dtype, if it differs
    works: list = field(default_factory=list)
    group: int = 0  # index into the reducer's groups
    # Worked out once (bucket-relative): each owner's piece as (destination rank, start, end),
    # this rank's pieces as (start, end, offset in its shard), and the ranges no gradient covers.
    sends: tuple[tuple[int, int, int], ...] = ()
    kept: tuple[tuple[int, int, int], ...] = ()
    padding: tuple[tuple[int, int], ...] = ()
    scatter: bool = False  # one reduce-scatter instead of `sends`
    # Quantized: each group rank's part as the (start, end) pieces it owns, in `sends` order; and
    # while in flight the payload sent and the copies of this rank's part received.
    parts: tuple[tuple[tuple[int, int], ...], ...] = ()
    exchange: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class GradientReducer:
    """Averages gradients laid out by `layout` over `group` (or, per region, over
    `region_groups`), bucket by bucket.

    `pre_scale` multiplies a bucket before the sum and `post_scale` after it, which expresses
    DeepSpeed's prescale_gradients / gradient_predivide_factor choices. `on_reduced(offset,
    piece)` receives each averaged piece this rank owns, with its offset in the rank's shard
    (`region_ranks`: this rank's rank among the ranks sharing each region; empty: its rank in
    each region's group).

    `quantized` (ZeRO++ qgZ; changes `collective == "reduce"` only, over groups of more than one):
    a bucket's parts travel as int4 blocks in one all-to-all and each owner sums the dequantized
    copies in fp32.
    """

    layout: FlatLayout
    bucket_elements: int
    group: Any
    grad_dtype: torch.dtype
    comm_dtype: torch.dtype
    pre_scale: float
    post_scale: float
    collective: Literal["all_reduce", "reduce"] = "all_reduce"
    quantized: bool = False
    grads: torch.Tensor | None = None  # the full gradient buffer; None: buckets are pooled
    device: torch.device | None = None
    on_reduced: Callable[[int, torch.Tensor], None] | None = None
    overlap: bool = True
    max_in_flight: int | None = None
    segment_starts: tuple[int, ...] = (0,)  # the first parameter index of each segment
    region_groups: tuple[Any, ...] = ()  # each layout region's group; empty: all `group`
    region_ranks: tuple[int, ...] = ()
    streams: CommStreams | None = None  # None: the device's own (`CommStreams.for_device`)
    active: bool = False
    pool: list[torch.Tensor] = field(default_factory=list)  # spare bucket buffers
    # For each spare buffer, an event recorded on the reduce stream when its last reduction ended.
    _pool_reduced: list[Any] = field(default_factory=list)
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
    _sizes: list[int] = field(default_factory=list)  # each of `_groups`' size
    _largest: int = 0

    def __post_init__(self) -> None:
        if self.streams is None:
            where = self.grads.device if self.grads is not None else self.device
            self.streams = CommStreams.for_device(where or torch.device("cpu"))
        starts = set(self.segment_starts)
        region_groups = self.region_groups or (self.group,) * len(self.layout.groups)
        self._groups = []
        for g in region_groups:
            if not any(g is known for known in self._groups):
                self._groups.append(g)
        region_comm = [
            next(i for i, known in enumerate(self._groups) if known is g) for g in region_groups
        ]
        # Where reduce-scatter is the faster, sharded buckets end where regions end, so that a
        # region that fits in a bucket is one bucket whose pieces line up with the shards.
        cut_at_regions = self.collective == "reduce" and any(map(reduces_by_scatter, self._groups))
        first_bucket = []
        region = 0
        for index, (offset, numel) in enumerate(zip(self.layout.offsets, self.layout.numels)):
            while len(first_bucket) < len(self.segment_starts) and (
                self.segment_starts[len(first_bucket)] <= index
            ):
                first_bucket.append(len(self._buckets))
            new_region = False
            while offset >= self.layout.groups[region][1] and region + 1 < len(region_comm):
                region, new_region = region + 1, True
            last = self._buckets[-1] if self._buckets else None
            full = last is not None and last.end - last.start >= self.bucket_elements
            other_group = last is not None and last.group != region_comm[region]
            region_end = cut_at_regions and new_region
            if last is None or full or other_group or region_end or index in starts:
                last = _Bucket(offset, offset, index, 0, group=region_comm[region])
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
        self._sizes = [dist.get_world_size(group) for group in self._groups]
        ranks = self.region_ranks or tuple(dist.get_rank(g) for g in region_groups)
        for bucket in self._buckets:
            self._plan(bucket, ranks)
        self._largest = max((b.end - b.start for b in self._buckets), default=0)

    def _plan(self, bucket: _Bucket, ranks: tuple[int, ...]) -> None:
        """Work out who owns which piece of `bucket`, which collective sends them, and what in it
        no gradient covers."""
        group, size = self._groups[bucket.group], self._sizes[bucket.group]
        pieces = self.layout.owners(bucket.start, bucket.end)
        base = bucket.start
        bucket.sends = tuple(
            (rank if group is None else dist.get_global_rank(group, rank), a - base, b - base)
            for _, rank, a, b, _ in pieces
        )
        bucket.kept = tuple(
            (a - base, b - base, offset)
            for region, rank, a, b, offset in pieces
            if rank == ranks[region]
        )
        lengths = {b - a for _, _, a, b, _ in pieces}
        in_rank_order = [rank for _, rank, *_ in pieces] == list(range(size))
        bucket.scatter = (
            size > 1 and in_rank_order and len(lengths) == 1 and reduces_by_scatter(group)
        )
        if self.quantized and self.collective == "reduce" and size > 1:
            bucket.parts = tuple(
                tuple((a - base, b - base) for _, rank, a, b, _ in pieces if rank == owner)
                for owner in range(size)
            )
        params = range(bucket.first, bucket.first + bucket.params)
        covered = [
            (self.layout.offsets[i], self.layout.offsets[i] + self.layout.numels[i]) for i in params
        ]
        bucket.padding = tuple(
            (end - base, start - base)
            for (_, end), (start, _) in zip(covered, [*covered[1:], (bucket.end, 0)])
            if start > end
        )

    def gradient_slot(self, index: int) -> torch.Tensor:
        """Where parameter `index`'s gradient goes in its bucket (taking a buffer if needed). A
        pooled buffer holds old values: the gradient is to be copied in, not added."""
        bucket = self._buckets[self._bucket_of[index]]
        if bucket.buffer is None:
            self._attach(bucket)
        offset, numel = self.layout.offsets[index], self.layout.numels[index]
        return bucket.buffer.narrow(0, offset - bucket.start, numel).view(self.layout.shapes[index])

    def _attach(self, bucket: _Bucket) -> None:
        if self.grads is not None:
            bucket.buffer = self.grads[bucket.start : bucket.end]
            return
        if self.pool:
            bucket.storage = self.pool.pop()
            # Gradients are copied into it on the compute stream: not before its last reduction,
            # on the reduce stream, is over.
            self.streams.current().wait_event(self._pool_reduced.pop())
        else:
            bucket.storage = torch.empty(self._largest, dtype=self.grad_dtype, device=self.device)
        bucket.buffer = bucket.storage[: bucket.end - bucket.start]

    def _detach(self, bucket: _Bucket, reduced: Any) -> None:
        """Give a pooled bucket's buffer back (kept for the next bucket if the pool has room);
        `reduced` is the event that ends its reduction."""
        if bucket.storage is not None:
            if len(self.pool) <= (self.max_in_flight or 0):
                self.pool.append(bucket.storage)
                self._pool_reduced.append(reduced)
            else:
                # Let go: the allocator may hand its memory out again on the compute stream (where
                # it was allocated) at once, so that stream waits until the reduction is over.
                self.streams.current().wait_event(reduced)
        bucket.buffer = bucket.storage = None

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
        self.streams.current().wait_stream(self.streams.reduce)  # the step reads what it wrote
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

    def _clear_unwritten(self, bucket: _Bucket) -> None:
        """Zero what no gradient wrote into a pooled buffer this micro-step."""
        for lo, hi in bucket.padding:
            bucket.buffer[lo:hi].zero_()
        if bucket.ready < bucket.params:
            for i in range(bucket.first, bucket.first + bucket.params):
                if not self._seen[i]:
                    self.gradient_slot(i).zero_()

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.buffer is None:
            self._attach(bucket)  # on the compute stream, whose allocations it shares
        with self.streams.side(self.streams.reduce):
            self._send(bucket)
        self._in_flight.append(bucket)
        # Without overlap a bucket is reduced before backward goes on, as DeepSpeed does.
        limit = self.max_in_flight if self.overlap else 0
        while limit is not None and len(self._in_flight) > limit:
            self._complete(self._in_flight.popleft())

    def _send(self, bucket: _Bucket) -> None:
        """Prepare `bucket` and start its collectives (on the reduce stream)."""
        if bucket.storage is not None:
            self._clear_unwritten(bucket)
        chunk = bucket.buffer
        # Quantized, the wire carries int4 whatever `comm_dtype` says: quantize the gradients as
        # they are rather than after a rounding to a 16-bit dtype.
        if self.comm_dtype != chunk.dtype and not bucket.parts:
            # Allocated on the reduce stream, and held until that stream waited for the collective.
            bucket.staging = chunk.to(self.comm_dtype)
            chunk = bucket.staging
        if self.pre_scale != 1.0:
            chunk.mul_(self.pre_scale)
        group = self._groups[bucket.group]
        if self._sizes[bucket.group] == 1:
            bucket.works = []  # a group of one (experts no other rank holds): nothing to send
        elif bucket.parts:
            bucket.works = [self._send_quantized(bucket, chunk, group)]
        elif self.collective == "all_reduce":
            bucket.works = [all_reduce(chunk, group=group, async_op=True)]
        elif bucket.scatter:
            lo, hi, _ = bucket.kept[0]
            bucket.works = [reduce_scatter_tensor(chunk[lo:hi], chunk, group=group, async_op=True)]
        else:
            bucket.works = [
                reduce(chunk[lo:hi], dst, group=group, async_op=True)
                for dst, lo, hi in bucket.sends
            ]

    def _send_quantized(self, bucket: _Bucket, chunk: torch.Tensor, group: Any) -> Any:
        """Quantize each owner's part of `chunk` and start the all-to-all that brings every rank
        the copies of its own part. Split sizes, not parts padded to the largest: a bucket inside
        one region belongs to one or two owners, and padding would send every rank a part."""
        sent = torch.cat(
            [quantize(_joined(chunk, spans), GRADIENT_BITS) for spans in bucket.parts if spans]
        )
        splits = [_payload(spans) for spans in bucket.parts]
        mine = _payload([(lo, hi) for lo, hi, _ in bucket.kept])
        received = torch.empty(len(splits) * mine, dtype=torch.uint8, device=chunk.device)
        # Both held until the all-to-all was waited for (allocated on the reduce stream).
        bucket.exchange = (sent, received)
        return all_to_all_single(
            received, sent, [mine] * len(splits), splits, group=group, async_op=True
        )

    def _sum_quantized(self, bucket: _Bucket) -> None:
        """Dequantize the copies of this rank's part, sum them in fp32, post-scale the sum and
        write it into the kept pieces."""
        lengths = [hi - lo for lo, hi, _ in bucket.kept]
        if not lengths:
            return
        _, received = bucket.exchange
        copies = dequantize(received.view(len(bucket.parts), -1), sum(lengths), GRADIENT_BITS)
        total = copies.sum(dim=0)
        if self.post_scale != 1.0:
            total.mul_(self.post_scale)
        for (lo, hi, _), piece in zip(bucket.kept, total.split(lengths)):
            bucket.buffer[lo:hi].copy_(piece)

    def _complete(self, bucket: _Bucket) -> None:
        with self.streams.on(self.streams.reduce):
            self._receive(bucket)
            reduced = self.streams.reduce.record_event()
        bucket.works, bucket.staging, bucket.exchange = [], None, None
        if self.grads is None:
            self._detach(bucket, reduced)

    def _receive(self, bucket: _Bucket) -> None:
        """Wait for `bucket`'s collectives, then copy back, post-scale and hand over this rank's
        pieces (on the reduce stream)."""
        for work in bucket.works:
            work.wait()
        spans: tuple[tuple[int, int, int], ...]
        if bucket.exchange is not None:
            self._sum_quantized(bucket)  # the kept pieces hold their post-scaled sums already
            spans = ()
        # Where an all-reduce fills the full gradient buffer the whole bucket is kept; otherwise
        # only this rank's pieces are (the rest is dropped, so it is neither copied nor scaled).
        elif self.collective == "all_reduce" and self.grads is not None:
            spans = ((0, bucket.end - bucket.start, 0),)
        else:
            spans = bucket.kept
        for lo, hi, _ in spans:
            piece = bucket.buffer[lo:hi]
            if bucket.staging is not None:
                piece.copy_(bucket.staging[lo:hi])
            if self.post_scale != 1.0:
                piece.mul_(self.post_scale)
        if self.on_reduced is not None:
            for lo, hi, offset in bucket.kept:
                self.on_reduced(offset, bucket.buffer[lo:hi])
