"""DeepSpeed-style hostfiles and ``--include``/``--exclude`` resource filters.

A hostfile lists one host per line as ``HOST slots=N`` (MPI style); ``#`` starts a comment and blank lines
are skipped. Resources are then narrowed with a spec of the form ``NODE_SPEC[@NODE_SPEC...]`` where
``NODE_SPEC = NAME[:SLOT[,SLOT...]]``: a bare name means every slot of that host. All functions return
an insertion-ordered ``dict`` of host -> sorted slot indices, in hostfile order, because the order of
the hosts decides which node gets which node rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

# What ssh gets as its destination: a name or an IPv4 address, never something it reads as an option.
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SLOTS = re.compile(r"slots=(\d+)")


def parse_hostfile(lines: Iterable[str], source: str = "hostfile") -> dict[str, int]:
    """Parse hostfile lines into ``{host: slot_count}``; errors name ``source`` and the line number."""
    pool: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        # Fields after slots=N are accepted and ignored: MPI hostfiles may carry e.g. max_slots=N.
        match = _SLOTS.fullmatch(fields[1]) if len(fields) > 1 else None
        if match is None:
            raise ValueError(f"{source}:{number}: expected 'HOST slots=N', got {raw.strip()!r}")
        host, slots = fields[0], int(match.group(1))
        if _HOST.fullmatch(host) is None:
            raise ValueError(
                f"{source}:{number}: {host!r} is not a host name: use letters, digits, '.', '-' "
                "and '_', starting with a letter or digit"
            )
        if slots < 1:
            raise ValueError(f"{source}:{number}: host {host!r} has slots={slots}, need at least 1")
        if host in pool:
            raise ValueError(
                f"{source}:{number}: host {host!r} is listed twice (first on line {first_seen[host]})"
            )
        pool[host] = slots
        first_seen[host] = number
    if not pool:
        raise ValueError(f"{source} lists no hosts")
    return pool


def read_hostfile(path: str | Path) -> dict[str, int]:
    """Read and parse the hostfile at ``path``."""
    with open(path, encoding="utf-8") as handle:
        return parse_hostfile(handle, source=str(path))


def parse_node_specs(spec: str, flag: str = "--include") -> dict[str, list[int] | None]:
    """Parse ``NAME[:SLOT[,SLOT]]@...`` into ``{host: sorted slots}``, with ``None`` for "all slots".

    A host named more than once gets the union of its slots; once named bare, it keeps all of them.
    """
    nodes: dict[str, list[int] | None] = {}
    for node_spec in spec.split("@"):
        name, colon, slot_text = node_spec.partition(":")
        if not name or (colon and not slot_text):
            raise ValueError(
                f"{flag} {spec!r}: bad node spec {node_spec!r}, expected NAME[:SLOT[,SLOT]]"
            )
        slots: list[int] | None = None
        if colon:
            try:
                slots = [int(text) for text in slot_text.split(",")]
            except ValueError:
                raise ValueError(
                    f"{flag} {spec!r}: slots in {node_spec!r} must be comma-separated integers"
                ) from None
            if any(slot < 0 for slot in slots):
                raise ValueError(f"{flag} {spec!r}: slots in {node_spec!r} must not be negative")
        if name in nodes:
            previous = nodes[name]
            slots = None if previous is None or slots is None else previous + slots
        nodes[name] = None if slots is None else sorted(set(slots))
    return nodes


def _describe_slots(slots: Sequence[int]) -> str:
    """``0-3`` for a contiguous run of slots, else the slots comma-separated."""
    if not slots:
        return "none"
    if list(slots) == list(range(slots[0], slots[0] + len(slots))):
        return f"{slots[0]}-{slots[-1]}" if len(slots) > 1 else str(slots[0])
    return ", ".join(map(str, slots))


def parse_resource_filter(
    host_info: Mapping[str, Sequence[int]], include_str: str = "", exclude_str: str = ""
) -> dict[str, list[int]]:
    """Apply an ``--include`` or ``--exclude`` spec to ``host_info`` (``{host: slot indices}``).

    Named as in DeepSpeed's runner. Hosts left without slots are dropped, so the result may be empty;
    with neither spec every slot of every host is kept.
    """
    if include_str and exclude_str:
        raise ValueError("--include and --exclude are mutually exclusive")
    available = {host: list(slots) for host, slots in host_info.items()}
    flag, spec = ("--include", include_str) if include_str else ("--exclude", exclude_str)
    if not spec:
        return available
    requested = parse_node_specs(spec, flag)
    for host, slots in requested.items():
        if host not in available:
            known = ", ".join(available)
            raise ValueError(f"{flag}: host {host!r} is not among the available hosts ({known})")
        for slot in slots or []:
            if slot not in available[host]:
                raise ValueError(
                    f"{flag}: host {host!r} has no slot {slot} "
                    f"(it has slots {_describe_slots(available[host])})"
                )
    if include_str:
        return {
            host: available[host] if requested[host] is None else requested[host]
            for host in available
            if host in requested
        }
    selected = {}
    for host, slots in available.items():
        removed = requested.get(host, [])
        kept = [] if removed is None else [slot for slot in slots if slot not in removed]
        if kept:
            selected[host] = kept
    return selected


def filter_resources(
    pool: Mapping[str, int], include: str = "", exclude: str = ""
) -> dict[str, list[int]]:
    """Apply an ``--include`` or ``--exclude`` spec to ``pool`` (``{host: slot_count}``).

    With neither spec every slot of every host is used. Hosts left without slots are dropped, and a
    spec that leaves none at all is refused: there would be nothing to run on.
    """
    available = {host: list(range(count)) for host, count in pool.items()}
    selected = parse_resource_filter(available, include, exclude)
    if not selected:
        flag, spec = ("--include", include) if include else ("--exclude", exclude)
        raise ValueError(f"{flag} {spec!r} leaves no slots to run on")
    return selected


def select_resources(
    pool: Mapping[str, int],
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> dict[str, list[int]]:
    """Resolve the hosts and slots to run on, following DeepSpeed's launcher rules.

    ``num_nodes`` keeps the first hosts of the pool; ``num_gpus`` uses slots ``0..num_gpus-1`` on every
    kept host. Neither may be combined with ``include``/``exclude``.
    """
    if (num_nodes is not None or num_gpus is not None) and (include or exclude):
        raise ValueError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    if num_nodes is not None and num_nodes < 1:
        raise ValueError(f"--num_nodes must be at least 1, got {num_nodes}")
    if num_gpus is not None and num_gpus < 1:
        raise ValueError(f"--num_gpus must be at least 1, got {num_gpus}")
    selected = filter_resources(pool, include, exclude)
    if num_nodes is not None:
        if num_nodes > len(selected):
            raise ValueError(
                f"--num_nodes {num_nodes} but only {len(selected)} host(s) are available: "
                f"{', '.join(selected)}"
            )
        selected = dict(list(selected.items())[:num_nodes])
    if num_gpus is not None:
        selected = {host: list(range(num_gpus)) for host in selected}
    return selected
