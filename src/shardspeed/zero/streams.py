"""The streams that stage 3's gathers and the gradient reductions run on, beside the compute stream.

On CUDA, as FSDP2 does, a unit's gather (the copy of an offloaded shard to the device and the
all-gather) runs on a gather stream, and a bucket's reduction (zeroing what no gradient wrote, the
cast to the communication dtype, the scaling, the collective, the copy back and the hand-over to
the shard accumulator) on a reduce stream. The compute stream goes on with the forward or the
backward meanwhile. On the CPU the accelerator's null streams stand in: every wait is free and the
work runs in program order, as it did before.

The waits, and where each is made:
- A side stream waits for the compute stream before it touches anything (`side`): the gradients
  it reduces, the shard that the optimizer wrote, and memory that the compute stream freed and
  the allocator handed out again.
- The compute stream waits for a side stream before it reads the result: a gathered unit before
  its parameters are used (`ShardedParameters.gather`), the reduced gradients before the step
  (`GradientReducer.finish`), and a pooled bucket buffer before a gradient is copied into it again
  (an event recorded when its reduction ended).
- Buffers that both streams use (a unit's buffer, a bucket's buffer, the rows of a unit gathered as
  one) are allocated on the compute stream, so the allocator reuses their memory only in the
  compute stream's order, which already waited for the side stream. What a side stream allocates
  itself (a shard's copy on the device, a bucket in the communication dtype) is held until that
  stream has waited for the collective that reads it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from ..accelerator import Accelerator


class CommStreams:
    """The gather stream and the reduce stream of one device, and the switches between them and
    the compute stream (whichever stream is current: autograd's, inside backward hooks).

    `device_streams` is the accelerator's streams part (`Stream`, `stream`, `current_stream`):
    torch.cuda's on a GPU, null ones on the CPU; `for_device` picks it once per device.
    """

    def __init__(self, device_streams: Any, device: torch.device | None = None) -> None:
        # Looked up once: the accelerator answers each attribute by searching its parts.
        self._switch, self._current = device_streams.stream, device_streams.current_stream
        where = {} if device is None else {"device": device}
        # High priority, as FSDP2's: the copies around a collective are not queued behind compute.
        self.gather = device_streams.Stream(priority=-1, **where)
        self.reduce = device_streams.Stream(priority=-1, **where)

    @staticmethod
    def for_device(device: torch.device) -> CommStreams:
        """The one holder for `device`, shared by the gathers and the reducer (as the collectives
        share one NCCL stream): real streams on CUDA, null ones elsewhere."""
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return _holder("cuda", index)
        return _holder("cpu", None)

    def current(self) -> Any:
        return self._current()

    @contextlib.contextmanager
    def side(self, stream: Any) -> Iterator[None]:
        """Run the block's work on `stream`, after everything the current stream queued so far."""
        stream.wait_stream(self._current())
        with self._switch(stream):
            yield

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        """Run the block's work on `stream`, in that stream's own order."""
        return self._switch(stream)


@functools.cache
def _holder(kind: str, index: int | None) -> CommStreams:
    device = torch.device(kind, index) if index is not None else None
    return CommStreams(Accelerator(kind), device)
