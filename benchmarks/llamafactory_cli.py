"""Every DeepSpeed config LlamaFactory ships, through `llamafactory-cli train` on shardspeed.

Each config (ZeRO 0, 2, 3 and the two offload ones) with full fine-tuning and with LoRA, 2 processes,
the SHARDSPEED_AS_DEEPSPEED switch on, against the same command without DeepSpeed (DDP): the loss at
every step, and the seconds each command took (start-up included: most of it is importing). The CI
test (tests/test_llamafactory.py) runs ZeRO 2 and 3; this covers the rest. Builds the environment
first if missing (scripts/llamafactory_env.sh).

.venv/bin/python benchmarks/llamafactory_cli.py [--configs z0 z2 ...] [--methods full lora]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from llamafactory_jobs import LOSS_RTOL, SHIPPED, losses  # noqa: E402

JOBS = ROOT / "tests" / "llamafactory_jobs.py"


def environment() -> Path:
    built = subprocess.run(
        [str(ROOT / "scripts" / "llamafactory_env.sh")], capture_output=True, text=True
    )
    if built.returncode != 0:
        sys.exit(built.stderr)
    return Path(built.stdout.split()[-1]) / "bin" / "python"


def run(python: Path, *args: str) -> float:
    """Seconds one job took; the job's own output if it fails."""
    started = time.perf_counter()
    done = subprocess.run([str(python), str(JOBS), *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{done.stdout[-4000:]}{done.stderr[-6000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(SHIPPED), default=list(SHIPPED))
    parser.add_argument("--methods", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    args = parser.parse_args()
    python = environment()
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory(prefix="llamafactory-") as folder:
        root = Path(folder)
        run(python, "inputs", folder)
        for method in args.methods:
            seconds = {"ddp": run(python, "train", folder, "ddp", method)}
            reference = losses(root, "ddp", method)
            rows.append(("ddp (no DeepSpeed)", method, seconds["ddp"], reference, 0.0))
            for config in args.configs:
                seconds[config] = run(python, "train", folder, config, method)
                ours = losses(root, config, method)
                gap = max(abs(a - b) / abs(b) for a, b in zip(ours, reference, strict=True))
                worst = max(worst, gap)
                rows.append((SHIPPED[config], method, seconds[config], ours, gap))
    print("| config | method | seconds | losses (4 steps) | max relative gap to DDP |")
    print("|---|---|---:|---|---:|")
    for name, method, seconds, values, gap in rows:
        shown = ", ".join(f"{value:.6f}" for value in values)
        print(f"| {name} | {method} | {seconds:.1f} | {shown} | {gap:.1e} |")
    if worst > LOSS_RTOL:
        sys.exit(f"a loss differs from DDP's by {worst:.1e} relative (tolerance {LOSS_RTOL:.0e})")


if __name__ == "__main__":
    main()
