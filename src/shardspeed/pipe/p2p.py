"""Activations forward and gradients back between neighbouring stages, through torch.distributed.

One `exchange` posts a batch of sends and receives together (`batch_isend_irecv`) and waits for
all of them: two neighbours that each send to the other in the same step must do so in one batch,
or NCCL, which runs a pair's transfers in order on one stream, deadlocks. The schedules are built
and checked that way (`schedule.check_schedule`).

A receiver must know what it receives. Before the first activation from each sending chunk to each
neighbour, a fixed-size metadata message (count, dtypes, shapes, which need gradients) goes ahead as
its own blocking transfer; both ends cache it, so later micro-batches send only data (with
`dynamic_shape`, metadata goes every time). Gradients need none: they have the shapes of the
activations that need them.

On torch's fake process group (a dry run, `shardspeed.planning`, which runs the ranks one after
another in one process) nothing arrives: a receiver reads the description its sender left on
`_fake_wire` when it ran, so a dry run of a later stage needs its sender's run before it (the dry
run starts it when `ActivationShapesUnknown` says so). Every transfer is still posted (and counted)
as in a real run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import comm

_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_META_SLOTS = 256  # int64 words: enough for a tuple of many tensors of several dimensions

# The descriptions sent on the fake group, by (sender, receiver, sending chunk): see the docstring.
_fake_wire: dict[tuple[int, int, int], list[TensorMeta]] = {}


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class Transfer:
    """One send or receive of a tuple of tensors. `key` names the sending chunk for activations
    (the metadata cache), None for gradients, whose `metas` the caller gives."""

    send: bool
    peer: int  # global rank
    key: int | None = None
    tensors: tuple[torch.Tensor, ...] = ()
    metas: list[TensorMeta] | None = None
    received: tuple[torch.Tensor, ...] = field(default=())


def metas_of(tensors: tuple[torch.Tensor, ...]) -> list[TensorMeta]:
    return [
        TensorMeta(tuple(t.shape), t.dtype, t.requires_grad and t.is_floating_point())
        for t in tensors
    ]


def _encode(metas: list[TensorMeta]) -> torch.Tensor:
    words = [len(metas)]
    for m in metas:
        words += [_DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
    if len(words) > _META_SLOTS:
        raise ValueError(
            f"a stage's output has too many tensors or dimensions to describe in {_META_SLOTS} "
            "words: send fewer tensors between stages"
        )
    buffer = torch.zeros(_META_SLOTS, dtype=torch.int64)
    buffer[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return buffer


def _decode(buffer: torch.Tensor) -> list[TensorMeta]:
    words = buffer.tolist()
    metas, i = [], 1
    for _ in range(words[0]):
        dtype, grad, ndim = words[i : i + 3]
        shape = tuple(words[i + 3 : i + 3 + ndim])
        metas.append(TensorMeta(shape, _DTYPES[dtype], bool(grad)))
        i += 3 + ndim
    return metas


class StageLink:
    """This rank's transfers to and from its neighbours, with the metadata cache."""

    def __init__(self, device: torch.device, dynamic_shape: bool) -> None:
        self.device = device
        self.dynamic_shape = dynamic_shape
        self._sent: dict[tuple[int, int], list[TensorMeta]] = {}
        self._known: dict[tuple[int, int], list[TensorMeta]] = {}

    def exchange(self, transfers: list[Transfer]) -> None:
        """Post every transfer of the batch together; on return each receive's `received` is set.

        Descriptions the peers lack go first, all of them as one batch of their own (the model
        `schedule.check_schedule(with_meta=True)` proves deadlock-free).
        """
        _post(self._metadata_ops(transfers))
        ops = []
        for t in transfers:
            if t.send:
                ops += [dist.P2POp(dist.isend, _wire(x.contiguous()), t.peer) for x in t.tensors]
            else:
                t.received = tuple(
                    torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in t.metas
                )
                ops += [dist.P2POp(dist.irecv, _wire(r), t.peer) for r in t.received]
        _post(ops)

    def _metadata_ops(self, transfers: list[Transfer]) -> list[dist.P2POp]:
        """Sends of new descriptions, and receives that fill `metas` once they complete."""
        ops, pending = [], []
        for t in transfers:
            if t.key is None:
                continue
            channel = (t.peer, t.key)
            if t.send:
                metas = metas_of(t.tensors)
                cached = self._sent.get(channel)
                if cached is not None and not self.dynamic_shape:
                    if cached != metas:
                        raise RuntimeError(
                            f"the activations sent to rank {t.peer} changed from {cached} to "
                            f"{metas}; build the PipelineModule with dynamic_shape=True"
                        )
                    continue
                ops.append(dist.P2POp(dist.isend, _encode(metas).to(self.device), t.peer))
                self._sent[channel] = metas
                if _on_fake_group():
                    _fake_wire[(dist.get_rank(), t.peer, t.key)] = metas
            elif channel in self._known and not self.dynamic_shape:
                t.metas = self._known[channel]
            else:
                buffer = torch.empty(_META_SLOTS, dtype=torch.int64, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, t.peer))
                pending.append((t, channel, buffer))
        if pending:
            _post(ops)
            ops = []
            for t, channel, buffer in pending:
                metas = _from_fake_wire(t) if _on_fake_group() else _decode(buffer.cpu())
                t.metas = self._known[channel] = metas
        return ops


def forget_fake_wire() -> None:
    """Drop the descriptions earlier dry runs left (a new dry run starts from none)."""
    _fake_wire.clear()


def _on_fake_group() -> bool:
    return dist.get_backend() == "fake"


class ActivationShapesUnknown(RuntimeError):
    """A dry run's stage receives activations whose sender has not run yet in this process."""

    def __init__(self, receiver: int, sender: int) -> None:
        super().__init__(
            f"a dry run of rank {receiver} needs the shapes of the activations rank {sender} "
            f"sends it, known once rank {sender} has run; stages that each wait for the other's "
            "activations (an interleaved schedule) cannot be dry-run one rank after another"
        )
        self.receiver, self.sender = receiver, sender


def _from_fake_wire(t: Transfer) -> list[TensorMeta]:
    me = dist.get_rank()
    metas = _fake_wire.get((t.peer, me, t.key))
    if metas is None:
        raise ActivationShapesUnknown(me, t.peer)
    return metas


def _post(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in comm.batch_isend_irecv(ops):
            work.wait()


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """Bools travel as bytes (not every backend sends bool tensors); the view shares storage."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
