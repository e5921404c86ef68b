"""``--launcher slurm``: one ``srun`` that starts every rank of the job as a Slurm task.

Each task runs the script through :mod:`shardspeed.launcher.entry`, which reads its place from
SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID (:mod:`shardspeed.comm.discovery`). The variables the
launcher exports travel in srun's own environment with ``--export=ALL``: srun's ``--export=K=V``
list cannot carry a value with a comma.

DeepSpeed's node filters become srun's where srun has them: whole hosts of ``--include`` are
``--nodelist``, of ``--exclude`` ``--exclude``; ``--num_nodes`` is ``--nodes`` and ``--num_gpus``
(processes per node here) ``--ntasks-per-node``. srun places tasks itself, so slot lists are refused.
"""

from __future__ import annotations

from collections.abc import Sequence


def srun_command(
    tasks: int,
    program: Sequence[str],
    launcher_args: Sequence[str] = (),
    *,
    nodelist: Sequence[str] = (),
    exclude: Sequence[str] = (),
    nodes: int | None = None,
    tasks_per_node: int | None = None,
) -> list[str]:
    """``srun -n TASKS [launcher args] [placement] --export=ALL PROGRAM``."""
    command = ["srun", "-n", str(tasks), *launcher_args]
    if nodelist:
        command.append(f"--nodelist={','.join(nodelist)}")
    if exclude:
        command.append(f"--exclude={','.join(exclude)}")
    if nodes is not None:
        command.append(f"--nodes={nodes}")
    if tasks_per_node is not None:
        command.append(f"--ntasks-per-node={tasks_per_node}")
    return [*command, "--export=ALL", *program]
