"""Launchers that start every rank themselves: ``--launcher openmpi|mpich|impi|mvapich|slurm``.

Where pdsh and ssh start one torchrun per node, these hand the whole job to the cluster's own tool
(``mpirun`` or ``srun``), which starts each rank; the rank runs :mod:`shardspeed.launcher.entry`,
which reads its place from the tool's variables. :func:`check_flags` refuses what the tool cannot
do, :func:`find_tool` finds it, and :func:`rank_launch` builds its command line (:mod:`.mpi`,
:mod:`.slurm`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from shardspeed.launcher.hostfile import parse_node_specs
from shardspeed.launcher.mpi import impi_command, mpich_command, mvapich_command, openmpi_command
from shardspeed.launcher.slurm import srun_command

RANK_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich", "slurm")
_MPI = ("openmpi", "mpich", "impi", "mvapich")


class Tool(NamedTuple):
    """How a launcher's program is found: names tried in order, and what its version must say."""

    names: tuple[str, ...]
    what: str  # for messages: the program and where it comes from
    probe: tuple[str, ...] = ()  # a command whose output must contain `expect`
    expect: str = ""


# Debian installs OpenMPI's and MPICH's mpirun side by side as mpirun.openmpi and mpirun.mpich,
# with plain mpirun pointing at one of them, so the explicit names are tried first.
TOOLS = {
    "openmpi": Tool(("mpirun.openmpi", "mpirun"), "OpenMPI's mpirun (Debian: openmpi-bin)",
                    ("ompi_info", "--version"), "Open MPI"),
    "mpich": Tool(("mpirun.mpich", "mpiexec.hydra", "mpirun"), "MPICH's mpirun (Debian: mpich)"),
    "impi": Tool(("mpirun",), "Intel MPI's mpirun (Intel oneAPI; Debian does not package it)",
                 ("mpirun", "--version"), "Intel(R) MPI"),
    "mvapich": Tool(("mpirun",), "MVAPICH2's mpirun (from the MVAPICH project; Debian does not "
                    "package it)", ("mpiname",), "MVAPICH2"),
    "slurm": Tool(("srun",), "Slurm's srun (Debian: slurm-client)"),
}  # fmt: skip


class RankLaunch(NamedTuple):
    """The tool's command line, variables to add to its environment, and files to write first."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]


def find_tool(
    launcher: str,
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[[Sequence[str]], str] | None = None,
) -> str:
    """The path of `launcher`'s program; ValueError saying what to install when it is missing."""
    tool = TOOLS[launcher]
    found = next((path for path in map(which, tool.names) if path), None)
    if found is None:
        raise ValueError(f"--launcher {launcher} needs {tool.what} on PATH; it is not there")
    if tool.probe:
        output = (run or _output)(tool.probe)
        if tool.expect not in output:
            said = output.strip().splitlines()[0] if output.strip() else "nothing"
            raise ValueError(
                f"--launcher {launcher} needs {tool.what}, but `{' '.join(tool.probe)}` says "
                f"{said!r}; put that MPI first on PATH or choose the launcher of the MPI you have"
            )
    return found


def _output(command: Sequence[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    return done.stdout + done.stderr


def check_flags(launcher: str, args: argparse.Namespace) -> None:
    """Refuse the flags `launcher` cannot honour, naming why (DeepSpeed's refusals, and ours)."""
    if args.max_restarts is not None:
        raise ValueError(
            f"--max_restarts restarts torchrun's workers; --launcher {launcher} starts the ranks "
            "without torchrun. Use --launcher pdsh or ssh, or leave it out"
        )
    if args.ssh_port is not None:
        how = (
            "uses no ssh"
            if launcher == "slurm"
            else "reaches other hosts through mpirun: give it ssh options in --launcher_args "
            "(OpenMPI: --mca plm_rsh_args '-p PORT')"
        )
        raise ValueError(
            f"--ssh_port is the ssh and pdsh launchers' option; --launcher {launcher} {how}"
        )
    if launcher in _MPI and (args.include or args.exclude):
        raise ValueError(
            f"--launcher {launcher} runs every host and slot of the hostfile (as in DeepSpeed): "
            "--include/--exclude cannot be used; list only the hosts to run on in the hostfile"
        )
    if launcher in _MPI and (args.num_nodes is not None or args.num_gpus is not None):
        raise ValueError(
            f"--launcher {launcher} runs every host and slot of the hostfile (as in DeepSpeed): "
            "--num_nodes/--num_gpus cannot be used; write the hosts and slots in the hostfile"
        )


def _whole_hosts(spec: str, flag: str) -> list[str]:
    nodes = parse_node_specs(spec, flag)
    with_slots = [host for host, slots in nodes.items() if slots is not None]
    if with_slots:
        raise ValueError(
            f"--launcher slurm: {flag} {spec!r} names slots of {with_slots[0]}, but srun places "
            "tasks on a node itself; name whole nodes"
        )
    return list(nodes)


def rank_launch(
    launcher: str,
    args: argparse.Namespace,
    hosts: Mapping[str, Sequence[int]],
    exports: Mapping[str, str],
    program: Sequence[str],
    hostfile_path: str,
    tool: str,
) -> RankLaunch:
    """The command that starts every rank of `hosts` running `program` through `launcher`.

    `exports` are the variables every rank gets (MASTER_ADDR and MASTER_PORT among them);
    `hostfile_path` is where a hostfile the tool reads is written; `tool` is the found program
    (:func:`find_tool`); the caller has checked the flags (:func:`check_flags`).
    """
    counts = {host: len(slots) for host, slots in hosts.items()}
    tasks = sum(counts.values())
    launcher_args = shlex.split(args.launcher_args)
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    if launcher == "openmpi":
        files[hostfile_path] = "".join(f"{host} slots={count}\n" for host, count in counts.items())
        argv = openmpi_command(hostfile_path, tasks, exports, program, launcher_args)
    elif launcher == "mpich":
        argv = mpich_command(counts, exports, program, launcher_args)
    elif launcher == "impi":
        argv = impi_command(counts, exports, program, launcher_args)
    elif launcher == "mvapich":
        files[hostfile_path] = "".join(f"{host}\n" for host in counts)
        argv = mvapich_command(counts, hostfile_path, exports, program, launcher_args)
    else:
        env = dict(exports)  # srun's --export=ALL carries them (see slurm.py)
        argv = srun_command(
            tasks,
            program,
            launcher_args,
            nodelist=_whole_hosts(args.include, "--include") if args.include else (),
            exclude=_whole_hosts(args.exclude, "--exclude") if args.exclude else (),
            nodes=args.num_nodes,
            tasks_per_node=args.num_gpus,
        )
    return RankLaunch([tool, *argv[1:]], env, files)


def hostfile_path(directory: str | None = None) -> str:
    """Where this launcher writes the hostfile an MPI reads (one per launcher process)."""
    return os.path.join(directory or tempfile.gettempdir(), f"shardspeed-{os.getpid()}.hostfile")
