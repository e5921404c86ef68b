"""``shardspeed --autotuning tune|run``: short measured trials of the user's script, planner-ordered.

Each trial is the user's command with ``--deepspeed_config`` pointing at
``exps_dir/<name>/ds_config.json``: the user's config with the trial's ZeRO stage and batch sizes and
an ``autotuning`` section asking the engine to measure. Two calibration trials, the candidate needing
the least memory and then the largest micro-batch estimated to fit at the same stage, calibrate the
:class:`~shardspeed.autotuning.planner.Planner` (with a probe's bandwidth and optimizer-step time),
which prunes what would not fit and orders the rest; trials then run in that order
(``gridsearch``), shuffled (``random``) or re-ranked before each pick (``model_based``), until
``tuner_num_trials`` trials ran or ``tuner_early_stopping`` trials in a row did not beat the best.
The planner is refitted to every trial measured so far before each pick, so each trial's estimate
comes from the trials before it. When the step-time model can be used (the GPU kind, the parameter
count and the tokens a sample known: ``Autotuner.predicting_planner``), it ranks the candidates
before any trial instead: no calibration, and each trial shows its prediction beside what it
measured.

The engine's side, when its config has ``autotuning.enabled`` true and ``autotuning.metric_path``
set (trial configs do; see docs/autotuning.md for the full contract): time optimizer steps
``start_profile_step`` to ``end_profile_step`` (1-based), then on global rank 0 write
``metric_path`` atomically (a temporary file renamed over it) as a JSON object with ``throughput``
(train_batch_size / step_time_s, samples/s), ``latency`` and ``step_time_s`` (seconds per optimizer
step), ``flops`` (FLOP/s per rank, or null), ``peak_memory_bytes`` (largest over ranks of a rank's
peak memory), ``activation_memory_bytes`` (what one forward pass kept, or null),
``device_memory_bytes`` (one rank's memory), ``num_params`` (all model-parallel ranks together) and
optionally ``tokens_per_sample``; then every rank exits with status 0. Only ``throughput``,
``step_time_s`` and the tuned metric are required. A trial also ends when its metric file appears
and the processes are still running ``stop_grace_s`` later, or after ``trial_timeout_s``.

Results: ``results_dir/summary.txt`` (every trial with measured and estimated figures and the
estimate's error), ``summary.json`` (the same as data) and ``ds_config_optimal.json`` (the best
trial's config without its ``autotuning`` section), rewritten after every trial.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shardspeed.config.errors import ConfigError
from shardspeed.config.loader import (
    STAGE3_UNPREFIXED,
    STAGE_ONLY_KEYS,
    load_config,
    read_config_source,
    validation_problems,
)
from shardspeed.config.schema import AutotuningConfig, ShardSpeedConfig
from shardspeed.launcher import runner
from shardspeed.launcher.hostfile import read_hostfile, select_resources
from shardspeed.launcher.runner import Launch

from .planner import (
    STAGES,
    Candidate,
    Estimate,
    Measurement,
    Planner,
    enumerate_candidates,
    format_bytes,
    micro_batch_sizes,
)
from .systems import GPUS, Cluster, gpu_kind_of

CONFIG_FILE = "ds_config.json"
METRICS_FILE = "metrics.json"
OPTIMAL_CONFIG_FILE = "ds_config_optimal.json"
SUMMARY_FILE = "summary.txt"
SUMMARY_JSON_FILE = "summary.json"
MEMORY_LIMIT_ENV = "SHARDSPEED_AUTOTUNING_MEMORY_LIMIT"
TRIAL_TIMEOUT_ENV = "SHARDSPEED_AUTOTUNING_TRIAL_TIMEOUT"
DEFAULT_TRIAL_TIMEOUT_S = 600.0
PROBE_MODULE = "shardspeed.autotuning.tuner"
PROBE_FLAG = "--probe-bandwidth"
_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")
_HIGHER_IS_BETTER = {"throughput": True, "flops": True, "latency": False}
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class TuningError(RuntimeError):
    """Autotuning cannot go on; the message says why and where to look."""


@dataclass
class Trial:
    """One measured run of the user's script with one candidate configuration."""

    candidate: Candidate
    config: dict[str, Any]
    directory: Path
    estimate: Estimate | None = None
    calibration: bool = False
    status: str = "pending"
    metrics: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "reused")

    def throughput_error(self) -> float | None:
        """(estimated - measured) / measured throughput."""
        if not self.ok or self.estimate is None:
            return None
        measured = self.metrics["throughput"]
        return (self.estimate.throughput - measured) / measured

    def memory_error(self) -> float | None:
        """(estimated - measured) / measured peak memory, when the engine measured it."""
        peak = self.metrics.get("peak_memory_bytes") if self.ok else None
        if not peak or self.estimate is None:
            return None
        return (self.estimate.memory_bytes - peak) / peak


def refused_settings(section: AutotuningConfig) -> list[str]:
    """`autotuning` settings this tuner cannot honour, each with the reason."""
    problems = []
    if not section.fast:
        problems.append(
            "'autotuning.fast' false asks to tune ZeRO's bucket and prefetch sizes too; this tuner "
            "explores the stage, micro-batch and accumulation steps only (leave it true)"
        )
    if section.model_info is not None and section.model_info.profile:
        problems.append(
            "'autotuning.model_info.profile' is the switch DeepSpeed's tuner sets for its own "
            "profiling run; here every trial reports num_params, so leave it false"
        )
    return problems


