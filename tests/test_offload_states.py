"""DeepSpeed's state offload (`engine.offload_states` / `reload_states` / `empty_partition_cache`)
on two gloo ranks at ZeRO 1, 2 and 3: the states' device storage is freed and what scripts reach
reads host copies, the bytes reported are the states' own, the steps that need the device copies
refuse, and training after a reload is bit-identical to training without the round trip.

Without a GPU the "device" is host memory: the device storages are still freed (resized to 0) and
the host copies are separate tensors, so the same checks hold; `test_cuda_round_trip` checks the
CUDA path (pinned copies, device memory returned) where a device exists.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.compat.deepspeed.runtime.zero.offload_config import (
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
)

ALL = list(OffloadStateTypeEnum)
States = OffloadStateTypeEnum


class Blocks(nn.Module):
    """Three Linear blocks in a ModuleList: at stage 3 one gather unit each, their biases (8
    elements) persistent."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def build(stage: int, precision: str = "fp32", **zero) -> shardspeed.ShardSpeedEngine:
    keys = {"stage": stage, "stage3_param_persistence_threshold": 8, **zero}
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": keys,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = shardspeed.initialize(model=Blocks(), config=config)
    return engine


def micro_batch(engine, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    rank, world = engine.global_rank, engine.dp_world_size
    part = slice(rank * 8 // world, (rank + 1) * 8 // world)
    dtype = next(engine.module.parameters()).dtype
    return x[part].to(dtype), y[part].to(dtype)


def train(engine, steps: range) -> None:
    for step in steps:
        x, y = micro_batch(engine, step)
        engine.backward(F.mse_loss(engine(x).float(), y.float()))
        engine.step()


def final_params(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with shardspeed.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def state_storages(engine) -> dict[States, list[torch.Tensor]]:
    """Independently of the offload code: one tensor per storage behind each state kind."""
    opt = engine.optimizer
    stores = opt.stores
    lp = [stores.params.flat] if opt.stage < 3 else [stores.params.sharded_params.store.flat]
    if opt.stage == 3:
        lp += list(opt.sharded_params.buffers.values())  # the persistent unit, gathered
    found = {
        States.optim_states: [v for s in opt.optimizer.state.values() for v in s.values()],
        States.hp_params: [opt.master_flat] if opt.master_flat is not None else [],
        States.lp_params: lp,
        States.lp_grads: [stores.grads.buffer()],
        States.contiguous_grad_buffer: list(opt.reducer.pool) if opt.reducer else [],
    }
    return {state: _distinct(tensors) for state, tensors in found.items()}


def _distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    by_storage = {
        t.untyped_storage().data_ptr(): t for t in tensors if t.untyped_storage().nbytes()
    }
    return list(by_storage.values())


def refusal(action) -> str:
    try:
        action()
    except (RuntimeError, ValueError) as error:
        return str(error)
    return "no error"


def round_trip(stage: int, include: list | None, precision: str = "fp32", **zero) -> dict:
    """Train 2 steps, offload `include`, check what moved, reload, train 3 more."""
    engine = build(stage, precision, **zero)
    train(engine, range(2))
    engine.empty_partition_cache()  # what offload_states does first at stage 3
    held = state_storages(engine)
    expected = {s: sum(t.untyped_storage().nbytes() for t in held[s]) for s in held}
    params_before = [p.detach().clone() for p in engine.module.parameters()]
    states_before = {
        id(m): {k: v.clone() for k, v in s.items()} for m, s in engine.optimizer.state.items()
    }
    report = engine.offload_states(include=include)
    moved = set(include if include is not None else ALL)
    freed = {s: all(t.untyped_storage().nbytes() == 0 for t in held[s]) for s in held if s in moved}
    kept = {s: all(t.untyped_storage().nbytes() for t in held[s]) for s in held if s not in moved}
    # What scripts reach reads the same values from the host copies meanwhile.
    readable = all(
        torch.equal(p.detach(), before)
        for p, before in zip(engine.module.parameters(), params_before)
    ) and all(
        torch.equal(v, states_before[id(m)][k])
        for m, s in engine.optimizer.state.items()
        for k, v in s.items()
    )
    x, _ = micro_batch(engine, 2)
    refusals = {
        "forward": refusal(lambda: engine(x)),
        "step": refusal(engine.step),
        "zero_grad": refusal(engine.zero_grad),
        "save_checkpoint": refusal(lambda: engine.save_checkpoint("/nonexistent/never-written")),
        "stream_weights": refusal(lambda: list(engine.stream_weights())),
        "again": engine.offload_states(include=include),  # already away: nothing more moves
    }
    restored = engine.reload_states()
    back = all(t.untyped_storage().nbytes() for s in moved for t in held[s])
    train(engine, range(2, 5))
    return {
        "report": {str(k): v for k, v in report.items()},
        "expected": {str(k): v for k, v in expected.items()},
        "restored": {str(k): v for k, v in restored.items()},
        "freed": freed,
        "kept": kept,
        "readable": readable,
        "refusals": refusals,
        "back": back,
        "params": final_params(engine),
    }


def reference(stage: int, precision: str = "fp32", **zero) -> list[torch.Tensor]:
    engine = build(stage, precision, **zero)
    train(engine, range(5))
    return final_params(engine)


@pytest.mark.parametrize(
    ("stage", "include", "precision"),
    [
        (1, None, "fp32"),
        (2, None, "fp32"),
        (3, None, "fp32"),
        (1, None, "bf16"),
        (3, None, "bf16"),
        (2, [States.optim_states, "lp_grads"], "fp32"),
        (3, [States.lp_params], "fp32"),
    ],
    ids=["z1", "z2", "z3", "z1-bf16", "z3-bf16", "z2-subset", "z3-params-only"],
)
def test_round_trip_frees_reports_and_trains_bit_identically(pool2, stage, include, precision):
    expected_params = pool2.run(reference, stage, precision)
    for result, want in zip(pool2.run(round_trip, stage, include, precision), expected_params):
        moved = [str(s) for s in (include or ALL)]
        assert result["report"] == {s: result["expected"][s] for s in moved}
        assert result["restored"] == {s: result["expected"][s] for s in moved}
        assert result["expected"]["lp_params"] > 0 and result["expected"]["lp_grads"] > 0
        if precision == "bf16":  # fp32 masters are a copy only under mixed precision
            assert result["expected"]["hp_params"] > 0
        if stage >= 2:  # pooled bucket buffers exist only with a shard accumulator
            assert result["expected"]["contiguous_grad_buffer"] > 0
        assert all(result["freed"].values()) and all(result["kept"].values())
        assert result["readable"] and result["back"]
        assert all(v == 0 for v in result["refusals"]["again"].values())
        params_away = "lp_params" in moved
        assert ("reload_states() first" in result["refusals"]["forward"]) == params_away
        assert "step needs the device copies of" in result["refusals"]["step"]
        assert "reload_states() first" in result["refusals"]["step"]
        assert "save_checkpoint needs" in result["refusals"]["save_checkpoint"]
        assert "stream_weights needs" in result["refusals"]["stream_weights"]
        assert ("zero_grad needs" in result["refusals"]["zero_grad"]) == ("lp_grads" in moved)
        for got, ref in zip(result["params"], want):
            assert torch.equal(got, ref)


def backward_while_grads_away() -> str:
    engine = build(2)
    train(engine, range(1))
    engine.offload_states(include=[OffloadStateTypeEnum.contiguous_grad_buffer])
    x, y = micro_batch(engine, 1)
    loss = F.mse_loss(engine(x), y)  # the parameters are in place: forward runs
    return refusal(lambda: engine.backward(loss))


def test_backward_refuses_while_gradient_buffers_are_away(pool2):
    for message in pool2.run(backward_while_grads_away):
        assert message.startswith("backward needs the device copies of contiguous_grad_buffer")


def bad_arguments() -> dict:
    engine = build(1)
    train(engine, range(1))
    return {
        "nvme": refusal(lambda: engine.offload_states(device=OffloadDeviceEnum.nvme)),
        "none": refusal(lambda: engine.offload_states(device="none")),
        "cuda": refusal(lambda: engine.offload_states(device=torch.device("cuda"))),
        "include": refusal(lambda: engine.offload_states(include=["optim"])),
        "cpu": engine.offload_states(device=torch.device("cpu"), include="lp_grads"),
    }


def test_refuses_other_devices_and_unknown_states(pool2):
    for result in pool2.run(bad_arguments):
        for device in ("nvme", "none", "cuda"):
            assert result[device].startswith("offload_states(device=")
            assert "device=OffloadDeviceEnum.cpu" in result[device]
        assert "unknown state 'optim'" in result["include"]
        assert "optim_states, hp_params, lp_params" in result["include"]
        assert list(result["cpu"]) == [OffloadStateTypeEnum.lp_grads]


def host_kept_states() -> dict:
    """offload_optimizer keeps the masters and optimizer states on the host: nothing to move."""
    engine = build(2, offload_optimizer={"device": "cpu"})
    train(engine, range(2))
    states = [v for s in engine.optimizer.state.values() for v in s.values()]
    report = engine.offload_states()
    untouched = all(v.untyped_storage().nbytes() for v in states)
    engine.reload_states()
    return {"report": {str(k): v for k, v in report.items()}, "untouched": untouched}


def test_offloaded_optimizer_states_are_not_moved_again(pool2):
    for result in pool2.run(host_kept_states):
        assert result["report"]["optim_states"] == 0 and result["report"]["hp_params"] == 0
        assert result["report"]["lp_params"] > 0 and result["untouched"]


def release_units() -> dict:
    """Stage 3: after a forward the units are kept for backward; empty_partition_cache releases
    every one but the persistent unit, and backward gathers them again."""
    engine = build(3)
    train(engine, range(1))
    sharded = engine.optimizer.sharded_params
    x, y = micro_batch(engine, 1)
    loss = F.mse_loss(engine(x), y)
    gathered = len(sharded.buffers)
    engine.empty_partition_cache()
    persistent = [u for u, unit in enumerate(sharded.units) if unit.persistent]
    left = sorted(sharded.buffers)
    engine.backward(loss)
    engine.step()
    train(engine, range(2, 3))
    return {
        "gathered": gathered,
        "left": left,
        "persistent": persistent,
        "params": final_params(engine),
    }


def reference_with_units() -> list[torch.Tensor]:
    engine = build(3)
    train(engine, range(3))
    return final_params(engine)


def test_empty_partition_cache_releases_gathered_units(pool2):
    expected = pool2.run(reference_with_units)
    for result, want in zip(pool2.run(release_units), expected):
        assert result["gathered"] == 4  # three blocks and the persistent unit
        assert result["left"] == result["persistent"] and len(result["persistent"]) == 1
        for got, ref in zip(result["params"], want):
            assert torch.equal(got, ref)


def no_optimizer() -> str:
    engine, *_ = shardspeed.initialize(
        model=Blocks(), config={"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    )
    engine.empty_partition_cache()  # nothing is gathered on demand without an optimizer
    return refusal(lambda: engine.offload_states())


def test_without_an_optimizer_offload_is_refused(pool2):
    for message in pool2.run(no_optimizer):
        assert message.startswith("offload_states() needs an optimizer")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip():
    """One process on the GPU: pinned host copies, device memory released and returned, and the
    states back bit for bit."""
    engine = build(1, "bf16")
    train(engine, range(2))
    before = torch.cuda.memory_allocated()
    values = [p.detach().clone() for p in engine.module.parameters()]
    report = engine.offload_states(pin_memory=True)
    assert before - torch.cuda.memory_allocated() >= sum(report.values()) > 0
    for p, value in zip(engine.module.parameters(), values):
        assert p.device.type == "cpu" and p.is_pinned() and torch.equal(p.detach(), value.cpu())
    engine.reload_states(non_blocking=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    for p, value in zip(engine.module.parameters(), values):
        assert p.device.type == "cuda" and torch.equal(p.detach(), value)
    train(engine, range(2, 3))


def test_enums_are_at_deepspeeds_path_and_defined_once():
    check = (
        "import shardspeed.compat; shardspeed.compat.install()\n"
        "from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, "
        "OffloadStateTypeEnum\n"
        "from shardspeed.zero import offload_states\n"
        "assert OffloadStateTypeEnum is offload_states.OffloadStateTypeEnum\n"
        "assert OffloadDeviceEnum is offload_states.OffloadDeviceEnum\n"
        "print(' '.join(s.value for s in OffloadStateTypeEnum))\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert done.stdout.split() == [
        "optim_states",
        "hp_params",
        "lp_params",
        "lp_grads",
        "contiguous_grad_buffer",
    ]
