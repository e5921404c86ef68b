"""Process-group start-up and thin collective wrappers that count the bytes they move and make a
failed collective say which rank stopped where.

Everything goes through torch.distributed (gloo on CPU, NCCL on CUDA). The wrappers exist so that
every room reports its traffic the same way; on success they add counters to the collective itself
(and, while the comms logger is on, its timing: `logger.py`). Each wrapped collective takes this
process's next sequence number. When one raises (or its work's `wait()` does), or the ranks are
about to call different collectives, the rank publishes where it stopped to the default group's
store, reads what its peers published for a few seconds, and raises `CollectiveError` saying both.

The same-call check (gloo groups of more than one rank; config 'comms_same_call_check'): gloo
aborts the process when ranks call collectives of different sizes in the same slot, before any
error reaches Python. So each call is first compared across the group, at one of two costs:

- call by call: a small blocking all-gather of (operation, size, dtype, root, number) before it;
- along an agreed sequence: once the engine's steps (`mark_step`) repeat the same calls in a group,
  two steps running, the next checked call also carries a digest of that sequence; when every rank
  offered the same one, the ranks follow it without exchanging anything, each comparing its calls
  with the sequence. A rank whose call departs from it compares notes with the others through the
  store, not the group (they may be inside the expected collective): when all departed alike (an
  evaluation, a checkpoint), checking goes back to call by call; otherwise the departing rank
  raises `CollectiveError` within seconds, and the others' collective fails as it exits.

The collective timeout: `init_distributed(timeout=)`, else the config's `comms_timeout_s` (applied
at `initialize`), else the timeout of a process group that other code started, else
`DEEPSPEED_TIMEOUT` (minutes), else `DEFAULT_TIMEOUT`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import time
import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..common.net import free_port, port_is_free
from ..config.errors import ConfigError
from .discovery import adopt as adopt_launcher_layout
from .discovery import torchrun_layout_present
from .logger import comms_logger
from .teardown import close_at_exit

ReduceOp = dist.ReduceOp
# torch 2.13 renamed the flat-tensor collectives; older releases (>= 2.4) have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Calls and payload bytes by (collective, size of the group it ran in, the global ranks it
# spans): the group size tells a gather within a few ranks (ZeRO++'s hpZ node) from one across the
# whole data-parallel group; the ranks (for a send: this rank and its peer) tell a dry run which
# links a collective crosses (`shardspeed.planning`).
_bytes: Counter[tuple[str, int, tuple[int, ...]]] = Counter()
_calls: Counter[tuple[str, int, tuple[int, ...]]] = Counter()
# Each group's global ranks, computed once (a world of thousands of ranks is asked every call).
_spans: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()
# Collectives this process entered through the wrappers, in any group (the last one's number).
_seq = 0

# Codes for what `_check_same_call` exchanges: the wrappers' operations, and torch's dtypes.
_OPS = ("barrier", "all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
        "reduce", "all_to_all_single", "all_gather", "gather")  # fmt: skip
_DTYPES = sorted({str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)})
_DTYPE_CODES = {name: code for code, name in enumerate(_DTYPES)}


# A call as the same-call check compares it: (operation, elements, dtype, root).
Call = tuple[int, int, int, int]


class _GroupState:
    """What the wrappers keep per process group: whether its calls are checked first (gloo and
    more than one rank: see the module docstring), how many wrapped collectives this process
    called in it, and the sequence of calls the ranks agreed to follow (`cycle`, at `position`)
    or the steps' calls that may lead to one."""

    __slots__ = ("calls", "checked", "cycle", "offer", "position", "previous", "step_calls")

    def __init__(self, group: Any) -> None:
        try:
            gloo = dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1
        except ValueError:  # this rank is not in the group: torch skips the call
            gloo = False
        self.checked = gloo and _same_call_check
        self.calls = 0
        self.step_calls: list[Call] = []  # checked calls since the last step boundary
        self.previous: tuple[Call, ...] = ()  # the last step's, each checked across the ranks
        self.offer: tuple[Call, ...] | None = None  # offered to the others at the next check
        self.cycle: tuple[Call, ...] | None = None  # agreed by every rank: followed unchecked
        self.position = 0

    def learn(self, call: Call) -> None:
        """Forget any agreed sequence: check call by call from `call` on."""
        self.cycle, self.offer, self.previous, self.step_calls = None, None, (), [call]


