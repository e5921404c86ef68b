"""DeepSpeed's own unit tests (a sample of `tests/unit`) under DeepSpeed and under the alias.

.venv/bin/python benchmarks/deepspeed_unit_tests.py --tests DIR --ds-python PY [--write]
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import harness as h
import render

SCENARIO = h.Scenario(
    name="unit_tests",
    section="## DeepSpeed's unit tests under the alias",
    modes={},
    options={
        "--tests": dict(type=Path, help="DeepSpeed's tests/ directory"),
        "--ds-python": dict(help="python of a venv with deepspeed 0.19.8"),
        "--every": dict(type=int, default=10, help="sample one id in N (default 10)"),
    },
    quick={"every": 200},
)

# What the measurement covers: config, initialize, LR schedules, launcher, utils, comm, monitor,
# pipe, checkpoint, half precision, MoE, ZeRO and zero.Init.
SCOPE = ("unit/runtime/test_ds_config_dict.py", "unit/runtime/test_ds_config_model.py")
SCOPE += ("unit/runtime/test_ds_initialize.py", "unit/runtime/test_lr_schedulers.py")
SCOPE += ("unit/launcher", "unit/utils", "unit/comm", "unit/monitor", "unit/pipe")
SCOPE += ("unit/runtime/pipe", "unit/checkpoint", "unit/runtime/half_precision")
SCOPE += ("unit/v1/half_precision", "unit/v1/moe", "unit/runtime/zero", "unit/v1/zero")

# DeepSpeed's own machinery that shardspeed has no counterpart of, and whose tests call it directly:
# AutoEP's internals (its layers, dispatch, folding and config classes), the AutoTP universal-
# checkpoint converter's private functions and the checkpoint-reshaping classes. The figure is also
# given without these.
INTERNALS = ("unit/v1/moe/test_autoep", "unit/v1/moe/test_fused_expert_layout.py")
INTERNALS += (
    "unit/checkpoint/test_autotp_uc_checkpoint.py",
    "unit/checkpoint/test_reshape_checkpoint.py",
)

# A pytest plugin that keeps exactly the ids in $ONLY_IDS (naming ids on the command line would
# stop the whole run at the first file that cannot be imported) and writes each one's outcome.
_PLUGIN = """
import os

def _id(item_or_report):
    return item_or_report.nodeid.removeprefix("tests/")

def pytest_collection_modifyitems(config, items):
    if "DUMP_IDS" in os.environ:
        with open(os.environ["DUMP_IDS"], "w") as out:
            out.writelines(f"tests/{_id(i)}\\n" for i in items)
        config.hook.pytest_deselected(items=list(items))
        items[:] = []
        return
    wanted = {i.removeprefix("tests/") for i in open(os.environ["ONLY_IDS"]).read().split()}
    config.hook.pytest_deselected(items=[i for i in items if _id(i) not in wanted])
    items[:] = [i for i in items if _id(i) in wanted]

def pytest_runtest_logreport(report):
    failed_setup = report.when == "setup" and report.failed
    if report.when == "call" or report.skipped or report.failed:
        outcome = "error" if failed_setup else report.outcome
        with open(os.environ["ONLY_IDS"] + ".out", "a") as out:
            out.write(f"tests/{_id(report)} {outcome}\\n")
"""


def _pytest(
    python: str, tests: Path, extra_env: dict[str, str], args: list[str], timeout: float = 3600
) -> str:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", **extra_env}
    # The caller's PYTHONPATH stays behind the plugin's folder (pytest-timeout may live there).
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [extra_env["PYTHONPATH"], os.environ.get("PYTHONPATH")])
    )
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", *args]
    try:
        done = subprocess.run(
            cmd, cwd=tests.parent, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as expired:
        return expired.stdout.decode() if isinstance(expired.stdout, bytes) else ""
    return done.stdout


def collect(python: str, tests: Path, work: Path) -> list[str]:
    """Every test id in the scope, as DeepSpeed's own install collects them."""
    (work / "only_ids.py").write_text(_PLUGIN)
    dump = work / "collected.ids"
    env = {"DUMP_IDS": str(dump), "PYTHONPATH": str(work)}
    scope = [f"tests/{s}" for s in SCOPE]
    _pytest(python, tests, env, ["-p", "only_ids", "-q", "--continue-on-collection-errors", *scope])
    return sorted(set(dump.read_text().split())) if dump.exists() else []