def _config_arg(user_args: Sequence[str]) -> tuple[int, str | None] | None:
    """(index, flag if written --flag=VALUE else None) of the config path in the script args."""
    for index, arg in enumerate(user_args):
        name, equals, value = arg.partition("=")
        if name not in _CONFIG_FLAGS:
            continue
        if not equals:
            if index + 1 == len(user_args):
                continue
            value = user_args[index + 1]
        # DeepSpeed's --deepspeed is a switch; Hugging Face's names a JSON file.
        if name == "--deepspeed" and not value.endswith(".json"):
            continue
        return (index, name) if equals else (index + 1, None)
    return None


def config_path(user_args: Sequence[str]) -> str:
    """The config file the script args name (``--deepspeed_config F`` or ``--deepspeed F.json``)."""
    found = _config_arg(user_args)
    if found is None:
        raise TuningError(
            "autotuning needs the config in the script args: --deepspeed_config FILE.json"
        )
    index, inline = found
    return user_args[index].partition("=")[2] if inline else user_args[index]


def with_config(user_args: Sequence[str], path: str) -> list[str]:
    """The script args with the config path replaced by `path`."""
    args = list(user_args)
    index, inline = _config_arg(args)
    args[index] = f"{inline}={path}" if inline else path
    return args


def apply_arg_mappings(
    user_args: Sequence[str], mappings: Mapping[str, str] | None, config: Mapping[str, Any]
) -> list[str]:
    """Script flags set from the config, for scripts that take batch sizes as arguments too.

    `mappings` maps a config key (dotted for nested ones) to a flag; an existing ``--flag V`` or
    ``--flag=V`` gets the config's value, otherwise ``--flag V`` is appended.
    """
    args = list(user_args)
    for key, flag in (mappings or {}).items():
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is None:
            continue
        text = str(value)
        for index, arg in enumerate(args):
            if arg == flag and index + 1 < len(args):
                args[index + 1] = text
                break
            if arg.startswith(f"{flag}="):
                args[index] = f"{flag}={text}"
                break
        else:
            args += [flag, text]
    return args


def trial_config(
    base: Mapping[str, Any],
    candidate: Candidate,
    section: AutotuningConfig,
    metric_path: str,
) -> dict[str, Any]:
    """The user's config set to `candidate`, asking the engine to write its metrics to `metric_path`.

    Keys that act only at other stages are dropped (the loader refuses them there): a stage-3
    prefetch size at stage 1, an optimizer offload at stage 0.
    """
    config = copy.deepcopy(dict(base))
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = candidate.stage
    if candidate.stage != 3:
        for name in STAGE3_UNPREFIXED:
            zero.pop(name, None)
    config["zero_optimization"] = zero
    for path, stages in STAGE_ONLY_KEYS.items():
        if candidate.stage not in stages:
            *parents, leaf = path.split(".")
            owner = config
            for parent in parents:
                owner = owner.get(parent) or {}
            owner.pop(leaf, None)
    config["train_micro_batch_size_per_gpu"] = candidate.micro_batch
    config["gradient_accumulation_steps"] = candidate.grad_accum
    config["train_batch_size"] = candidate.train_batch
    config["autotuning"] = {
        "enabled": True,
        "metric_path": metric_path,
        "metric": section.metric,
        "start_profile_step": section.start_profile_step,
        "end_profile_step": section.end_profile_step,
    }
    return config


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at `path`, or None while it is missing or half-written."""
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _write_json(path: Path, value: Any) -> None:
    """Written whole or not at all, so that a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(temporary, path)