# Weak keys: a destroyed group's state goes with it, and a new group never inherits it.
_groups: weakref.WeakKeyDictionary[Any, _GroupState] = weakref.WeakKeyDictionary()

_fake_stands_for = "nccl"  # a dry run's backend, for choices made per backend (`backend_of`)
_same_call_check = True  # the config's 'comms_same_call_check'
_steps_marked = False  # the engine marks its steps (`mark_step`): steps' calls are recorded
_STALL_KEY = "shardspeed/stalled/{}"  # + global rank, in the default group's store
_DEPARTURE_KEY = "shardspeed/departed/{}/{}/{{}}"  # group, call number; + global rank
_GRACE_S = 5.0  # longest wait for the peers' records (at most the group timeout)
_SHOWN_PEERS = 8  # peers described one by one; the rest are summed up
_HERE = os.path.abspath(__file__)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(_HERE)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

# DeepSpeed 0.19's default: a job moved over keeps its limit, and it is long enough for what one
# rank does while the others wait at a collective (rank 0 writing a large consolidated checkpoint,
# one rank loading a model to broadcast), yet a hang is reported in minutes rather than torch's 30.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_EXPLICIT = "init_distributed(timeout=)"
_CONFIG_KEY = "comms_timeout_s"
_CHECK_KEY = "comms_same_call_check"
_SOURCES = (  # where a timeout came from, highest precedence first
    _EXPLICIT,
    f"config '{_CONFIG_KEY}'",
    "the process group's own",
    "DEEPSPEED_TIMEOUT",
    "default",
)
# The default group (a weak reference) with the timeout it started with and where that came from,
# then with the timeout applied at initialize: a group started again, or by other code, is not
# these records'.
_started: tuple[Any, datetime.timedelta, str] | None = None
_applied: tuple[Any, datetime.timedelta] | None = None
_warned: set[str] = set()
_logger = logging.getLogger("shardspeed")


