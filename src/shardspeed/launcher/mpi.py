"""``--launcher openmpi|mpich|impi|mvapich``: one ``mpirun`` that starts every rank of the job.

The command lines are DeepSpeed's for each MPI. Variables go to Hydra (the process manager MPICH,
Intel MPI and MVAPICH2 share) as ``-genv NAME VALUE`` / ``-env NAME VALUE`` throughout, where
DeepSpeed mixes in one-word ``NAME=VALUE``, which Hydra reads as well.
Each rank runs the script through :mod:`shardspeed.launcher.entry`, which reads its place from the
MPI's variables (:mod:`shardspeed.comm.discovery`); the launcher exports MASTER_ADDR and
MASTER_PORT with the others, which is how the ranks find each other without mpi4py.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

# DeepSpeed's defaults for each MPI; variables of the same name in the launcher's environment win.
OPENMPI_DEFAULTS = {"UCX_TLS": "tcp"}
MVAPICH_DEFAULTS = {
    "MV2_SMP_USE_CMA": "0",  # the CMA kernel module is missing on many distributions
    "MV2_DEBUG_SHOW_BACKTRACE": "1",
    "MV2_SUPPORT_DL": "1",
    "MV2_ENABLE_AFFINITY": "0",  # ranks start threads of their own
    "MV2_INTER_ALLGATHER_TUNING": "5",
    "MV2_CUDA_USE_NAIVE": "0",
}


def _processes_per_node(hosts: Mapping[str, int], launcher: str) -> int:
    """The one count every host runs: these MPIs place ranks with ``-ppn``, the same on each node."""
    counts = set(hosts.values())
    if len(counts) != 1:
        listed = ", ".join(f"{host}: {count}" for host, count in hosts.items())
        raise ValueError(
            f"--launcher {launcher} starts the same number of processes on every node (-ppn), but "
            f"the hostfile's slots differ ({listed}); give every host the same slots"
        )
    return counts.pop()


def _pairs(flag: str, exports: Mapping[str, str]) -> list[str]:
    return [word for key, value in exports.items() for word in (flag, key, value)]


def _names_interface(launcher_args: Sequence[str]) -> bool:
    return any(
        flag in ("-mca", "--mca") and name == "btl_tcp_if_include"
        for flag, name in itertools.pairwise(launcher_args)
    )


def openmpi_command(
    hostfile: str,
    tasks: int,
    exports: Mapping[str, str],
    program: Sequence[str],
    launcher_args: Sequence[str] = (),
) -> list[str]:
    """OpenMPI: ``mpirun -n TASKS -hostfile F --mca btl ^openib ... -x K=V ... PROGRAM``.

    As in DeepSpeed, TCP traffic is kept to eth0 unless `launcher_args` name
    ``btl_tcp_if_include`` themselves.
    """
    interface = [] if _names_interface(launcher_args) else ["--mca", "btl_tcp_if_include", "eth0"]
    exports = {**OPENMPI_DEFAULTS, **exports}
    exported = [word for key, value in exports.items() for word in ("-x", f"{key}={value}")]
    return [
        "mpirun", "-n", str(tasks), "-hostfile", hostfile, "--mca", "btl", "^openib",
        *interface, *launcher_args, *exported, *program,
    ]  # fmt: skip


def mpich_command(
    hosts: Mapping[str, int],
    exports: Mapping[str, str],
    program: Sequence[str],
    launcher_args: Sequence[str] = (),
) -> list[str]:
    """MPICH: ``mpirun -n N -ppn P ... -genv K V ... -hosts H1,H2 PROGRAM``."""
    per_node = _processes_per_node(hosts, "mpich")
    tasks = per_node * len(hosts)
    sizes = {"WORLD_SIZE": str(tasks), "LOCAL_SIZE": str(per_node)}
    return [
        "mpirun", "-n", str(tasks), "-ppn", str(per_node), *launcher_args,
        *_pairs("-genv", {**exports, **sizes}), "-hosts", ",".join(hosts), *program,
    ]  # fmt: skip


def impi_command(
    hosts: Mapping[str, int],
    exports: Mapping[str, str],
    program: Sequence[str],
    launcher_args: Sequence[str] = (),
) -> list[str]:
    """Intel MPI: one ``-n 1 -env RANK r -env LOCAL_RANK l PROGRAM`` section per rank, ``:`` apart.

    Intel MPI's own pinning is turned off (``I_MPI_PIN 0``), as in DeepSpeed: core binding is
    ``--bind_cores_to_rank``'s.
    """
    per_node = _processes_per_node(hosts, "impi")
    tasks = per_node * len(hosts)
    shared = {**exports, "WORLD_SIZE": str(tasks), "LOCAL_SIZE": str(per_node), "I_MPI_PIN": "0"}
    # RANK and WORLD_SIZE given, the entry reads no MPI variables: torchrun's name for LOCAL_SIZE
    # too, for --bind_cores_to_rank.
    shared["LOCAL_WORLD_SIZE"] = str(per_node)
    command = ["mpirun", "-ppn", str(per_node), *launcher_args, *_pairs("-genv", shared)]
    command += ["-hosts", ",".join(hosts)]
    for rank in range(tasks):
        if rank:
            command.append(":")
        ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node)}
        command += ["-n", "1", *_pairs("-env", ranks), *program]
    return command


def mvapich_command(
    hosts: Mapping[str, int],
    hostfile: str,
    exports: Mapping[str, str],
    program: Sequence[str],
    launcher_args: Sequence[str] = (),
) -> list[str]:
    """MVAPICH2: ``mpirun -np N -ppn P --hostfile F ... -env K V ... PROGRAM`` (F lists the hosts)."""
    per_node = _processes_per_node(hosts, "mvapich")
    return [
        "mpirun", "-np", str(per_node * len(hosts)), "-ppn", str(per_node), "--hostfile", hostfile,
        *launcher_args, *_pairs("-env", {**MVAPICH_DEFAULTS, **exports}), *program,
    ]  # fmt: skip
