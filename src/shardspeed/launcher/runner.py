"""The ``shardspeed`` command: DeepSpeed's launcher flags, with torchrun starting the processes.

``shardspeed [flags] script.py [script args]`` resolves which hosts and device slots to use (hostfile,
``--include``/``--exclude``, ``--num_nodes``, ``--num_gpus``), then runs one
``python -m torch.distributed.run`` per node: locally for a single node (or for this node with
``--no_ssh``), over ssh for several. Each worker runs :mod:`shardspeed.launcher.entry`, which adds
``--local_rank`` and runs the script. The command lines are built by pure functions so they can be
checked without starting anything.

On one node without ``--master_port`` or ``--master_addr`` torchrun meets on a port it binds itself
(``--standalone``): probing for a free port and passing it on would leave a moment in which two
launches started together pick the same one. torchrun gives the workers MASTER_ADDR and
MASTER_PORT as usual.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple

from shardspeed.common.net import free_port, port_is_free
from shardspeed.launcher import cluster, pdsh
from shardspeed.launcher.cluster import RANK_LAUNCHERS
from shardspeed.launcher.cores import parse_range_list
from shardspeed.launcher.hostfile import parse_hostfile, read_hostfile, select_resources
from shardspeed.launcher.hostfile import parse_resource_filter as parse_resource_filter
from shardspeed.launcher.shell import node_shell, sourcing

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_PORT = 29500
ENTRY_MODULE = "shardspeed.launcher.entry"
# DeepSpeed's name and value (accelerate writes a multi-node job's environment to this file).
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
# Variables whose names start with one of these are copied to remote nodes. This is DeepSpeed's list
# (MLFLOW, PYTHON, MV2, UCX) plus NCCL, which its CUDA accelerator adds.
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "UCX", "MV2")
# DeepSpeed's --save_pid file: PID_FILE_DIR/<pid of the launcher>.deepspeed.
PID_FILE_DIR = "/tmp"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LAUNCHERS = ("pdsh", "ssh", *RANK_LAUNCHERS)
# Launchers that reach other hosts over ssh, whose first host DeepSpeed checks before starting.
SSH_LAUNCHERS = ("pdsh", "ssh", "openmpi", "mpich", "impi", "mvapich")
# torchrun's --node_rank in the pdsh command, until it becomes pdsh's %n (a word shells leave alone).
_PDSH_NODE_RANK = "SHARDSPEED_PDSH_NODE_RANK"
_log = logging.getLogger("shardspeed.launcher")

# DeepSpeed's runner offers its hostfile helpers under these names (parse_resource_filter is
# re-exported above); code written for it calls them here.
_parse_hostfile = parse_hostfile

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Launch(NamedTuple):
    """One process for the launcher to start: its argv, its environment, and whether it reaches
    other hosts (then it gets no stdin)."""

    argv: list[str]
    env: dict[str, str]
    remote: bool
    files: Mapping[str, str] = {}  # written before it starts and removed after (an MPI hostfile)
    # What stops it early: pdsh stops its ssh clients (and so the nodes' torchruns) only on a
    # second SIGINT within a second; alone, SIGTERM would leave them running.
    stop: tuple[int, ...] = (signal.SIGTERM,)


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, bool]]:
    """The launcher's parser, and for each option string whether it takes a value."""
    parser = argparse.ArgumentParser(
        prog="shardspeed",
        usage="shardspeed [launcher flags] script.py [script args]",
        description="Launch a training script on one or more nodes with torchrun, "
        "accepting DeepSpeed's launcher flags.",
        add_help=False,
    )
    takes_value: dict[str, bool] = {}

    def add(*names: str, **kwargs: object) -> None:
        action = parser.add_argument(*names, **kwargs)
        for name in action.option_strings:
            takes_value[name] = action.nargs != 0

    add("-h", "--help", action="help", help="show this help and exit")
    add(
        "-H",
        "--hostfile",
        default=None,
        help=f"MPI-style hostfile ('worker-0 slots=4' lines); default {DEFAULT_HOSTFILE} if it exists, "
        "else this machine only",
    )
    add(
        "-i",
        "--include",
        default="",
        help="resources to use: NODE_SPEC[@NODE_SPEC...] with NODE_SPEC=NAME[:SLOT[,SLOT...]], "
        "e.g. 'worker-0@worker-1:0,2'",
    )
    add("-e", "--exclude", default="", help="resources not to use, same format as --include")
    add("--num_nodes", type=int, default=None, help="use the first N hosts of the hostfile")
    add(
        "--num_gpus",
        "--num_accelerators",
        "--num_procs",
        dest="num_gpus",
        type=int,
        default=None,
        help="processes per node, on device slots 0..N-1 (default: every slot; on this machine "
        "the visible GPU count, or 1 process without GPUs)",
    )
    add("--node_rank", type=int, default=None, help="this node's rank, used with --no_ssh")
    add(
        "--master_addr",
        default=None,
        help="rendezvous address (default: on one node torchrun's own, else the first host's name)",
    )
    add(
        "--master_port",
        type=int,
        default=None,
        help=f"rendezvous port (default: on one node a port torchrun binds itself, else "
        f"{DEFAULT_MASTER_PORT}; with --master_addr on one node, {DEFAULT_MASTER_PORT} or a free "
        "port if that one is taken)",
    )
    add("--max_restarts", type=int, default=None, help="passed to torchrun")
    add(
        "--no_local_rank",
        action="store_true",
        help="do not append --local_rank=N to the script args",
    )
    add("--module", action="store_true", help="run the target as a module, like python -m")
    add("--no_python", action="store_true", help="the target is an executable, not a Python script")
    add(
        "--compat",
        action="store_true",
        help="make 'import deepspeed' in the script resolve to shardspeed",
    )
    add(
        "--no_ssh",
        action="store_true",
        help="start only this node's processes (needs --node_rank); run it on every node",
    )
    add("--ssh_port", type=int, default=None, help="ssh port for remote nodes")
    add(
        "--launcher",
        type=str.lower,
        default=None,
        help="how a multi-node job starts: pdsh (DeepSpeed's default; ssh when pdsh is not "
        "installed), ssh, openmpi, mpich, impi, mvapich or slurm (see docs/launching.md)",
    )
    add(
        "--launcher_args",
        default="",
        help="arguments for the multi-node launcher's program, as one quoted string",
    )
    add(
        "--force_multi",
        action="store_true",
        help="start through the multi-node launcher even when the job has one node",
    )
    add(
        "--no_ssh_check",
        action="store_true",
        help="do not check that the first host answers ssh without a password before starting",
    )
    add(
        "--enable_each_rank_log",
        default=None,
        metavar="DIR",
        help="write each rank's stdout and stderr to DIR/<start time>_rank<N>.log",
    )
    add(
        "--save_pid",
        action="store_true",
        help=f"while the job runs, write the pid of the process this launcher started (torchrun on "
        f"one node; pdsh, mpirun or srun) to {PID_FILE_DIR}/<launcher pid>.deepspeed",
    )
    add(
        "--venv_script",
        default=None,
        help="a shell script (e.g. a virtualenv's bin/activate) sourced before each node's or "
        "rank's processes start",
    )
    add(
        "--log_level",
        choices=LOG_LEVELS,
        default="info",
        help="the launcher's own messages: info shows the commands it runs",
    )
    add("-q", "--quiet", action="store_true", help="only errors: same as --log_level error")
    add(
        "--bind_cores_to_rank",
        action="store_true",
        help="pin each process to an equal share of its node's CPU cores and set OMP_NUM_THREADS "
        "to the share's size (no NUMA memory binding)",
    )
    add(
        "--bind_core_list",
        default=None,
        help="with --bind_cores_to_rank: the cores to share out, e.g. 0,2-5 (default: all the "
        "cores the launcher may use)",
    )
    add(
        "--autotuning",
        choices=("tune", "run"),
        default=None,
        help="tune: run short trials of the script over ZeRO stages and batch sizes and write the "
        "best config to the config's autotuning.results_dir; run: then train with it",
    )
    return parser, takes_value


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse launcher flags up to the script; the script's own args are kept verbatim.

    The split is done by hand rather than by argparse so that script args which look like launcher
    flags (``--num_gpus``, ``--master_port``, ``--``) are passed through, never interpreted.
    """
    parser, takes_value = _build_parser()
    index = 0
    typed: dict[str, str] = {}  # option dest -> the spelling the user typed, for messages
    while index < len(argv) and argv[index].startswith("-") and argv[index] != "-":
        name, has_equals, _ = argv[index].partition("=")
        if name not in takes_value:
            parser.error(
                f"unrecognized launcher flag {argv[index]!r} (launcher flags go before the script)"
            )
        typed[parser._option_string_actions[name].dest] = name
        index += 2 if takes_value[name] and not has_equals else 1
    args = parser.parse_args(argv[:index])
    for dest in ("num_gpus", "num_nodes"):
        value = getattr(args, dest)
        if value is not None and value < 1:
            parser.error(f"{typed[dest]} must be at least 1, got {value}")
    if index >= len(argv):
        parser.error("missing the script to run")
    args.user_script, args.user_args = argv[index], list(argv[index + 1 :])
    if args.module and args.no_python:
        parser.error("--module and --no_python cannot be used together")
    if args.compat and args.no_python:
        parser.error("--compat needs a Python script; it cannot be used with --no_python")
    if args.launcher is not None and args.launcher not in LAUNCHERS:
        parser.error(f"--launcher {args.launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if args.quiet:
        args.log_level = "error"
    # DeepSpeed's default value of --enable_each_rank_log is the string "None".
    if args.enable_each_rank_log in (None, "None"):
        args.rank_log_prefix = args.enable_each_rank_log = None
    else:
        if os.path.isfile(args.enable_each_rank_log):
            parser.error(
                f"--enable_each_rank_log {args.enable_each_rank_log!r} is a file; name a directory"
            )
        # One start time for every rank's file name, as DeepSpeed's per-node launcher stamps them.
        stamp = time.strftime("%Y%m%d%H%M%S", time.localtime())
        args.rank_log_prefix = os.path.join(os.path.abspath(args.enable_each_rank_log), stamp)
    if args.bind_core_list is not None:
        if not args.bind_cores_to_rank:
            parser.error("--bind_core_list only takes effect with --bind_cores_to_rank; add it")
        try:
            parse_range_list(args.bind_core_list)
        except ValueError as error:
            parser.error(f"--bind_core_list: {error}")
    return args


def _count_local_devices() -> int:
    """Processes to start on this machine by default: one per visible CUDA device, else one."""
    import torch  # deferred: only needed when neither a hostfile nor --num_gpus gives the count

    return torch.cuda.device_count() or 1


def local_visible_devices(slots: Sequence[int], environ: Mapping[str, str]) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for slots on this machine, or None to leave it as it is.

    Slot k means the k-th device this process can see, so a CUDA_VISIBLE_DEVICES set by a job
    scheduler is respected (DeepSpeed instead drops it when a filter flag is given). Set but empty
    means no GPUs: the processes run on the CPU and the variable is left alone.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ",".join(str(slot) for slot in slots)
    if not visible.strip():
        return None
    devices = [device.strip() for device in visible.split(",")]
    missing = [slot for slot in slots if slot >= len(devices)]
    if missing:
        raise ValueError(
            f"slot {missing[0]} requested but CUDA_VISIBLE_DEVICES={visible!r} lists "
            f"{len(devices)} device(s); unset it or ask for fewer processes"
        )
    return ",".join(devices[slot] for slot in slots)


def read_env_file(path: str) -> dict[str, str]:
    """Read ``KEY=VALUE`` lines (blank lines and ``#`` comments skipped) from a .deepspeed_env file."""
    values: dict[str, str] = {}
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, has_equals, value = line.partition("=")
            key = key.strip()
            if not has_equals or not _ENV_NAME.fullmatch(key):
                raise ValueError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
            values[key] = value.strip()
    return values


def remote_environment(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """Variables to set on remote nodes, as DeepSpeed's launcher propagates them.

    Variables of this process named with an :data:`EXPORT_PREFIXES` prefix, PYTHONPATH with ``cwd``
    first, then the ``.deepspeed_env`` files in the home directory and in ``cwd`` (later ones win).
    ``DS_ENV_FILE`` replaces the file name; an absolute path names one file.
    """
    exports = {
        key: value
        for key, value in environ.items()
        if key.startswith(EXPORT_PREFIXES) and _ENV_NAME.fullmatch(key)
    }
    # cwd goes first on PYTHONPATH so remote processes import the same local modules as this one.
    exports["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, environ.get("PYTHONPATH")]))
    name = environ.get("DS_ENV_FILE", DEEPSPEED_ENVIRONMENT_NAME)
    home = environ.get("HOME") or os.path.expanduser("~")
    for path in dict.fromkeys(os.path.join(directory, name) for directory in (home, cwd)):
        if os.path.isfile(path):
            exports.update(read_env_file(path))
    return exports


def entry_flags(args: argparse.Namespace, *, local_rank: bool = True) -> list[str]:
    """The flags of :mod:`shardspeed.launcher.entry` that `args` ask for.

    `local_rank` False: the script gets no ``--local_rank``, as DeepSpeed's MPI and Slurm
    launchers run it.
    """
    flags = [
        f"--{flag}"
        for flag in ("no_local_rank", "module", "no_python", "compat", "bind_cores_to_rank")
        if getattr(args, flag)
    ]
    if not local_rank and not args.no_local_rank:
        flags.insert(0, "--no_local_rank")
    if args.bind_core_list is not None:
        flags.append(f"--bind_core_list={args.bind_core_list}")
    if args.rank_log_prefix is not None:
        flags.append(f"--rank_log={args.rank_log_prefix}")
    return flags


def torchrun_command(
    args: argparse.Namespace,
    *,
    nproc: int,
    nnodes: int,
    node_rank: int | str,
    master_addr: str | None,
) -> list[str]:
    """The torchrun command for one node, running the script through :mod:`shardspeed.launcher.entry`.

    `master_addr` None means one node meeting on a port torchrun binds itself (``--standalone``).
    """
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc),
        "--nnodes", str(nnodes),
    ]  # fmt: skip
    if master_addr is None:
        command.append("--standalone")
    else:
        command += [
            "--node_rank", str(node_rank),
            "--master_addr", master_addr,
            "--master_port", str(args.master_port or DEFAULT_MASTER_PORT),
        ]  # fmt: skip
    if args.max_restarts is not None:
        command += ["--max_restarts", str(args.max_restarts)]
    command += ["--module", ENTRY_MODULE, *entry_flags(args)]
    return [*command, args.user_script, *args.user_args]


def rank_program(args: argparse.Namespace) -> list[str]:
    """What each rank runs when mpirun or srun starts it: the script through the entry module."""
    command = [sys.executable, "-u", "-m", ENTRY_MODULE, *entry_flags(args, local_rank=False)]
    return sourcing(args.venv_script, [*command, args.user_script, *args.user_args])


def ssh_command(
    host: str,
    cwd: str,
    exports: Mapping[str, str],
    command: Sequence[str],
    ssh_port: int | None = None,
    venv_script: str | None = None,
) -> list[str]:
    """``ssh host "cd CWD && [. VENV &&] export K=V ... && exec COMMAND"``, every word quoted.

    ``-tt`` gives the remote command a terminal so that stopping this ssh client hangs it up and
    torchrun, which handles SIGHUP, stops its workers instead of running on unattended.
    """
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    return ["ssh", "-tt", *port, host, node_shell(cwd, exports, command, venv_script)]


def resolve_hosts(
    args: argparse.Namespace, count_local_devices: Callable[[], int] = _count_local_devices
) -> dict[str, list[int]]:
    """The hosts and slots to run on: the hostfile's (or this machine's), narrowed by the flags."""
    hostfile = args.hostfile or DEFAULT_HOSTFILE
    if os.path.isfile(hostfile):
        pool = read_hostfile(hostfile)
    elif args.hostfile is not None:
        raise ValueError(f"hostfile {args.hostfile!r} does not exist")
    else:
        # The local device count is only needed when no flag says how many processes to start.
        pool = {"localhost": args.num_gpus or count_local_devices()}
    return select_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)