def _stop(processes: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each process group (torchrun and its workers), SIGKILL what outlives `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [process for process in processes if process.poll() is None]
        for process in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        deadline = time.monotonic() + grace_s
        for process in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))


def run_processes(
    launches: Sequence[Launch],
    directory: Path,
    result_path: Path,
    timeout_s: float,
    grace_s: float,
) -> tuple[str, dict[str, Any] | None]:
    """Run `launches` until they end, `result_path` appears, or `timeout_s` passes.

    Output goes to ``stdout.log`` / ``stderr.log`` in `directory`. Returns ("ok", result) once the
    result file holds a JSON object (processes still running `grace_s` later are stopped), else a
    status saying what happened: "failed (exit N)" (the others are stopped), "no metrics" (all
    exited 0 without writing it) or "timeout".
    """
    deadline = time.monotonic() + timeout_s
    with (
        open(directory / "stdout.log", "wb") as out,
        open(directory / "stderr.log", "wb") as err,
        runner.written_files(launches),  # an MPI launch's hostfile
    ):
        processes = [
            # A session of its own, so that stopping it reaches torchrun's workers too.
            subprocess.Popen(
                launch.argv,
                env=launch.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            for launch in launches
        ]
        try:
            stop_at = None
            while True:
                codes = [process.poll() for process in processes]
                result = _read_json(result_path)
                if result is not None and stop_at is None:
                    stop_at = time.monotonic() + grace_s
                failed = [code for code in codes if code]
                if failed or all(code is not None for code in codes):
                    if result is not None:
                        return "ok", result
                    if failed:
                        code = failed[0]
                        return f"failed (exit {128 - code if code < 0 else code})", None
                    return "no metrics", None
                if stop_at is not None and time.monotonic() >= stop_at:
                    return "ok", result
                if time.monotonic() >= deadline:
                    return "timeout", None
                time.sleep(0.05)
        finally:
            for launch, process in zip(launches, processes):
                runner.send_stop(launch, process)  # pdsh stops its nodes' ranks on two SIGINTs
            _stop(processes, grace_s)


def _check_metrics(metrics: Mapping[str, Any], metric: str) -> str | None:
    """What is wrong with an engine's metric file, or None."""
    for key in dict.fromkeys((metric, "throughput", "step_time_s")):
        value = metrics.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            return f"bad metrics: {key!r} is {value!r}, not a positive number"
    return None


def job_shape(args: argparse.Namespace, count_local_devices: Callable[[], int]) -> tuple[int, int]:
    """(nodes, processes per node) the launcher would start: the pool it resolves, without launching."""
    hostfile = args.hostfile or runner.DEFAULT_HOSTFILE
    if os.path.isfile(hostfile):
        pool = read_hostfile(hostfile)
    elif args.hostfile is not None:
        raise TuningError(f"hostfile {args.hostfile!r} does not exist")
    else:
        pool = {"localhost": args.num_gpus or count_local_devices()}
    hosts = select_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)
    return len(hosts), min(len(slots) for slots in hosts.values())


def _count_local_devices() -> int:
    import torch  # deferred, as in the launcher: only needed without a process count

    return torch.cuda.device_count() or 1


def local_memory_bytes(ranks_per_node: int) -> tuple[float, str]:
    """This machine's memory for one rank, and where the figure comes from."""
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory), "CUDA device 0 here"
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available / ranks_per_node, f"available host memory here / {ranks_per_node} rank(s)"


def local_gpu_kind() -> tuple[str | None, str]:
    """This machine's accelerator as a kind of the step-time model's table (None when it has no
    CUDA device or the table lacks its kind), and its name."""
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device"
    name = torch.cuda.get_device_name(0)
    return gpu_kind_of(name), name


def parse_bytes(text: str) -> float:
    """Bytes from ``8e10``, ``80G`` or ``80GiB`` (K, M, G, T are powers of 1024)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(?:i?B)?\s*", text)
    if match is None:
        raise ValueError(f"not a byte count: {text!r} (say e.g. 80GiB or 8.5e10)")
    return float(match[1]) * _UNITS[match[2]]


def probe(
    args: argparse.Namespace,
    plan: Callable[[argparse.Namespace], list[Launch]],
    directory: Path,
    timeout_s: float,
    optimizer_params: int = 0,
) -> dict[str, Any]:
    """Measure on the job's processes, as the trials run them: the bus bandwidth (bytes/s) of an
    all-reduce and, with `optimizer_params`, the seconds per parameter of an AdamW step over that
    many parameters (``bus_bandwidth_bytes_per_s``, ``optimizer_s_per_param`` in the result)."""
    directory.mkdir(parents=True, exist_ok=True)
    result_path = directory / "bandwidth.json"
    result_path.unlink(missing_ok=True)
    probe_args = copy.copy(args)
    probe_args.user_script = PROBE_MODULE
    probe_args.user_args = [PROBE_FLAG, str(result_path), str(int(optimizer_params))]
    probe_args.module, probe_args.no_python = True, False
    probe_args.compat, probe_args.no_local_rank = False, True
    status, result = run_processes(plan(probe_args), directory, result_path, timeout_s, 10.0)
    if result is None:
        raise TuningError(f"bandwidth probe {status}: see {directory / 'stderr.log'}")
    return result


def measure_bandwidth(
    args: argparse.Namespace,
    plan: Callable[[argparse.Namespace], list[Launch]],
    directory: Path,
    timeout_s: float,
) -> float:
    """Bus bandwidth (bytes/s) of an all-reduce over the job's processes, as the trials run them."""
    return float(probe(args, plan, directory, timeout_s)["bus_bandwidth_bytes_per_s"])


class Autotuner:
    """Tunes ZeRO stage, micro-batch and accumulation steps for the launcher's `args`.

    `plan` turns launcher args into processes (the launcher's own planning by default; tests
    substitute plain ``python script``). `memory_limit_bytes` bounds the planner's per-rank memory;
    without it the calibration trial's ``device_memory_bytes``, else this machine's, is the bound.
    `seed` makes the random tuner repeatable.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        *,
        plan: Callable[[argparse.Namespace], list[Launch]] | None = None,
        world_size: int | None = None,
        memory_limit_bytes: float | None = None,
        trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
        stop_grace_s: float = 10.0,
        seed: int | None = None,
        cwd: str | None = None,
    ) -> None:
        cwd = cwd or os.getcwd()
        self.args = args
        self._plan = plan or (
            lambda launch_args: runner.plan_launches(launch_args, os.environ, cwd)
        )
        self.base_config = read_config_source(config_path(args.user_args))
        try:
            self.section = AutotuningConfig.model_validate(self.base_config.get("autotuning") or {})
        except ValidationError as err:
            raise ConfigError(validation_problems(err, AutotuningConfig, ("autotuning",))) from None
        problems = refused_settings(self.section)
        if problems:
            raise ConfigError(problems)
        if self.section.gpu is not None and self.section.gpu not in GPUS:
            raise ConfigError(
                f"'autotuning.gpu' is {self.section.gpu!r}, not a GPU kind the step-time model "
                f"knows: choose one of {', '.join(GPUS)}, or leave it out"
            )
        # Ranks of one node share its host memory when trials run on the CPU.
        self.nodes, self.ranks_per_node = 1, world_size
        if world_size is None:
            self.nodes, self.ranks_per_node = job_shape(args, _count_local_devices)
            world_size = self.nodes * self.ranks_per_node
        if world_size % self.section.mp_size:
            raise TuningError(
                f"{world_size} processes do not split into model-parallel groups of "
                f"autotuning.mp_size {self.section.mp_size}"
            )
        self.dp_size = world_size // self.section.mp_size
        self.exps_dir = Path(cwd, self.section.exps_dir)
        self.results_dir = Path(cwd, self.section.results_dir)
        self.memory_limit_bytes = memory_limit_bytes
        self.memory_limit_source = "" if memory_limit_bytes is None else "the limit given"
        self.trial_timeout_s = trial_timeout_s
        self.stop_grace_s = stop_grace_s
        self.rng = random.Random(seed)
        self.trials: list[Trial] = []
        self.pruned: list[tuple[Candidate, str]] = []
        self.planner: Planner | None = None
        self.predicted = False  # the step-time model ordered the trials (no calibration)
        self.fitted_to = 0  # measurements the planner is fitted to
        self.best: Trial | None = None

    # -- candidates ------------------------------------------------------------------------------

    def _user_value(self, key: str) -> Any:
        """A batch key of the user's config, None when absent or "auto"."""
        value = self.base_config.get(key)
        return None if value == "auto" else value

    def candidates(self) -> dict[Candidate, ShardSpeedConfig]:
        """Candidates whose config the loader accepts, with the validated config; the rest are
        recorded in `pruned` with the loader's reason."""
        section = self.section
        stage = (self.base_config.get("zero_optimization") or {}).get("stage", "all")
        stages = STAGES if stage == "all" else stage if isinstance(stage, list) else [stage]
        high = section.max_train_micro_batch_size_per_gpu
        if section.max_train_batch_size is not None:
            high = min(high, max(section.max_train_batch_size // self.dp_size, 1))
        sizes = micro_batch_sizes(
            section.min_train_micro_batch_size_per_gpu,
            high,
            self._user_value("train_micro_batch_size_per_gpu"),
        )
        candidates = enumerate_candidates(
            stages,
            sizes,
            self.dp_size,
            train_batch_size=self._user_value("train_batch_size"),
            grad_accum=self._user_value("gradient_accumulation_steps"),
            min_train_batch_size=section.min_train_batch_size,
            max_train_batch_size=section.max_train_batch_size,
        )
        valid: dict[Candidate, ShardSpeedConfig] = {}
        for candidate in candidates:
            config = self._config(candidate)
            del config["autotuning"]  # the engine's side of it is validated where it is wired
            try:
                valid[candidate] = load_config(config, self.dp_size)
            except ConfigError as error:
                self.pruned.append((candidate, f"config refused: {error}"))
        if not valid:
            raise TuningError(
                "no candidate configuration is valid: "
                + "; ".join(f"{c.name}: {why}" for c, why in self.pruned)
                if self.pruned
                else "no candidate keeps the batch-size constraints"
            )
        return valid

    def _config(self, candidate: Candidate) -> dict[str, Any]:
        metric_path = self.exps_dir / candidate.name / METRICS_FILE
        return trial_config(self.base_config, candidate, self.section, str(metric_path))

    # -- trials ----------------------------------------------------------------------------------

    def run_trial(
        self, candidate: Candidate, estimate: Estimate | None = None, calibration: bool = False
    ) -> Trial:
        """Run (or with ``overwrite`` false, reuse) one trial and record it."""
        config = self._config(candidate)
        trial = Trial(candidate, config, self.exps_dir / candidate.name, estimate, calibration)
        metric_path = trial.directory / METRICS_FILE
        config_file = trial.directory / CONFIG_FILE
        started = time.monotonic()
        if not self.section.overwrite and _read_json(config_file) == config:
            trial.metrics = _read_json(metric_path)
            trial.status = "reused" if trial.metrics else "pending"
        if trial.status == "pending":
            shutil.rmtree(trial.directory, ignore_errors=True)
            trial.directory.mkdir(parents=True)
            _write_json(config_file, config)
            launch_args = copy.copy(self.args)
            launch_args.user_args = apply_arg_mappings(
                with_config(self.args.user_args, str(config_file)),
                self.section.arg_mappings,
                config,
            )
            launches = self._plan(launch_args)
            (trial.directory / "cmd.txt").write_text(
                "".join(shlex.join(launch.argv) + "\n" for launch in launches)
            )
            trial.status, trial.metrics = run_processes(
                launches, trial.directory, metric_path, self.trial_timeout_s, self.stop_grace_s
            )
        if trial.ok:
            problem = _check_metrics(trial.metrics, self.section.metric)
            if problem:
                trial.status = problem
        trial.seconds = time.monotonic() - started
        self.trials.append(trial)
        return trial

    def _score(self, trial: Trial) -> float:
        value = float(trial.metrics[self.section.metric])
        return value if _HIGHER_IS_BETTER[self.section.metric] else -value

    def _calibrated_planner(self, trial: Trial, precision: str) -> Planner:
        """The planner fitted to the first calibration trial, with num_params, the probe's bandwidth
        and optimizer-step time, and the memory bound."""
        metrics = trial.metrics
        info = self.section.model_info
        num_params = info.num_params if info is not None else None
        info_path = self.section.model_info_path
        if num_params is None and info_path and os.path.isfile(info_path):
            num_params = (_read_json(Path(info_path)) or {}).get("num_params")
        num_params = num_params or metrics.get("num_params")
        if not num_params:
            raise TuningError(
                "the parameter count is unknown: set autotuning.model_info.num_params, or have the "
                f"engine report num_params in {trial.directory / METRICS_FILE}"
            )
        if self.memory_limit_bytes is None and metrics.get("device_memory_bytes"):
            self.memory_limit_bytes = float(metrics["device_memory_bytes"])
            self.memory_limit_source = "device_memory_bytes reported by the calibration trial"
        if self.memory_limit_bytes is None:
            self.memory_limit_bytes, self.memory_limit_source = local_memory_bytes(
                self.ranks_per_node
            )
        bandwidth, optimizer_s_per_param = None, 0.0
        if self.dp_size > 1:
            # Stages differ in their communication and in the parameters each rank updates.
            measured = probe(
                self.args,
                self._plan,
                self.exps_dir / "bandwidth_probe",
                self.trial_timeout_s,
                optimizer_params=math.ceil(int(num_params) / self.section.mp_size),
            )
            bandwidth = float(measured["bus_bandwidth_bytes_per_s"])
            optimizer_s_per_param = float(measured.get("optimizer_s_per_param") or 0.0)
        zero = self.base_config.get("zero_optimization") or {}
        planner = Planner(
            num_params=int(num_params),
            dp_size=self.dp_size,
            mp_size=self.section.mp_size,
            precision=precision,
            offload_optimizer=_offloaded(zero, "offload_optimizer"),
            offload_param=_offloaded(zero, "offload_param"),
            bandwidth=bandwidth,
            optimizer_s_per_param=optimizer_s_per_param,
            tokens_per_sample=float(metrics.get("tokens_per_sample") or 1.0),
        ).calibrate([self._measurement(trial)])
        if info_path and not os.path.exists(info_path):
            _write_json(
                Path(info_path),
                {
                    "num_params": planner.num_params,
                    "activation_bytes_per_sample": planner.activation_bytes_per_sample,
                },
            )
        return planner

    @staticmethod
    def _measurement(trial: Trial) -> Measurement:
        metrics = trial.metrics
        return Measurement(
            trial.candidate,
            metrics["step_time_s"],
            metrics.get("peak_memory_bytes"),
            metrics.get("activation_memory_bytes"),
        )

    def tune(self) -> Trial:
        """Run the trials; returns the best one (also in `best`). Results are written as it goes.

        With the step-time model usable (`predicting_planner`) the trials follow its prediction
        from the first; otherwise two calibration trials fit the planner that orders the rest."""
        self.results_dir.mkdir(parents=True, exist_ok=True)
        validated = self.candidates()
        candidates = list(validated)
        predicting = self.predicting_planner(validated)
        if predicting is None:
            queue = self._calibrate(validated, candidates)
        else:
            self.planner, self.predicted = predicting, True
            queue = self._order(candidates)
        without_gain = 0
        self._write_results()
        while (
            queue
            and len(self.trials) < self.section.tuner_num_trials
            and without_gain < self.section.tuner_early_stopping
        ):
            self._refit()
            if self.section.tuner_type == "model_based":
                queue = self._rerank(queue)
                if not queue:
                    break
            candidate = queue.pop(0)
            trial = self.run_trial(candidate, self.planner.estimate(candidate))
            self._report(trial)
            if trial.ok and (self.best is None or self._score(trial) > self._score(self.best)):
                self.best, without_gain = trial, 0
            else:
                without_gain += 1
            self._write_results()
        self._refit()  # the summary's model: fitted to every trial
        self._write_results()
        best = self.best
        if best is None:
            raise TuningError(
                f"no trial succeeded: see the stderr.log of each trial under {self.exps_dir}"
            )
        if without_gain >= self.section.tuner_early_stopping and queue:
            self._say(
                f"early stop: {without_gain} trials in a row did not beat {best.candidate.name}"
            )
        self._say(f"best: {best.candidate.name} ({self._metric_text(best)})")
        self._say(f"summary: {self.results_dir / SUMMARY_FILE}")
        return best

    def predicting_planner(self, validated: Mapping[Candidate, ShardSpeedConfig]) -> Planner | None:
        """The planner that ranks with the step-time model (docs/planning.md) before any trial,
        for this job's nodes x processes per node of the GPU kind (`autotuning.gpu`, else this
        machine's accelerator); None, saying why once, when the kind, the parameter count
        (`model_info.num_params` or `model_info_path`) or the tokens a sample
        (`model_info.tokens_per_sample`) is unknown."""
        info = self.section.model_info
        gpu, source = self.section.gpu, "autotuning.gpu"
        if gpu is None:
            gpu, name = local_gpu_kind()
            source = f"this machine's {name}"
            if gpu is None:
                self._say(
                    f"the step-time model has no GPU kind ({name} here; set autotuning.gpu to one "
                    f"of {', '.join(GPUS)}): the search starts from calibration trials"
                )
                return None
        num_params = info.num_params if info is not None else None
        info_path = self.section.model_info_path
        saved = {}
        if info_path and os.path.isfile(info_path):
            saved = _read_json(Path(info_path)) or {}
        num_params = num_params or saved.get("num_params")
        tokens = info.tokens_per_sample if info is not None else None
        missing = [
            key
            for key, value in (
                ("autotuning.model_info.num_params", num_params),
                ("autotuning.model_info.tokens_per_sample", tokens),
            )
            if value is None
        ]
        if missing:
            self._say(
                f"the step-time model ({gpu}) needs {' and '.join(missing)} to rank layouts "
                "before any trial: the search starts from calibration trials"
            )
            return None
        cluster = Cluster(self.nodes, self.ranks_per_node, gpu)
        if self.memory_limit_bytes is None:
            self.memory_limit_bytes = float(cluster.gpu_kind.memory_bytes)
            self.memory_limit_source = f"the memory of one {gpu}"
        self._say(
            f"trials in the order the step-time model predicts for {self.nodes} x "
            f"{self.ranks_per_node} {gpu} ({source}), no calibration trials"
        )
        zero = self.base_config.get("zero_optimization") or {}
        return Planner(
            num_params=int(num_params),
            dp_size=self.dp_size,
            mp_size=self.section.mp_size,
            precision=next(iter(validated.values())).precision,
            offload_optimizer=_offloaded(zero, "offload_optimizer"),
            offload_param=_offloaded(zero, "offload_param"),
            tokens_per_sample=float(tokens),
            activation_bytes_per_sample=float(saved.get("activation_bytes_per_sample") or 0.0),
            cluster=cluster,
        )

    def _order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """The planner's order of `candidates` (shuffled by the random tuner); the pruned are
        recorded."""
        plan = self.planner.plan(
            candidates,
            self.memory_limit_bytes,
            per_stage=self.section.num_tuning_micro_batch_sizes,
            metric=self.section.metric,
        )
        self.pruned += [(estimate.candidate, why) for estimate, why in plan.pruned]
        queue = [estimate.candidate for estimate in plan.ranked]
        if self.section.tuner_type == "random":
            self.rng.shuffle(queue)
        return queue

    def _calibrate(
        self, validated: Mapping[Candidate, ShardSpeedConfig], candidates: list[Candidate]
    ) -> list[Candidate]:
        """The two calibration trials and the calibrated planner's order of the other
        candidates."""
        first = min(candidates, key=lambda c: (-c.stage, c.micro_batch, -c.grad_accum))
        self._say(f"calibration trial {first.name} (the candidate needing the least memory)")
        calibration = self.run_trial(first, calibration=True)
        self._report(calibration)
        if not calibration.ok:
            self._write_results()
            raise TuningError(
                f"calibration trial {first.name} {calibration.status}: see "
                f"{calibration.directory / 'stderr.log'}"
            )
        self.best = calibration
        self.planner = self._calibrated_planner(calibration, validated[first].precision)
        self.fitted_to = 1
        second = self._second_calibration(first, candidates)
        if second is not None and self.section.tuner_num_trials > 1:
            self._say(
                f"calibration trial {second.name} (the largest micro-batch estimated to fit, to "
                "separate per-micro-step from per-sample time)"
            )
            other = self.run_trial(second, calibration=True)
            self._report(other)
            if other.ok and self._score(other) > self._score(self.best):
                self.best = other
        calibrated = [trial for trial in self.trials if trial.ok]
        self.planner = self.planner.calibrate([self._measurement(t) for t in calibrated])
        self.fitted_to = len(calibrated)
        for trial in calibrated:
            trial.estimate = self.planner.estimate(trial.candidate)
        tried = {trial.candidate for trial in self.trials}
        return self._order([c for c in candidates if c not in tried])

    def _second_calibration(
        self, first: Candidate, candidates: Sequence[Candidate]
    ) -> Candidate | None:
        """The other end of the micro-batch range: the largest micro-batch the planner fitted to
        `first` says fits, at `first`'s stage if it has another size, else at the nearest stage."""
        fitting = [
            candidate
            for candidate in candidates
            if candidate.micro_batch != first.micro_batch
            and (
                self.memory_limit_bytes is None
                or self.planner.estimate(candidate).memory_bytes <= self.memory_limit_bytes
            )
        ]
        if not fitting:
            return None
        return min(fitting, key=lambda c: (abs(c.stage - first.stage), -c.micro_batch, -c.stage))

    def _refit(self) -> None:
        """Fit the planner to every successful trial so far (each estimate is then made from all
        the trials before it); only ``model_based`` also re-ranks with it. The step-time model's
        prediction is not refitted: each trial shows it beside the measurement."""
        if self.predicted:
            return
        measured = [self._measurement(trial) for trial in self.trials if trial.ok]
        if len(measured) > self.fitted_to:
            self.planner, self.fitted_to = self.planner.calibrate(measured), len(measured)

    def _rerank(self, queue: list[Candidate]) -> list[Candidate]:
        """model_based: re-prune by memory and re-order with the refitted planner."""
        plan = self.planner.plan(queue, self.memory_limit_bytes, metric=self.section.metric)
        self.pruned += [(estimate.candidate, why) for estimate, why in plan.pruned]
        return [estimate.candidate for estimate in plan.ranked]

    # -- reporting -------------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        print(f"shardspeed autotuning: {message}", file=sys.stderr, flush=True)

    def _metric_text(self, trial: Trial) -> str:
        value = trial.metrics[self.section.metric]
        unit = {"throughput": "samples/s", "latency": "s/step", "flops": "FLOP/s"}[
            self.section.metric
        ]
        return f"{self.section.metric} {value:.4g} {unit}"

    def _report(self, trial: Trial) -> None:
        text = f"trial {len(self.trials)} {trial.candidate.name}: {trial.status}"
        if trial.ok:
            text += f", {self._metric_text(trial)}"
        error = trial.throughput_error()
        if error is not None:
            said = "predicted by the step-time model" if self.predicted else "estimated"
            text += f", {said} {trial.estimate.throughput:.4g} samples/s ({error:+.1%})"
        self._say(text)

    def mean_abs_error(self) -> tuple[float | None, float | None]:
        """Mean |relative error| of the estimated throughput and memory, calibration trials
        excluded (the model is fitted to them)."""
        scored = [t for t in self.trials if not t.calibration]
        means = []
        for errors in (
            [t.throughput_error() for t in scored],
            [t.memory_error() for t in scored],
        ):
            known = [abs(e) for e in errors if e is not None]
            means.append(sum(known) / len(known) if known else None)
        return means[0], means[1]

    def summary_rows(self) -> list[dict[str, Any]]:
        rows = []
        for number, trial in enumerate(self.trials, start=1):
            c, e, m = trial.candidate, trial.estimate, trial.metrics or {}
            rows.append(
                {
                    "trial": number,
                    "name": c.name,
                    "calibration": trial.calibration,
                    "status": trial.status,
                    "stage": c.stage,
                    "micro_batch": c.micro_batch,
                    "grad_accum": c.grad_accum,
                    "train_batch": c.train_batch,
                    "measured_throughput": m.get("throughput"),
                    "measured_metric": m.get(self.section.metric),
                    "measured_peak_memory_bytes": m.get("peak_memory_bytes"),
                    "estimated_throughput": e.throughput if e else None,
                    "estimated_step_time_s": e.step_time_s if e else None,
                    "estimated_memory_bytes": e.memory_bytes if e else None,
                    "throughput_error": trial.throughput_error(),
                    "memory_error": trial.memory_error(),
                    "seconds": round(trial.seconds, 3),
                    "config": str(trial.directory / CONFIG_FILE),
                }
            )
        return rows

    def _write_results(self) -> None:
        rows = self.summary_rows()
        throughput_error, memory_error = self.mean_abs_error()
        planner = self.planner
        calibration = None
        if planner is not None:
            calibration = {
                "fitted_to_trials": self.fitted_to,
                "num_params": planner.num_params,
                "dp_size": planner.dp_size,
                "mp_size": planner.mp_size,
                "precision": planner.precision,
                "flops_per_s_per_rank": planner.flops_per_s,
                "tokens_per_sample": planner.tokens_per_sample,
                "micro_step_s": {str(k): v for k, v in sorted(planner.micro_step_s.items())},
                "optimizer_s_per_param": planner.optimizer_s_per_param,
                "activation_bytes_per_sample": planner.activation_bytes_per_sample,
                "runtime_bytes": planner.runtime_bytes,
                "bus_bandwidth_bytes_per_s": planner.bandwidth,
                "memory_limit_bytes": self.memory_limit_bytes,
                "memory_limit_source": self.memory_limit_source,
                "step_time_model": dataclasses.asdict(planner.cluster) if self.predicted else None,
            }
        best = self.best.candidate.name if self.best else None
        _write_json(
            self.results_dir / SUMMARY_JSON_FILE,
            {
                "metric": self.section.metric,
                "tuner_type": self.section.tuner_type,
                "best": best,
                "trials": rows,
                "mean_abs_throughput_error": throughput_error,
                "mean_abs_memory_error": memory_error,
                "calibration": calibration,
                "pruned": [{"name": c.name, "reason": why} for c, why in self.pruned],
            },
        )
        (self.results_dir / SUMMARY_FILE).write_text(
            _summary_text(
                rows, best, self.section, calibration, throughput_error, memory_error, self.pruned
            )
        )
        if self.best is not None:
            optimal = {k: v for k, v in self.best.config.items() if k != "autotuning"}
            _write_json(self.results_dir / OPTIMAL_CONFIG_FILE, optimal)

    def run_best(self) -> int:
        """Launch the training with ``ds_config_optimal.json``, as the launcher would."""
        optimal = self.results_dir / OPTIMAL_CONFIG_FILE
        launch_args = copy.copy(self.args)
        launch_args.user_args = apply_arg_mappings(
            with_config(self.args.user_args, str(optimal)),
            self.section.arg_mappings,
            self.best.config,
        )
        launches = self._plan(launch_args)
        for launch in launches:
            print(f"shardspeed: {shlex.join(launch.argv)}", file=sys.stderr, flush=True)
        return runner.run_launches(launches)


def _offloaded(zero: Mapping[str, Any], key: str) -> bool:
    """Whether the user's `zero_optimization` section offloads `key` (a device other than none)."""
    return (zero.get(key) or {}).get("device", "none") != "none"


def _number(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _bytes(value: float | None) -> str:
    return "-" if value is None else format_bytes(value)


def _summary_text(
    rows: list[dict[str, Any]],
    best: str | None,
    section: AutotuningConfig,
    calibration: dict[str, Any] | None,
    throughput_error: float | None,
    memory_error: float | None,
    pruned: list[tuple[Candidate, str]],
) -> str:
    """summary.txt: the trial table, the best trial, the estimate's accuracy and what was pruned."""
    other_metric = section.metric != "throughput"
    header = ["#", "trial", "status", "stage", "mbs", "gas", "batch"]
    header += [f"measured {section.metric}"] if other_metric else []
    header += ["samples/s", "estimated", "error", "peak memory", "estimated", "error"]
    table = [header]
    for row in rows:
        name = row["name"] + (" (calibration)" if row["calibration"] else "")
        cells = [str(row["trial"]), name + (" *" if row["name"] == best else ""), row["status"]]
        cells += [str(row[key]) for key in ("stage", "micro_batch", "grad_accum", "train_batch")]
        cells += [_number(row["measured_metric"])] if other_metric else []
        cells += [
            _number(row["measured_throughput"]),
            _number(row["estimated_throughput"]),
            _percent(row["throughput_error"]),
            _bytes(row["measured_peak_memory_bytes"]),
            _bytes(row["estimated_memory_bytes"]),
            _percent(row["memory_error"]),
        ]
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    lines += [
        "",
        f"best (* above, by {section.metric}): {best or 'none'}",
        "mean |estimate error| over the trials after calibration: throughput "
        f"{_number(throughput_error and 100 * throughput_error, '.1f')}%, memory "
        f"{_number(memory_error and 100 * memory_error, '.1f')}%",
    ]
    lines += _estimates_text(calibration)
    if pruned:
        lines += ["", f"not tried ({len(pruned)}):"]
        lines += [f"  {candidate.name}: {why}" for candidate, why in pruned]
    return "\n".join(lines) + "\n"


def _estimates_text(calibration: dict[str, Any] | None) -> list[str]:
    """summary.txt's lines on where the estimates came from: the step-time model's prediction,
    or the planner model fitted to calibration trials (none without either)."""
    if calibration is None:
        return []
    if calibration["step_time_model"] is not None:
        cluster = calibration["step_time_model"]
        return [
            "",
            "estimates: the step-time model's prediction (docs/planning.md) for "
            f"{cluster['nodes']} x {cluster['gpus_per_node']} {cluster['gpu']}, made before any "
            "trial and not refitted:",
            f"  {calibration['num_params']:,} parameters, {calibration['tokens_per_sample']:g} "
            f"tokens a sample, {calibration['dp_size']} data-parallel x "
            f"{calibration['mp_size']} model-parallel ranks, {calibration['precision']}",
            f"  memory limit {_bytes(calibration['memory_limit_bytes'])} a rank "
            f"({calibration['memory_limit_source']}); memory is the model states and "
            f"{_bytes(calibration['activation_bytes_per_sample'])} of activations a sample",
        ]
    bandwidth = calibration["bus_bandwidth_bytes_per_s"]
    return [
        "",
        f"planner model (fitted to {calibration['fitted_to_trials']} trial(s)):",
        f"  {calibration['num_params']:,} parameters, {calibration['dp_size']} data-parallel x "
        f"{calibration['mp_size']} model-parallel ranks, {calibration['precision']}",
        f"  compute {_number(calibration['flops_per_s_per_rank'])} FLOP/s per rank (6 x "
        f"parameters x {calibration['tokens_per_sample']:g} token(s) a sample) + per "
        "micro-step "
        + (
            ", ".join(
                f"{seconds:.4g} s at stage {stage}"
                for stage, seconds in calibration["micro_step_s"].items()
            )
            or "0 s"
        )
        + " (other stages: the nearest's)",
        f"  optimizer step {_number(calibration['optimizer_s_per_param'])} s a parameter updated",
        f"  activations {_bytes(calibration['activation_bytes_per_sample'])} a sample, "
        f"{_bytes(calibration['runtime_bytes'])} besides model states and activations",
        "  bus bandwidth "
        + (f"{bandwidth / 1e9:.4g} GB/s" if bandwidth else "- (one data-parallel rank)"),
        f"  memory limit {_bytes(calibration['memory_limit_bytes'])} a rank "
        f"({calibration['memory_limit_source']})",
    ]


def run_autotuning(args: argparse.Namespace) -> int:
    """What ``shardspeed --autotuning tune|run`` does; returns the exit status."""
    try:
        limit = os.environ.get(MEMORY_LIMIT_ENV)
        tuner = Autotuner(
            args,
            memory_limit_bytes=parse_bytes(limit) if limit else None,
            trial_timeout_s=float(os.environ.get(TRIAL_TIMEOUT_ENV, DEFAULT_TRIAL_TIMEOUT_S)),
        )
        tuner.tune()
    except (TuningError, ValueError) as error:
        print(f"shardspeed: autotuning: {error}", file=sys.stderr)
        return 2
    return tuner.run_best() if args.autotuning == "run" else 0


def _probe_bandwidth(result_path: str, optimizer_params: int = 0) -> None:
    """Time an all-reduce over every process and write the bus bandwidth; with `optimizer_params`,
    also time an AdamW step (run under torchrun)."""
    import torch
    import torch.distributed as dist

    from shardspeed.comm import init_distributed

    init_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    size = (64 if cuda else 8) * 2**20
    buffer = torch.ones(size // 4, device=device)

    def seconds_per_call(calls: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(buffer)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls

    seconds_per_call(2)  # connections and buffers are set up on first use
    seconds = seconds_per_call(5)
    world = dist.get_world_size()
    result = {
        "bus_bandwidth_bytes_per_s": 2 * (world - 1) / world * size / seconds,
        "bytes": size,
        "seconds": seconds,
        "world_size": world,
    }
    if optimizer_params > 0:
        # One flat fp32 tensor, fused where torch has it (as the engine builds AdamW), at most 2**24
        # elements: the step is memory-bound, so its time per parameter carries over to larger ones.
        numel = min(optimizer_params, 2**24)
        param = torch.nn.Parameter(torch.zeros(numel, device=device))
        param.grad = torch.full_like(param, 1e-3)
        fused = {"fused": True} if device.type in ("cpu", "cuda") else {}
        optimizer = torch.optim.AdamW([param], lr=1e-3, **fused)
        optimizer.step()  # creates the state
        dist.barrier()  # every rank steps at once, as in training
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        result["optimizer_s_per_param"] = (time.perf_counter() - start) / 5 / numel
        result["optimizer_params_timed"] = numel
    if dist.get_rank() == 0:
        _write_json(Path(result_path), result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] != PROBE_FLAG:
        sys.exit(
            f"usage: python -m {PROBE_MODULE} {PROBE_FLAG} RESULT.json [PARAMETERS] (under torchrun)"
        )
    _probe_bandwidth(sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else 0)
