"""Optimizer offload: CPU and NVMe at stages 1 to 3 equal to no offload, resident memory measured,
swap files cleaned up, bad paths refused before training, checkpoints across offload settings."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import shardspeed
from reference_training import make_model
from shardspeed.testing import RankFailure
from shardspeed.utils.net import free_port
from test_checkpoint import session


def offload(device: str, path: str | None = None, **keys) -> dict:
    if device == "none":
        return {}
    block = {"device": device, **({"nvme_path": path} if device == "nvme" else {}), **keys}
    return {"offload_optimizer": block}


def keys(stage: int, device: str, path: str | None = None, sub_group: int = 0, **extra) -> dict:
    zero = {"stage": stage, **offload(device, path, **extra)}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if sub_group:
        zero["sub_group_size"] = sub_group
    return {"zero_optimization": zero}


PIPELINED = {"pipeline_read": True, "pipeline_write": True}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(
    ("device", "sub_group", "pipeline"),
    [("cpu", 0, {}), ("nvme", 0, {}), ("nvme", 60, {}), ("nvme", 60, PIPELINED)],
    ids=["cpu", "nvme", "nvme-pieces", "nvme-pieces-pipelined"],
)
def test_offload_equals_no_offload(pool2, tmp_path, stage, device, sub_group, pipeline):
    # sub_group_size splits the masters (several pieces stepped one by one) in both runs: it moves
    # the padding, hence the order of the norm's sum, so the runs compare under the same layout.
    plain = pool2.run(session, keys(stage, "none", sub_group=sub_group), 2, 4)
    offloaded = pool2.run(session, keys(stage, device, str(tmp_path), sub_group, **pipeline), 2, 4)
    for a, b in zip(plain, offloaded):
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y)
    pool2.run(gc.collect)  # the engines are garbage now; their swap files go with them
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("saved", "loaded"), [("nvme", "none"), ("none", "nvme")])
def test_checkpoints_cross_offload_settings(pool2, tmp_path, saved, loaded):
    swap = tmp_path / "swap"
    swap.mkdir()
    ckpt = str(tmp_path / "ckpt")
    straight = pool2.run(session, keys(2, "none"), 2, 4)
    pool2.run(session, keys(2, saved, str(swap)), 2, 2, ckpt)
    resumed = pool2.run(session, keys(2, loaded, str(swap)), 2, 4, None, ckpt)
    for a, b in zip(straight, resumed):
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y)


def nvme_breakdown(path: str) -> dict:
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        config={"train_batch_size": 8, "optimizer": {"type": "Adam"}, **keys(2, "nvme", path, 60)},
    )
    x = torch.randn(4, 8)
    engine.backward(engine(x).square().mean())
    engine.step()
    return engine.memory_breakdown()


def test_memory_breakdown_reports_nvme_bytes(pool2, tmp_path):
    for memory in pool2.run(nvme_breakdown, str(tmp_path)):
        params = memory["parameters"] // 4
        # Two fp32 moments per element of this rank's shard are on disk (padded to whole blocks).
        assert memory["on_nvme"] >= 2 * 4 * params // 2
        assert memory["on_device"] == memory["total"]  # no accelerator: all in host memory


def test_unusable_nvme_path_is_refused_before_training(pool2, tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(RankFailure, match=f"{missing}"):
        pool2.run(nvme_breakdown, str(missing))


PEAK_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch, shardspeed
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])  # 16.8M parameters
    zero = {"stage": 1}
    if sys.argv[1] == "nvme":
        zero.update(sub_group_size=1_100_000, offload_optimizer={"device": "nvme", "nvme_path": sys.argv[2]})
    engine, *_ = shardspeed.initialize(
        model=model, config={"train_batch_size": 2, "optimizer": {"type": "Adam"}, "zero_optimization": zero}
    )
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 1024)).square().mean())
        engine.step()
    if sys.argv[1] == "raise":
        raise RuntimeError("boom")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    """
)


def script_env() -> dict:
    # A one-process group on a port of its own: the default 29500 may be taken by another job.
    return {
        **os.environ,
        "PYTHONPATH": str(Path(shardspeed.__file__).parents[1]),
        **dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"),
    }


