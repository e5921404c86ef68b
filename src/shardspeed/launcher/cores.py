"""``--bind_cores_to_rank``: pin each worker process of a node to its own share of CPU cores.

The launcher's ``--bind_core_list`` names the cores to share out (``0,2-4`` style); without it, the
cores this process may run on are shared. Each of a node's N processes gets an equal, contiguous
slice of the list (the remainder stays unused, as in DeepSpeed), and ``OMP_NUM_THREADS`` is set to the
slice's size so that intra-op thread pools do not oversubscribe it. Unlike DeepSpeed, which starts each
rank under ``numactl``, binding is done with ``sched_setaffinity`` in the worker itself: it needs no
extra program, but it does not bind memory to a NUMA node.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_range_list(text: str) -> list[int]:
    """Expand ``"0,2-4,6"`` into ``[0, 2, 3, 4, 6]``.

    Items are comma-separated numbers or inclusive ``FIRST-LAST`` ranges, in ascending order and not
    overlapping, so that a list that is probably a typo (``"8,2-6"``, ``"0,2-6,5-9"``) is refused.
    """
    cores: list[int] = []
    for item in text.split(","):
        match = _RANGE.fullmatch(item)
        if match is None:
            raise ValueError(
                f"bad core list {text!r}: {item!r} is neither a number nor a range like 2-5"
            )
        first = int(match.group(1))
        last = first if match.group(2) is None else int(match.group(2))
        if last < first:
            raise ValueError(f"bad core list {text!r}: range {item!r} ends before it starts")
        if cores and first <= cores[-1]:
            raise ValueError(
                f"bad core list {text!r}: {item!r} is not above the cores before it; "
                "list cores in ascending order, each once"
            )
        cores.extend(range(first, last + 1))
    return cores


def cores_for_rank(cores: Sequence[int], local_world_size: int, local_rank: int) -> list[int]:
    """The slice of ``cores`` that local rank ``local_rank`` of ``local_world_size`` is pinned to."""
    per_rank = len(cores) // local_world_size
    if per_rank < 1:
        raise ValueError(
            f"--bind_cores_to_rank: {len(cores)} core(s) for {local_world_size} processes on this "
            "node; give each process at least one (list more with --bind_core_list, or start fewer "
            "processes)"
        )
    return list(cores[per_rank * local_rank : per_rank * (local_rank + 1)])


def bind_this_process(core_list: str | None, local_world_size: int, local_rank: int) -> list[int]:
    """Pin this process to its cores, set ``OMP_NUM_THREADS`` to match, and return the cores."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--bind_cores_to_rank needs os.sched_setaffinity, which only Linux has")
    allowed = sorted(os.sched_getaffinity(0))
    cores = allowed if core_list is None else parse_range_list(core_list)
    mine = cores_for_rank(cores, local_world_size, local_rank)
    outside = sorted(set(mine) - set(allowed))
    if outside:
        raise ValueError(
            f"--bind_core_list {core_list!r}: local rank {local_rank} would run on cores {outside}, "
            f"which this process may not use (it may use {allowed}); list only those"
        )
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    return mine