def launcher_name(
    args: argparse.Namespace, which: Callable[[str], str | None] = shutil.which
) -> str:
    """``--launcher``, else DeepSpeed's default pdsh, or ssh where pdsh is not installed."""
    return args.launcher or ("pdsh" if which("pdsh") else "ssh")


def is_multi_node(args: argparse.Namespace, hosts: Mapping[str, list[int]]) -> bool:
    """Whether the job starts through the multi-node launcher (as DeepSpeed decides)."""
    return (args.force_multi or len(hosts) > 1) and not args.no_ssh


def plan_launches(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    cwd: str,
    count_local_devices: Callable[[], int] = _count_local_devices,
    which: Callable[[str], str | None] = shutil.which,
    find_tool: Callable[[str], str] = cluster.find_tool,
) -> list[Launch]:
    """Resolve resources and build the processes to start; raises ValueError for bad requests.

    `which` says whether pdsh is installed and `find_tool` finds mpirun or srun (tests pass their
    own to build commands where the tools are not installed).
    """
    hosts = resolve_hosts(args, count_local_devices)
    launcher = launcher_name(args, which)
    names = list(hosts)
    master_addr: str | None = args.master_addr or ("127.0.0.1" if len(names) == 1 else names[0])
    if is_multi_node(args, hosts):
        if args.launcher is None:
            _log.info("multi-node launch through %s", launcher)
        return _multi_node_launches(args, launcher, hosts, environ, cwd, find_tool)
    if args.launcher is not None or args.launcher_args:
        _log.info(
            "one node: started by torchrun here; --launcher and --launcher_args apply to "
            "multi-node launches (add --force_multi to start through the launcher)"
        )

    if args.no_ssh:
        if args.node_rank is None or not 0 <= args.node_rank < len(names):
            raise ValueError(f"--no_ssh needs --node_rank between 0 and {len(names) - 1}")
        node_rank = args.node_rank
    else:
        node_rank = 0
        if args.master_port is None and args.master_addr is None:
            master_addr = None  # torchrun's own free port, bound as it is chosen
        elif args.master_port is None and not port_is_free(DEFAULT_MASTER_PORT):
            # Only this machine meets at the port, so any free one will do.
            args = copy.copy(args)
            args.master_port = free_port()
    slots = hosts[names[node_rank]]
    env = dict(environ)
    devices = local_visible_devices(slots, environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    command = torchrun_command(
        args, nproc=len(slots), nnodes=len(names), node_rank=node_rank, master_addr=master_addr
    )
    return [Launch(sourcing(args.venv_script, command), env, remote=False)]


def _multi_node_launches(
    args: argparse.Namespace,
    launcher: str,
    hosts: Mapping[str, list[int]],
    environ: Mapping[str, str],
    cwd: str,
    find_tool: Callable[[str], str],
) -> list[Launch]:
    """The launches of a multi-node job: a torchrun per node (ssh, pdsh), or the cluster's tool."""
    master_addr = args.master_addr or next(iter(hosts))
    if launcher == "ssh":
        return _remote_launches(args, hosts, master_addr, environ, cwd)
    if launcher == "pdsh":
        return [_pdsh_launch(args, hosts, master_addr, environ, cwd)]
    cluster.check_flags(launcher, args)
    tool = find_tool(launcher)
    port = str(args.master_port or DEFAULT_MASTER_PORT)
    exports = {**remote_environment(environ, cwd), "MASTER_PORT": port}
    if launcher != "slurm" or args.master_addr:
        # srun decides where rank 0 runs; its ranks read the first host of their node list.
        exports["MASTER_ADDR"] = master_addr
    argv, env, files = cluster.rank_launch(
        launcher, args, hosts, exports, rank_program(args), cluster.hostfile_path(), tool
    )
    return [Launch(argv, {**environ, **env}, remote=True, files=files)]


def _pdsh_launch(
    args: argparse.Namespace,
    hosts: Mapping[str, list[int]],
    master_addr: str,
    environ: Mapping[str, str],
    cwd: str,
) -> Launch:
    """One pdsh command running every node's torchrun; pdsh's ``%n`` is the node rank."""
    slots = next(iter(hosts.values()))
    if any(other != slots for other in hosts.values()):
        listed = ", ".join(f"{host}: {','.join(map(str, s))}" for host, s in hosts.items())
        raise ValueError(
            f"--launcher pdsh runs one command on every node, so every node needs the same slots "
            f"({listed}); use --num_gpus N, or --launcher ssh, which starts each node on its own"
        )
    exports = {
        **remote_environment(environ, cwd),
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, slots)),
    }
    command = torchrun_command(
        args,
        nproc=len(slots),
        nnodes=len(hosts),
        node_rank=_PDSH_NODE_RANK,
        master_addr=master_addr,
    )
    shell = pdsh.escape(node_shell(cwd, exports, command, args.venv_script))
    argv = pdsh.pdsh_command(
        list(hosts), shell.replace(_PDSH_NODE_RANK, pdsh.NODE_RANK), shlex.split(args.launcher_args)
    )
    env = {**environ, **pdsh.pdsh_environment(environ, args.ssh_port)}
    return Launch(argv, env, remote=True, stop=(signal.SIGINT, signal.SIGINT))


