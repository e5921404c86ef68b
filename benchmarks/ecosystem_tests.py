"""transformers', accelerate's and PEFT's own DeepSpeed tests under DeepSpeed 0.19.8 and the alias.

.venv/bin/python benchmarks/ecosystem_tests.py [--from DIR] [--ds-python PY] [--projects ...] [--write]

The test files are those of the versions in pyproject.toml's `test` extra, kept under
.cache/ecosystem/PROJECT-VERSION/ (the repository's layout) and run there unmodified: fetched from
the project's repository at its version tag, or copied from `--from DIR` (DIR/PROJECT-VERSION/PATH
or DIR/PATH). Each runs twice on the CPU, offline, with the GPU-only skips turned off
(ecosystem_plugin.py): with DeepSpeed 0.19.8 in a venv of the same versions of everything else
(built once under .cache/ecosystem/ unless `--ds-python` names one), and with this venv's python
under SHARDSPEED_AS_DEEPSPEED=1.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import harness as h
import render

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "ecosystem"
DEEPSPEED = "0.19.8"
# Packages the test files import that the test extra does not bring; both runs get them from one
# folder on PYTHONPATH, so neither venv is changed.
TEST_DEPS = ("parameterized==0.9.0", "pytest-timeout==2.4.0")


@dataclass(frozen=True)
class Project:
    repo: str
    # What the runs read: the tests, the modules and configs they import (those only the @slow
    # tests read, which stay skipped, are left out).
    files: tuple[str, ...]
    targets: tuple[str, ...]  # what pytest runs


PROJECTS = {
    "transformers": Project(
        "huggingface/transformers",
        (
            "tests/__init__.py",
            "tests/trainer/__init__.py",
            "tests/trainer/trainer_test_utils.py",
            "tests/trainer/distributed/__init__.py",
            "tests/trainer/distributed/test_trainer_distributed.py",
            "tests/trainer/distributed/test_trainer_distributed_deepspeed.py",
            "tests/trainer/distributed/scripts/ds_config_zero2.json",
            "tests/trainer/distributed/scripts/ds_config_zero3.json",
        ),
        ("tests/trainer/distributed/test_trainer_distributed_deepspeed.py",),
    ),
    "accelerate": Project(
        "huggingface/accelerate",
        (
            "tests/__init__.py",
            "tests/deepspeed/test_deepspeed.py",
            "tests/deepspeed/test_deepspeed_multiple_model.py",
            "tests/deepspeed/ds_config_zero2.json",
            "tests/deepspeed/ds_config_zero3.json",
            "tests/deepspeed/ds_config_zero2_model_only.json",
            "tests/deepspeed/ds_config_zero3_model_only.json",
        ),
        ("tests/deepspeed/test_deepspeed.py", "tests/deepspeed/test_deepspeed_multiple_model.py"),
    ),
    "peft": Project(
        "huggingface/peft",
        (
            "tests/__init__.py",
            "tests/conftest.py",
            "tests/testing_utils.py",
            "tests/test_gpu_examples.py",
        ),
        # The one test of that GPU module that runs DeepSpeed itself.
        ("tests/test_gpu_examples.py::TestUnshardedLoRASaveUnderZeRO3",),
    ),
}

# Where the alias fails on purpose: (a test id's fragment, its failure's fragment, why).
DELIBERATE = (
    (
        "test_save_checkpoints",
        "model_states.pt is not found",
        "checkpoint files: shardspeed writes safetensors + JSON, never pickles, so DeepSpeed's "
        "*_model_states.pt names are absent",
    ),
    (
        "test_stage3_nvme_offload",
        "ConfigError",
        "fp16 with NVMe parameter offload is refused (the swap files hold the fp32 masters); "
        "DeepSpeed skips the test on a CPU without its async I/O op",
    ),
)
# A failure whose message says this needed the Hugging Face Hub, which the offline runs refuse.
HUB = ("offline", "HF_HUB_OFFLINE", "huggingface.co", "LocalEntryNotFound", "couldn't connect")

SCENARIO = h.Scenario(
    name="ecosystem",
    section="## The ecosystem's DeepSpeed tests under the alias",
    modes={},
    timeout=600,
    options={
        "--from": dict(dest="from_dir", type=Path, help="a folder holding the files, fetched"),
        "--ds-python": dict(help="python of a venv with deepspeed 0.19.8 (default: built)"),
        "--projects": dict(nargs="+", default=list(PROJECTS), choices=list(PROJECTS)),
    },
    quick={"projects": ["peft"]},
)


def test_extra_versions() -> dict[str, str]:
    """name -> version, of the `==` pins of the test extra of shardspeed as installed."""
    pins = [r.split(";")[0] for r in importlib.metadata.requires("shardspeed") or [] if "test" in r]
    return dict(p.strip().split("==") for p in pins if "==" in p)


def fetch(name: str, version: str, from_dir: Path | None) -> Path:
    """The project's test folder at `version` in the cache, filled from --from or the network."""
    project, root = PROJECTS[name], CACHE / f"{name}-{version}"
    for path in project.files:
        dest = root / path
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        given = [from_dir / f"{name}-{version}" / path, from_dir / path] if from_dir else []
        found = next((p for p in given if p.exists()), None)
        if found:
            shutil.copyfile(found, dest)
            continue
        url = f"https://raw.githubusercontent.com/{project.repo}/v{version}/{path}"
        try:
            with urllib.request.urlopen(url, timeout=60) as answer:
                dest.write_bytes(answer.read())
        except OSError as why:
            sys.exit(
                f"could not fetch {path} of {name} {version} from {url} ({why}); put the file "
                f"at {dest}, or give --from DIR with DIR/{name}-{version}/{path} in it"
            )
    return root