def _use_local_gpu(asked: str | None) -> None:
    """NCCL's device for this rank: the GPU of its local rank (there must be one)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"init_distributed(dist_backend={asked!r}): the nccl backend needs a CUDA GPU and "
            "this machine has none: pass dist_backend='gloo' (or leave it out: shardspeed picks "
            "gloo where there is no GPU)"
        )
    torch.cuda.set_device(get_local_rank())


def default_backend() -> str:
    """The process group backend that suits this process's accelerator (nccl on CUDA, else gloo)."""
    from ..accelerator import get_accelerator

    return get_accelerator().communication_backend_name()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Start the default process group, as `deepspeed.init_distributed` does.

    Reads torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK). In a
    process started by ``mpirun`` or ``srun`` without torchrun, it reads the rank layout they give
    (`discovery.py`) unless `auto_mpi_discovery` is False; without any launcher it starts a
    one-process group on a free local port. `timeout` bounds every collective and takes precedence
    over the config's `comms_timeout_s`; without it the group starts with `DEEPSPEED_TIMEOUT`
    (minutes) or `DEFAULT_TIMEOUT`, which the config's key replaces at `initialize`. `verbose` and
    `config` are accepted for signature compatibility only.
    """
    global _started, _applied
    del verbose, config
    if dist_init_required is False or dist.is_initialized():
        if dist.is_initialized():
            close_at_exit()  # a group other code started is closed at exit too
        return
    backend = dist_backend or default_backend()
    source = _EXPLICIT
    if timeout is None:
        timeout, source = _environment_timeout()
    if init_method is None:
        try:
            adopt_launcher_layout(os.environ, distributed_port, allowed=auto_mpi_discovery)
        except ValueError as error:
            raise RuntimeError(f"init_distributed: {error}") from None
    if not torchrun_layout_present() and init_method is None:
        if rank not in (-1, 0) or world_size not in (-1, 1):
            raise RuntimeError(
                f"init_distributed(rank={rank}, world_size={world_size}) needs MASTER_ADDR and "
                "MASTER_PORT (or init_method): start the script with `shardspeed` or `torchrun`"
            )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        port = distributed_port if port_is_free(distributed_port) else free_port()
        os.environ.setdefault("MASTER_PORT", str(port))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    if backend == "nccl":
        _use_local_gpu(dist_backend)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's static rendezvous hands every restart the store of the first attempt, keys and
        # all, and the process group reuses its key names: a restarted rank could read the address
        # of a rank that died and fail to connect, or hang. A prefix per attempt keeps them apart.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timeout,
        )
        kwargs.pop("init_method", None)
        kwargs.update(
            store=dist.PrefixStore(f"attempt{restart}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    dist.init_process_group(**kwargs)
    close_at_exit()  # see teardown.py: a script that ends without destroying it could abort
    world = weakref.ref(dist.group.WORLD)
    _started, _applied = (world, timeout, source), (world, timeout)


def _of_this_world(record: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """`record` without its group, if that group is the default group now."""
    if record is None or not dist.is_initialized() or record[0]() is not dist.group.WORLD:
        return None
    return record[1:]


def _environment_timeout() -> tuple[datetime.timedelta, str]:
    minutes = os.environ.get("DEEPSPEED_TIMEOUT")
    if not minutes:
        return DEFAULT_TIMEOUT, _SOURCES[4]
    try:
        value = float(minutes)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(
            f"DEEPSPEED_TIMEOUT={minutes!r}: expected the collective timeout in minutes, a "
            "number above 0"
        )
    return datetime.timedelta(minutes=value), _SOURCES[3]


def collective_timeout() -> datetime.timedelta | None:
    """The timeout of shardspeed's collectives and of the groups it makes; None before a process
    group exists (torch's default then applies)."""
    applied = _of_this_world(_applied)
    return None if applied is None else applied[0]


def use_collective_timeout(
    config_seconds: float | None, same_call_check: bool = True
) -> datetime.timedelta | None:
    """Settle the collective timeout and the same-call check at `initialize` and apply them to
    every process group.

    `config_seconds` is the config's `comms_timeout_s` (None: not set). It replaces the timeout
    the default group started with unless that was `init_distributed(timeout=)`.
    `same_call_check` is the config's `comms_same_call_check`. The ranks must agree: each one's
    values are all-gathered, and a difference raises `ConfigError` naming them. Returns the
    timeout applied (None without a process group).
    """
    global _applied
    if not dist.is_initialized():
        return None
    started = _of_this_world(_started)
    if started is not None:
        timeout, source = started
    else:  # started by other code (torch, accelerate): its timeout is the store's
        timeout = dist.distributed_c10d._get_default_store().timeout
        source = _SOURCES[2]
    if config_seconds is not None:
        wanted = datetime.timedelta(seconds=config_seconds)
        if source == _EXPLICIT and wanted != timeout:
            _warn_once(
                f"'{_CONFIG_KEY}': {config_seconds:g} is not applied: init_distributed(timeout="
                f"{timeout.total_seconds():g} s) was given and takes precedence; pass the same "
                "value or drop one of them"
            )
        elif source != _EXPLICIT:
            timeout, source = wanted, _SOURCES[1]
    _check_ranks_agree(timeout, source, same_call_check)
    _applied = (weakref.ref(dist.group.WORLD), timeout)
    _apply_timeout(timeout)
    if same_call_check != _same_call_check:
        set_same_call_check(same_call_check)  # every rank here, after the same collectives
    return timeout


def _check_ranks_agree(timeout: datetime.timedelta, source: str, same_call_check: bool) -> None:
    world = get_world_size()
    if world == 1:
        return
    mine = torch.tensor(
        [timeout.total_seconds(), float(_SOURCES.index(source)), float(same_call_check)],
        dtype=torch.float64,
    )
    everyone = torch.empty(3 * world, dtype=torch.float64)
    all_gather_into_tensor(everyone, mine)
    rows = everyone.view(world, 3).tolist()
    checks = [bool(check) for _, _, check in rows]
    if len(set(checks)) != 1:
        on = [rank for rank, check in enumerate(checks) if check]
        raise ConfigError(
            f"'{_CHECK_KEY}': the ranks disagree ({_ranks(on)}: true; the others: false): give "
            "every rank the same config"
        )
    if len({seconds for seconds, _, _ in rows}) == 1:
        return
    found: dict[tuple[float, int], list[int]] = {}
    for rank, (seconds, index, _) in enumerate(rows):
        found.setdefault((seconds, int(index)), []).append(rank)
    values = "; ".join(
        f"{_ranks(ranks)}: {seconds:g} s ({_SOURCES[index]})"
        for (seconds, index), ranks in found.items()
    )
    raise ConfigError(
        f"'{_CONFIG_KEY}': the ranks disagree on the collective timeout ({values}): give every "
        "rank the same value (and the same DEEPSPEED_TIMEOUT and init_distributed(timeout=))"
    )


def _apply_timeout(timeout: datetime.timedelta) -> None:
    """Give every process group and the default store `timeout`; warn once where torch cannot."""
    if dist.get_backend() == "fake":
        return  # a dry run's collectives return at once: there is nothing to time out
    kept = []
    groups = list(dist.distributed_c10d._world.pg_map)
    for group in groups:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dist.distributed_c10d._set_pg_timeout(timeout, group)
            if caught:
                kept.append(str(caught[0].message))
        except Exception as exc:  # private torch API: a failure keeps the group's own timeout
            kept.append(f"{type(exc).__name__}: {_first_line(exc)}")
    try:
        dist.distributed_c10d._get_default_store().set_timeout(timeout)
    except Exception as exc:
        kept.append(f"{type(exc).__name__}: {_first_line(exc)}")
    if kept:
        _warn_once(
            f"the collective timeout {timeout.total_seconds():g} s could not be applied to "
            f"{len(kept)} of {len(groups) + 1} process groups and stores ({kept[0]}): those keep "
            "the timeout they were made with"
        )


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        _logger.warning(message)


def is_initialized() -> bool:
    return dist.is_initialized()


def destroy_process_group(group: Any = None) -> None:
    """Close `group` (default: every group, as torch does); nothing to do without a process group."""
    if dist.is_initialized():
        dist.destroy_process_group(group)


def backend_of(group: Any = None) -> str:
    """The backend whose choices apply to `group`: its own, or on torch's fake process group (a
    dry run, `shardspeed.planning`) the backend that the dry run stands for."""
    name = str(dist.get_backend(group))
    return _fake_stands_for if name == "fake" else name


def stand_in_for(backend: str) -> None:
    """Make choices on torch's fake process group as on `backend` ("nccl", "gloo")."""
    global _fake_stands_for
    _fake_stands_for = backend


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group: Any = None) -> None:
    if dist.is_initialized():
        _run("barrier", group, False, dist.barrier)


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _count(
    name: str, tensor: torch.Tensor, group: Any = None, span: tuple[int, ...] | None = None
) -> int:
    """Add one call of `tensor`'s payload to `name` in `group` (over `span`, the global ranks, when
    they are not the group's); return the payload bytes (for the logger)."""
    nbytes = tensor.numel() * tensor.element_size()
    _add(name, group, nbytes, span)
    return nbytes


