"""Autotuning benchmark: the autotuner's chosen configuration against the demo's default, and the
planner's estimate error.

One invocation, on the demo (``examples/train_gpt.py`` with ``examples/ds_config.json``, 2
processes, gloo on CPU):

  1. ``shardspeed --num_procs 2 --autotuning tune examples/train_gpt.py --deepspeed_config
     TUNE.json`` where TUNE.json is the demo's config with ``train_batch_size`` fixed at the demo's
     32, every ZeRO stage allowed and an ``autotuning`` section. The engine measures every trial
     (AutotuningMeter); the tuner's summary.json gives each trial's measured and estimated
     throughput and memory.
  2. The demo's config and the chosen ``ds_config_optimal.json`` measured in alternating rounds by
     the same method: the engine's meter over a longer window (steps 6-25 by default), samples/s,
     median over the rounds.

    .venv/bin/python benchmarks/bench_autotune.py            # tune, measure, print the tables
    .venv/bin/python benchmarks/bench_autotune.py --write    # ... and update BENCHMARKS.md
    .venv/bin/python benchmarks/bench_autotune.py --smoke    # stages 0 and 3 only, 1 round
    .venv/bin/python benchmarks/bench_autotune.py --from-results TMP/results.json --write

``--write`` refuses a run that other work disturbed (``--write-disturbed`` overrides);
``--from-results`` reports a previous run's saved results again without measuring.

See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common
from common import BENCH_MD, machine_busy_s

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
SECTION_TITLE = "## Autotuning: the tuner's choice vs the demo's default, and the planner's error"
DEMO_SCRIPT = REPO / "examples" / "train_gpt.py"
DEMO_CONFIG = REPO / "examples" / "ds_config.json"
LAUNCHER = Path(sys.executable).parent / "shardspeed"
WORLD = 2
DEMO_TRAIN_BATCH = 32  # the demo's train_micro_batch_size_per_gpu 16 x 2 processes x 1 step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def own_cpu_s() -> float:
    """CPU seconds of this process and of every live descendant (the launcher, torchrun, the
    ranks), each with its reaped children's, from /proc: what the benchmark itself used."""
    parents, cpu = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold ")"
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        cpu[pid] = sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    tree, frontier = {os.getpid()}, [os.getpid()]
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(cpu.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


class LoadSampler:
    """Machine-wide busy CPU time (/proc/stat) and the benchmark's own (`own_cpu_s`) every 0.5 s,
    in a thread, so that the CPU other processes used in any time window can be looked up."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.samples.append((time.time(), machine_busy_s(), own_cpu_s()))

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(0.5):
            self._sample()

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def others(self, start: float, end: float) -> float | None:
        """Cores used by other processes from the last sample before `start` to the first after
        `end` (None when the samples do not span at least half a second)."""
        before = [sample for sample in self.samples if sample[0] <= start]
        after = [sample for sample in self.samples if sample[0] >= end]
        if not before or not after or after[0][0] - before[-1][0] < 0.5:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = before[-1], after[0]
        return max(0.0, (busy1 - busy0 - (own1 - own0)) / (t1 - t0))


def window_load(sampler: LoadSampler, metrics_path: Path, seconds: float) -> float | None:
    """Cores other processes used during a measured window: the `seconds` before `metrics_path`
    was written (the engine writes it right after the window's last step)."""
    end = metrics_path.stat().st_mtime
    return sampler.others(end - seconds, end)


def run_measured(argv: list[str], cwd: Path, log: Path, sampler: LoadSampler | None = None) -> dict:
    """Run `argv`; its wall time, exit status, and the cores other processes used meanwhile."""
    busy0, own0, t0 = machine_busy_s(), children_cpu_s(), time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out, sampler or contextlib.nullcontext():
        code = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - t0
    own = children_cpu_s() - own0
    foreign = max(0.0, (machine_busy_s() - busy0 - own) / wall)
    return {"returncode": code.returncode, "wall_s": wall, "foreign_cores": foreign}


def tune_config(args) -> dict:
    """The demo's config as a user would set it up for tuning (see the module docstring)."""
    config = json.loads(DEMO_CONFIG.read_text())
    config["train_batch_size"] = DEMO_TRAIN_BATCH
    config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": "all"}
    if args.smoke:
        config["zero_optimization"]["stage"] = [0, 3]
    config["autotuning"] = {
        "start_profile_step": args.trial_start,
        "end_profile_step": args.trial_end,
        "tuner_early_stopping": args.early_stopping,
        "num_tuning_micro_batch_sizes": args.micro_batch_sizes,
    }
    return config


def launch_argv(port: int, config: Path, out: Path, tune: bool) -> list[str]:
    argv = [str(LAUNCHER), "--num_procs", str(WORLD), "--master_port", str(port)]
    argv += ["--autotuning", "tune"] if tune else []
    return [*argv, str(DEMO_SCRIPT), "--deepspeed_config", str(config), "--out", str(out)]


# --------------------------------------------------------------------------------------------
# The tuner run and its trials
# --------------------------------------------------------------------------------------------


def run_tuner(args, tmp: Path) -> dict:
    """The tuner, after waiting for an idle machine; rerun (`args.tune_retries` times, within
    `args.budget`) when other processes used more than `args.max_other_load` cores during it, or
    more than `args.max_window_load` cores during a calibration trial's timed window
    (a disturbed calibration spoils every estimate), since its trials cannot wait for quiet one by
    one. The least disturbed run is kept."""
    runs, started = [], time.perf_counter()
    for attempt in range(args.tune_retries + 1):
        directory = tmp / f"tune{attempt}"
        directory.mkdir()
        config = directory / "ds_config_tune.json"
        config.write_text(json.dumps(tune_config(args), indent=2) + "\n")
        if args.wait_idle > 0:
            common.wait_idle(6 * args.wait_idle)
        argv = launch_argv(free_port(), config, tmp / "run", tune=True)
        print(f"tuning: {shlex.join(argv)}", flush=True)
        sampler = LoadSampler()
        run = run_measured(argv, directory, directory / "tune.log", sampler)
        if run["returncode"] != 0:
            log = tail(directory / "tune.log")
            raise SystemExit(f"the tuner failed (exit {run['returncode']}):\n{log}")
        summary = json.loads((directory / "autotuning_results" / "summary.json").read_text())
        loads = {}
        for row in summary["trials"]:
            path = directory / "autotuning_exps" / row["name"] / "metrics.json"
            if row["measured_throughput"] and path.exists():
                window = row["train_batch"] / row["measured_throughput"]
                window *= args.trial_end - args.trial_start + 1
                loads[row["name"]] = window_load(sampler, path, window)
        calibration = [
            loads.get(row["name"]) or 0.0 for row in summary["trials"] if row["calibration"]
        ]
        run["calibration_load"] = max(calibration, default=0.0)
        runs.append({"run": run, "summary": summary, "dir": directory, "loads": loads})
        print(
            f"tuner run {attempt}: {run['wall_s']:.0f}s, other load {run['foreign_cores']:.2f} "
            f"cores, in the calibration trials' timed windows up to "
            f"{run['calibration_load']:.2f}, best {summary['best']}",
            flush=True,
        )
        quiet = (
            run["foreign_cores"] <= args.max_other_load
            and run["calibration_load"] <= args.max_window_load
        )
        if quiet or time.perf_counter() - started > args.budget:
            break
    best = min(
        runs, key=lambda tuned: (tuned["run"]["calibration_load"], tuned["run"]["foreign_cores"])
    )
    best["discarded"] = [tuned["run"] for tuned in runs if tuned is not best]
    return best


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text()[-chars:] if path.exists() else ""


def _candidate(row: dict):
    from shardspeed.autotuning.planner import Candidate

    return Candidate(row["stage"], row["micro_batch"], row["grad_accum"], row["train_batch"])


def _planner(summary: dict, optimizer: bool = True):
    """The tuner's planner before any fit: its parameter count, bandwidth and optimizer time."""
    from shardspeed.autotuning.planner import Planner

    fitted = summary["calibration"]
    return Planner(
        num_params=fitted["num_params"],
        dp_size=fitted["dp_size"],
        mp_size=fitted["mp_size"],
        precision=fitted["precision"],
        bandwidth=fitted["bus_bandwidth_bytes_per_s"],
        optimizer_s_per_param=fitted["optimizer_s_per_param"] if optimizer else 0.0,
        tokens_per_sample=fitted["tokens_per_sample"],
    )


def _measurements(summary: dict, tmp: Path) -> list[tuple[dict, object]]:
    """(row, Measurement of its step time) for every successful trial, in the order run."""
    from shardspeed.autotuning.planner import Measurement

    out = []
    for row in summary["trials"]:
        if row["status"] in ("ok", "reused"):
            path = tmp / "autotuning_exps" / row["name"] / "metrics.json"
            step_time = json.loads(path.read_text())["step_time_s"]
            out.append((row, Measurement(_candidate(row), step_time)))
    return out


def replayed_estimates(summary: dict, tmp: Path) -> dict[str, dict[str, float]]:
    """Other planners' throughput estimates for the same trials, from the same measurements:
    ``calibration``, this planner fitted to the two calibration trials only (what it would say
    without refitting), and ``one_point``, the planner as it was before (its model fitted to the
    first calibration trial alone: everything per sample, no optimizer term)."""
    measured = _measurements(summary, tmp)
    calibration = _planner(summary).calibrate([m for row, m in measured if row["calibration"]])
    one_point = _planner(summary, optimizer=False).calibrate([measured[0][1]])
    return {
        "calibration": {
            row["name"]: calibration.estimate(_candidate(row)).throughput for row, _ in measured
        },
        "one_point": {
            row["name"]: one_point.estimate(_candidate(row)).throughput for row, _ in measured
        },
    }


# --------------------------------------------------------------------------------------------
# Default against chosen, alternating rounds
# --------------------------------------------------------------------------------------------


def measure_config(args, tmp: Path, base: dict, label: str, tag: str) -> dict:
    """One run of the demo with `base`, timed by the engine's meter over the long window."""
    directory = tmp / "rounds" / f"{tag}_{label}"
    directory.mkdir(parents=True)
    config = dict(base)
    config["autotuning"] = {
        "enabled": True,
        "metric_path": str(directory / "metrics.json"),
        "start_profile_step": args.warmup + 1,
        "end_profile_step": args.warmup + args.steps,
    }
    path = directory / "ds_config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    if args.wait_idle > 0:
        common.wait_idle(args.wait_idle)
    argv = launch_argv(free_port(), path, tmp / "run", tune=False)
    sampler = LoadSampler()
    run = run_measured(argv, directory, directory / "log.txt", sampler)
    metrics_path = directory / "metrics.json"
    if not metrics_path.exists():
        return {**run, "error": f"exit {run['returncode']}", "log": tail(directory / "log.txt")}
    metrics = json.loads(metrics_path.read_text())
    load = window_load(sampler, metrics_path, metrics["step_time_s"] * args.steps)
    return {**run, **metrics, "window_load": load or 0.0}


def alternate(args, tmp: Path, configs: dict[str, dict]) -> tuple[dict[str, list[dict]], list]:
    """`args.rounds` rounds, the order swapped every round; a run that other processes disturbed
    more than `args.max_other_load` cores is rerun (`args.retries` times, within `args.budget`)."""
    results: dict[str, list[dict]] = {label: [] for label in configs}
    discarded = []
    started = time.perf_counter()
    labels = list(configs)
    for round_ in range(args.rounds):
        order = labels if round_ % 2 == 0 else labels[::-1]
        for label in order:
            for attempt in range(args.retries + 1):
                result = measure_config(args, tmp, configs[label], label, f"r{round_}a{attempt}")
                quiet = (
                    result.get("foreign_cores", 0) <= args.max_other_load
                    and result.get("window_load", 0) <= args.max_window_load
                )
                if "error" in result or quiet:
                    break
                if attempt == args.retries or time.perf_counter() - started > args.budget:
                    result["noisy"] = True
                    break
                discarded.append(result)
                print(
                    f"[round {round_}] {label}: {result['throughput']:.1f} samples/s discarded "
                    f"(other load {result['foreign_cores']:.2f} cores, "
                    f"{result['window_load']:.2f} in the timed window), retrying",
                    flush=True,
                )
            if "error" in result:
                raise SystemExit(f"{label} failed ({result['error']}):\n{result['log']}")
            results[label].append(result)
            print(
                f"[round {round_}] {label:8s}: {result['throughput']:7.1f} samples/s "
                f"({1000 * result['step_time_s']:.0f} ms/step, run {result['wall_s']:.0f}s, "
                f"other load {result['foreign_cores']:.2f} cores, "
                f"{result['window_load']:.2f} in the timed window"
                f"{', NOISY' if result.get('noisy') else ''})",
                flush=True,
            )
    return results, discarded


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def mean_abs(values: list[float | None]) -> float | None:
    known = [abs(v) for v in values if v is not None]
    return sum(known) / len(known) if known else None


def trial_table(
    summary: dict, replayed: dict[str, dict[str, float]], loads: dict[str, float | None]
) -> tuple[str, dict]:
    header = (
        "| # | trial | role | measured samples/s | estimated (refitted to the trials before) | "
        "error | calibration fit only | error | one-point model | error | peak memory MiB | "
        "estimated MiB | error | other load (cores) |"
    )
    lines = [header, "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    scored: dict[str, list[float]] = {
        "throughput": [],
        "calibration": [],
        "one_point": [],
        "memory": [],
    }
    for row in summary["trials"]:
        measured = row["measured_throughput"]
        role = "calibration" if row["calibration"] else "planned"
        best = " (best)" if row["name"] == summary["best"] else ""
        if measured is None:
            cells = " - |" * 11
            lines.append(f"| {row['trial']} | {row['name']} | {role} | {row['status']} |{cells}")
            continue
        cells = [f"{row['estimated_throughput']:.1f}", percent(row["throughput_error"])]
        errors = {"throughput": row["throughput_error"], "memory": row["memory_error"]}
        for key in ("calibration", "one_point"):
            estimate = replayed[key].get(row["name"])
            errors[key] = None if estimate is None else (estimate - measured) / measured
            cells += ["-" if estimate is None else f"{estimate:.1f}", percent(errors[key])]
        if not row["calibration"]:
            for key, error in errors.items():
                if error is not None:
                    scored[key].append(error)
        lines.append(
            f"| {row['trial']} | {row['name']}{best} | {role} | {measured:.1f} | "
            + " | ".join(cells)
            + f" | {mib(row['measured_peak_memory_bytes'])} | "
            f"{mib(row['estimated_memory_bytes'])} | {percent(row['memory_error'])} | "
            f"{'-' if loads.get(row['name']) is None else format(loads[row['name']], '.2f')} |"
        )
    summary_errors = {key: mean_abs(values) for key, values in scored.items()}
    summary_errors["throughput_max"] = max((abs(e) for e in scored["throughput"]), default=None)
    summary_errors["scored"] = len(scored["throughput"])
    return "\n".join(lines), summary_errors


def model_lines(summary: dict) -> list[str]:
    fitted = summary["calibration"]
    per_micro = ", ".join(
        f"stage {stage} {1000 * seconds:.2f} ms"
        for stage, seconds in fitted["micro_step_s"].items()
    )
    per_sample_s = (
        6 * fitted["num_params"] * fitted["tokens_per_sample"] / fitted["flops_per_s_per_rank"]
    )
    bandwidth = fitted["bus_bandwidth_bytes_per_s"]
    return [
        f"per sample (forward and backward) {1000 * per_sample_s:.2f} ms",
        f"per micro-step {per_micro} (other stages take the nearest's)",
        f"optimizer {1e9 * fitted['optimizer_s_per_param']:.2f} ns a parameter updated "
        f"({1000 * fitted['optimizer_s_per_param'] * fitted['num_params']:.2f} ms at stage 0)",
        f"bus bandwidth {bandwidth / 1e9:.3f} GB/s"
        if bandwidth
        else "bus bandwidth - (one data-parallel rank)",
        f"activations {mib(fitted['activation_bytes_per_sample'])} MiB a sample, "
        f"{mib(fitted['runtime_bytes'])} MiB besides model states and activations",
    ]


def breakdown_notes(summary: dict, tmp: Path, threshold: float) -> list[str]:
    """The trials the planner missed by more than `threshold`, with the terms of the estimate the
    tuner made (the planner fitted to the trials before each)."""
    measured = _measurements(summary, tmp)
    notes = []
    for index, (row, _) in enumerate(measured):
        error = row["throughput_error"]
        if row["calibration"] or error is None or abs(error) <= threshold:
            continue
        planner = _planner(summary).calibrate([m for _, m in measured[:index]])
        estimate = planner.estimate(_candidate(row))
        measured_s = row["train_batch"] / row["measured_throughput"]
        per_micro = (measured_s - estimate.step_time_s) / row["grad_accum"]
        fitted = sorted(planner.micro_step_s)
        notes.append(
            f"{row['name']}: measured {1000 * measured_s:.0f} ms a step, estimated "
            f"{1000 * estimate.step_time_s:.0f} ms = forward and backward "
            f"{1000 * estimate.compute_s:.0f} + optimizer {1000 * estimate.optimizer_s:.1f} + "
            f"communication {1000 * estimate.comm_s:.1f} ({percent(error)} in throughput): "
            f"{1000 * abs(per_micro):.2f} ms a micro-step {'more' if per_micro > 0 else 'less'} "
            f"than modelled over its {row['grad_accum']} micro-steps, against a fitted "
            f"{1000 * planner.micro_step_time(row['stage']):.2f} ms a micro-step at stage "
            f"{row['stage']} (stages fitted so far: {', '.join(map(str, fitted))})"
        )
        earlier = sorted(
            {r["micro_batch"] for r, _ in measured[:index] if r["stage"] == row["stage"]}
        )
        if row["grad_accum"] >= 4 and earlier:
            notes[-1] += (
                f". In words: this configuration runs {row['grad_accum']} micro-steps a step, so "
                "an error in the per-micro-step time counts that many times, and that time had "
                f"been fitted from stage {row['stage']}'s micro-batches "
                f"{', '.join(map(str, earlier))}, where it is a small part of each micro-step"
            )
        elif row["grad_accum"] >= 4:
            notes[-1] += (
                f". In words: no trial at stage {row['stage']} had been measured yet, so its "
                "per-micro-step time was borrowed from the nearest measured stage, and this "
                f"configuration pays it {row['grad_accum']} times a step"
            )
    return notes


def plain_notes(summary: dict, loads: dict[str, float | None], max_load: float) -> list[str]:
    """Why trials were missed, in words: trials other work disturbed, and stages where the time per
    sample was not the same at every micro-batch size (the model's c is one number)."""
    notes = []
    rows = [r for r in summary["trials"] if r["measured_throughput"] and not r["calibration"]]
    disturbed = [r for r in rows if (loads.get(r["name"]) or 0.0) > max_load]
    if disturbed:
        notes.append(
            "- Disturbed trials (other processes used more than "
            f"{max_load} cores during the timed window): "
            + "; ".join(
                f"{r['name']} ({loads[r['name']]:.2f} cores, estimate off by "
                f"{percent(r['throughput_error'])})"
                for r in disturbed
            )
            + ". Such a trial measures the machine's other work as much as its configuration, "
            "which makes it slower than the configuration is: its error says little about the "
            "model, and a refit that takes it in learns the disturbance."
        )
    for stage in sorted({r["stage"] for r in summary["trials"]}):
        at_stage = [
            r for r in summary["trials"] if r["stage"] == stage and r["measured_throughput"]
        ]
        if len(at_stage) < 2:
            continue
        fastest = max(at_stage, key=lambda r: r["measured_throughput"])
        largest = max(at_stage, key=lambda r: r["micro_batch"])
        if (
            fastest is largest
            or fastest["measured_throughput"] < 1.03 * largest["measured_throughput"]
        ):
            continue
        notes.append(
            f"- Stage {stage}: micro-batch {fastest['micro_batch']} measured "
            f"{fastest['measured_throughput']:.1f} samples/s against "
            f"{largest['measured_throughput']:.1f} at micro-batch {largest['micro_batch']}, "
            "although it does more micro-steps a step. On this CPU the time per sample is not the "
            "same at every micro-batch size (likely the caches: a smaller micro-batch's "
            "activations fit in them; run-to-run noise of a few percent adds to it), while the "
            "model charges one time per sample c at every size plus a time per micro-step. That "
            "shows in the errors of the mid-size micro-batches, and a refit that learns from them "
            "expects too little of the per-micro-step time, which then shows at micro-batch 1."
        )
    return notes


def measure_all(args) -> dict:
    """Tune, then the default/chosen rounds; everything the report needs, also saved as
    ``results.json`` in the run's temporary directory (see ``--from-results``)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_autotune_"))
    started = time.perf_counter()
    tuned = run_tuner(args, tmp)
    print(tail(tuned["dir"] / "tune.log", 6000))
    chosen_path = tuned["dir"] / "autotuning_results" / "ds_config_optimal.json"
    configs = {
        "default": json.loads(DEMO_CONFIG.read_text()),
        "chosen": json.loads(chosen_path.read_text()),
    }
    results, discarded = alternate(args, tmp, configs)
    saved = {
        "command": " ".join(["python", "benchmarks/bench_autotune.py", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "args": {
            k: v
            for k, v in vars(args).items()
            if k not in ("write", "write_disturbed", "from_results", "note")
        },
        "tmp": str(tmp),
        "dir": str(tuned["dir"]),
        "summary": tuned["summary"],
        "run": tuned["run"],
        "loads": tuned["loads"],
        "discarded": tuned["discarded"],
        "results": results,
        "rounds_discarded": discarded,
        "total": time.perf_counter() - started,
    }
    (tmp / "results.json").write_text(json.dumps(saved, indent=2) + "\n")
    return saved


def disturbed(saved: dict, args) -> str | None:
    """Why the kept tuner run is not a fair measurement, or None."""
    run = saved["run"]
    if run["foreign_cores"] > args.max_other_load:
        return f"other processes used {run['foreign_cores']:.2f} cores during the tuner run"
    if run["calibration_load"] > args.max_window_load:
        return (
            f"other processes used {run['calibration_load']:.2f} cores during a calibration "
            "trial's timed window"
        )
    return None


def orchestrate(args) -> int:
    if args.from_results:
        saved = json.loads(Path(args.from_results).read_text())
        for key, value in saved["args"].items():
            setattr(args, key, value)
        if args.smoke and args.write:
            raise SystemExit("that was a --smoke run: its figures are not benchmarks, no --write")
    else:
        saved = measure_all(args)
    summary, run, results = saved["summary"], saved["run"], saved["results"]
    tuned = {
        "summary": summary,
        "run": run,
        "dir": Path(saved["dir"]),
        "loads": saved["loads"],
        "discarded": saved["discarded"],
    }
    replayed = replayed_estimates(summary, tuned["dir"])
    table, errors = trial_table(summary, replayed, tuned["loads"])
    medians = {k: statistics.median(r["throughput"] for r in v) for k, v in results.items()}
    ratio = medians["chosen"] / medians["default"]
    per_round = [c["throughput"] / d["throughput"] for d, c in zip(*results.values())]
    default_trial = next(
        (
            row
            for row in summary["trials"]
            if (row["stage"], row["micro_batch"], row["grad_accum"]) == (2, 16, 1)
        ),
        None,
    )
    print()
    print(table)
    print()
    print(
        f"mean |throughput error| over the {errors['scored']} trials after calibration: "
        f"refitted before each {share(errors['throughput'])}, calibration fit only "
        f"{share(errors['calibration'])}, one-point model {share(errors['one_point'])}; memory "
        f"{share(errors['memory'])}"
    )
    print(
        f"chosen {summary['best']}: {medians['chosen']:.1f} samples/s vs default "
        f"{medians['default']:.1f} (ratio {ratio:.3f}; per round "
        f"{', '.join(f'{r:.3f}' for r in per_round)})"
    )
    print(
        f"tuner wall time {run['wall_s']:.0f}s; total {saved['total']:.0f}s; files in "
        f"{saved['tmp']} (results.json)"
    )
    if not args.write:
        return 0
    problem = disturbed(saved, args)
    if problem is not None and not args.write_disturbed:
        print(
            f"\nnot writing {BENCH_MD.name}: {problem}. Rerun when the machine is quiet (or pass "
            "--write-disturbed)."
        )
        return 1
    write(
        args,
        tuned,
        table,
        errors,
        results,
        medians,
        ratio,
        per_round,
        default_trial,
        saved,
    )
    print(f"\nupdated {BENCH_MD}")
    return 0


def rounds_table(results: dict[str, list[dict]], medians: dict[str, float]) -> str:
    lines = [
        "| config | samples/s (median) | tokens/s | all rounds | ms/step | other load (cores, per "
        "run) | other load in the timed window (per run) |",
        "|---|---:|---:|---|---:|---|---|",
    ]
    for label, runs in results.items():
        rounds = ", ".join(f"{r['throughput']:.1f}{'*' if r.get('noisy') else ''}" for r in runs)
        step_ms = statistics.median(1000 * r["step_time_s"] for r in runs)
        load = ", ".join(f"{r['foreign_cores']:.2f}" for r in runs)
        tasks = ", ".join(f"{r['window_load']:.2f}" for r in runs)
        lines.append(
            f"| {label} | {medians[label]:.1f} | {128 * medians[label]:,.0f} | {rounds} | "
            f"{step_ms:.0f} | {load} | {tasks} |"
        )
    return "\n".join(lines)


def write(
    args,
    tuned: dict,
    table: str,
    errors: dict,
    results: dict[str, list[dict]],
    medians: dict[str, float],
    ratio: float,
    per_round: list[float],
    default_trial: dict | None,
    saved: dict,
) -> None:
    summary, run = tuned["summary"], tuned["run"]
    total, discarded = saved["total"], saved["rounds_discarded"]
    chosen = summary["best"]
    command = saved["command"]
    tune_json = json.dumps(tune_config(args)["autotuning"])
    trials = summary["trials"]
    pruned = summary["pruned"]
    spread = {
        label: (max(r["throughput"] for r in runs) - min(r["throughput"] for r in runs))
        / medians[label]
        for label, runs in results.items()
    }
    noisy = sum(bool(r.get("noisy")) for runs in results.values() for r in runs)
    notes = [
        f"- Demo: `examples/train_gpt.py` unchanged (875,264-parameter byte-level GPT, 128-byte "
        f"samples, fp32, AdamW, WarmupCosineLR over 700 steps), {WORLD} processes x 1 thread, gloo. "
        "The script runs as is: trials use its default `--steps 700` and the engine ends each "
        "trial after its measured window, so the schedule's `total_num_steps` stays valid; "
        "`--out` points into a temporary directory. No `arg_mappings` are needed: the script takes "
        "its batch sizes from the config only.",
        f"- Tuning config: `examples/ds_config.json` with `train_batch_size` {DEMO_TRAIN_BATCH} "
        "(the demo's 16 per rank x 2 ranks, fixed so that the chosen configuration trains the same "
        'way), `zero_optimization.stage` "all" and `autotuning` '
        f"`{tune_json}`: every stage and micro-batch 1, 2, 4, 8, 16 with the accumulation steps "
        f"that keep the batch at {DEMO_TRAIN_BATCH} ({len(trials) + len(pruned)} candidates), "
        f"gridsearch. Early stopping after {args.early_stopping} trials without a gain "
        + (
            "did not trigger: every candidate was measured, so the error columns cover the whole "
            "space, small micro-batches included."
            if not pruned
            else f"left {len(pruned)} candidate(s) untried."
        ),
        f"- Trials: the engine's `AutotuningMeter` times optimizer steps {args.trial_start}-"
        f"{args.trial_end}; memory is the growth of the largest rank's resident set over the run "
        "(CPU). Error = (estimated - measured) / measured; the means are of absolute values over "
        "the trials after the two calibration trials (the model is fitted to those, so their "
        "error is 0 by construction). 'Estimated' is what the tuner recorded: the planner refitted "
        "to every trial before that one. 'Calibration fit only' and 'one-point model' are "
        "recomputed here from the same measurements: the planner fitted to the two calibration "
        "trials only (what it says before any other trial), and the planner as it was before "
        "this change (one calibration trial, everything charged per sample, no per-micro-step or "
        "optimizer term; the model behind the 57-81% errors reported earlier).",
        f"- Default against chosen: the demo's own `examples/ds_config.json` and the tuner's "
        f"`ds_config_optimal.json`, each run {args.rounds} times in alternating order (swapped "
        "every round), each run a fresh launch of the demo timed by the same engine meter over "
        f"optimizer steps {args.warmup + 1}-{args.warmup + args.steps}; median samples/s. "
        f"{len(discarded)} run(s) discarded and rerun because other processes used more than "
        f"{args.max_other_load} cores during the run or more than {args.max_window_load} cores "
        f"in its timed window; {noisy} noisy run(s) kept (marked *). "
        f"Spread (max - min over rounds / median): default {100 * spread['default']:.0f}%, "
        f"chosen {100 * spread['chosen']:.0f}%.",
        f"- Tuner wall time {run['wall_s']:.0f}s for {len(trials)} trials and the probe (other "
        f"load during it {run['foreign_cores']:.2f} cores, from /proc/stat less the run's own CPU "
        f"time); whole benchmark {total:.0f}s. Tuner runs discarded because other processes "
        f"used more than {args.max_other_load} cores during them or more than "
        f"{args.max_window_load} cores in a calibration trial's timed window: "
        f"{len(tuned['discarded'])}"
        + "".join(
            f" ({d['foreign_cores']:.2f} cores, up to {d['calibration_load']:.2f} in a "
            "calibration trial's window)"
            for d in tuned["discarded"]
        )
        + ". 'Other load' is the CPU that processes other than the benchmark's own (it, the "
        "launcher, torchrun and the ranks) used, in cores, from /proc/stat less the benchmark's "
        "/proc/<pid>/stat times sampled every 0.5 s; for a trial or a round it covers the timed "
        "steps (ending when the engine wrote its metric file). About 1 means another process "
        f"used a whole core of the {os.cpu_count()}, so that measurement is slow for reasons the "
        "model does not know.",
    ]
    if default_trial is not None and default_trial["measured_throughput"]:
        notes.append(
            f"- Noise yardstick: the demo's default (z2_mbs16_gas1) was also a trial; its "
            f"{args.trial_end - args.trial_start + 1}-step trial measured "
            f"{default_trial['measured_throughput']:.1f} samples/s against "
            f"{medians['default']:.1f} for the median of the longer runs "
            f"({percent(default_trial['measured_throughput'] / medians['default'] - 1)})."
        )
    misses = breakdown_notes(summary, tuned["dir"], args.miss_threshold)
    if misses:
        notes.append(
            f"- Trials missed by more than {100 * args.miss_threshold:.0f}% (the model's terms): "
            + "; ".join(misses)
            + "."
        )
    notes += plain_notes(summary, tuned["loads"], args.max_window_load)
    notes += common.note_lines(args)
    rerendered = (
        "; this section was rendered again from that run's saved `results.json` (`--from-results`)"
        if args.from_results
        else ""
    )
    blocks = [
        f"Chosen: **{chosen}**. Throughput chosen / default (z2_mbs16_gas1): **{ratio:.3f}** "
        f"({medians['chosen']:.1f} / {medians['default']:.1f} samples/s, per-round ratios "
        f"{', '.join(f'{r:.3f}' for r in per_round)}).",
        f"Planner estimate error, mean |error| over the {errors['scored']} trials after "
        f"calibration: throughput **{share(errors['throughput'])}** (largest "
        f"{100 * errors['throughput_max']:.1f}%), each estimate made by the planner "
        "refitted to the trials before it, as the tuner does; with the fit to the two "
        f"calibration trials only {share(errors['calibration'])}; the one-point model (the "
        f"planner before this change) on the same trials {share(errors['one_point'])}; peak "
        f"memory {share(errors['memory'])}.",
        rounds_table(results, medians),
        ("Every trial (in the order run):", table),
        "The fitted model: " + "; ".join(model_lines(summary)) + ".",
    ]
    section = common.section_text(
        SECTION_TITLE,
        command,
        total,
        blocks,
        notes,
        date=saved["date"],
        command_tail=rerendered
        + ". The tuner's own command: `shardspeed --num_procs 2 --autotuning tune "
        "examples/train_gpt.py --deepspeed_config ds_config_tune.json --out TMP/run` "
        "(plus `--master_port`)",
    )
    common.write_markdown(section, SECTION_TITLE, BENCH_MD)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5, help="default/chosen rounds (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of a round's run (5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps of a round's run (20)")
    p.add_argument("--trial-start", type=int, default=3, help="trials' start_profile_step (3)")
    p.add_argument("--trial-end", type=int, default=10, help="trials' end_profile_step (10)")
    p.add_argument(
        "--early-stopping", type=int, default=20, help="tuner_early_stopping (20: no early stop)"
    )
    p.add_argument(
        "--micro-batch-sizes",
        type=int,
        default=5,
        help="num_tuning_micro_batch_sizes (5: every size on the ladder 1-16)",
    )
    p.add_argument(
        "--miss-threshold",
        type=float,
        default=0.10,
        help="trials whose throughput estimate is off by more than this are itemised (0.10)",
    )
    p.add_argument(
        "--tune-retries",
        type=int,
        default=2,
        help="reruns of the tuner when other load disturbed it (default 2)",
    )
    p.add_argument("--note", action="append", default=[], help="a line for the written notes")
    common.add_smoke_arg(p, help="stages 0 and 3, 1 round; no --write")
    common.add_noise_args(p, budget=300.0)
    p.add_argument(
        "--max-window-load",
        type=float,
        default=0.25,
        help="rerun a round's run, or the tuner when it happened in a calibration trial, when "
        "other processes used more than this many cores in the timed window (0.25)",
    )
    p.add_argument("--write", action="store_true", help=f"update {BENCH_MD.name}")
    p.add_argument(
        "--write-disturbed",
        action="store_true",
        help="write even when other load disturbed the tuner run (refused by default)",
    )
    p.add_argument(
        "--from-results",
        metavar="RESULTS_JSON",
        help="measure nothing: report (and with --write, write) a previous run's results.json "
        "(its temporary directory must still exist)",
    )
    args = p.parse_args(argv)
    common.apply_smoke(p, args, rounds=1, steps=5, wait_idle=0, tune_retries=0)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
