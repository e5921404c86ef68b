"""``--launcher pdsh``: one pdsh command that starts every node's torchrun over ssh.

As DeepSpeed does, pdsh runs the same shell command on every host (``-w``), at most
:data:`FANOUT` at a time, and ``-S`` makes its exit status the largest of the nodes'. pdsh replaces
``%n`` in the command with the host's position in the ``-w`` list, which becomes torchrun's
``--node_rank``; any other ``%`` in the command is doubled so that pdsh leaves it as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

FANOUT = 1024  # DeepSpeed's PDSH_MAX_FAN_OUT
NODE_RANK = "%n"  # what pdsh replaces with the node's position in the host list


def escape(command: str) -> str:
    """`command` with every ``%`` doubled, so pdsh passes it through unchanged."""
    return command.replace("%", "%%")


def pdsh_command(
    hosts: Sequence[str], node_command: str, launcher_args: Sequence[str] = ()
) -> list[str]:
    """``pdsh -S -f FANOUT -w HOSTS [launcher args] NODE_COMMAND`` (`node_command` escaped)."""
    return ["pdsh", "-S", "-f", str(FANOUT), "-w", ",".join(hosts), *launcher_args, node_command]


def pdsh_environment(environ: Mapping[str, str], ssh_port: int | None) -> dict[str, str]:
    """pdsh's own variables: the ssh remote command, and ``-p PORT`` after the user's ssh options.

    ``-tt`` gives each node's command a terminal, as the ssh launcher does, so that stopping
    pdsh hangs it up and torchrun stops its workers rather than running on unattended.
    """
    append = [environ.get("PDSH_SSH_ARGS_APPEND", "").strip(), "-tt"]
    if ssh_port is not None:
        append.append(f"-p {ssh_port}")
    return {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": " ".join(filter(None, append))}
