"""The ``shardspeed`` command: a launch (:mod:`shardspeed.launcher`), with ``--autotuning tune|run``
a tuning run (:mod:`shardspeed.autotuning`), which starts its trials through the launcher, or
``shardspeed plan`` (:mod:`shardspeed.planning`), a dry run of a cluster on this machine.

It sits above both rooms so that neither imports the other's caller: the tuner uses the launcher's
planning, and the launcher knows nothing of the tuner. ``python -m shardspeed.cli`` is the same.
"""

from __future__ import annotations

import sys

from shardspeed.launcher import runner


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardspeed`` command; returns the exit status of the run."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        # Deferred: a plan imports torch and transformers, which plain launches avoid.
        from shardspeed.planning.cli import main as plan

        return plan(argv[1:])
    args = runner.parse_args(argv)
    if args.autotuning:
        # Deferred: the tuner imports torch, which plain launches avoid.
        from shardspeed.autotuning.tuner import run_autotuning

        return run_autotuning(args)
    return runner.launch(args)


if __name__ == "__main__":
    sys.exit(main())
