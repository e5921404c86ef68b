"""Autotuning: the planner's model and pruning, the tuner's trials, and ``shardspeed --autotuning``.

The tuner's trials run a fake training script that reads its config and writes the metric file as
the engine will (see shardspeed.autotuning.tuner), with simulated times and memory, so that which
configuration wins is known and no engine is needed. Most tests start it with plain ``python``;
the command-line test and the bandwidth probe go through torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from shardspeed import cli
from shardspeed.autotuning.planner import (
    Candidate,
    Measurement,
    Planner,
    enumerate_candidates,
    micro_batch_sizes,
)
from shardspeed.autotuning.tuner import (
    Autotuner,
    TuningError,
    apply_arg_mappings,
    config_path,
    measure_bandwidth,
    parse_bytes,
    probe,
    trial_config,
    with_config,
)
from shardspeed.config.errors import ConfigError
from shardspeed.config.schema import AutotuningConfig
from shardspeed.launcher import runner
from shardspeed.launcher.runner import Launch

P = 1_000_000

# The fake script's world: 1,000 fp32 parameters (16 kB of model states at every stage with one
# rank), 2 kB + 4 kB of activations per sample on top, 76 kB of device memory; a step costs 4 ms per
# micro-step, 1 ms per sample, 3 ms more per sample past 4 and 1 ms per ZeRO stage. Best: stage 0,
# micro-batch 4.
FAKE_SCRIPT = r"""
import json, os, sys, time

args = sys.argv[1:]
config = json.load(open(args[args.index("--deepspeed_config") + 1]))
stage = config["zero_optimization"]["stage"]
micro = config["train_micro_batch_size_per_gpu"]
steps = config["gradient_accumulation_steps"]
if "--batch" in args:
    assert int(args[args.index("--batch") + 1]) == micro, "arg_mappings did not set --batch"
tuning = config.get("autotuning") or {}
if not tuning.get("metric_path"):
    with open(os.environ["FAKE_TRAINED"], "w") as out:
        json.dump({"config": config, "args": args}, out)
    sys.exit(0)
mode = os.environ.get("FAKE_MODE", "")
if mode == "hang":
    time.sleep(60)
if mode == "oom" and micro >= 8:
    sys.exit("out of memory")
step = steps * (0.004 + 0.001 * micro + 0.003 * max(micro - 4, 0)) + 0.001 * stage
metrics = {
    "throughput": config["train_batch_size"] / step,
    "latency": step,
    "step_time_s": step,
    "flops": None,
    "peak_memory_bytes": 16 * 1000 + 2000 + 4000 * micro,
    "activation_memory_bytes": 4000 * micro,
    "device_memory_bytes": 76000,
    "num_params": 1000,
}
temporary = tuning["metric_path"] + ".tmp"
with open(temporary, "w") as out:
    json.dump(metrics, out)
os.replace(temporary, tuning["metric_path"])
if mode == "linger":
    time.sleep(60)