def _add(name: str, group: Any, nbytes: int, span: tuple[int, ...] | None = None) -> None:
    key = (name, _group_size(group), _span(group) if span is None else span)
    _bytes[key] += nbytes
    _calls[key] += 1


def _span(group: Any) -> tuple[int, ...]:
    if not dist.is_initialized():
        return (0,)
    group = dist.group.WORLD if group is None else group
    span = _spans.get(group)
    if span is None:
        span = _spans[group] = tuple(_members(group) or ())
    return span


def comm_volume(by_group: bool = False, by_ranks: bool = False) -> dict[Any, dict[str, int]]:
    """Per collective, the calls this process made and their payload bytes since the last reset;
    `by_group`: keyed by (collective, size of the group it ran in) instead; `by_ranks`: by
    (collective, the group's global ranks in group order), a send's being (this rank, its peer).

    Payload is the size of the full tensor a collective acts on (a reduce-scatter's input, an
    all-gather's output), the measure the ZeRO paper counts in; wire traffic depends on the algorithm.
    """
    total: dict[Any, dict[str, int]] = {}
    for key, calls in sorted(_calls.items()):
        name, size, span = key
        entry = total.setdefault(
            (name, span) if by_ranks else (name, size) if by_group else name,
            {"calls": 0, "bytes": 0},
        )
        entry["calls"] += calls
        entry["bytes"] += _bytes[key]
    return total


def reset_comm_volume() -> None:
    _bytes.clear()
    _calls.clear()


class CollectiveError(RuntimeError):
    """A collective raised or timed out. The message says where this rank stopped (rank, operation,
    sequence number, caller) and what the other ranks of the group reported about themselves."""

    __module__ = "shardspeed.comm"  # where users import it from


def collective_sequence() -> int:
    """How many collectives this process has entered through these wrappers (the last one's number)."""
    return _seq


