"""The shell words that start a node's or a rank's processes: ``--venv_script`` and the environment.

Every launcher that goes through a shell (ssh, pdsh) runs ``cd CWD && . VENV && export K=V ... &&
exec COMMAND`` on each node; one that starts a program directly (torchrun here, mpirun, srun) gets
``sh -c '. VENV && exec "$@"' sh COMMAND...`` when a venv script is named, so the script is sourced
in the same place either way: just before the processes of the job start.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence


def node_shell(
    cwd: str,
    exports: Mapping[str, str],
    command: Sequence[str],
    venv_script: str | None = None,
) -> str:
    """``cd CWD && [. VENV &&] [export K=V ... &&] exec COMMAND`` with every word shell-quoted."""
    parts = [f"cd {shlex.quote(cwd)}"]
    if venv_script is not None:
        parts.append(f". {shlex.quote(venv_script)}")
    if exports:
        parts.append("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in exports.items()))
    parts.append("exec " + shlex.join(command))
    return " && ".join(parts)


def sourcing(venv_script: str | None, command: Sequence[str]) -> list[str]:
    """`command`, run after sourcing `venv_script` in ``sh`` when one is named."""
    if venv_script is None:
        return list(command)
    return ["sh", "-c", f'. {shlex.quote(venv_script)} && exec "$@"', "sh", *command]
