"""The engine on one CUDA device (world size 1, NCCL): precision, ZeRO stages, offload, checkpoints.

Every test here is marked `cuda` and skipped without a CUDA device, so the CPU suite passes over
them at once. They share one process and one NCCL process group (a module fixture starts it and
destroys it at the end). Each trains a small MLP (Linear, GELU, LayerNorm; about 6k parameters) for
a few steps on fixed batches and compares with:

- the same training in fp32 with plain torch on the same device (AdamW(fused=True), the kernel the
  engine builds from the config, and `clip_grad_norm_`), or
- the same engine configuration without the feature under test (offload),

at tolerances stated per test: fp32 per parameter (||a - b|| / ||b||); 16-bit over the whole
model, plus the direction each parameter moved (see `assert_tracks`).

At world size 1 the ZeRO optimizer runs stages 2 and 3 as stage 1 (one rank has nothing to shard,
`ZeroOptimizer.stage`), so the stage tests check that such configs train correctly on CUDA; the
sharded stage-2 and stage-3 code paths need two ranks, which the gloo tests cover on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.comm import free_port

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

IN, HIDDEN, OUT = 16, 64, 8
BATCH = 16
STEPS = 6
LR = 1e-2
WEIGHT_DECAY = 0.01
CLIP = 1.0

# fp32 runs differ from the reference only in summation order (one flat gradient norm against
# torch's norm of per-tensor norms; the flat buffers): 1e-5 relative per parameter, as the CPU
# tests use.
FP32_TOL = 1e-5
# 16-bit runs are compared over the whole model (all parameters as one vector). Per parameter the
# error is dominated by Adam's normalised first steps: an element whose true gradient is near zero
# gets +-lr depending on the sign its 16-bit gradient rounds to, and a zero-initialised bias (the
# LayerNorm's) is made of little else, so it deviates by several percent in fp16 and bf16 alike.
# bf16 keeps 8 significant bits: the weights the model computes with are the fp32 masters rounded
# to bf16 (up to 2^-9 relative each) and every matmul and activation rounds again; on this model
# 6 steps drift ~1e-2 from fp32 training (seen on CPU), so 3e-2.
BF16_TOL = 3e-2
# fp16 keeps 11 significant bits, 8x finer, but the near-zero gradients above do not shrink with
# it: ~4e-3 seen on CPU, so 1.5e-2.
FP16_TOL = 1.5e-2
# And every parameter must have moved the way fp32 training moved it: cosine of the two updates
# (final - initial) at least this (0.995 and more seen on CPU). A parameter left untouched fails.
MIN_UPDATE_COSINE = 0.98


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """One NCCL group of one process for the whole module, started as torchrun's environment says."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        if dist.is_initialized() and dist.get_backend() != "nccl":
            dist.destroy_process_group()  # a CPU test's gloo group: CUDA tensors need NCCL here
        owned = not dist.is_initialized()
        shardspeed.init_distributed(dist_backend="nccl")
        # fp32 means fp32: no TF32 in the matmuls of either side of a comparison.
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(precision)
            if owned and dist.is_initialized():
                dist.destroy_process_group()


# -- the model, the batches and the two sides of a comparison -----------------------------------


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.GELU(),
        nn.LayerNorm(HIDDEN),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, OUT),
    )


def n_params() -> int:
    return sum(p.numel() for p in make_model().parameters())


def initial_params() -> list[torch.Tensor]:
    return [p.detach() for p in make_model().parameters()]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def reference(steps: list[int]) -> list[torch.Tensor]:
    """Plain torch in fp32 on the GPU, one step per batch of `steps` (the steps a run applied)."""
    device = torch.device("cuda")
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    for step in steps:
        x, y = (t.to(device) for t in batch(step))
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return [p.detach().float().cpu() for p in model.parameters()]


def config(micro: int = BATCH, **extra: Any) -> dict:
    return {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        **extra,
    }


def zero(stage: int, **keys: Any) -> dict:
    return {"zero_optimization": {"stage": stage, **keys}}


def params_of(engine) -> list[torch.Tensor]:
    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().float().cpu().clone() for p in engine.module.parameters()]


def train_steps(engine, steps: range) -> list[int]:
    """Train the global batches `steps`; return those whose update was applied (not skipped)."""
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dtype = next(engine.module.parameters()).dtype
    applied = []
    for step in steps:
        x, y = (t.to(engine.device) for t in batch(step))
        for m in range(gas):
            xs, ys = x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]
            engine.backward(F.mse_loss(engine(xs.to(dtype)).float(), ys))
            engine.step()
        if engine.was_step_applied():
            applied.append(step)
    return applied


