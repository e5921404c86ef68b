"""Pipeline schedules as explicit per-rank instruction lists.

A schedule is one list of `Instruction`s per pipeline rank, built before anything runs, so it can
be printed (`format_schedule`), checked without a device (`check_schedule`) and executed by the
pipeline engine one instruction at a time.

Layout: `stages` ranks each hold `chunks` model chunks. Chunk `c` of rank `r` is virtual stage
`c * stages + r` (Megatron's interleaving); virtual stage 0 takes the inputs, the last one computes
the loss. Activations flow from virtual stage `vs` to `vs + 1`, gradients back.

Execution contract (what `check_schedule` verifies and the engine must honour): a rank runs its
list in order; a maximal run of consecutive communication instructions is one batch, posted
together (`batch_isend_irecv`) and waited on as a whole; on each directed rank pair, the k-th send
matches the k-th receive. The builders give every message one "phase" (the step before the
receiver computes with it) and put its send and its receive in the batches of that phase on both
ranks, so batches that depend on each other are always posted together and no order of waiting
can deadlock. Hence a receive sits in the batch right before the compute that uses it, and a send
in the batch where its receiver takes it, which may be a few steps after the producing compute.

DeepSpeed's `TrainSchedule` and `InferenceSchedule` are these lists for one stage, cut into steps
(`PipeSchedule`): not a second scheduler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

KINDS = ("gpipe", "1f1b", "interleaved_1f1b")


class ScheduleError(ValueError):
    """A schedule that would compute the wrong thing, miss a step or hang when executed."""


# Instructions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    """One step of one rank's schedule; `str()` gives the short form `format_schedule` prints."""

    tag: ClassVar[str] = ""
    _short_names: ClassVar[dict[str, str]] = {"micro_batch": "mb", "chunk": "c"}

    def __str__(self) -> str:
        args = ",".join(
            f"{self._short_names.get(f.name, f.name)}={getattr(self, f.name)}"
            for f in fields(self)
            if f.compare  # what the step is, not where a DeepSpeed-style engine keeps its data
        )
        return f"{self.tag}({args})" if args else self.tag


PipeInstruction = Instruction  # DeepSpeed's name for the base class


@dataclass(frozen=True)
class BufferOpInstruction(Instruction):
    """A step on one micro-batch's data (DeepSpeed's name: it works on a pipeline buffer).

    `buffer_id` is DeepSpeed's slot for that data, set only in the step view
    (`TrainSchedule`, `InferenceSchedule`); shardspeed's engine keys its data by micro-batch.
    """

    micro_batch: int
    buffer_id: int | None = field(default=None, compare=False, kw_only=True)


@dataclass(frozen=True)
class LoadMicroBatch(BufferOpInstruction):
    """Fetch the inputs (first stage) or labels (last stage) of one micro-batch."""

    tag: ClassVar[str] = "Load"


@dataclass(frozen=True)
class _ChunkStep(BufferOpInstruction):
    chunk: int


@dataclass(frozen=True)
class ForwardPass(_ChunkStep):
    """Run one model chunk forward on one micro-batch."""

    tag: ClassVar[str] = "F"


@dataclass(frozen=True)
class BackwardPass(_ChunkStep):
    """Run one model chunk backward on one micro-batch."""

    tag: ClassVar[str] = "B"


@dataclass(frozen=True)
class _Transfer(_ChunkStep):
    """A point-to-point message; `peer` is the other pipeline rank."""

    peer: int
    peer_word: ClassVar[str]  # "to" or "from"

    def __str__(self) -> str:
        return f"{self.tag}(mb={self.micro_batch},c={self.chunk},{self.peer_word}={self.peer})"


@dataclass(frozen=True)
class SendActivation(_Transfer):
    """Send the output of the sender's `chunk` to the rank holding the next virtual stage."""

    tag: ClassVar[str] = "SendAct"
    peer_word: ClassVar[str] = "to"


@dataclass(frozen=True)
class RecvActivation(_Transfer):
    """Receive the input of the receiver's `chunk` from the rank holding the previous stage."""

    tag: ClassVar[str] = "RecvAct"
    peer_word: ClassVar[str] = "from"


@dataclass(frozen=True)
class SendGrad(_Transfer):
    """Send the gradient of the input of the sender's `chunk` back to the previous stage."""

    tag: ClassVar[str] = "SendGrad"
    peer_word: ClassVar[str] = "to"


