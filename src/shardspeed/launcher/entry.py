"""What torchrun runs in every worker process: ``python -m shardspeed.launcher.entry [flags] target args``.

Flags (before the target): ``--no_local_rank`` (do not append ``--local_rank=N``), ``--compat`` (install
the ``deepspeed`` import alias first), ``--module`` (the target is a module name), ``--no_python`` (the
target is an executable to exec), ``--bind_cores_to_rank`` (pin this process to its share of cores,
see :mod:`shardspeed.launcher.cores`), ``--bind_core_list=LIST`` (the cores to share out) and
``--rank_log=PREFIX`` (this rank's stdout and stderr go to ``PREFIX_rank<RANK>.log``).

A worker that ``mpirun`` or ``srun`` started rather than torchrun first gets torchrun's variables
from theirs (:mod:`shardspeed.comm.discovery`), so everything below, and the script, reads one set.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from shardspeed.alias import install as install_deepspeed_alias
from shardspeed.launcher.cores import bind_this_process

_FLAGS = ("--no_local_rank", "--compat", "--module", "--no_python", "--bind_cores_to_rank")
_CORE_LIST = "--bind_core_list="
_RANK_LOG = "--rank_log="


def run_target(target: str, args: Sequence[str], *, module: bool = False) -> None:
    """Run a script (or with ``module``, a module) as ``__main__``, as ``python target args`` would.

    ``sys.argv`` becomes ``[target, *args]`` and, for a script, ``sys.path[0]`` its directory, so the
    script imports its neighbours exactly as it does when started by ``python`` itself.
    """
    sys.argv = [target, *args]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if not os.path.exists(target):
        print(f"shardspeed: can't open file {os.path.abspath(target)!r}", file=sys.stderr)
        raise SystemExit(2)
    sys.path[0] = os.path.dirname(os.path.realpath(target))
    runpy.run_path(target, run_name="__main__")


def _set_deepspeed_rank_env() -> None:
    """Add the variables DeepSpeed's launcher sets and torchrun names differently."""
    for ours, torchrun in (
        ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"),
        ("CROSS_RANK", "GROUP_RANK"),
        ("CROSS_SIZE", "GROUP_WORLD_SIZE"),
    ):
        if torchrun in os.environ:
            os.environ.setdefault(ours, os.environ[torchrun])


def _adopt_launcher_layout() -> None:
    """Set RANK, LOCAL_RANK, ... from an MPI's or Slurm's variables when torchrun did not."""
    if "RANK" in os.environ:
        return  # torchrun's (the check imports no torch)
    from shardspeed.comm.discovery import adopt

    try:
        adopt(os.environ)
    except ValueError as error:
        raise SystemExit(f"shardspeed.launcher.entry: {error}") from None


def _redirect_output(prefix: str) -> None:
    """Send this process's stdout and stderr to ``PREFIX_rank<RANK>.log`` (DeepSpeed's name)."""
    path = f"{prefix}_rank{os.environ.get('RANK', '0')}.log"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # the directory on a remote node
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _bind_cores(core_list: str | None) -> None:
    """Pin this worker to its share of the node's cores (before the target starts its threads)."""
    try:
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    except KeyError as missing:
        raise SystemExit(
            f"shardspeed.launcher.entry: --bind_cores_to_rank needs {missing.args[0]}; run it under "
            "torchrun, mpirun or srun"
        ) from None
    try:
        bind_this_process(core_list, local_world_size, local_rank)
    except ValueError as error:
        raise SystemExit(f"shardspeed.launcher.entry: {error}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the target of this worker; returns 0 when it finishes (failures raise)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = set()
    core_list = rank_log = None
    while argv and argv[0].startswith("-"):
        if argv[0].startswith(_CORE_LIST):
            core_list = argv.pop(0)[len(_CORE_LIST) :]
            continue
        if argv[0].startswith(_RANK_LOG):
            rank_log = argv.pop(0)[len(_RANK_LOG) :]
            continue
        if argv[0] not in _FLAGS:
            raise SystemExit(f"shardspeed.launcher.entry: unknown flag {argv[0]!r}")
        flags.add(argv.pop(0))
    if not argv:
        raise SystemExit("usage: python -m shardspeed.launcher.entry [flags] target [args]")
    target, args = argv[0], argv[1:]
    _adopt_launcher_layout()
    if rank_log is not None:
        _redirect_output(rank_log)
    if "--no_local_rank" not in flags:
        local_rank = os.environ.get("LOCAL_RANK")
        if local_rank is None:
            raise SystemExit(
                "shardspeed.launcher.entry: LOCAL_RANK is not set; run it under torchrun, mpirun "
                "or srun"
            )
        # DeepSpeed's launcher passes the local rank as an argument; scripts written for it parse it.
        args.append(f"--local_rank={local_rank}")
    _set_deepspeed_rank_env()
    if "--bind_cores_to_rank" in flags:
        _bind_cores(core_list)
    if "--no_python" in flags:
        os.execvp(target, [target, *args])
    if "--compat" in flags:
        install_deepspeed_alias()
    try:
        run_target(target, args, module="--module" in flags)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    close_process_group()
    return 0


def close_process_group() -> None:
    """Close the process groups a finished script left open, once every rank is done (bounded):
    see `shardspeed.comm.teardown`, which also runs at exit for scripts started any other way."""
    from shardspeed.comm.teardown import close

    close()


if __name__ == "__main__":
    sys.exit(main())