def pip_install(python: str, args: list[str]) -> None:
    cmd = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed (is the package registry reachable?):\n{done.stderr}")


def deepspeed_python(given: str | None) -> str:
    """A venv with DeepSpeed 0.19.8 and this venv's versions of everything the tests use."""
    if given:
        return given
    same = ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "pytest")
    # A local label (2.13.0+cpu) is left out: the registry's build of that version matches it.
    pins = [f"deepspeed=={DEEPSPEED}"]
    pins += [f"{n}=={importlib.metadata.version(n).split('+')[0]}" for n in same]
    venv = CACHE / f"deepspeed-{DEEPSPEED}"
    marker = venv / ".built"
    if not (marker.exists() and marker.read_text() == " ".join(pins)):
        print(f"building {venv} ({' '.join(pins)})", flush=True)
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip_install(str(venv / "bin" / "python"), pins)
        marker.write_text(" ".join(pins))
    return str(venv / "bin" / "python")


def test_deps() -> Path:
    """One folder with TEST_DEPS, put on both runs' PYTHONPATH."""
    folder = CACHE / "testdeps"
    wanted = {d.replace("-", "_").replace("==", "-") + ".dist-info" for d in TEST_DEPS}
    if not wanted <= {p.name for p in folder.glob("*.dist-info")}:
        pip_install(sys.executable, ["--no-deps", "--target", str(folder), *TEST_DEPS])
    return folder


def run(python: str, root: Path, targets: tuple[str, ...], alias: bool, timeout: float) -> dict:
    """Outcome and message per test id, of one project's files under one install."""
    with tempfile.TemporaryDirectory() as tmp:
        out, ini = Path(tmp) / "outcomes.jsonl", Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n")  # not this repository's pytest settings
        pythonpath = [str(Path(__file__).parent), str(test_deps())]
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "HF_HUB_OFFLINE": "1",
            "ECOSYSTEM_OUT": str(out),
        }
        env |= {"PYTHONPATH": os.pathsep.join(pythonpath), "TOKENIZERS_PARALLELISM": "false"}
        # The launchers the tests start (accelerate, torchrun) are the ones of the venv under test.
        env["PATH"] = os.pathsep.join([str(Path(python).parent), env["PATH"]])
        env.pop("SHARDSPEED_AS_DEEPSPEED", None)
        if alias:
            env["SHARDSPEED_AS_DEEPSPEED"] = "1"
        cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(ini), "--rootdir", "."]
        cmd += ["-p", "ecosystem_plugin", "--timeout", str(int(timeout)), "-q", *targets]
        started = time.time()
        with contextlib.suppress(subprocess.TimeoutExpired):  # unreported tests count as missing
            subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3 * 3600)
        outcomes: dict[str, dict] = {}
        for line in out.read_text().splitlines() if out.exists() else []:
            record = json.loads(line)
            if outcomes.get(record["id"], {}).get("outcome") in (None, "passed"):
                outcomes[record["id"]] = record  # a failing teardown overrides a pass
        return {"seconds": round(time.time() - started), "tests": outcomes}


