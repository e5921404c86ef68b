"""The rank layout of a process started by ``mpirun`` or ``srun`` rather than torchrun.

torchrun gives each process RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. A process
that an MPI launcher or Slurm started directly finds its place under other names instead:

| started by | rank | world size | local rank | processes on this node |
| --- | --- | --- | --- | --- |
| OpenMPI ``mpirun`` | OMPI_COMM_WORLD_RANK | OMPI_COMM_WORLD_SIZE | OMPI_COMM_WORLD_LOCAL_RANK | OMPI_COMM_WORLD_LOCAL_SIZE |
| MPICH / Intel MPI (Hydra) | PMI_RANK | PMI_SIZE | MPI_LOCALRANKID | MPI_LOCALNRANKS |
| MVAPICH2 | MV2_COMM_WORLD_RANK | MV2_COMM_WORLD_SIZE | MV2_COMM_WORLD_LOCAL_RANK | MV2_COMM_WORLD_LOCAL_SIZE |
| Slurm ``srun`` | SLURM_PROCID | SLURM_NTASKS | SLURM_LOCALID | from SLURM_STEP_TASKS_PER_NODE |

The MPI families come first: an ``mpirun`` inside a Slurm allocation inherits the batch step's
SLURM_* variables, which describe the allocation, not this job. Slurm's are read only inside a job
step (SLURM_STEP_ID), so a script started by plain ``python`` in a batch script is not mistaken for
rank 0 of the allocation's tasks.

DeepSpeed learns the rendezvous address by broadcasting rank 0's address with mpi4py. That needs a
compiled MPI binding, so the address is read from the environment instead, in this order:
MASTER_ADDR (the ``shardspeed`` launcher exports it, and a user can), Azure ML's
AZ_BATCH_MASTER_NODE / AZ_BATCHAI_MPI_MASTER_NODE, for Slurm the first host of the step's node list
(rank 0 runs there, and it hosts the rendezvous store), and 127.0.0.1 when every rank runs on this
node. A job across nodes with none of these is refused, naming MASTER_ADDR. The port is MASTER_PORT,
else the caller's default (DeepSpeed's 29500).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from typing import NamedTuple

# torchrun's names: when all of these are set, a launcher that knows the rendezvous is around.
TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Family(NamedTuple):
    """Where one launcher family keeps a process's place (see the table above)."""

    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str | None
    # Present only when this family started the process (None: the rank variable says so).
    marker: str | None = None


FAMILIES = (
    Family("OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
           "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    Family("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    Family("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
           "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    Family("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, marker="SLURM_STEP_ID"),
)  # fmt: skip


class Layout(NamedTuple):
    """One process's place in the job, and where the ranks meet."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # the launcher family, for messages


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{name}={environ[name]!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    depth, end = 0, len(nodelist)
    for index, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    host = nodelist[:end].strip()
    # Each bracket group (there may be several: rack[1-2]node[01-08]) contributes its first value.
    while (match := re.search(r"\[([^\]]*)\]", host)) is not None:
        first = match.group(1).split(",")[0].split("-")[0]
        host = host[: match.start()] + first + host[match.end() :]
    return host


def tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """Entry `node_index` of Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: 2, 2, 2, 1)."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} is not Slurm's format")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_index < len(counts):
        raise ValueError(
            f"SLURM_NODEID={node_index} is outside SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}"
        )
    return counts[node_index]


def _family(environ: Mapping[str, str]) -> Family | None:
    for family in FAMILIES:
        if family.rank in environ and (family.marker is None or family.marker in environ):
            return family
    return None


def _master_addr(environ: Mapping[str, str], family: Family, single_node: bool) -> str:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if "AZUREML_EXPERIMENT_ID" in environ and "DLTS_JOB_ID" not in environ:
        # Azure ML runs OpenMPI jobs and names the first node (host:port for several nodes).
        name = "AZ_BATCHAI_MPI_MASTER_NODE" if single_node else "AZ_BATCH_MASTER_NODE"
        if environ.get(name):
            return environ[name].split(":")[0]
    if family.name == "Slurm":
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST")
        if nodelist:
            return first_host(nodelist)
    if single_node:
        return "127.0.0.1"
    raise ValueError(
        f"this process was started by {family.name} as rank {environ[family.rank]} of "
        f"{environ[family.size]} on several nodes, and MASTER_ADDR is not set: set it to the address "
        "of the host of rank 0 (the shardspeed launcher's --launcher option exports it), or start "
        "the job with torchrun"
    )


def discover(environ: Mapping[str, str], default_port: int = 29500) -> Layout | None:
    """The layout an MPI launcher or Slurm gave this process, or None when neither started it.

    Raises ValueError naming the variable when the layout is incomplete or inconsistent.
    """
    family = _family(environ)
    if family is None:
        return None
    # Slurm says how many tasks each node runs; this node's count is at its index.
    slurm_local = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID")
    needed = (
        family.size,
        family.local_rank,
        *((family.local_size,) if family.local_size else slurm_local),
    )
    missing = [name for name in needed if name not in environ]
    if missing:
        raise ValueError(
            f"{family.rank} is set, so this process looks started by {family.name}, but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not"
        )
    rank, size = _int(environ, family.rank), _int(environ, family.size)
    local_rank = _int(environ, family.local_rank)
    if family.local_size is not None:
        local_size = _int(environ, family.local_size)
    else:
        local_size = tasks_on_node(environ[slurm_local[0]], _int(environ, slurm_local[1]))
    if not (0 <= rank < size and 0 <= local_rank < local_size <= size):
        raise ValueError(
            f"{family.name} gave rank {rank} of {size}, local rank {local_rank} of {local_size}: "
            "these do not fit together"
        )
    master_port = _int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else default_port
    addr = _master_addr(environ, family, single_node=local_size == size)
    return Layout(rank, size, local_rank, local_size, addr, master_port, family.name)


def export(layout: Layout, environ: MutableMapping[str, str]) -> None:
    """Write `layout` under torchrun's names, so env:// initialization and scripts read it."""
    environ.update(
        RANK=str(layout.rank),
        WORLD_SIZE=str(layout.world_size),
        LOCAL_RANK=str(layout.local_rank),
        LOCAL_WORLD_SIZE=str(layout.local_world_size),
        MASTER_ADDR=layout.master_addr,
        MASTER_PORT=str(layout.master_port),
    )


def torchrun_layout_present(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun (or a user) already set every variable of the rendezvous."""
    return all(key in environ for key in TORCHRUN_KEYS)


def adopt(
    environ: MutableMapping[str, str], default_port: int = 29500, allowed: bool = True
) -> Layout | None:
    """Give a process that MPI or Slurm started torchrun's variables; return the layout written.

    Nothing is written when torchrun's variables are all set already, when no launcher family
    started the process, or when it is a world of one (the one-process start-up applies).
    `allowed` False (``init_distributed(auto_mpi_discovery=False)``) refuses a larger world rather
    than starting a one-process group that the other ranks would wait for.
    """
    if torchrun_layout_present(environ):
        return None
    layout = discover(environ, default_port)
    if layout is None or layout.world_size == 1:
        return None
    if not allowed:
        raise ValueError(
            f"auto_mpi_discovery=False, but RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT is not "
            f"set and {layout.source} started this process as rank {layout.rank} of "
            f"{layout.world_size}: leave auto_mpi_discovery at True to read {layout.source}'s "
            "variables, or set torchrun's"
        )
    export(layout, environ)
    return layout
