"""Exit statuses of finished 2-rank jobs started by plain torchrun, hundreds of times: shardspeed's
job (ZeRO 1 with a checkpoint saved and loaded, ZeRO 3, an all-reduce left in flight at the end:
`tests/exit_job.py train`), the in-flight all-reduce alone under `shardspeed.init_distributed`,
and the same under torch's own `init_process_group` (torch's floor, without shardspeed).

    .venv/bin/python benchmarks/bench_exit.py [--runs 200] [--write]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import render

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "exit_job.py"
MODES = {
    "train": "shardspeed: ZeRO 1 + checkpoint save and load, ZeRO 3, all-reduce left in flight",
    "inflight": "shardspeed.init_distributed: all-reduce left in flight",
    "torch-inflight": "torch's init_process_group, no shardspeed: all-reduce left in flight",
}


def launch(mode: str, port: int, directory: str) -> tuple[int, bool]:
    """One job: torchrun's exit status, and whether a rank printed the abort."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(port), str(JOB), mode]
    command += ["--dir", directory] if mode == "train" else []
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    return proc.returncode, "terminate called" in proc.stdout + proc.stderr


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(modes: list[str], runs: int) -> dict:
    counts: dict[str, collections.Counter] = {m: collections.Counter() for m in modes}
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            for mode in modes:  # interleaved, so that load changes hit every mode alike
                code, aborted = launch(mode, free_port(), f"{tmp}/{mode}{i}")
                counts[mode]["exit 0" if code == 0 else "failed"] += 1
                counts[mode]["abort printed"] += aborted
            if (i + 1) % 10 == 0:
                done = {m: dict(c) for m, c in counts.items()}
                print(f"{i + 1} rounds, {time.monotonic() - start:.0f} s: {done}", flush=True)
    return {"counts": counts, "seconds": time.monotonic() - start}


def table(result: dict, runs: int) -> str:
    rows = []
    for mode, counts in result["counts"].items():
        rows.append(
            [
                f"`{mode}`",
                MODES[mode],
                str(runs),
                str(counts["exit 0"]),
                str(counts["failed"]),
                str(counts["abort printed"]),
            ]
        )
    return render.table(
        "job | what it does | runs | every rank exit 0 | failed | 'terminate called' printed",
        rows,
        "llrrrr",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="launches of each job")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args()
    result = measure(args.modes, args.runs)
    text = table(result, args.runs)
    command = "`.venv/bin/python benchmarks/bench_exit.py " + " ".join(sys.argv[1:]) + "`"
    run = (
        f"Run of {datetime.date.today().isoformat()} ({os.cpu_count()} CPU cores): {command}, "
        f"{result['seconds']:.0f} s."
    )
    print(text, "\n", run, sep="")
    if args.write:
        render.write("exit", {"statuses": text, "run": run})


if __name__ == "__main__":
    main()