@dataclass(frozen=True)
class RecvGrad(_Transfer):
    """Receive the gradient of the output of the receiver's `chunk` from the next stage."""

    tag: ClassVar[str] = "RecvGrad"
    peer_word: ClassVar[str] = "from"


@dataclass(frozen=True)
class ReduceGrads(Instruction):
    """Finish averaging the gradients across data-parallel replicas."""

    tag: ClassVar[str] = "ReduceGrads"


@dataclass(frozen=True)
class ReduceTiedGrads(Instruction):
    """Sum the gradients of weights tied across stages. Shardspeed's optimizer does this as the
    first thing of its step, so the engine's lists have it inside `OptimizerStep`; only the
    DeepSpeed step view lists it on its own, before `ReduceGrads` as DeepSpeed does (summing
    over stages and averaging over replicas commute)."""

    tag: ClassVar[str] = "ReduceTiedGrads"


@dataclass(frozen=True)
class OptimizerStep(Instruction):
    """Sum tied weights' gradients across stages, then apply the optimizer, once all
    micro-batches are done."""

    tag: ClassVar[str] = "OptimizerStep"


def is_communication(instr: Instruction) -> bool:
    """Whether `instr` is a send or receive, i.e. part of a batch of point-to-point ops."""
    return isinstance(instr, _Transfer)