"""


def _fake_throughput(stage: int, micro: int) -> float:
    return micro / (0.004 + 0.001 * micro + 0.003 * max(micro - 4, 0) + 0.001 * stage)


# --- planner ---------------------------------------------------------------------------------------


def _candidate(stage: int, micro: int = 1, steps: int = 1, dp: int = 4) -> Candidate:
    return Candidate(stage, micro, steps, micro * steps * dp)


def test_model_state_memory_is_the_zero_formulas() -> None:
    # ZeRO paper, fp16 mixed precision with Adam (K = 12), per rank over N = 4 ranks.
    planner = Planner(num_params=P, dp_size=4, precision="fp16")
    expected = {0: 16 * P, 1: 4 * P + 12 * P / 4, 2: 2 * P + 14 * P / 4, 3: 16 * P / 4}
    for stage, bytes_ in expected.items():
        assert planner.model_states(_candidate(stage))["device_total"] == bytes_
    # Model parallelism splits the parameters first; fp32 keeps no separate master copy.
    assert Planner(num_params=P, dp_size=4, mp_size=2).model_states(_candidate(0))[
        "device_total"
    ] == (16 * P / 2)
    fp32 = Planner(num_params=P, dp_size=4, precision="fp32")
    assert fp32.model_states(_candidate(2))["device_total"] == 4 * P + 12 * P / 4
    # An optimizer offload counts only where the stage allows one.
    offload = Planner(num_params=P, dp_size=4, offload_optimizer=True)
    assert offload.model_states(_candidate(0))["device_total"] == 16 * P
    assert offload.model_states(_candidate(2))["device_total"] == 2 * P + 2 * P / 4


def test_communication_bytes_by_stage() -> None:
    planner = Planner(num_params=P, dp_size=4, precision="bf16")
    share = 3 / 4 * 2 * P  # one ring reduce-scatter or all-gather, per rank
    passes = {0: 2, 1: 2, 2: 4 + 1, 3: 3 * 4}  # with 4 accumulation steps
    for stage, count in passes.items():
        assert planner.comm_bytes(_candidate(stage, steps=4)) == pytest.approx(count * share)
    assert Planner(num_params=P, dp_size=1).comm_bytes(_candidate(3, dp=1)) == 0
    with pytest.raises(ValueError, match="bandwidth"):
        planner.comm_s(_candidate(0))


def test_calibration_recovers_the_model() -> None:
    truth = Planner(
        num_params=P,
        dp_size=4,
        bandwidth=1e9,
        optimizer_s_per_param=2e-9,
        flops_per_s=2e12,
        micro_step_s={1: 0.01, 2: 0.03},
        activation_bytes_per_sample=5e6,
        runtime_bytes=3e6,
    )
    one, two = _candidate(1, micro=2, steps=4), _candidate(1, micro=8, steps=1)
    three = _candidate(2, micro=4, steps=2)
    measured = [
        Measurement(
            c,
            truth.estimate(c).step_time_s,
            truth.estimate(c).memory_bytes,
            activation_bytes=5e6 * c.micro_batch,
        )
        for c in (one, two, three)
    ]
    untrained = Planner(num_params=P, dp_size=4, bandwidth=1e9, optimizer_s_per_param=2e-9)
    fitted = untrained.calibrate(measured)
    assert fitted.flops_per_s == pytest.approx(2e12)
    assert fitted.micro_step_s == pytest.approx({1: 0.01, 2: 0.03})
    assert fitted.activation_bytes_per_sample == pytest.approx(5e6)
    assert fitted.runtime_bytes == pytest.approx(3e6)
    # Two micro-batch sizes at one stage separate the per-micro-step from the per-sample time;
    # stages not measured take the nearest measured stage's.
    pair = untrained.calibrate(measured[:2])
    assert pair.flops_per_s == pytest.approx(2e12)
    assert pair.micro_step_s == pytest.approx({1: 0.01})
    for stage in (0, 3):
        candidate = _candidate(stage, micro=4, steps=2)
        assert pair.micro_step_time(stage) == pytest.approx(0.01)
        expected = truth.estimate(candidate).step_time_s + (0.01 - truth.micro_step_time(stage)) * 2
        assert pair.estimate(candidate).step_time_s == pytest.approx(expected)
    # One measurement: all compute is per sample, exact at the calibration point.
    single = untrained.calibrate(measured[:1])
    assert single.micro_step_s == {1: 0}
    assert single.estimate(one).step_time_s == pytest.approx(measured[0].step_time_s)
    assert single.estimate(one).memory_bytes == pytest.approx(measured[0].peak_memory_bytes)
    # Without the activations measured, all that is not model states is charged per sample.
    unsplit = Measurement(one, 1.0, measured[0].peak_memory_bytes)
    conservative = Planner(num_params=P, dp_size=4, bandwidth=1e9).calibrate([unsplit])
    assert conservative.runtime_bytes == 0
    assert conservative.activation_bytes_per_sample == pytest.approx(5e6 + 3e6 / 2)
    assert conservative.estimate(two).memory_bytes > truth.estimate(two).memory_bytes


def test_memory_is_fitted_over_micro_batch_sizes() -> None:
    planner = Planner(num_params=P, dp_size=4, bandwidth=1e9)
    states = planner.model_states(_candidate(3))["device_total"]

    def measured(micro: int, rest: float, activations: float) -> Measurement:
        return Measurement(_candidate(3, micro=micro), 1.0, states + rest, activations)

    # Activations with a fixed part (3 MB here) make the one-size split overestimate larger
    # micro-batches; two sizes give the slope and the fixed part directly.
    pair = [measured(1, 10e6 + 3e6 + 4e6, 3e6 + 4e6), measured(16, 10e6 + 3e6 + 64e6, 3e6 + 64e6)]
    one = planner.calibrate(pair[:1])
    assert one.activation_bytes_per_sample == pytest.approx(7e6)
    two = planner.calibrate(pair)
    assert two.activation_bytes_per_sample == pytest.approx(4e6)
    assert two.runtime_bytes == pytest.approx(13e6)
    for m in pair:
        assert two.estimate(m.candidate).memory_bytes == pytest.approx(m.peak_memory_bytes)
    # Noisy peaks: a least-squares slope, the fixed part raised until no measurement is above.
    noisy = [measured(1, 10e6, 0), measured(4, 12e6, 0), measured(8, 22e6, 0)]
    fitted = planner.calibrate(noisy)
    assert fitted.activation_bytes_per_sample > 0
    estimates = [fitted.estimate(m.candidate).memory_bytes for m in noisy]
    assert all(e >= m.peak_memory_bytes - 1 for e, m in zip(estimates, noisy))
    assert min(e - m.peak_memory_bytes for e, m in zip(estimates, noisy)) == pytest.approx(0, abs=1)


def test_step_time_terms_by_stage() -> None:
    planner = Planner(
        num_params=P,
        dp_size=4,
        bandwidth=1e9,
        optimizer_s_per_param=1e-9,
        flops_per_s=6e9,  # 1 ms a sample
        micro_step_s={0: 0.002, 3: 0.005},
    )
    # The optimizer updates every parameter at stage 0, a quarter of them when sharded.
    assert planner.optimizer_s(_candidate(0)) == pytest.approx(1e-3)
    assert [planner.optimizer_s(_candidate(s)) for s in (1, 2, 3)] == pytest.approx([2.5e-4] * 3)
    # Per micro-step time: a stage's own, else the nearest stage's (the lower on a tie).
    assert [planner.micro_step_time(s) for s in range(4)] == [0.002, 0.002, 0.005, 0.005]
    estimate = planner.estimate(_candidate(2, micro=8, steps=3))
    assert estimate.compute_s == pytest.approx(3 * (0.005 + 8 * 0.001))
    assert estimate.optimizer_s == pytest.approx(2.5e-4)
    assert estimate.comm_s == pytest.approx(planner.comm_bytes(estimate.candidate) / 1e9)
    assert estimate.step_time_s == pytest.approx(
        estimate.compute_s + estimate.optimizer_s + estimate.comm_s
    )
    # Noise that would make the per-micro-step time negative leaves it at 0.
    noisy = [
        Measurement(_candidate(0, micro=1, steps=4), 0.004 + 1e-3),
        Measurement(_candidate(0, micro=4, steps=1), 0.006 + 1e-3),
    ]
    fitted = Planner(num_params=P, dp_size=4, bandwidth=1e30, optimizer_s_per_param=1e-9)
    fitted = fitted.calibrate(noisy)
    assert fitted.micro_step_s == {0: 0} and fitted.flops_per_s > 0


def test_plan_prunes_over_the_memory_limit_and_ranks_by_throughput() -> None:
    planner = Planner(num_params=P, dp_size=4, bandwidth=1e10).calibrate(
        [Measurement(_candidate(3, micro=1), 0.05, 16 * P / 4 + 1e5)]
    )
    assert planner.activation_bytes_per_sample == pytest.approx(1e5)
    candidates = enumerate_candidates(range(4), [1, 2, 4, 8, 16], 4)
    limit = 2 * P + 14 * P / 4 + 8e5 + 1  # stage 2 fits up to micro-batch 8, stages 0-1 not at all
    plan = planner.plan(candidates, limit)
    fitting = {(e.candidate.stage, e.candidate.micro_batch) for e in plan.ranked}
    assert fitting == {(2, m) for m in (1, 2, 4, 8)} | {(3, m) for m in (1, 2, 4, 8, 16)}
    assert all(e.memory_bytes <= limit for e in plan.ranked)
    assert all(e.memory_bytes > limit and "limit" in why for e, why in plan.pruned)
    throughputs = [e.throughput for e in plan.ranked]
    assert throughputs == sorted(throughputs, reverse=True)
    # per_stage keeps each stage's best micro-batch sizes only.
    kept = planner.plan(candidates, limit, per_stage=2).ranked
    assert sorted((e.candidate.stage, e.candidate.micro_batch) for e in kept) == [
        (2, 4),
        (2, 8),
        (3, 8),
        (3, 16),
    ]
    latency_first = planner.plan(candidates, limit, metric="latency").ranked[0]
    assert latency_first.step_time_s == min(e.step_time_s for e in plan.ranked)


def test_before_any_trial_the_step_time_model_ranks_the_layouts() -> None:
    """An 8B model (8,192 tokens a sample) on 8 nodes of 8 H100s, batch 512, ZeRO 0-3 at
    micro-batches 1-4. Given the cluster, the planner ranks before any trial by the step-time
    model's prediction for each layout (its FLOPs and ZeRO collectives, `step_inputs`). On
    inter-node links 50 times slower, the layouts that move the model's bytes least often lead:
    stages 0 and 1 (twice a step), then stage 2 (once a micro-step, plus the gather), larger
    micro-batches first, and stage 3 (three times a micro-step) last at each micro-batch."""
    from shardspeed.autotuning.step_time import step_time
    from shardspeed.autotuning.systems import Cluster

    candidates = enumerate_candidates(range(4), [1, 2, 4], 64, train_batch_size=512)
    slow = (("inter_node_bw", 5e8),)
    for cluster in (Cluster(8, 8, "H100-SXM"), Cluster(8, 8, "H100-SXM", overrides=slow)):
        planner = Planner(num_params=8 * 10**9, dp_size=64, precision="bf16",
                          tokens_per_sample=8192, cluster=cluster)  # fmt: skip
        ranked = planner.plan(candidates, None).ranked
        predicted = [
            e.candidate.train_batch / step_time(planner.step_inputs(e.candidate), cluster).total
            for e in ranked
        ]
        assert [e.throughput for e in ranked] == pytest.approx(predicted, rel=1e-9)
        assert predicted == sorted(predicted, reverse=True) and len(ranked) == len(candidates)
    order = [(e.candidate.stage, e.candidate.micro_batch) for e in ranked]
    assert {stage for stage, _ in order[:6]} == {0, 1}
    stage_2 = [micro for stage, micro in order if stage == 2]
    assert stage_2 == [4, 2, 1]
    for micro in (1, 2, 4):
        slowest = [stage for stage, m in order if m == micro][-1]
        assert slowest == 3
    # The memory model prunes as before: stage 3's 16 bytes a parameter over 64 ranks fit in 4 GB.
    fits = planner.plan(candidates, 4 * 2**30).ranked
    assert {e.candidate.stage for e in fits} == {3}


def test_candidates_keep_the_batch_constraints() -> None:
    assert micro_batch_sizes(3, 20, 5) == [3, 4, 5, 8, 16, 20]
    assert micro_batch_sizes(1, 1024, [8, 2, 8]) == [2, 8]
    sizes = [1, 2, 4, 8, 16, 32]
    fixed = enumerate_candidates([1], sizes, 2, train_batch_size=32)
    assert [(c.micro_batch, c.grad_accum) for c in fixed] == [
        (1, 16),
        (2, 8),
        (4, 4),
        (8, 2),
        (16, 1),
    ]
    assert all(c.train_batch == 32 for c in fixed)
    capped = enumerate_candidates([0], sizes, 2, max_train_batch_size=20, min_train_batch_size=16)
    assert [(c.micro_batch, c.grad_accum, c.train_batch) for c in capped] == [
        (1, 10, 20),
        (2, 5, 20),
        (4, 2, 16),
        (8, 1, 16),
    ]
    free = enumerate_candidates([0, 3], [2, 4], 4, grad_accum=3)
    assert {(c.stage, c.micro_batch, c.grad_accum, c.train_batch) for c in free} == {
        (s, m, 3, 12 * m) for s in (0, 3) for m in (2, 4)
    }
    with pytest.raises(ValueError, match="outside the autotuning bounds"):
        enumerate_candidates([0], sizes, 2, train_batch_size=64, max_train_batch_size=32)


# --- trial configs and script args -----------------------------------------------------------------


def test_trial_config_drops_keys_of_other_stages() -> None:
    base = {
        "train_batch_size": "auto",
        "fp16": {"enabled": True},
        "zero_optimization": {
            "stage": [0, 3],
            "offload_optimizer": {"device": "cpu"},
            "stage3_prefetch_bucket_size": 1000,
            "max_live_parameters": 10**6,
            "reduce_scatter": False,
        },
        "autotuning": {"enabled": False, "end_profile_step": 7},
    }
    section = AutotuningConfig.model_validate(base["autotuning"])
    zero0 = trial_config(base, Candidate(0, 4, 2, 8), section, "/m.json")
    assert zero0["zero_optimization"] == {"stage": 0}
    assert (zero0["train_micro_batch_size_per_gpu"], zero0["gradient_accumulation_steps"]) == (4, 2)
    assert zero0["train_batch_size"] == 8
    assert zero0["autotuning"] == {
        "enabled": True,
        "metric_path": "/m.json",
        "metric": "throughput",
        "start_profile_step": 3,
        "end_profile_step": 7,
    }
    zero3 = trial_config(base, Candidate(3, 4, 2, 8), section, "/m.json")
    assert zero3["zero_optimization"] == {**base["zero_optimization"], "stage": 3}
    assert base["zero_optimization"]["stage"] == [0, 3]  # the user's config is left alone


def test_config_and_mapped_script_args() -> None:
    assert config_path(["--x", "1", "--deepspeed_config", "a.json"]) == "a.json"
    assert config_path(["--deepspeed_config=a.json"]) == "a.json"
    assert config_path(["--deepspeed", "--deepspeed", "hf.json"]) == "hf.json"
    assert with_config(["--deepspeed_config=a.json", "--y"], "b.json") == [
        "--deepspeed_config=b.json",
        "--y",
    ]
    assert with_config(["--deepspeed_config", "a.json"], "b.json") == [
        "--deepspeed_config",
        "b.json",
    ]
    for args in (["--deepspeed", "--lr", "1"], ["--deepspeed_config"]):
        with pytest.raises(TuningError, match="--deepspeed_config"):
            config_path(args)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}
    mappings = {
        "train_micro_batch_size_per_gpu": "--batch",
        "zero_optimization.stage": "--stage",
        "gradient_accumulation_steps": "--gas",
    }
    assert apply_arg_mappings(["--batch", "1", "--stage=0"], mappings, config) == [
        "--batch",
        "8",
        "--stage=2",
    ]
    assert apply_arg_mappings([], mappings, config) == ["--batch", "8", "--stage", "2"]


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512M") == 512 * 2**20
    assert parse_bytes("8.5e10") == 8.5e10
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes("lots")


# --- the tuner on a fake script --------------------------------------------------------------------


def _setup(tmp_path: Path, autotuning: dict, **config: object) -> argparse.Namespace:
    script = tmp_path / "train.py"
    script.write_text(FAKE_SCRIPT)
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(
        json.dumps({"zero_optimization": {"stage": [0, 1]}, **config, "autotuning": autotuning})
    )
    return runner.parse_args(
        ["--num_gpus", "1", str(script), "--deepspeed_config", str(cfg), "--epochs", "1"]
    )


def _tuner(
    tmp_path: Path, args: argparse.Namespace, mode: str = "", world_size: int = 1, **kwargs: object
) -> Autotuner:
    """A tuner whose trials run the fake script once (as a job of `world_size` ranks on one
    node: the script reads only its config)."""
    env = {**os.environ, "FAKE_MODE": mode, "FAKE_TRAINED": str(tmp_path / "trained.json")}

    def plan(launch_args: argparse.Namespace) -> list[Launch]:
        argv = [sys.executable, launch_args.user_script, *launch_args.user_args]
        return [Launch(argv, env, remote=False)]

    return Autotuner(args, plan=plan, world_size=world_size, cwd=str(tmp_path), **kwargs)


def _tried(tuner: Autotuner) -> list[str]:
    return [trial.candidate.name for trial in tuner.trials]


def test_gridsearch_picks_the_best_measured_and_writes_results(tmp_path: Path) -> None:
    args = _setup(
        tmp_path,
        {"tuner_num_trials": 5, "max_train_micro_batch_size_per_gpu": 32, "metric_path": "x"},
    )
    tuner = _tuner(tmp_path, args)
    best = tuner.tune()
    # Calibration on the candidate needing least memory and on the largest micro-batch that fits at
    # its stage, then the planner's order. Its model is linear in the micro-batch, so it ranks the
    # largest sizes first and misses the fake script's slowdown past micro-batch 4.
    assert _tried(tuner) == [
        "z1_mbs1_gas1",
        "z1_mbs8_gas1",
        "z0_mbs8_gas1",
        "z0_mbs4_gas1",
        "z1_mbs4_gas1",
    ]
    assert [t.calibration for t in tuner.trials] == [True, True, False, False, False]
    measured = {t.candidate.name: t.metrics["throughput"] for t in tuner.trials}
    assert measured["z0_mbs4_gas1"] == pytest.approx(_fake_throughput(0, 4))
    assert best.candidate.name == max(measured, key=measured.get) == "z0_mbs4_gas1"
    # Micro-batches 16 and 32 would need more than the 76 kB the script reports.
    pruned = {c.name: why for c, why in tuner.pruned}
    assert "limit" in pruned["z0_mbs16_gas1"] and "limit" in pruned["z1_mbs32_gas1"]
    assert "best micro-batch sizes" in pruned["z0_mbs1_gas1"]

    results = tmp_path / "autotuning_results"
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal
    assert (optimal["zero_optimization"]["stage"], optimal["train_micro_batch_size_per_gpu"]) == (
        0,
        4,
    )
    summary = (results / "summary.txt").read_text()
    assert "z0_mbs4_gas1 *" in summary and "z1_mbs1_gas1 (calibration)" in summary
    assert "z1_mbs8_gas1 (calibration)" in summary
    assert "mean |estimate error|" in summary
    data = json.loads((results / "summary.json").read_text())
    assert [row["name"] for row in data["trials"]] == _tried(tuner)
    assert data["calibration"]["memory_limit_bytes"] == 76000
    # Two calibration points, two unknowns at their stage (per micro-step and per sample): exact.
    for row in data["trials"][:2]:
        assert row["throughput_error"] == pytest.approx(0, abs=1e-9)
    assert data["calibration"]["fitted_to_trials"] == 5  # refitted before each trial and at the end
    errors = [abs(row["throughput_error"]) for row in data["trials"][2:]]
    assert data["mean_abs_throughput_error"] == pytest.approx(sum(errors) / len(errors))
    # The fake script's stage 0 costs 1 ms less a step: the estimate borrowed stage 1's time.
    assert data["trials"][2]["throughput_error"] == pytest.approx(320 / (1000 / 3) - 1)
    # Later estimates come from the planner refitted to the trials before them, stage 0's own
    # time per micro-step included; the fake script's slowdown past micro-batch 4 stays unmodelled.
    assert tuner.planner.micro_step_s.keys() == {0, 1}
    # The script's memory is the planner's model exactly: states + 2 kB + measured activations.
    assert all(row["memory_error"] == pytest.approx(0, abs=1e-9) for row in data["trials"])
    trial_dir = tmp_path / "autotuning_exps" / "z0_mbs4_gas1"
    assert json.loads((trial_dir / "ds_config.json").read_text())["autotuning"][
        "metric_path"
    ] == str(trial_dir / "metrics.json")


def test_early_stopping_and_trial_limit(tmp_path: Path) -> None:
    args = _setup(tmp_path, {"tuner_early_stopping": 2, "max_train_micro_batch_size_per_gpu": 8})
    tuner = _tuner(tmp_path, args)
    tuner.tune()
    # z0_mbs4 (2nd after calibration) is the last gain; two trials without one end the search.
    assert _tried(tuner) == [
        "z1_mbs1_gas1",
        "z1_mbs8_gas1",
        "z0_mbs8_gas1",
        "z0_mbs4_gas1",
        "z1_mbs4_gas1",
        "z0_mbs2_gas1",
    ]
    args = _setup(tmp_path, {"tuner_num_trials": 2, "max_train_micro_batch_size_per_gpu": 8})
    limited = _tuner(tmp_path, args)
    limited.tune()
    assert _tried(limited) == ["z1_mbs1_gas1", "z1_mbs8_gas1"]  # both calibration trials
    args = _setup(tmp_path, {"tuner_num_trials": 1, "max_train_micro_batch_size_per_gpu": 8})
    single = _tuner(tmp_path, args)
    single.tune()
    assert _tried(single) == ["z1_mbs1_gas1"] and single.fitted_to == 1


@pytest.mark.parametrize("tuner_type", ["random", "model_based"])
def test_other_tuner_types(tmp_path: Path, tuner_type: str) -> None:
    args = _setup(
        tmp_path,
        {"tuner_type": tuner_type, "tuner_num_trials": 4, "max_train_micro_batch_size_per_gpu": 8},
        train_batch_size=8,
    )
    tuner = _tuner(tmp_path, args, seed=3)
    best = tuner.tune()
    assert len(tuner.trials) == 4 and len(set(_tried(tuner))) == 4
    assert all(t.candidate.train_batch == 8 for t in tuner.trials)  # a fixed batch stays fixed
    assert best.metrics["throughput"] == max(t.metrics["throughput"] for t in tuner.trials)


def test_arg_mappings_reach_the_script(tmp_path: Path) -> None:
    args = _setup(
        tmp_path,
        {
            "tuner_num_trials": 2,
            "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"},
            "metric": "latency",
        },
    )
    tuner = _tuner(tmp_path, args)
    best = tuner.tune()  # the fake script fails unless --batch matches its micro-batch
    assert all(t.ok for t in tuner.trials)
    assert best.metrics["latency"] == min(t.metrics["latency"] for t in tuner.trials)


def test_trials_stop_on_metrics_or_timeout(tmp_path: Path) -> None:
    args = _setup(tmp_path, {"tuner_num_trials": 1})
    lingering = _tuner(tmp_path, args, mode="linger", stop_grace_s=0.2)
    assert lingering.tune().status == "ok"  # stopped once its metrics were written
    assert lingering.trials[0].seconds < 10
    hanging = _tuner(tmp_path, args, mode="hang", trial_timeout_s=1.0, stop_grace_s=0.2)
    with pytest.raises(TuningError, match="timeout"):
        hanging.tune()
    summary = json.loads((tmp_path / "autotuning_results" / "summary.json").read_text())
    assert summary["trials"][0]["status"] == "timeout"


def test_a_failed_second_calibration_trial_leaves_the_one_point_model(tmp_path: Path) -> None:
    args = _setup(tmp_path, {"tuner_num_trials": 4, "max_train_micro_batch_size_per_gpu": 8})
    tuner = _tuner(tmp_path, args, mode="oom")
    best = tuner.tune()
    assert [t.status for t in tuner.trials[:2]] == ["ok", "failed (exit 1)"]
    assert tuner.trials[1].calibration
    # The next trial was estimated from the first alone, all of it per sample: the same throughput.
    assert tuner.trials[2].estimate.throughput == pytest.approx(
        tuner.trials[0].metrics["throughput"]
    )
    assert best.ok and best.candidate.micro_batch < 8


def test_refused_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fast"):
        _tuner(tmp_path, _setup(tmp_path, {"fast": False}))
    with pytest.raises(ConfigError, match="profile"):
        _tuner(tmp_path, _setup(tmp_path, {"model_info": {"profile": True}}))
    with pytest.raises(ConfigError, match="tuner_type"):
        _tuner(tmp_path, _setup(tmp_path, {"tuner_type": "bayes"}))


def test_with_a_stated_gpu_the_trials_follow_the_step_time_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`autotuning.gpu` H100-SXM with an 8B model's parameter count and 4,096 tokens a sample,
    a job of 8 ranks on one node, ZeRO 0-3 at micro-batches 1-8: no calibration trial; the
    trials run in the step-time model's order (the planner's step_inputs through step_time),
    stage 0 (16 bytes a parameter: 128 GB a rank) pruned as not fitting an H100's 80 GiB, and
    each trial's log line and summary row show the prediction beside the measurement."""
    from shardspeed.autotuning.step_time import step_time

    autotuning = {
        "gpu": "H100-SXM",
        "model_info": {"num_params": 8 * 10**9, "tokens_per_sample": 4096},
        "max_train_micro_batch_size_per_gpu": 8,
        "tuner_num_trials": 4,
    }
    args = _setup(tmp_path, autotuning, zero_optimization={"stage": "all"}, bf16={"enabled": True})
    tuner = _tuner(tmp_path, args, world_size=8)
    tuner.tune()
    err = capsys.readouterr().err
    planner, cluster = tuner.planner, tuner.planner.cluster
    assert (cluster.nodes, cluster.gpus_per_node, cluster.gpu) == (1, 8, "H100-SXM")
    assert len(tuner.trials) == 4 and not any(t.calibration for t in tuner.trials)
    predicted = [
        t.candidate.train_batch / step_time(planner.step_inputs(t.candidate), cluster).total
        for t in tuner.trials
    ]
    assert [t.estimate.throughput for t in tuner.trials] == pytest.approx(predicted, rel=1e-9)
    assert predicted == sorted(predicted, reverse=True)
    ranked = planner.plan(tuner.candidates(), 80 * 2**30, per_stage=3).ranked
    assert _tried(tuner) == [e.candidate.name for e in ranked[:4]]
    pruned = {c.name: why for c, why in tuner.pruned}
    assert all("limit" in pruned[f"z0_mbs{m}_gas1"] for m in (1, 2, 4, 8))
    assert "order the step-time model predicts for 1 x 8 H100-SXM" in err
    assert err.count("predicted by the step-time model") == 4
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert "the step-time model's prediction" in summary and "(calibration)" not in summary