def _remote_launches(
    args: argparse.Namespace,
    hosts: Mapping[str, list[int]],
    master_addr: str,
    environ: Mapping[str, str],
    cwd: str,
) -> list[Launch]:
    """One ssh command per host, each starting that node's torchrun."""
    shared_exports = remote_environment(environ, cwd)
    launches = []
    for node_rank, (host, slots) in enumerate(hosts.items()):
        # On a remote node slots are its device ids: its own CUDA_VISIBLE_DEVICES is unknown here.
        exports = {**shared_exports, "CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}
        command = torchrun_command(
            args, nproc=len(slots), nnodes=len(hosts), node_rank=node_rank, master_addr=master_addr
        )
        argv = ssh_command(host, cwd, exports, command, args.ssh_port, args.venv_script)
        launches.append(Launch(argv, dict(environ), remote=True))
    return launches


def _exit_status(returncode: int) -> int:
    """A shell-style status: a process killed by signal N reports 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class _Terminated(Exception):
    """Raised by the SIGTERM handler so that the launcher stops its children before it exits."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


def run_launches(
    launches: Sequence[Launch], grace_s: float = 10.0, pid_file: str | None = None
) -> int:
    """Start the launches in parallel and wait for them.

    Returns 0 when all succeed; the first non-zero status stops the others and is returned.
    `pid_file` holds the started processes' pids, one a line, while they run.
    """
    with written_files(launches):
        return _run(launches, grace_s, pid_file)


@contextlib.contextmanager
def written_files(launches: Sequence[Launch]) -> Iterator[None]:
    """The launches' files (an MPI hostfile) written for as long as they run, removed after."""
    files = {path: text for launch in launches for path, text in launch.files.items()}
    for path, text in files.items():
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    try:
        yield
    finally:
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def send_stop(launch: Launch, process: subprocess.Popen) -> None:
    """What stops `launch` early, sent to its `process` while it runs (pdsh: two SIGINTs)."""
    for number, signum in enumerate(launch.stop):
        if process.poll() is None:
            time.sleep(0.2 if number else 0)
            process.send_signal(signum)


def _run(launches: Sequence[Launch], grace_s: float, pid_file: str | None) -> int:
    processes = [
        # ssh gets no stdin: several clients must not fight over this terminal.
        subprocess.Popen(
            launch.argv, env=launch.env, stdin=subprocess.DEVNULL if launch.remote else None
        )
        for launch in launches
    ]
    if pid_file is not None:
        with open(pid_file, "w", encoding="utf-8") as handle:
            handle.write("".join(f"{process.pid}\n" for process in processes))
        _log.info("launcher pid file %s: %s", pid_file, " ".join(str(p.pid) for p in processes))
    in_main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM (e.g. from a job scheduler) must stop the children too, not orphan them.
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        while True:
            codes = [process.poll() for process in processes]
            failed = [code for code in codes if code]
            if failed:
                return _exit_status(failed[0])
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except _Terminated:
        return 128 + signal.SIGTERM
    finally:
        if in_main_thread:
            # A handler installed outside Python reads back as None; the default is the best restore.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        for launch, process in zip(launches, processes):
            send_stop(launch, process)
        for process in processes:
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if pid_file:
            with contextlib.suppress(FileNotFoundError):
                os.remove(pid_file)


def main(argv: list[str] | None = None) -> int:
    """``python -m shardspeed.launcher.runner``: a launch without autotuning (the ``shardspeed``
    command, :mod:`shardspeed.cli`, runs ``--autotuning`` too); returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.autotuning:
        print(
            "shardspeed.launcher.runner: error: --autotuning is run by the shardspeed command "
            "(shardspeed --autotuning tune|run ..., or python -m shardspeed.cli)",
            file=sys.stderr,
        )
        return 2
    return launch(args)


def launch(args: argparse.Namespace) -> int:
    """Start the processes `args` describe and wait for them; returns the exit status."""
    _show_messages(args.log_level)
    try:
        hosts = resolve_hosts(args)
        launcher = launcher_name(args)
        if is_multi_node(args, hosts) and launcher in SSH_LAUNCHERS and not args.no_ssh_check:
            check_ssh(next(iter(hosts)), args.ssh_port, launcher)
        launches = plan_launches(args, os.environ, os.getcwd())
    except ValueError as error:
        print(f"shardspeed: error: {error}", file=sys.stderr)
        return 2
    for launch in launches:
        _log.info("%s", shlex.join(launch.argv))
    if args.enable_each_rank_log is not None:
        os.makedirs(args.enable_each_rank_log, exist_ok=True)
    pid_file = os.path.join(PID_FILE_DIR, f"{os.getpid()}.deepspeed") if args.save_pid else None
    return run_launches(launches, pid_file=pid_file)


def _show_messages(level: str) -> None:
    """Print the launcher's own messages at `level` and above to stderr, as ``shardspeed: ...``."""
    if not _log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("shardspeed: %(message)s"))
        _log.addHandler(handler)
        _log.propagate = False
    _log.setLevel(level.upper())


def check_ssh(host: str, ssh_port: int | None, launcher: str) -> None:
    """Refuse to start when `host` does not answer ssh without a password, as DeepSpeed checks the
    first host for launchers that reach hosts over ssh (srun does not)."""
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    command = ["ssh", "-o", "PasswordAuthentication=no", *port, host, "hostname"]
    try:
        done = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
        )
        failure = done.stderr.strip().splitlines()[-1:] if done.returncode else None
    except subprocess.TimeoutExpired:
        failure = ["no answer in 60 s"]
    if failure is not None:
        said = f": {failure[0]}" if failure else ""
        raise ValueError(
            f"host {host!r} was not reachable by ssh without a password ({shlex.join(command)} "
            f"failed{said}). Set up passwordless ssh to the hosts, or pass --no_ssh_check if "
            f"--launcher {launcher} reaches them another way"
        )


if __name__ == "__main__":
    sys.exit(main())