def _run(
    name: str,
    group: Any,
    async_op: bool,
    call: Callable[..., Any],
    /,
    *args: Any,
    nbytes: int = 0,
    payload: torch.Tensor | None = None,
    root: int = -1,
    **kwargs: Any,
) -> Any:
    # The hot path: an int increment, one flag test and, for async work, a small wrapper; no store
    # traffic and no stack capture unless the collective fails or the comms logger is on. `nbytes`
    # is the payload the logger reports (what `_count` returned); `payload` (this rank's input,
    # whose size and dtype every rank must share) and `root` describe the call for the check.
    global _seq
    _seq += 1
    seq = _seq
    key = dist.group.WORLD if group is None else group
    state = _groups.get(key)
    if state is None:
        state = _groups[key] = _GroupState(key)
    state.calls += 1
    if state.checked:
        # gloo aborts the process (SIGABRT, "Received data size doesn't match") when ranks call
        # collectives of different sizes in the same slot, before any error reaches Python: see
        # the module docstring for how calls are compared first.
        made = _call(name, payload, root)
        if state.cycle is None:
            _check_same_call(state, made, name, seq, group)
        elif made == state.cycle[state.position]:
            state.position = (state.position + 1) % len(state.cycle)
        else:
            _agree_on_departure(state, made, name, seq, group)
    timing = comms_logger.start(name, nbytes, group) if comms_logger.enabled else None
    try:
        work = call(*args, group=group, async_op=async_op, **kwargs)
    except RuntimeError as exc:  # gloo / NCCL failures and timeouts are RuntimeErrors
        raise _collective_error(name, seq, group, exc, None) from exc
    if async_op and work is not None:
        return _CheckedWork(work, name, seq, group, timing)
    if timing is not None:
        comms_logger.finish(timing)
    return work


def _call(name: str, payload: torch.Tensor | None, root: int) -> Call:
    if payload is None:
        return (_OPS.index(name), 0, -1, root)
    return (_OPS.index(name), payload.numel(), _DTYPE_CODES[str(payload.dtype)], root)


def _digest(calls: tuple[Call, ...] | None) -> int:
    """A sequence of calls as one int64 that ranks can compare (0: none offered)."""
    if not calls:
        return 0
    value = int.from_bytes(
        hashlib.blake2b(repr(calls).encode(), digest_size=8).digest(), "little", signed=True
    )
    return value or 1


def _check_same_call(state: _GroupState, call: Call, name: str, seq: int, group: Any) -> None:
    """Raise `CollectiveError` unless every rank of `group` is about to make the same call: the
    same operation, size, dtype and root, as the same wrapped call in the group. The exchange
    also carries each rank's offered sequence: every rank offering the same one starts following
    it (from this call, its first)."""
    offer = state.offer
    state.offer = None
    mine = torch.tensor([*call, state.calls, _digest(offer)])
    size = dist.get_world_size(group)
    everyone = torch.empty(size * mine.numel(), dtype=mine.dtype)
    try:
        _all_gather_single(everyone, mine, group=group)
    except RuntimeError as exc:  # a rank that never comes: gloo's timeout
        raise _collective_error(name, seq, group, exc, None) from exc
    rows = [tuple(row) for row in everyone.view(size, -1).tolist()]
    calls = [row[:5] for row in rows]
    if len(set(calls)) != 1:
        _raise_different_calls(dict(zip(_members(group) or range(size), calls)), name, seq, group)
    if offer is not None and {row[5] for row in rows} == {_digest(offer)} and call == offer[0]:
        state.cycle, state.position = offer, 1 % len(offer)
    elif _steps_marked:
        state.step_calls.append(call)


def _raise_different_calls(
    calls: dict[int, tuple[int, ...]], name: str, seq: int, group: Any
) -> None:
    """Raise the error for ranks (global rank -> (call..., number)) about to call different
    collectives."""
    by_call: dict[tuple[int, ...], list[int]] = {}
    for rank, call in calls.items():
        by_call.setdefault(call, []).append(rank)
    described = "; ".join(f"{_ranks(ranks)}: {_describe(call)}" for call, ranks in by_call.items())
    mismatch = RuntimeError(f"the ranks called different collectives: {described}")
    raise _collective_error(name, seq, group, mismatch, None) from None