def run(
    cfg: dict, steps: int = STEPS, inspect: Callable[[Any], dict] | None = None
) -> dict[str, Any]:
    """Train `steps` global batches with a fresh engine; what came out (the engine is destroyed)."""
    engine, *_ = shardspeed.initialize(model=make_model(), config=cfg)
    try:
        applied = train_steps(engine, range(steps))
        torch.cuda.synchronize()
        return {
            "params": params_of(engine),
            "applied": applied,
            "skipped": engine.skipped_steps,
            "global_steps": engine.global_steps,
            "loss_scale": engine.loss_scale,
            "memory": engine.memory_breakdown(),
            "stage": engine.optimizer.stage,
            **(inspect(engine) if inspect is not None else {}),
        }
    finally:
        engine.destroy()


def assert_close_relative(actual: list, expected: list, tol: float) -> None:
    """Each parameter within `tol` relative error (the fp32 comparisons)."""
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        err = ((a - e).norm() / e.norm()).item()
        assert err <= tol, f"parameter {i}: relative error {err:.2e} > {tol:.0e}"


def assert_tracks(actual: list, expected: list, tol: float) -> None:
    """16-bit against fp32 (or two 16-bit runs): the whole model within `tol` relative error, and
    every parameter's update pointing the way the expected run's did."""
    a, e = torch.cat([t.flatten() for t in actual]), torch.cat([t.flatten() for t in expected])
    err = ((a - e).norm() / e.norm()).item()
    assert err <= tol, f"whole-model relative error {err:.2e} > {tol:.0e}"
    for i, (a, e, init) in enumerate(zip(actual, expected, initial_params(), strict=True)):
        cos = F.cosine_similarity((a - init).flatten(), (e - init).flatten(), dim=0).item()
        assert cos >= MIN_UPDATE_COSINE, f"parameter {i}: update cosine {cos:.4f}"


# -- the engine on CUDA, by precision -----------------------------------------------------------


def placement(engine) -> dict:
    zopt = engine.optimizer
    return {
        "device": engine.device,
        "param_devices": {p.device.type for p in engine.module.parameters()},
        "param_dtypes": {p.dtype for p in engine.module.parameters()},
        "master_devices": {m.device.type for m in zopt.masters},
        "master_dtypes": {m.dtype for m in zopt.masters},
        "grad_device": (zopt.grad_flat if zopt.grad_flat is not None else zopt.grad_shard).device,
        "fused": zopt.optimizer.defaults.get("fused"),
    }


@pytest.mark.parametrize("micro", [BATCH, BATCH // 2], ids=["accumulation1", "accumulation2"])
def test_fp32_on_cuda_with_nccl_matches_torch(micro):
    result = run(config(micro), inspect=placement)
    assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
    assert result["device"].type == "cuda"
    assert result["param_devices"] == {"cuda"} and result["master_devices"] == {"cuda"}
    assert result["grad_device"].type == "cuda"
    assert result["fused"] is True  # torch's fused CUDA AdamW, built from the config
    assert result["global_steps"] == STEPS and result["skipped"] == 0
    assert_close_relative(result["params"], reference(list(range(STEPS))), FP32_TOL)


def test_bf16_tracks_fp32_torch():
    result = run(config(bf16={"enabled": True}), inspect=placement)
    assert result["param_dtypes"] == {torch.bfloat16}
    assert result["master_dtypes"] == {torch.float32} and result["master_devices"] == {"cuda"}
    assert result["skipped"] == 0
    assert_tracks(result["params"], reference(list(range(STEPS))), BF16_TOL)


def test_fp16_dynamic_loss_scale_skips_overflows_then_tracks_fp32_torch():
    # 2^22 times this model's gradients overflows fp16 (largest finite 65504; about 2^18 fits, on
    # CPU): steps are skipped, the scale halving after each (hysteresis 1), until the scaled
    # gradients fit. Which steps overflow depends on the gradients, so the reference trains on
    # exactly the batches whose update was applied; the scale never grows (window 1000 steps).
    power, steps = 22, STEPS + 4
    fp16 = {"enabled": True, "initial_scale_power": power, "hysteresis": 1}
    result = run(config(fp16=fp16), steps=steps, inspect=placement)
    assert result["param_dtypes"] == {torch.float16}
    skipped, applied = result["skipped"], result["applied"]
    assert skipped >= 1 and len(applied) >= 3, applied
    assert len(applied) + skipped == steps and result["global_steps"] == steps
    assert result["loss_scale"] == 2.0 ** (power - skipped)
    assert_tracks(result["params"], reference(applied), FP16_TOL)


# -- ZeRO stages at world size 1 ------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_stage_on_cuda(stage, precision):
    half = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    keys = zero(stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}))
    result = run(config(**keys, **half))
    expected = reference(list(range(STEPS)))
    assert result["global_steps"] == STEPS and result["skipped"] == 0
    if precision == "fp32":
        assert_close_relative(result["params"], expected, FP32_TOL)
        return
    assert_tracks(result["params"], expected, BF16_TOL)
    # Against stage 0 in bf16 the same arithmetic runs on flat shards instead of per-parameter
    # masters; only the gradient norm's summation order differs, which can move a master across a
    # bf16 rounding boundary and then the near-zero gradients' signs (1e-2; equal on CPU).
    stage0 = run(config(**half))
    assert_tracks(result["params"], stage0["params"], 1e-2)


