"""Autotuning: the tuner's chosen configuration against the demo's default, and the planner's
estimate error, on the demo (2 processes, gloo on CPU).

    .venv/bin/python benchmarks/bench_autotune.py [--quick] [--write]
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness as h
import render

SCENARIO = h.Scenario(
    name="autotune",
    section="## Autotuning: the tuner's choice vs the demo's default, and the planner's error",
    modes={},
    warmup=5,
    steps=20,
    rounds=5,
    quick={"rounds": 1, "steps": 5},
)
DEMO_SCRIPT = h.REPO / "examples" / "train_gpt.py"
DEMO_CONFIG = h.REPO / "examples" / "ds_config.json"
LAUNCHER = Path(sys.executable).parent / "shardspeed"
WORLD = 2
DEMO_TRAIN_BATCH = 32  # the demo's train_micro_batch_size_per_gpu 16 x 2 processes x 1 step
# The tuner's settings: its trials' profiled steps, no early stop, micro-batch sizes to try.
TUNING = {"start_profile_step": 3, "end_profile_step": 10, "tuner_early_stopping": 20}
TUNING["num_tuning_micro_batch_sizes"] = 5
TUNE_RETRIES = 2  # reruns of a disturbed tuner run (none with --quick)
MISS_THRESHOLD = 0.10  # the trials missed by more than this are itemised


def tune_config(args) -> dict:
    """The demo's config as a user would set it up for tuning (see the module docstring)."""
    config = json.loads(DEMO_CONFIG.read_text())
    config["train_batch_size"] = DEMO_TRAIN_BATCH
    config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": "all"}
    if args.quick:
        config["zero_optimization"]["stage"] = [0, 3]
    config["autotuning"] = dict(TUNING)
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_cpu_s() -> float:
    """CPU seconds of this process and its live descendants (from /proc), reaped children's too."""
    parents, cpu = {}, {}
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(entry.path, "stat").read_text()
            fields = text[text.rindex(")") + 2 :].split()  # the command name may hold ")"
            parents[int(entry.name)] = int(fields[1])
            cpu[int(entry.name)] = sum(map(int, fields[11:15]))  # utime stime cutime cstime
    tree, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for child in [pid for pid, p in parents.items() if p == parent and pid not in tree]:
            tree.add(child)
            frontier.append(child)
    return sum(cpu.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


class LoadSampler:
    """Machine-wide and own busy CPU sampled every 0.5 s, for any window's other load."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.samples.append((time.time(), h.machine_busy_s(), own_cpu_s()))

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._sample()

    def __enter__(self) -> LoadSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def others(self, start: float, end: float) -> float | None:
        """Other processes' cores from `start` to `end` (None under half a second of samples)."""
        before = [sample for sample in self.samples if sample[0] <= start]
        after = [sample for sample in self.samples if sample[0] >= end]
        if not before or not after or after[0][0] - before[-1][0] < 0.5:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = before[-1], after[0]
        return max(0.0, (busy1 - busy0 - (own1 - own0)) / (t1 - t0))

    def before(self, path: Path, seconds: float) -> float | None:
        """Other processes' cores in the `seconds` before `path` (engine metrics) was written."""
        end = path.stat().st_mtime
        return self.others(end - seconds, end)


def run_measured(argv: list[str], cwd: Path, log: Path) -> tuple[dict, LoadSampler]:
    """Run `argv`: wall time, exit status, others' cores meanwhile, and the sampler."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out, LoadSampler() as sampler:
        t0 = time.time()
        code = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        t1 = time.time()
    foreign = sampler.others(t0, t1) or 0.0
    return {"returncode": code.returncode, "wall_s": t1 - t0, "foreign_cores": foreign}, sampler


def launch_argv(port: int, config: Path, out: Path, tune: bool) -> list[str]:
    argv = [str(LAUNCHER), "--num_procs", str(WORLD), "--master_port", str(port)]
    argv += ["--autotuning", "tune"] if tune else []
    return [*argv, str(DEMO_SCRIPT), "--deepspeed_config", str(config), "--out", str(out)]


def run_tuner(args, tmp: Path) -> dict:
    """The tuner, rerun while other processes disturbed it or a calibration trial."""
    runs, started = [], time.perf_counter()
    for attempt in range(1 if args.quick else 1 + TUNE_RETRIES):
        directory = tmp / f"tune{attempt}"
        directory.mkdir()
        config = directory / "ds_config_tune.json"
        config.write_text(json.dumps(tune_config(args), indent=2) + "\n")
        if args.wait_idle > 0:
            h.wait_idle(6 * args.wait_idle)
        argv = launch_argv(free_port(), config, tmp / "run", tune=True)
        print(f"tuning: {shlex.join(argv)}")
        run, sampler = run_measured(argv, directory, directory / "tune.log")
        if run["returncode"] != 0:
            log = tail(directory / "tune.log")
            raise SystemExit(f"the tuner failed (exit {run['returncode']}):\n{log}")
        summary = json.loads((directory / "autotuning_results" / "summary.json").read_text())
        loads = {}
        for row in summary["trials"]:
            path = directory / "autotuning_exps" / row["name"] / "metrics.json"
            if row["measured_throughput"] and path.exists():
                window = row["train_batch"] / row["measured_throughput"]
                window *= TUNING["end_profile_step"] - TUNING["start_profile_step"] + 1
                loads[row["name"]] = sampler.before(path, window)
        calibration = [loads.get(r["name"]) or 0.0 for r in summary["trials"] if r["calibration"]]
        run["calibration_load"] = max(calibration, default=0.0)
        runs.append({"run": run, "summary": summary, "dir": directory, "loads": loads})
        loads_text = f"other load {run['foreign_cores']:.2f}, {run['calibration_load']:.2f}"
        print(f"tuner run {attempt}: {run['wall_s']:.0f}s, {loads_text}, best {summary['best']}")
        quiet = max(run["foreign_cores"], run["calibration_load"]) <= args.max_other_load
        if quiet or time.perf_counter() - started > args.budget:
            break
    best = min(runs, key=lambda t: (t["run"]["calibration_load"], t["run"]["foreign_cores"]))
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
    same = ("num_params", "dp_size", "mp_size", "precision", "tokens_per_sample")
    kwargs = {key: fitted[key] for key in same} | {"bandwidth": fitted["bus_bandwidth_bytes_per_s"]}
    kwargs["optimizer_s_per_param"] = fitted["optimizer_s_per_param"] if optimizer else 0.0
    return Planner(**kwargs)


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
    """Estimates of the calibration-only planner and the old one-point model, same trials."""
    measured = _measurements(summary, tmp)
    calibration = _planner(summary).calibrate([m for row, m in measured if row["calibration"]])
    one_point = _planner(summary, optimizer=False).calibrate([measured[0][1]])
    planners = {"calibration": calibration, "one_point": one_point}
    return {
        key: {row["name"]: p.estimate(_candidate(row)).throughput for row, _ in measured}
        for key, p in planners.items()
    }


def measure_config(args, tmp: Path, base: dict, label: str, tag: str) -> dict:
    """One run of the demo with `base`, timed by the engine's meter over the long window."""
    directory = tmp / "rounds" / f"{tag}_{label}"
    directory.mkdir(parents=True)
    config = dict(base)
    config["autotuning"] = {"enabled": True, "metric_path": str(directory / "metrics.json")}
    config["autotuning"] |= {"start_profile_step": args.warmup + 1}
    config["autotuning"] |= {"end_profile_step": args.warmup + args.steps}
    path = directory / "ds_config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    if args.wait_idle > 0:
        h.wait_idle(args.wait_idle)
    argv = launch_argv(free_port(), path, tmp / "run", tune=False)
    run, sampler = run_measured(argv, directory, directory / "log.txt")
    metrics_path = directory / "metrics.json"
    if not metrics_path.exists():
        return {**run, "error": f"exit {run['returncode']}", "log": tail(directory / "log.txt")}
    metrics = json.loads(metrics_path.read_text())
    load = sampler.before(metrics_path, metrics["step_time_s"] * args.steps)
    return {**run, **metrics, "window_load": load or 0.0}


def alternate(args, tmp: Path, configs: dict[str, dict]) -> tuple[dict[str, list[dict]], list]:
    """`args.rounds` rounds, order swapped each round; disturbed runs are rerun."""
    results: dict[str, list[dict]] = {label: [] for label in configs}
    discarded = []
    started = time.perf_counter()
    labels = list(configs)
    for round_ in range(args.rounds):
        order = labels if round_ % 2 == 0 else labels[::-1]
        for label in order:
            for attempt in range(args.retries + 1):
                result = measure_config(args, tmp, configs[label], label, f"r{round_}a{attempt}")
                loads = (result.get("foreign_cores", 0), result.get("window_load", 0))
                if "error" in result or max(loads) <= args.max_other_load:
                    break
                if attempt == args.retries or time.perf_counter() - started > args.budget:
                    result["noisy"] = True
                    break
                discarded.append(result)
                print(f"[round {round_}] {label}: discarded (other load {loads}), retrying")
            if "error" in result:
                raise SystemExit(f"{label} failed ({result['error']}):\n{result['log']}")
            results[label].append(result)
            noisy = ", NOISY" * bool(result.get("noisy"))
            print(f"[round {round_}] {label}: {result['throughput']:.1f} samples/s{noisy}")
    return results, discarded


def missed(summary: dict, tmp: Path, threshold: float) -> list[dict]:
    """The trials the planner missed by more than `threshold`, with its estimate's terms."""
    measured, out = _measurements(summary, tmp), []
    for index, (row, _) in enumerate(measured):
        error = row["throughput_error"]
        if row["calibration"] or error is None or abs(error) <= threshold:
            continue
        planner = _planner(summary).calibrate([m for _, m in measured[:index]])
        estimate = planner.estimate(_candidate(row))
        measured_s = row["train_batch"] / row["measured_throughput"]
        item = {"name": row["name"], "error": error, "measured_s": measured_s}
        item["estimated_s"] = estimate.step_time_s
        item["terms_s"] = [estimate.compute_s, estimate.optimizer_s, estimate.comm_s]
        item["per_micro_s"] = (measured_s - estimate.step_time_s) / row["grad_accum"]
        item["fitted_micro_s"] = planner.micro_step_time(row["stage"])
        out.append(item | {"stages_fitted": sorted(planner.micro_step_s)})
    return out


def measure(scenario, args) -> dict:
    """Tune, then the default/chosen rounds; estimates are worked out while trials exist."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_autotune_"))
    sys.stdout.reconfigure(line_buffering=True)  # progress shows as it happens
    started = time.perf_counter()
    tuned = run_tuner(args, tmp)
    print(tail(tuned["dir"] / "tune.log", 6000))
    chosen_path = tuned["dir"] / "autotuning_results" / "ds_config_optimal.json"
    configs = {"default": json.loads(DEMO_CONFIG.read_text())}
    configs["chosen"] = json.loads(chosen_path.read_text())
    rounds, discarded = alternate(args, tmp, configs)
    meta = h.run_meta(time.perf_counter() - started, len(discarded), rounds)
    meta |= {"quick": args.quick, "tuner_discarded": tuned["discarded"]}
    out = {"scenario": scenario.name, "meta": meta, "runs": rounds, "failed": {}}
    out |= {"summary": tuned["summary"], "tuner": tuned["run"], "loads": tuned["loads"]}
    out["replayed"] = replayed_estimates(tuned["summary"], tuned["dir"])
    return out | {"missed": missed(tuned["summary"], tuned["dir"], MISS_THRESHOLD)}


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def trial_table(results: dict) -> tuple[str, dict]:
    """Every trial: measured and estimated throughput and memory; mean |error| of each."""
    summary, replayed, loads = results["summary"], results["replayed"], results["loads"]
    scored: dict[str, list[float]] = {k: [] for k in ("throughput", "calibration", "one_point")}
    scored["memory"] = []
    rows = []
    for row in summary["trials"]:
        measured = row["measured_throughput"]
        name = row["name"] + " (best)" * (row["name"] == summary["best"])
        head = [row["trial"], name, "calibration" if row["calibration"] else "planned"]
        if measured is None:
            rows.append([*head, row["status"]] + ["-"] * 10)
            continue
        cells = [f"{row['estimated_throughput']:.1f}", percent(row["throughput_error"])]
        errors = {"throughput": row["throughput_error"], "memory": row["memory_error"]}
        for key in ("calibration", "one_point"):
            estimate = replayed[key].get(row["name"])
            errors[key] = None if estimate is None else (estimate - measured) / measured
            cells += [render.fmt(estimate, ".1f"), percent(errors[key])]
        for key, error in errors.items():
            if error is not None and not row["calibration"]:
                scored[key].append(abs(error))
        memory = [mib(row["measured_peak_memory_bytes"]), mib(row["estimated_memory_bytes"])]
        memory += [percent(row["memory_error"]), render.fmt(loads.get(row["name"]), ".2f")]
        rows.append([*head, f"{measured:.1f}", *cells, *memory])
    means = {key: sum(v) / len(v) if v else None for key, v in scored.items()}
    means["largest"] = max(scored["throughput"], default=None)
    means["scored"] = len(scored["throughput"])
    columns = ["#", "trial", "role", "measured samples/s"]
    columns += ["estimated (refitted to the trials before)", "error", "calibration fit only"]
    columns += ["error", "one-point model", "error", "peak memory MiB", "estimated MiB", "error"]
    columns += ["other load (cores)"]
    return render.table(columns, rows, "rllrrrrrrrrrrr"), means


def share(means: dict, key: str) -> str:
    return "-" if means.get(key) is None else f"{100 * means[key]:.1f}%"


def summary_table(results: dict, means: dict) -> str:
    """The choice and its speed-up, and the planner's mean error over the trials after calibration."""
    chosen = render.med(results, "chosen", "throughput")
    default = render.med(results, "default", "throughput")
    pairs = zip(render.runs(results, "default"), render.runs(results, "chosen"))
    per_round = ", ".join(f"{c['throughput'] / d['throughput']:.3f}" for d, c in pairs)
    speeds = f"{render.fmt(chosen, '.1f')} / {render.fmt(default, '.1f')} samples/s"
    tuner = results["tuner"]
    loads = ", ".join(f"{x:.2f}" for x in (tuner["foreign_cores"], tuner["calibration_load"]))
    speedup = f"{render.ratio(chosen, default)} ({speeds}; per round {per_round})"
    error = f"{share(means, 'throughput')} (largest {share(means, 'largest')})"
    rows = [["chosen", results["summary"]["best"]], ["throughput chosen / default", speedup]]
    rows.append([f"mean abs throughput error, {means['scored']} trials after calibration", error])
    rows.append(["the same, fit to the calibration trials only", share(means, "calibration")])
    rows.append(["the same, one-point model", share(means, "one_point")])
    rows.append(["mean abs memory error", share(means, "memory")])
    load_label = "tuner wall time, other load during it (cores), in calibration windows"
    rows.append([load_label, f"{tuner['wall_s']:.0f}s, {loads}"])
    return render.table(["measure", "value"], rows)


def rounds_table(results: dict) -> str:
    rows = []
    for label, runs in results["runs"].items():
        samples = render.med(results, label, "throughput")
        rounds = ", ".join(f"{r['throughput']:.1f}" + "*" * bool(r.get("noisy")) for r in runs)
        cells = [f"{samples:.1f}", f"{128 * samples:,.0f}", rounds]
        cells.append(f"{h.median(1000 * r['step_time_s'] for r in runs):.0f}")
        loads = [", ".join(f"{r[k]:.2f}" for r in runs) for k in ("foreign_cores", "window_load")]
        rows.append([label, *cells, *loads])
    columns = ["config", "samples/s (median)", "tokens/s", "all rounds", "ms/step"]
    columns += ["other load (cores, per run)", "other load in the timed window (per run)"]
    return render.table(columns, rows, "lrrlrll")


def model_table(summary: dict) -> str:
    """The model the tuner fitted: its terms."""
    fitted = summary["calibration"]
    flops = 6 * fitted["num_params"] * fitted["tokens_per_sample"]
    per_sample = flops / fitted["flops_per_s_per_rank"]
    micro = ", ".join(f"stage {s} {1000 * t:.2f}" for s, t in fitted["micro_step_s"].items())
    opt = fitted["optimizer_s_per_param"]
    bandwidth = fitted["bus_bandwidth_bytes_per_s"]
    bus = f"{bandwidth / 1e9:.3f}" if bandwidth else "- (one data-parallel rank)"
    opt_text = f"{1e9 * opt:.2f} ({1000 * opt * fitted['num_params']:.2f})"
    rows = [
        ["per sample, forward and backward (ms)", f"{1000 * per_sample:.2f}"],
        ["per micro-step (ms; other stages take the nearest's)", micro],
        ["optimizer, ns a parameter updated (ms at stage 0)", opt_text],
        ["bus bandwidth (GB/s)", bus],
        ["activations a sample (MiB)", mib(fitted["activation_bytes_per_sample"])],
        ["besides model states and activations (MiB)", mib(fitted["runtime_bytes"])],
    ]
    return render.table(["term", "fitted"], rows)


def missed_table(results: dict) -> str:
    rows = []
    for m in results["missed"]:
        terms = " + ".join(f"{1000 * t:.1f}" for t in m["terms_s"])
        cells = [percent(m["error"]), f"{1000 * m['measured_s']:.0f}"]
        cells += [f"{1000 * m['estimated_s']:.0f} = {terms}", f"{1000 * m['per_micro_s']:+.2f}"]
        cells += [f"{1000 * m['fitted_micro_s']:.2f}", ", ".join(map(str, m["stages_fitted"]))]
        rows.append([m["name"], *cells])
    columns = "trial | throughput error | measured ms a step | estimated ms = fwd+bwd + optimizer"
    columns += " + communication | unmodelled ms a micro-step | fitted ms a micro-step"
    return render.table(columns + " | stages fitted before it", rows, "lrrlrrl")


def tables(results: dict) -> dict:
    trials, means = trial_table(results)
    out = {"summary": summary_table(results, means), "rounds": rounds_table(results)}
    out |= {"trials": trials, "model": model_table(results["summary"])}
    return out | {"missed": missed_table(results), "run": render.run_line(results)}


if __name__ == "__main__":
    h.main(SCENARIO, None, tables, "bench_autotune.py", orchestrate=measure)