def measure(scenario, args) -> dict:
    versions, started = test_extra_versions(), time.time()
    ds_python = deepspeed_python(args.ds_python)
    projects = {}
    for name in args.projects:
        root = fetch(name, versions[name], args.from_dir)
        source = root / "SOURCE"
        targets = PROJECTS[name].targets
        print(f"{name} {versions[name]}: under DeepSpeed {DEEPSPEED} ...", flush=True)
        reference = run(ds_python, root, targets, alias=False, timeout=args.timeout)
        print(f"{name} {versions[name]}: under the alias ...", flush=True)
        ours = run(sys.executable, root, targets, alias=True, timeout=args.timeout)
        projects[name] = {"version": versions[name], "deepspeed": reference, "alias": ours}
        projects[name]["source"] = source.read_text().strip() if source.exists() else "tag"
    meta = h.run_meta(time.time() - started, 0, {}) | {"quick": args.quick}
    meta["versions"] |= {"deepspeed": DEEPSPEED} | {n: versions[n] for n in PROJECTS}
    return {"scenario": scenario.name, "meta": meta, "runs": {}, "failed": {}, "projects": projects}


def note(test_id: str, ds: dict, ours: dict) -> str:
    """Why the two outcomes are what they are, where a reader needs it."""
    bad = ("failed", "error")
    why = next((w for t, m, w in DELIBERATE if t in test_id and m in ours["message"]), None)
    if why:
        return f"deliberate: {why}"
    messages = [r["message"] for r in (ds, ours) if r["outcome"] in bad]
    if messages and all(any(k in m for k in HUB) for m in messages):
        return "needs a model from the Hugging Face Hub (offline)"
    if ds["outcome"] == ours["outcome"] == "passed":
        return ""
    if ds["outcome"] in bad and ours["outcome"] in bad and ds["message"] != ours["message"]:
        return f"DeepSpeed: {_cell(ds['message'])}; alias: {_cell(ours['message'])}"
    return _cell(ours["message"] if ours["outcome"] != "passed" else ds["message"])


def _cell(message: str) -> str:
    return message.replace("|", "\\|").replace("`", "'")[:160]


def tables(results: dict) -> dict:
    counts, rows = [], []
    missing = {"outcome": "missing", "message": "not reported (the run stopped)"}
    for name, p in results["projects"].items():
        ds, ours = p["deepspeed"]["tests"], p["alias"]["tests"]
        ids = sorted(set(ds) | set(ours))
        passing = [i for i in ids if ds.get(i, missing)["outcome"] == "passed"]
        kept = [i for i in passing if ours.get(i, missing)["outcome"] == "passed"]
        only_ours = [
            i for i in ids if ours.get(i, missing)["outcome"] == "passed" and i not in passing
        ]
        outcome = {
            k: dict(sorted(Counter(r["outcome"] for r in x.values()).items()))
            for k, x in (("ds", ds), ("ours", ours))
        }
        kept_share = f"**{len(kept)} of {len(passing)}**"
        head = [f"{name} {p['version']}", len(ids), outcome["ds"], outcome["ours"]]
        counts.append([*head, kept_share, len(only_ours)])
        for i in ids:
            a, b = ds.get(i, missing), ours.get(i, missing)
            rows.append(
                [f"`{name}: {i.removeprefix('tests/')}`", a["outcome"], b["outcome"], note(i, a, b)]
            )
    count_head = ["project", "tests", "under DeepSpeed 0.19.8", "under the alias"]
    count_head += ["pass under DeepSpeed that pass under the alias", "pass only under the alias"]
    sources = "; ".join(
        f"{n} {p['version']}: {p['source']}" for n, p in results["projects"].items()
    )
    return {
        "run": render.run_line(results) + f" Test files: {sources}.",
        "counts": render.table(count_head, counts, "lrllrr"),
        "tests": render.table(["test", "DeepSpeed", "shardspeed alias", "note"], rows),
    }


if __name__ == "__main__":
    h.main(SCENARIO, None, tables, "ecosystem_tests.py", orchestrate=measure)