# -- offload ----------------------------------------------------------------------------------------


def offload_placement(engine) -> dict:
    zopt = engine.optimizer
    states = [
        value
        for state in zopt.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.numel() > 1
    ]
    return {
        **placement(engine),
        "masters_pinned": all(m.is_pinned() for m in zopt.masters if m.device.type == "cpu"),
        "state_devices": {s.device.type for s in states},
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_optimizer_offload_equals_no_offload(stage, precision):
    half = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    plain = run(config(**zero(stage), **half), inspect=offload_placement)
    block = {"device": "cpu", "pin_memory": True}
    offloaded = run(
        config(**zero(stage, offload_optimizer=block), **half), inspect=offload_placement
    )
    # The step runs in host memory (torch's fused CPU AdamW) on a copy of the device's gradients:
    # the same arithmetic as the fused CUDA kernel, but not promised to round identically, hence
    # 1e-5 in fp32. In bf16 a master an ulp away can round to the neighbouring bf16 weight and
    # change the next gradients: compared as 16-bit runs, at 1e-2.
    if half:
        assert_tracks(offloaded["params"], plain["params"], 1e-2)
    else:
        assert_close_relative(offloaded["params"], plain["params"], 1e-5)
    assert offloaded["skipped"] == 0

    assert plain["master_devices"] == {"cuda"} and plain["state_devices"] == {"cuda"}
    assert offloaded["param_devices"] == {"cuda"} and offloaded["grad_device"].type == "cuda"
    assert offloaded["master_devices"] == {"cpu"} and offloaded["masters_pinned"]
    assert offloaded["state_devices"] == {"cpu"}

    # memory_breakdown: nothing in host memory without offload; with it, exactly the fp32 masters
    # (4 bytes per parameter, one rank holds every element) and Adam's two fp32 moments (8 bytes)
    # plus torch's per-tensor step counters; parameters and gradients stay on the device.
    n, width = n_params(), 2 if half else 4
    mem = plain["memory"]
    assert mem["on_cpu"] == 0 and mem["on_nvme"] == 0
    assert mem["on_device"] == mem["total"]
    mem = offloaded["memory"]
    assert mem["master_weights"] == 4 * n
    assert 8 * n <= mem["optimizer_states"] <= 8 * n + 64
    assert mem["on_cpu"] == mem["master_weights"] + mem["optimizer_states"]
    assert mem["parameters"] == width * n and mem["gradients"] == 4 * n  # fp32 gradients
    assert mem["on_device"] == mem["parameters"] + mem["gradients"] + mem["buffers"]
    assert mem["on_device"] + mem["on_cpu"] == mem["total"] and mem["on_nvme"] == 0


NVME = {
    "optimizer": lambda path: zero(2, offload_optimizer={"device": "nvme", "nvme_path": path}),
    "optimizer-pieces-pipelined": lambda path: zero(
        2,
        sub_group_size=2000,  # three pieces, stepped one by one with read-ahead / write-behind
        offload_optimizer={
            "device": "nvme",
            "nvme_path": path,
            "pipeline_read": True,
            "pipeline_write": True,
        },
    ),
    "stage3-param-and-optimizer": lambda path: zero(
        3,
        stage3_param_persistence_threshold=0,
        offload_optimizer={"device": "nvme", "nvme_path": path},
        offload_param={"device": "nvme", "nvme_path": path},
    ),
}


def nvme_files(engine) -> dict:
    path = engine.run_config.zero_optimization.offload_optimizer.nvme_path
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    return {"swap_files": len(files)}


@pytest.mark.parametrize("variant", sorted(NVME))
def test_nvme_offload_equals_no_offload(tmp_path, variant):
    keys = NVME[variant](str(tmp_path))
    unswapped = {
        k: v
        for k, v in keys["zero_optimization"].items()
        if k not in ("offload_optimizer", "offload_param")
    }
    plain = run(config(zero_optimization=unswapped))  # the same layout (sub_group_size) in memory
    swapped = run(config(**keys), inspect=nvme_files)
    # Optimizer states go to files and come back: bytes unchanged. The step itself runs on the CPU
    # (masters in host memory) rather than with the CUDA kernel: 1e-5, as for CPU offload.
    assert_close_relative(swapped["params"], plain["params"], 1e-5)
    assert swapped["swap_files"] >= 1
    n = n_params()
    mem = swapped["memory"]
    if "offload_param" in keys["zero_optimization"]:
        # The fp32 shard is the master and lives in swap files too, with Adam's two moments.
        assert mem["on_nvme"] >= 3 * 4 * n
    else:
        assert mem["on_nvme"] >= 2 * 4 * n  # Adam's two fp32 moments, padded to whole blocks
        assert mem["on_cpu"] >= 4 * n  # the fp32 masters stay in host memory
    assert list(tmp_path.iterdir()) == [], "engine.destroy() removes the swap directory"


# -- checkpoints ------------------------------------------------------------------------------------

CHECKPOINTED = {
    "bf16-stage1": {"bf16": {"enabled": True}, **zero(1)},
    "fp16-stage2": {"fp16": {"enabled": True, "initial_scale_power": 12}, **zero(2)},
    "fp32-stage3-cpu-offload": zero(
        3, stage3_param_persistence_threshold=0, offload_optimizer={"device": "cpu"}
    ),
}


@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_checkpoint_on_cuda_loads_back_and_resumes_bit_for_bit(tmp_path, name):
    cfg = config(**CHECKPOINTED[name])
    half, total = 3, 6
    straight = run(cfg, steps=total)

    engine, *_ = shardspeed.initialize(model=make_model(), config=cfg)
    train_steps(engine, range(half))
    engine.save_checkpoint(str(tmp_path), client_state={"note": "cuda"})
    saved = params_of(engine)
    saved_state = {k: v.cpu().clone() for k, v in engine.optimizer.state_of(0).items()}
    saved_scale = engine.loss_scale
    engine.destroy()

    torch.manual_seed(99)  # whatever the fresh engine starts from, the load must replace it
    engine, *_ = shardspeed.initialize(model=make_model(), config=cfg)
    try:
        path, client = engine.load_checkpoint(str(tmp_path))
        assert path is not None and client == {"note": "cuda"}
        assert engine.global_steps == half and engine.loss_scale == saved_scale
        assert {p.device.type for p in engine.module.parameters()} == {"cuda"}
        for a, b in zip(params_of(engine), saved, strict=True):
            assert torch.equal(a, b), "the loaded weights are the saved ones"
        loaded_state = engine.optimizer.state_of(0)
        assert loaded_state.keys() == saved_state.keys()
        for key, value in saved_state.items():
            assert torch.equal(loaded_state[key].cpu(), value), f"optimizer state {key}"
        train_steps(engine, range(half, total))
        resumed = params_of(engine)
    finally:
        engine.destroy()
    for a, b in zip(resumed, straight["params"], strict=True):
        assert torch.equal(a, b), "a resumed run takes the same steps as one that never stopped"


# -- the data loader --------------------------------------------------------------------------------


def test_data_loader_pins_batches_for_cuda():
    xs = torch.cat([batch(s)[0] for s in range(2)])
    ys = torch.cat([batch(s)[1] for s in range(2)])
    dataset = torch.utils.data.TensorDataset(xs, ys)
    engine, _, loader, _ = shardspeed.initialize(
        model=make_model(), config=config(), training_data=dataset
    )
    try:
        seen = 0
        for x, y in loader:
            assert x.is_pinned() and y.is_pinned()
            x, y = x.to(engine.device, non_blocking=True), y.to(engine.device, non_blocking=True)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
            seen += 1
        assert seen == 2 and engine.global_steps == 2
    finally:
        engine.destroy()