def sample(ids: list[str], every: int) -> list[str]:
    return [i for i in ids if int(hashlib.md5(i.encode()).hexdigest(), 16) % every == 0]


def run(python: str, tests: Path, ids: list[str], alias: bool, work: Path) -> dict[str, str]:
    """Outcome per id: passed, failed, skipped, or error (not importable, or failed in setup)."""
    name = "alias" if alias else "deepspeed"
    listing = work / f"{name}.ids"
    listing.write_text("\n".join(ids) + "\n")
    env = {"ONLY_IDS": str(listing), "PYTHONPATH": str(work)}
    if alias:
        env["SHARDSPEED_AS_DEEPSPEED"] = "1"
    # One pytest per file, each bounded: DeepSpeed's harness can hang in its process pool when a
    # test fails in a way the pool cannot report; that file's remaining tests then count as errors.
    for path in sorted({i.split("::")[0] for i in ids}):
        _pytest(python, tests, env, ["-p", "only_ids", "--timeout", "180", "-q", path], 900)
    outcome = dict.fromkeys(ids, "error")
    results = Path(f"{listing}.out")
    # Later reports of one test overwrite earlier ones, so a failing teardown counts as failed.
    for line in results.read_text().splitlines() if results.exists() else []:
        test_id, result = line.rsplit(" ", 1)
        if test_id in outcome and outcome[test_id] in ("error", "passed"):
            outcome[test_id] = result
    return outcome


def measure(scenario, args) -> dict:
    if not (args.tests and args.ds_python):
        sys.exit("give --tests (DeepSpeed's tests/ directory) and --ds-python (a venv's python)")
    tests, started = args.tests.resolve(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        ids = collect(args.ds_python, tests, Path(tmp))
        chosen = sample(ids, args.every)
        reference = run(args.ds_python, tests, chosen, alias=False, work=Path(tmp))
        ours = run(sys.executable, tests, chosen, alias=True, work=Path(tmp))
    meta = h.run_meta(time.time() - started, 0, {}) | {"quick": args.quick, "tests": str(tests)}
    out = {"scenario": scenario.name, "meta": meta, "runs": {}, "failed": {}, "collected": len(ids)}
    return out | {"every": args.every, "deepspeed": reference, "alias": ours}


def _share(kept: list, of: list) -> str:
    return f"**{len(kept)} of {len(of)} ({100 * len(kept) / max(len(of), 1):.0f}%)**"


def tables(results: dict) -> dict:
    reference, ours = results["deepspeed"], results["alias"]
    passing = [i for i in reference if reference[i] == "passed"]
    kept = [i for i in passing if ours[i] == "passed"]
    own = [i for i in passing if not i.removeprefix("tests/").startswith(INTERNALS)]
    own_kept = [i for i in own if ours[i] == "passed"]
    counts = [
        ["collected under DeepSpeed", results["collected"]],
        [f"sample (1 in {results['every']})", len(reference)],
        ["under DeepSpeed 0.19.8", dict(sorted(Counter(reference.values()).items()))],
        ["under the alias", dict(sorted(Counter(ours.values()).items()))],
        ["pass under DeepSpeed that pass under the alias", _share(kept, passing)],
        [
            "the same, without the tests of AutoEP's internals, the universal-checkpoint "
            "converter's private functions and the checkpoint-reshaping classes",
            _share(own_kept, own),
        ],
    ]
    by_file, kept_by_file = (Counter(i.split("::")[0] for i in x) for x in (passing, kept))
    files = [
        [f"`{f.removeprefix('tests/unit/')}`", n, kept_by_file[f]]
        for f, n in sorted(by_file.items())
    ]
    lost = [[f"`{i.removeprefix('tests/unit/')}`", ours[i]] for i in passing if i not in kept]
    file_head = ["file", "pass under DeepSpeed", "of those, pass under the alias"]
    lost_head = ["passing under DeepSpeed, not under the alias", "under the alias"]
    out = {"counts": render.table(["measure", "tests"], counts, "lr")}
    out |= {"files": render.table(file_head, files, "lrr"), "lost": render.table(lost_head, lost)}
    return out | {"run": render.run_line(results)}


if __name__ == "__main__":
    h.main(SCENARIO, None, tables, "deepspeed_unit_tests.py", orchestrate=measure)