# Layout -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    stages: int
    chunks: int

    @property
    def last(self) -> int:
        return self.stages * self.chunks - 1

    def virtual(self, rank: int, chunk: int) -> int:
        return chunk * self.stages + rank

    def place(self, vs: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage `vs`."""
        return vs % self.stages, vs // self.stages

    def holds_data(self, rank: int, chunk: int) -> bool:
        return self.virtual(rank, chunk) in (0, self.last)

    def inputs(self, rank: int, op: _ChunkStep) -> list[tuple[int, _ChunkStep]]:
        """The (rank, compute) steps whose results `op` on `rank` needs."""
        vs = self.virtual(rank, op.chunk)
        if isinstance(op, ForwardPass):
            return [self._at(vs - 1, ForwardPass, op.micro_batch)] if vs > 0 else []
        own = (rank, ForwardPass(op.micro_batch, op.chunk))
        return [own, self._at(vs + 1, BackwardPass, op.micro_batch)] if vs < self.last else [own]

    def consumer(self, rank: int, op: _ChunkStep) -> tuple[int, _ChunkStep] | None:
        """The (rank, compute) step on another rank that takes the output of `op`, if any."""
        vs = self.virtual(rank, op.chunk)
        if isinstance(op, ForwardPass):
            return self._at(vs + 1, ForwardPass, op.micro_batch) if vs < self.last else None
        return self._at(vs - 1, BackwardPass, op.micro_batch) if vs > 0 else None

    def _at(self, vs: int, kind: type[_ChunkStep], micro_batch: int) -> tuple[int, _ChunkStep]:
        rank, chunk = self.place(vs)
        return rank, kind(micro_batch, chunk)


def _check_sizes(stages: int, micro_batches: int, chunks: int) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches), ("chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_interleaving(stages: int, micro_batches: int, what: str) -> None:
    if stages < 2:
        raise ValueError(f"{what} needs stages >= 2: with one rank every chunk is on the same rank")
    if micro_batches % stages:
        raise ValueError(
            f"{what} needs micro_batches ({micro_batches}) to be a multiple of stages ({stages}): "
            "Megatron's interleaved order runs micro-batches through each chunk in groups of "
            "`stages`"
        )


# Builders ---------------------------------------------------------------------------------------


def train_schedule(
    kind: str, stages: int, micro_batches: int, chunks: int = 1
) -> list[list[Instruction]]:
    """One training step (forwards, backwards, gradient reduction, optimizer step) per rank."""
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}; choose one of {', '.join(KINDS)}")
    _check_sizes(stages, micro_batches, chunks)
    if kind == "interleaved_1f1b":
        if chunks < 2:
            raise ValueError("interleaved_1f1b needs chunks >= 2; use 1f1b for one chunk per rank")
        _check_interleaving(stages, micro_batches, "interleaved_1f1b")
    elif chunks != 1:
        raise ValueError(f"{kind} runs one model chunk per rank (chunks=1), got chunks={chunks}")
    return _flatten(_train_steps(kind, stages, micro_batches, chunks))


def _train_steps(
    kind: str, stages: int, micro_batches: int, chunks: int
) -> list[list[list[Instruction]]]:
    layout = _Layout(stages, chunks)
    orders = []
    forwards, backwards = _virtual_order(stages, micro_batches, chunks)
    for rank in range(stages):
        if kind == "gpipe":
            orders.append(forwards + backwards)
            continue
        if kind == "1f1b":
            warmup = stages - rank - 1
        else:  # Megatron: two steps per later rank, plus one round of chunks to fill the ring
            warmup = (stages - rank - 1) * 2 + (chunks - 1) * stages
        orders.append(_one_f_one_b(forwards, backwards, min(warmup, len(forwards))))
    return _assemble(layout, orders, train=True)


def inference_schedule(stages: int, micro_batches: int, chunks: int = 1) -> list[list[Instruction]]:
    """Forward passes only, in the forward order of the matching training schedule."""
    _check_sizes(stages, micro_batches, chunks)
    if chunks > 1:
        _check_interleaving(stages, micro_batches, "an inference schedule with chunks > 1")
    return _flatten(_inference_steps(stages, micro_batches, chunks))


def _inference_steps(stages: int, micro_batches: int, chunks: int) -> list[list[list[Instruction]]]:
    forwards, _ = _virtual_order(stages, micro_batches, chunks)
    return _assemble(_Layout(stages, chunks), [list(forwards) for _ in range(stages)], train=False)


def _virtual_order(
    stages: int, micro_batches: int, chunks: int
) -> tuple[list[_ChunkStep], list[_ChunkStep]]:
    """Megatron's forward and backward order of (micro-batch, chunk); plain order for one chunk."""
    forwards: list[_ChunkStep] = []
    backwards: list[_ChunkStep] = []
    for k in range(micro_batches * chunks):
        micro_batch = k // (stages * chunks) * stages + k % stages
        chunk = k // stages % chunks
        forwards.append(ForwardPass(micro_batch, chunk))
        backwards.append(BackwardPass(micro_batch, chunks - 1 - chunk))
    return forwards, backwards


def _one_f_one_b(
    forwards: list[_ChunkStep], backwards: list[_ChunkStep], warmup: int
) -> list[_ChunkStep]:
    """`warmup` forwards, then forward/backward pairs, then the remaining backwards."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for i in range(steady):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[steady:]


def _assemble(
    layout: _Layout, orders: list[list[_ChunkStep]], train: bool
) -> list[list[list[Instruction]]]:
    """Add loads and messages to per-rank compute orders (see the module docstring), cut into
    steps: step `s` of every rank holds the messages of phase `s`, then the compute of unit-time
    round `s + 1` with its load. A message sits in the same step on both of its ranks, so a
    barrier between steps cannot deadlock; the training tail ends the last step."""
    rounds = _rounds(layout, orders)
    round_of = {
        (rank, op): t for rank in range(layout.stages) for op, t in zip(orders[rank], rounds[rank])
    }
    total = max((t for r in rounds for t in r), default=0)
    steps: list[list[list[Instruction]]] = [[[] for _ in range(total)] for _ in orders]
    # (phase, 0 for sends / 1 for receives, instruction), sorted below; one receive per phase
    messages: list[list[tuple[int, int, Instruction]]] = [[] for _ in range(layout.stages)]
    for rank in range(layout.stages):
        for op in orders[rank]:
            target = layout.consumer(rank, op)
            if target is None:
                continue
            peer, peer_op = target
            phase = round_of[target] - 1
            if isinstance(op, ForwardPass):
                send, recv = SendActivation, RecvActivation
            else:
                send, recv = SendGrad, RecvGrad
            messages[rank].append((phase, 0, send(op.micro_batch, op.chunk, peer)))
            messages[peer].append((phase, 1, recv(op.micro_batch, peer_op.chunk, rank)))
    for rank in range(layout.stages):
        for phase, _, instr in sorted(messages[rank], key=lambda m: m[:2]):
            steps[rank][phase].append(instr)
        loaded: set[int] = set()
        for op, t in zip(orders[rank], rounds[rank]):
            needs_data = isinstance(op, ForwardPass) and layout.holds_data(rank, op.chunk)
            if needs_data and op.micro_batch not in loaded:
                loaded.add(op.micro_batch)
                steps[rank][t - 1].append(LoadMicroBatch(op.micro_batch))
            steps[rank][t - 1].append(op)
        if train:
            steps[rank][-1] += [ReduceGrads(), OptimizerStep()]
    return steps


def _flatten(steps: list[list[list[Instruction]]]) -> list[list[Instruction]]:
    return [[instr for step in rank_steps for instr in step] for rank_steps in steps]


def _rounds(layout: _Layout, orders: list[list[_ChunkStep]]) -> list[list[int]]:
    """Unit-time step of every compute op when each rank runs its order as early as it can."""
    done: dict[tuple[int, _ChunkStep], int] = {}
    rounds: list[list[int]] = [[] for _ in orders]
    t = 0
    while any(len(r) < len(o) for r, o in zip(rounds, orders)):
        t += 1
        progressed = False
        for rank, order in enumerate(orders):
            if len(rounds[rank]) == len(order):
                continue
            op = order[len(rounds[rank])]
            if all(done.get(dep, t) < t for dep in layout.inputs(rank, op)):
                done[(rank, op)] = t
                rounds[rank].append(t)
                progressed = True
        if not progressed:
            raise ScheduleError(f"bug: the compute orders cannot finish (stuck at step {t})")
    return rounds


# DeepSpeed's step view ---------------------------------------------------------------------------


class PipeSchedule(ABC):
    """DeepSpeed's schedule of one stage: iterating it yields steps, each a list of instructions.

    Shardspeed's engine runs the flat lists (`train_schedule`); `TrainSchedule` and
    `InferenceSchedule` present the same lists for one stage, cut into the steps of the
    builders' unit-time rounds (see `_assemble`). Every stage has the same number of steps, and
    the transfers of a step are one batch, posted together, as the engine posts them.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        _check_sizes(stages, micro_batches, 1)
        if not isinstance(stage_id, int) or not 0 <= stage_id < stages:
            raise ValueError(f"stage_id must be an integer in 0..{stages - 1}, got {stage_id!r}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id

    @abstractmethod
    def steps(self) -> Iterator[list[Instruction]]:
        """This stage's steps, in order."""

    def __iter__(self) -> Iterator[list[Instruction]]:
        return self.steps()

    def num_pipe_buffers(self) -> int:
        """How many micro-batches' data the stage keeps apart (DeepSpeed's buffers)."""
        return self.micro_batches

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1


class _StepView(PipeSchedule):
    """One stage's steps of a shardspeed schedule, each buffer op given DeepSpeed's
    `buffer_id`: its micro-batch modulo `num_pipe_buffers()`."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__(micro_batches, stages, stage_id)
        plain = self._all_steps()[stage_id]
        self._buffers = _live_peak(plain)
        self._steps = [
            [
                replace(i, buffer_id=i.micro_batch % self._buffers)
                if isinstance(i, BufferOpInstruction)
                else i
                for i in step
            ]
            for step in plain
        ]

    @abstractmethod
    def _all_steps(self) -> list[list[list[Instruction]]]:
        """Every rank's steps: where a step ends depends on the whole pipeline."""

    def steps(self) -> Iterator[list[Instruction]]:
        for step in self._steps:
            yield list(step)

    def num_pipe_buffers(self) -> int:
        """The most micro-batches this stage holds data of at once, each from the first step
        that touches it to the last. Micro-batches come and go in order, so the micro-batch
        modulo this number never names a slot still in use."""
        return self._buffers


class TrainSchedule(_StepView):
    """DeepSpeed's `TrainSchedule`: one stage's steps of shardspeed's 1F1B training schedule.

    Its 2 * (micro_batches + stages - 1) steps each hold at most one forward or backward pass;
    the last ends with `ReduceTiedGrads`, `ReduceGrads`, `OptimizerStep`.
    """

    def _all_steps(self) -> list[list[list[Instruction]]]:
        steps = _train_steps("1f1b", self.stages, self.micro_batches, 1)
        for rank_steps in steps:
            last = rank_steps[-1]
            last.insert(last.index(ReduceGrads()), ReduceTiedGrads())
        return steps


class InferenceSchedule(_StepView):
    """DeepSpeed's `InferenceSchedule`: one stage's steps of shardspeed's forward-only
    schedule, micro_batches + stages - 1 of them."""

    def _all_steps(self) -> list[list[list[Instruction]]]:
        return _inference_steps(self.stages, self.micro_batches, 1)


def _live_peak(steps: Sequence[Sequence[Instruction]]) -> int:
    """The most micro-batches live in one step, each from its first step to its last."""
    spans: dict[int, tuple[int, int]] = {}
    for s, step in enumerate(steps):
        for instr in step:
            if isinstance(instr, BufferOpInstruction):
                spans[instr.micro_batch] = (spans.get(instr.micro_batch, (s, s))[0], s)
    live = [sum(a <= s <= b for a, b in spans.values()) for s in range(len(steps))]
    return max(live, default=0) or 1


# Checking ---------------------------------------------------------------------------------------


def check_schedule(
    lists: Sequence[Sequence[Instruction]],
    stages: int,
    micro_batches: int,
    chunks: int = 1,
    train: bool = True,
    *,
    with_meta: bool = False,
    dynamic_shape: bool = False,
) -> None:
    """Raise `ScheduleError` unless `lists` is complete, consistent and cannot deadlock.

    `with_meta` also models the engine's metadata messages (`p2p.StageLink`): before a batch of
    transfers, one batch carrying the description of each activation in it that is the first
    from its sending chunk to that peer, or of every activation with `dynamic_shape`.
    """
    _check_sizes(stages, micro_batches, chunks)
    if chunks > 1 and stages < 2:
        raise ValueError("chunks > 1 needs stages >= 2")
    if len(lists) != stages:
        raise ScheduleError(f"expected one instruction list per stage ({stages}), got {len(lists)}")
    layout = _Layout(stages, chunks)
    for rank, instrs in enumerate(lists):
        _check_rank(layout, rank, instrs, micro_batches, train)
    _check_matching(layout, lists)
    _simulate(lists, with_meta, dynamic_shape)


def _misplaced(
    layout: _Layout, rank: int, instr: Instruction, micro_batches: int, train: bool
) -> str | None:
    """Why `instr` cannot be on `rank` at all, or None."""
    if isinstance(instr, (ReduceGrads, OptimizerStep)):
        return None if train else "an inference schedule has no optimizer step"
    if not isinstance(instr, (LoadMicroBatch, _ChunkStep)):
        return "not a pipeline instruction"
    if not 0 <= instr.micro_batch < micro_batches:
        return f"micro-batch out of range 0..{micro_batches - 1}"
    if isinstance(instr, LoadMicroBatch):
        if any(layout.holds_data(rank, c) for c in range(layout.chunks)):
            return None
        return "only the ranks of the first and last stage load data"
    if not 0 <= instr.chunk < layout.chunks:
        return f"chunk out of range 0..{layout.chunks - 1}"
    if not train and isinstance(instr, (BackwardPass, SendGrad, RecvGrad)):
        return "an inference schedule has no backward"
    if isinstance(instr, _Transfer):
        vs = layout.virtual(rank, instr.chunk)
        other = vs + 1 if isinstance(instr, (SendActivation, RecvGrad)) else vs - 1
        if not 0 <= other <= layout.last:
            return f"virtual stage {vs} has no neighbour {other}"
        if instr.peer != layout.place(other)[0]:
            return f"virtual stage {other} is on rank {layout.place(other)[0]}"
    return None


def _check_rank(
    layout: _Layout, rank: int, instrs: Sequence[Instruction], micro_batches: int, train: bool
) -> None:
    """Every step present once, on the right rank, after what it needs."""
    where: dict[Instruction, int] = {}
    for i, instr in enumerate(instrs):
        problem = _misplaced(layout, rank, instr, micro_batches, train)
        if problem is None and instr in where:
            problem = f"repeats #{where[instr]}"
        if problem is not None:
            raise ScheduleError(f"rank {rank}, #{i} {instr}: {problem}")
        where[instr] = i
    if train:
        tail = [ReduceGrads(), OptimizerStep()]
        if list(instrs[-2:]) != tail:
            raise ScheduleError(
                f"rank {rank}: a training list must end with ReduceGrads, OptimizerStep"
            )

    def require(instr: Instruction, why: str) -> None:
        if instr not in where:
            raise ScheduleError(f"rank {rank}: no {instr} ({why})")

    def before(first: Instruction, then: Instruction) -> None:
        if where[first] > where[then]:
            raise ScheduleError(
                f"rank {rank}: #{where[then]} {then} comes before #{where[first]} {first}"
            )

    for mb in range(micro_batches):
        data_uses = []
        for chunk in range(layout.chunks):
            vs = layout.virtual(rank, chunk)
            fwd = ForwardPass(mb, chunk)
            require(fwd, "every chunk runs every micro-batch forward")
            if layout.holds_data(rank, chunk):
                data_uses.append(fwd)
            if vs > 0:
                recv = RecvActivation(mb, chunk, layout.place(vs - 1)[0])
                require(recv, f"virtual stage {vs} needs its input")
                before(recv, fwd)
            if vs < layout.last:
                send = SendActivation(mb, chunk, layout.place(vs + 1)[0])
                require(send, f"virtual stage {vs + 1} needs this output")
                before(fwd, send)
            if not train:
                continue
            bwd = BackwardPass(mb, chunk)
            require(bwd, "every forward of a training step has its backward")
            before(fwd, bwd)
            if vs < layout.last:
                recv = RecvGrad(mb, chunk, layout.place(vs + 1)[0])
                require(recv, f"virtual stage {vs} needs its output gradient")
                before(recv, bwd)
            if vs > 0:
                send = SendGrad(mb, chunk, layout.place(vs - 1)[0])
                require(send, f"virtual stage {vs - 1} needs this input gradient")
                before(bwd, send)
        if data_uses:
            load = LoadMicroBatch(mb)
            require(load, "this rank holds the first or last stage")
            for use in data_uses:
                before(load, use)


def _payload(layout: _Layout, rank: int, instr: _Transfer) -> tuple[str, int, int]:
    """(kind, micro-batch, receiving virtual stage) of a message, as seen from either end."""
    vs = layout.virtual(rank, instr.chunk)
    if isinstance(instr, SendActivation):
        return "activation", instr.micro_batch, vs + 1
    if isinstance(instr, SendGrad):
        return "gradient", instr.micro_batch, vs - 1
    kind = "activation" if isinstance(instr, RecvActivation) else "gradient"
    return kind, instr.micro_batch, vs


def _check_matching(layout: _Layout, lists: Sequence[Sequence[Instruction]]) -> None:
    """The k-th send and the k-th receive on each directed rank pair carry the same message."""
    sends: dict[tuple[int, int], list[tuple[int, _Transfer]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, _Transfer]]] = defaultdict(list)
    for rank, instrs in enumerate(lists):
        for i, instr in enumerate(instrs):
            if isinstance(instr, (SendActivation, SendGrad)):
                sends[(rank, instr.peer)].append((i, instr))
            elif isinstance(instr, _Transfer):
                recvs[(instr.peer, rank)].append((i, instr))
    for src, dst in sorted(set(sends) | set(recvs)):
        out, into = sends[(src, dst)], recvs[(src, dst)]
        for k, ((i, send), (j, recv)) in enumerate(zip(out, into)):
            sent, received = _payload(layout, src, send), _payload(layout, dst, recv)
            if sent != received:
                raise ScheduleError(
                    f"messages {src}->{dst} match in order: #{i} {send} on rank {src} (message {k}, "
                    f"{sent[0]} of micro-batch {sent[1]} for virtual stage {sent[2]}) would arrive "
                    f"at #{j} {recv} on rank {dst} ({received[0]} of micro-batch {received[1]} "
                    f"for virtual stage {received[2]})"
                )
        if len(out) != len(into):
            raise ScheduleError(
                f"rank {src} sends {len(out)} messages to rank {dst}, which receives {len(into)}"
            )


@dataclass(eq=False)
class _Op:
    """One posted send or receive in the deadlock simulation."""

    rank: int
    batch: int
    label: str
    partner: _Op | None = None
    done: bool = False


_Posting = tuple[tuple[int, int], bool, str]  # (channel src->dst, is_send, label)


def _batches(
    rank: int, stages: int, instrs: Sequence[Instruction], with_meta: bool, dynamic_shape: bool
) -> list[list[_Posting]]:
    """The rank's batches of sends/receives, with the metadata batches the engine adds: before a
    batch, one batch with the description of each activation in it whose (channel, sending
    chunk) has none cached yet (every activation with `dynamic_shape`)."""
    batches: list[list[_Posting]] = []
    current: list[_Posting] = []
    metas: list[_Posting] = []
    meta_done: set[tuple[tuple[int, int], int]] = set()
    for i, instr in enumerate([*instrs, None]):
        if isinstance(instr, _Transfer):
            is_send = isinstance(instr, (SendActivation, SendGrad))
            channel = (rank, instr.peer) if is_send else (instr.peer, rank)
            label = f"#{i} {instr}"
            activation = isinstance(instr, (SendActivation, RecvActivation))
            sender_chunk = instr.chunk if is_send else (instr.chunk * stages + rank - 1) // stages
            key = (channel, sender_chunk)
            if with_meta and activation and (dynamic_shape or key not in meta_done):
                meta_done.add(key)
                metas.append((channel, is_send, f"metadata {channel[0]}->{channel[1]} for #{i}"))
            current.append((channel, is_send, label))
        elif current:
            batches += [metas, current] if metas else [current]
            current, metas = [], []
    return batches


def _simulate(
    lists: Sequence[Sequence[Instruction]], with_meta: bool, dynamic_shape: bool = False
) -> None:
    """Run the lists under strict batch semantics; raise naming every stuck rank if they hang."""
    batches: list[list[list[_Op]]] = []
    queues: dict[tuple[tuple[int, int], bool], list[_Op]] = defaultdict(list)
    for rank, instrs in enumerate(lists):
        rank_batches = []
        for b, spec in enumerate(_batches(rank, len(lists), instrs, with_meta, dynamic_shape)):
            ops = []
            for channel, is_send, label in spec:
                op = _Op(rank, b, label)
                queues[(channel, is_send)].append(op)
                ops.append(op)
            rank_batches.append(ops)
        batches.append(rank_batches)
    for (channel, is_send), ops in queues.items():
        if is_send:
            for send, recv in zip(ops, queues.get((channel, False), [])):
                send.partner, recv.partner = recv, send
    position = [0] * len(lists)
    work = deque(range(len(lists)))
    while work:
        rank = work.popleft()
        while position[rank] < len(batches[rank]):
            batch = batches[rank][position[rank]]
            for op in batch:
                peer = op.partner
                if not op.done and peer is not None and position[peer.rank] == peer.batch:
                    op.done = peer.done = True
                    work.append(peer.rank)
            if not all(op.done for op in batch):
                break
            position[rank] += 1
    stuck = [rank for rank in range(len(lists)) if position[rank] < len(batches[rank])]
    if stuck:
        raise ScheduleError(
            "deadlock under strict batched send/recv"
            + (" with metadata messages" if with_meta else "")
            + ": "
            + "; ".join(_waits(batches, position, rank) for rank in stuck)
        )


def _waits(batches: list[list[list[_Op]]], position: list[int], rank: int) -> str:
    waits = []
    for op in batches[rank][position[rank]]:
        if op.done:
            continue
        peer = op.partner
        if peer is None:
            waits.append(f"{op.label} (nothing on the peer matches it)")
            continue
        blocked = next(o for o in batches[peer.rank][position[peer.rank]] if not o.done)
        waits.append(f"{op.label} (rank {peer.rank} is blocked at {blocked.label})")
    return f"rank {rank} waits on " + ", ".join(waits)


# Metrics and printing ---------------------------------------------------------------------------


def max_in_flight(lists_for_rank: Sequence[Instruction]) -> int:
    """Most forwards done and not yet backwarded at once: the activations a rank must keep."""
    live: set[tuple[int, int]] = set()
    peak = 0
    for instr in lists_for_rank:
        if isinstance(instr, ForwardPass):
            live.add((instr.micro_batch, instr.chunk))
            peak = max(peak, len(live))
        elif isinstance(instr, BackwardPass):
            live.discard((instr.micro_batch, instr.chunk))
    return peak


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share of a step in theory, (p-1)/(v*m + p-1): what more micro-batches or chunks buy."""
    _check_sizes(stages, micro_batches, chunks)
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def format_schedule(lists: Sequence[Sequence[Instruction]]) -> str:
    """One line per rank; each batch of sends/receives in brackets, as the engine posts it."""
    lines = []
    for rank, instrs in enumerate(lists):
        parts: list[str] = []
        batch: list[str] = []
        for instr in [*instrs, None]:
            if instr is not None and is_communication(instr):
                batch.append(str(instr))
                continue
            if batch:
                parts.append("[" + " ".join(batch) + "]")
                batch = []
            if instr is not None:
                parts.append(str(instr))
        lines.append(f"rank {rank}: " + " ".join(parts))
    return "\n".join(lines)