def _agree_on_departure(state: _GroupState, call: Call, name: str, seq: int, group: Any) -> None:
    """This rank's call departs from the agreed sequence. The ranks compare notes through the
    store (the others may already be inside the expected collective): when every rank departed
    with the same call, checking goes back to call by call; otherwise raise `CollectiveError`."""
    expected = state.cycle[state.position] if state.cycle else call
    rank = dist.get_rank()
    members = _members(group) or [rank]
    peers = [r for r in members if r != rank]
    timeout = _group_timeout()
    grace = min(_GRACE_S, timeout) if timeout else _GRACE_S
    key = _DEPARTURE_KEY.format(_group_id(group), state.calls)
    record = {"rank": rank, "call": [*call, state.calls], "time": time.time()}
    found, problem = _exchange(record, peers, grace, math.inf, key)
    theirs = {peer: tuple(found[peer]["call"]) for peer in found}
    mine = (*call, state.calls)
    if len(theirs) == len(peers):
        if all(other == mine for other in theirs.values()):
            state.learn(call)
            return
        _raise_different_calls({rank: mine, **theirs}, name, seq, group)
    silent = [r for r in peers if r not in theirs]
    why = f"the store could not be used ({problem})" if problem else f"within {grace:g} s"
    departure = RuntimeError(
        f"this rank called {_describe(mine)} where the earlier steps, agreed by every rank, call "
        f"{_describe((*expected, state.calls))}; {_ranks(silent)} did not reach this call "
        f"{why}: they are in the expected collective or elsewhere (a data-dependent branch or "
        "a skipped call on this rank?)"
    )
    raise _collective_error(name, seq, group, departure, None, ask_peers=False) from None


def _group_id(group: Any) -> str:
    """A name of `group` that every member computes alike."""
    group = dist.group.WORLD if group is None else group
    name = getattr(group, "group_name", None)
    return name or "-".join(map(str, _members(group) or []))


def mark_step() -> None:
    """The engine's step boundary. In each checked group, a step that made exactly the calls of
    the step before (both checked call by call) is offered to the others as the sequence to
    follow; see the module docstring."""
    global _steps_marked
    _steps_marked = True
    for state in list(_groups.values()):
        if not state.checked or state.cycle is not None:
            continue
        calls, state.step_calls = tuple(state.step_calls), []
        if not calls:
            continue  # not used this step: its steps are the ones that use it
        if calls == state.previous:
            state.offer = calls
        state.previous = calls


def set_same_call_check(enabled: bool) -> None:
    """Turn the same-call check on or off for every group (the config's
    'comms_same_call_check'); every rank must do the same, at the same point."""
    global _same_call_check
    _same_call_check = enabled
    for group, state in list(_groups.items()):
        fresh = _GroupState(group)
        state.checked, state.cycle, state.offer = fresh.checked, None, None
        state.previous, state.step_calls = (), []


def _describe(call: tuple[int, ...]) -> str:
    op, numel, dtype, root, number = call
    text = _OPS[op]
    if op != _OPS.index("barrier") and dtype >= 0:  # dtype -1: sizes that may differ by rank
        text += f" of {numel} {_DTYPES[dtype].removeprefix('torch.')} element"
        text += "" if numel == 1 else "s"
    if root >= 0:
        text += f" with root rank {root}"
    return f"{text} (collective {number} in this group)"


def _members(group: Any) -> list[int] | None:
    """The group's global ranks, in group-rank order (None if torch cannot say)."""
    try:
        return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
    except Exception:
        return None


class _CheckedWork:
    """The Work of an async collective whose `wait()` raises `CollectiveError` and, when the comms
    logger times it, records it on the first return; the rest of the Work API is delegated
    (`.work` is the real object, for APIs that need it)."""

    __slots__ = ("_group", "_op", "_seq", "_timing", "work")

    def __init__(self, work: Any, op: str, seq: int, group: Any, timing: Any = None) -> None:
        self.work, self._op, self._seq, self._group = work, op, seq, group
        self._timing = timing

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            result = self.work.wait(*args, **kwargs)
        except RuntimeError as exc:
            waited = time.monotonic() - start
            raise _collective_error(self._op, self._seq, self._group, exc, waited) from exc
        if self._timing is not None:
            comms_logger.finish(self._timing)
            self._timing = None
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def _caller_frames(limit: int = 3) -> list[str]:
    """The innermost `limit` frames outside this file and torch, innermost first, then the innermost
    frame outside shardspeed (the user's call) when those do not reach it."""
    frames, user = [], None
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path == _HERE or path.startswith(_TORCH_DIR):
            continue
        text = f"{_short(path)}:{frame.lineno} in {frame.name}"
        if len(frames) < limit:
            frames.append(text)
        if user is None and not path.startswith(_PACKAGE_DIR):
            user = text
        if len(frames) >= limit and user is not None:
            break
    if user is not None and user not in frames:
        frames.append(user)
    return frames


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _group_timeout() -> float | None:
    applied = collective_timeout()
    if applied is not None:
        return applied.total_seconds()
    # init_process_group gives the default store the group's timeout; subgroups usually share it.
    try:
        return dist.distributed_c10d._get_default_store().timeout.total_seconds()
    except Exception:
        return None