def peak_rss(mode: str, path: Path) -> int:
    env = script_env()
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, mode, str(path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_nvme_offload_cuts_resident_memory(tmp_path):
    states = 2 * 4 * 16 * (1024 * 1024 + 1024)  # Adam's two fp32 moments
    plain = peak_rss("none", tmp_path)
    nvme = peak_rss("nvme", tmp_path)
    assert plain - nvme >= 0.7 * states, (plain, nvme, states)
    assert list(tmp_path.iterdir()) == []


def test_swap_files_removed_after_an_exception(tmp_path):
    script = PEAK_SCRIPT.replace('sys.argv[1] == "nvme"', 'sys.argv[1] in ("nvme", "raise")')
    out = subprocess.run(
        [sys.executable, "-c", script, "raise", str(tmp_path)],
        capture_output=True,
        text=True,
        env=script_env(),
    )
    assert "boom" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_destroy_removes_swap_files_and_a_dropped_engine_is_collected(tmp_path):
    import weakref

    model = make_model()
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "Adam"},
        **keys(1, "nvme", str(tmp_path)),
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    assert len(list(tmp_path.iterdir())) == 1
    engine.destroy()
    assert list(tmp_path.iterdir()) == []
    engine = shardspeed.initialize(model=make_model(), config=config)[0]
    alive = weakref.ref(engine.optimizer)
    del engine
    gc.collect()
    assert alive() is None and list(tmp_path.iterdir()) == []


def test_offload_at_stage_0_changes_nothing(tmp_path, caplog):
    # The loader accepts it with a warning, as DeepSpeed does; the engine must then not offload.
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "Adam"},
        **keys(0, "nvme", str(tmp_path)),
    }
    with caplog.at_level("WARNING", logger="shardspeed"):
        engine, *_ = shardspeed.initialize(model=make_model(), config=config)
    assert "only acts at ZeRO stage 1 or 2 or 3" in caplog.text
    assert not engine.optimizer.offload.enabled
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_nvme_offload_equals_no_offload(pool2, tmp_path, precision):
    # 16-bit models have separate fp32 masters; their moments go to the swap files all the same.
    half = {precision: {"enabled": True}}
    plain = pool2.run(session, {**keys(2, "none", sub_group=60), **half}, 2, 3)
    nvme = pool2.run(session, {**keys(2, "nvme", str(tmp_path), 60, **PIPELINED), **half}, 2, 3)
    for a, b in zip(plain, nvme):
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y)


def test_parameter_offload_to_cpu_equals_no_offload(pool2, tmp_path):
    # Without an accelerator the shards are in host memory already: the same run, bit for bit.
    plain = pool2.run(session, keys(3, "none"), 2, 3)
    both = keys(3, "cpu")
    both["zero_optimization"]["offload_param"] = {"device": "cpu"}
    offloaded = pool2.run(session, both, 2, 3)
    for a, b in zip(plain, offloaded):
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y)


def param_nvme(path: str, sub_group: int = 0) -> dict:
    both = keys(3, "nvme", path, sub_group, **PIPELINED)
    both["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": path}
    return both


@pytest.mark.parametrize("sub_group", [0, 60])
def test_parameter_offload_to_nvme_equals_no_offload(pool2, tmp_path, sub_group):
    # The shards (the fp32 masters) live in swap files, read for each gather and each step.
    plain = pool2.run(session, keys(3, "none", sub_group=sub_group), 2, 4)
    swapped = pool2.run(session, param_nvme(str(tmp_path), sub_group), 2, 4)
    for a, b in zip(plain, swapped):
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y)
    pool2.run(gc.collect)
    assert list(tmp_path.iterdir()) == []


def test_checkpoints_cross_parameter_offload(pool2, tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    ckpt = str(tmp_path / "ckpt")
    straight = pool2.run(session, keys(3, "none"), 2, 4)
    pool2.run(session, param_nvme(str(swap)), 2, 2, ckpt)
    resumed = pool2.run(session, keys(3, "none"), 2, 4, None, ckpt)
    back = pool2.run(session, param_nvme(str(swap)), 2, 4, None, ckpt)
    for a, b, c in zip(straight, resumed, back):
        for x, y, z in zip(a["params"], b["params"], c["params"]):
            assert torch.equal(x, y) and torch.equal(x, z)


def _one_rank_stage(keys_: dict) -> tuple[dict, int]:
    result = session(keys_, 8, 3)
    return result, shardspeed.comm.get_world_size()


def test_parameter_offload_on_one_rank_keeps_stage_3(tmp_path):
    # Stage 3 stays stage 3 on one rank (as DeepSpeed's does), with its parameters on the device
    # or, with offload_param, in swap files: offload_param acts there too.
    from shardspeed.testing import run_on_ranks

    [(plain, world)] = run_on_ranks(_one_rank_stage, 1, keys(3, "none"))
    [(swapped, _)] = run_on_ranks(_one_rank_stage, 1, param_nvme(str(tmp_path)))
    assert world == 1
    for x, y in zip(plain["params"], swapped["params"]):
        assert torch.equal(x, y)
    assert swapped["stage"] == 3 and plain["stage"] == 3