def test_without_a_gpu_kind_the_search_starts_from_calibration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The step-time model needs the GPU kind (this machine's, or autotuning.gpu) and the model's
    size: without them the tuner says so once and calibrates as before (the trial tests above);
    a kind it does not know is refused naming the key."""
    from shardspeed.autotuning.systems import gpu_kind_of
    from shardspeed.autotuning.tuner import local_gpu_kind

    tuner = _tuner(tmp_path, _setup(tmp_path, {}))
    assert tuner.predicting_planner(tuner.candidates()) is None
    kind, name = local_gpu_kind()
    said = capsys.readouterr().err
    if kind is None:  # this machine's accelerator (none on a CPU machine)
        assert f"the step-time model has no GPU kind ({name} here" in said
    assert "the search starts from calibration trials" in said
    stated = _tuner(tmp_path, _setup(tmp_path, {"gpu": "A100-80GB"}))
    assert stated.predicting_planner(stated.candidates()) is None
    assert "needs autotuning.model_info.num_params and autotuning.model_info.tokens_per_sample" in (
        capsys.readouterr().err
    )
    with pytest.raises(ConfigError, match=r"'autotuning.gpu' is 'H100', not a GPU kind"):
        _tuner(tmp_path, _setup(tmp_path, {"gpu": "H100"}))
    names = {
        "NVIDIA H100 80GB HBM3": "H100-SXM",
        "NVIDIA H100 PCIe": None,
        "NVIDIA A100-SXM4-40GB": "A100-40GB",
        "NVIDIA A100 80GB PCIe": "A100-80GB",
        "NVIDIA H200": "H200",
        "Tesla V100-SXM2-32GB": "V100-32GB",
    }
    assert {name: gpu_kind_of(name) for name in names} == names


def test_candidates_the_loader_refuses_are_not_tried(tmp_path: Path) -> None:
    zero = {"stage": [0, 3], "zero_quantized_weights": True}
    args = _setup(tmp_path, {}, zero_optimization=zero)
    candidates = _tuner(tmp_path, args).candidates()
    assert {c.stage for c in candidates} == {3}  # ZeRO++'s keys are refused below stage 3


# --- through the launcher --------------------------------------------------------------------------


def test_shardspeed_autotuning_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(runner, "DEFAULT_HOSTFILE", str(tmp_path / "no-hostfile"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FAKE_TRAINED", str(tmp_path / "trained.json"))
    args = _setup(tmp_path, {"tuner_num_trials": 3, "max_train_micro_batch_size_per_gpu": 8})
    argv = ["--num_gpus", "1", "--autotuning", "run", args.user_script, *args.user_args]
    assert cli.main(argv) == 0
    assert "best: z0_mbs8_gas1" in capsys.readouterr().err
    trained = json.loads((tmp_path / "trained.json").read_text())
    optimal = tmp_path / "autotuning_results" / "ds_config_optimal.json"
    assert trained["args"][:3] == ["--deepspeed_config", str(optimal), "--epochs"]
    assert trained["config"]["train_micro_batch_size_per_gpu"] == 8
    assert trained["config"]["zero_optimization"] == {"stage": 0}


def test_bandwidth_probe_on_two_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "DEFAULT_HOSTFILE", str(tmp_path / "no-hostfile"))
    args = runner.parse_args(["--num_gpus", "2", "train.py"])
    plan = lambda a: runner.plan_launches(a, os.environ, str(tmp_path))  # noqa: E731
    assert measure_bandwidth(args, plan, tmp_path, 60.0) > 0
    measured = probe(args, plan, tmp_path, 60.0, optimizer_params=10_000)
    assert measured["bus_bandwidth_bytes_per_s"] > 0 and measured["optimizer_s_per_param"] > 0


REAL_SCRIPT = """
import sys, torch
sys.path.insert(0, {examples!r})
from gpt import GPT, GPTConfig
import shardspeed
args = sys.argv[1:]
config = args[args.index("--deepspeed_config") + 1]
torch.manual_seed(0)
shardspeed.init_distributed()
model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
engine, *_ = shardspeed.initialize(model=model, config=config)
micro = engine.train_micro_batch_size_per_gpu()
while engine.global_steps < 10:
    x = torch.randint(0, 256, (micro, 16))
    engine.backward(engine(x, torch.roll(x, -1, dims=1)))
    engine.step()
"""


def test_the_engine_measures_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real training script: the engine times steps 2-3, writes the metric file, stops early;
    the tuner reads it (throughput, activations, peak memory) and picks the best it measured."""
    monkeypatch.setattr(runner, "DEFAULT_HOSTFILE", str(tmp_path / "no-hostfile"))
    monkeypatch.chdir(tmp_path)
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    (tmp_path / "train.py").write_text(REAL_SCRIPT.format(examples=examples))
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW"},
        "autotuning": {
            "enabled": True,
            "start_profile_step": 2,
            "end_profile_step": 3,
            "tuner_num_trials": 2,
            "num_tuning_micro_batch_sizes": 1,
        },
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    argv = ["--num_gpus", "1", "--autotuning", "tune", "train.py", "--deepspeed_config", "ds.json"]
    assert cli.main(argv) == 0
    summary = json.loads((tmp_path / "autotuning_results" / "summary.json").read_text())
    measured = [t for t in summary["trials"] if t["status"] == "ok"]
    assert len(measured) == 2
    for trial in measured:
        metrics = json.loads(
            (tmp_path / "autotuning_exps" / trial["name"] / "metrics.json").read_text()
        )
        assert metrics["throughput"] > 0 and metrics["step_time_s"] > 0
        assert metrics["activation_memory_bytes"] > 0 and metrics["num_params"] > 0
        assert trial["measured_throughput"] == pytest.approx(metrics["throughput"])
    best = max(measured, key=lambda t: t["measured_throughput"])
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == best["micro_batch"]


def test_a_trial_writes_its_launch_files_while_it_runs(tmp_path):
    """An MPI launch's hostfile (`Launch.files`) exists while a trial's processes run and is
    removed after, as for a plain launch."""
    import sys

    from shardspeed.autotuning.tuner import run_processes
    from shardspeed.launcher.runner import Launch

    hostfile = tmp_path / "hostfile"
    check = f"import os, sys; sys.exit(0 if os.path.exists({str(hostfile)!r}) else 3)"
    launch = Launch([sys.executable, "-c", check], {}, False, files={str(hostfile): "h slots=1"})
    status, _ = run_processes([launch], tmp_path, tmp_path / "result.json", 60, 1)
    assert status == "no metrics"  # exited 0: the file was there
    assert not hostfile.exists()