def _ranks(ranks: list[int]) -> str:
    """[1, 2, 3, 5] -> 'ranks 1-3, 5'."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _exchange(
    record: dict[str, Any],
    peers: list[int],
    grace: float,
    max_age: float,
    key: str = _STALL_KEY,
) -> tuple[dict[int, dict[str, Any]], str | None]:
    """Publish this rank's record under `key` (formatted with a rank), then collect the peers'
    for up to `grace` seconds.

    Returns the records found, by rank, and what went wrong with the store, if anything. The store
    is private torch API and its host may be gone, so any failure only ends the exchange early.
    """
    found: dict[int, dict[str, Any]] = {}
    try:
        store = dist.distributed_c10d._get_default_store()
        try:  # an own connection with a short timeout; the group's store stays as it was
            store = store.clone()
            store.set_timeout(datetime.timedelta(seconds=grace + 1))
        except Exception:
            pass
        store.set(key.format(record["rank"]), json.dumps(record))
        deadline = time.monotonic() + grace
        pause = 0.05 * max(1.0, len(peers) / 16)  # keeps a large group from flooding the store
        while True:
            for peer in peers:
                theirs_key = key.format(peer)
                # check() does not block, and get() of a present key returns at once.
                if peer not in found and store.check([theirs_key]):
                    theirs = json.loads(store.get(theirs_key))
                    if time.time() - theirs["time"] <= max_age:  # not left from an older failure
                        found[peer] = theirs
            if len(found) == len(peers) or time.monotonic() >= deadline:
                return found, None
            time.sleep(pause)
    except Exception as exc:
        return found, f"{type(exc).__name__}: {_first_line(exc)}"


def _collective_error(
    op: str,
    seq: int,
    group: Any,
    exc: BaseException,
    waited: float | None,
    ask_peers: bool = True,
) -> CollectiveError:
    """Build the error for this rank's failed collective #`seq`, after trading records with peers
    (without `ask_peers`, only publishing this rank's, for the peers' own errors)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    members = _members(group) or [rank]
    peers = [r for r in members if r != rank]
    frames = _caller_frames()
    where = frames[0] if frames else "an unknown place"
    timeout = _group_timeout()
    size = f"{len(members)} rank" + ("s" if len(members) != 1 else "")
    lines = [f"rank {rank} stopped in {op} #{seq} at {where} (group of {size})"]
    if len(frames) > 1:
        lines.append("called from " + " <- ".join(frames[1:]))
    limit = f"group timeout {timeout:g} s" if timeout is not None else "group timeout unknown"
    lines.append(f"waited {waited:.1f} s ({limit})" if waited is not None else limit)
    lines.append(f"error: {_first_line(exc)}")
    if peers:
        grace = min(_GRACE_S, timeout) if timeout else _GRACE_S
        record = {"rank": rank, "op": op, "seq": seq, "where": where, "time": time.time()}
        max_age = (timeout or 1800.0) + grace + 10.0
        found, problem = _exchange(record, peers if ask_peers else [], grace, max_age)
        if ask_peers:
            lines += _peer_lines(op, seq, peers, found, grace, problem)
    return CollectiveError("\n  ".join(lines))


def _peer_lines(
    op: str,
    seq: int,
    peers: list[int],
    found: dict[int, dict[str, Any]],
    grace: float,
    problem: str | None,
) -> list[str]:
    lines = []
    # Peers in another collective first: they are the ones that explain a mismatch.
    order = sorted(found, key=lambda p: ((found[p]["op"], found[p]["seq"]) == (op, seq), p))
    for i, peer in enumerate(order):
        if i == _SHOWN_PEERS:
            lines.append(f"{len(found) - i} more peers reported")
            break
        theirs = found[peer]
        lines.append(f"rank {peer} stopped in {theirs['op']} #{theirs['seq']} at {theirs['where']}")
        if (theirs["op"], theirs["seq"]) != (op, seq):
            lines.append(
                f"rank {peer} is in {theirs['op']} #{theirs['seq']} while this rank is in "
                f"{op} #{seq}: the ranks called collectives in different orders"
            )
    silent = [r for r in peers if r not in found]
    if silent and problem is not None:
        lines.append(f"{_ranks(silent)} unknown: the default store could not be used ({problem})")
    elif silent:
        they, are = ("it", "is") if len(silent) == 1 else ("they", "are")
        lines.append(
            f"{_ranks(silent)} did not report within {grace:g} s: {they} {are} not inside a "
            f"shardspeed collective ({they} raised, exited, {are} stuck in compute, or skipped "
            "the collective this rank waits in)"
        )
    return lines


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    nbytes = _count("all_reduce", tensor, group)
    return _run(
        "all_reduce", group, async_op, dist.all_reduce, tensor, op=op, nbytes=nbytes, payload=tensor
    )


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None) -> None:
    """DeepSpeed's blocking all-reduce for inference code (tensor-parallel outputs); the same
    counted all-reduce as training's, since torch's collectives serve both."""
    all_reduce(tensor, op=op, group=group)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    nbytes = _count("broadcast", tensor, group)
    return _run(
        "broadcast", group, async_op, dist.broadcast, tensor, src=src, nbytes=nbytes,
        payload=tensor, root=src,
    )  # fmt: skip


def all_gather_into_tensor(
    output: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    nbytes = _count("all_gather", output, group)
    return _run(
        "all_gather_into_tensor", group, async_op, _all_gather_single, output, tensor,
        nbytes=nbytes, payload=tensor,
    )  # fmt: skip


def reduce_scatter_tensor(
    output: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    nbytes = _count("reduce_scatter", tensor, group)
    return _run(
        "reduce_scatter_tensor",
        group,
        async_op,
        _reduce_scatter_single,
        output,
        tensor,
        op=op,
        nbytes=nbytes,
        payload=tensor,
    )


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    nbytes = _count("reduce", tensor, group)
    return _run(
        "reduce", group, async_op, dist.reduce, tensor, dst=dst, op=op, nbytes=nbytes,
        payload=tensor, root=dst,
    )  # fmt: skip


def gather(
    tensor: torch.Tensor,
    outputs: list[torch.Tensor] | None,
    dst: int,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Every rank's `tensor` into `outputs` on global rank `dst` (None elsewhere), in group order.
    Counted as what moves through this rank: the gathered whole on `dst`, its input elsewhere."""
    nbytes = tensor.numel() * tensor.element_size() * (1 if outputs is None else len(outputs))
    _add("gather", group, nbytes)
    return _run(
        "gather", group, async_op, dist.gather, tensor, outputs, dst=dst, nbytes=nbytes,
        payload=tensor, root=dst,
    )  # fmt: skip


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Split `tensor` along dim 0, the i-th chunk to group rank i; `output` gets the chunks sent
    here, in rank order. Chunks are equal unless the split sizes (rows to and from each rank) say
    otherwise."""
    nbytes = _count("all_to_all", tensor, group)
    # Uneven splits may make ranks' inputs differ in size legitimately: the same-call check then
    # compares the operation only.
    return _run(
        "all_to_all_single", group, async_op, dist.all_to_all_single, output, tensor,
        output_split_sizes, input_split_sizes, nbytes=nbytes,
        payload=tensor if input_split_sizes is None else None,
    )  # fmt: skip


def batch_isend_irecv(ops: list[dist.P2POp]) -> list[Any]:
    """Post point-to-point sends and receives (`torch.distributed.P2POp`s) together; return one
    Work per op, to `wait()` on. Sends count under "send" and receives under "recv", each over
    (this rank, its peer). There is no same-call check: the peers of a point-to-point batch are not
    a whole group making one collective."""
    global _seq
    _seq += 1
    seq = _seq
    for op in ops:
        kind = "send" if op.op is dist.isend else "recv"
        _count(kind, op.tensor, op.group, (get_rank(), op.peer))
    group = ops[0].group if ops else None
    try:
        if ops and dist.get_backend(group) == "fake":
            # A dry run's meta tensors have no backend to coalesce on; nothing moves anyway, so
            # each op is posted alone (as torch does for backends that cannot coalesce).
            works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
        else:
            works = dist.batch_isend_irecv(ops)
    except RuntimeError as exc:
        raise _collective_error("batch_isend_irecv", seq, group, exc, None) from exc
    return [_CheckedWork(work, "batch_isend_irecv", seq, group) for work in works]


def all_gather(
    outputs: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    nbytes = sum(output.numel() * output.element_size() for output in outputs)
    _add("all_gather", group, nbytes)
    return _run(
        "all_gather", group, async_op, dist.all_gather, outputs, tensor, nbytes=nbytes,
        payload=tensor,
    )  # fmt: skip
