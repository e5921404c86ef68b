"""Pipeline parallelism: a tiny GPT with a tied embedding and head, cut into 2 and 4 stages (and 2
stages x 2 data-parallel replicas), trains to the single-process fp32 reference's parameters with
every schedule, ZeRO stage 1 and 2, 16-bit precision and activation checkpointing; checkpoints
move between pipelined and unpipelined layouts; partitioning matches DeepSpeed's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipe_model as pm
import shardspeed
from shardspeed.config import ConfigError
from shardspeed.pipe import LayerSpec, PipelineError, PipelineModule
from shardspeed.pipe.module import partition_balanced, partition_layers, partition_uniform
from shardspeed.testing import HostSyncCounter, RankFailure
from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

MICRO, GAS = 2, 4
# fp32 against fp32: the pipeline sums micro-batch gradients where the reference takes the whole
# batch at once, so only summation order differs (seen: under 2e-7 relative after 3 steps).
FP32_TOL = 2e-6


def _check_parity(results: list[dict], dp: int, whole_model_tol: float | None = None) -> None:
    """Each parameter within FP32_TOL of the reference; or, for 16-bit runs, the whole model
    (all parameters as one vector) within `whole_model_tol`, since a small bias rounded to 8
    bits of mantissa is off by more than the model is."""
    expected, losses = pm.reference(MICRO * GAS * dp)
    merged = pm.merged_params(results)
    assert sorted(merged) == sorted(expected)
    if whole_model_tol is None:
        for name, value in expected.items():
            err = ((merged[name] - value).norm() / value.norm()).item()
            assert err <= FP32_TOL, f"{name}: relative error {err:.1e} > {FP32_TOL:.0e}"
    else:
        got = torch.cat([merged[n].reshape(-1) for n in expected])
        want = torch.cat([v.reshape(-1) for v in expected.values()])
        err = ((got - want).norm() / want.norm()).item()
        assert err <= whole_model_tol, f"whole model: relative error {err:.1e}"
    tol = whole_model_tol or 1e-6
    for result in results:  # every stage returns the same mean loss
        assert result["losses"] == pytest.approx(losses, rel=tol)
        assert result["global_steps"] == pm.STEPS


SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)]


@pytest.mark.parametrize(("schedule", "chunks"), SCHEDULES)
def test_two_stages_two_replicas(pool4, schedule, chunks):
    results = pool4.run(
        pm.train, 2, virtual_stages=chunks, pipeline={"schedule": schedule}, timeout=180
    )
    _check_parity(results, dp=2)


@pytest.mark.parametrize(("schedule", "chunks"), SCHEDULES)
def test_four_stages(pool4, schedule, chunks):
    results = pool4.run(
        pm.train, 4, virtual_stages=chunks, pipeline={"schedule": schedule}, timeout=180
    )
    _check_parity(results, dp=1)


@pytest.mark.parametrize(("schedule", "chunks"), SCHEDULES)
def test_two_stages(pool2, schedule, chunks):
    results = pool2.run(
        pm.train, 2, virtual_stages=chunks, pipeline={"schedule": schedule}, timeout=180
    )
    _check_parity(results, dp=1)


@pytest.mark.parametrize(
    ("stage", "schedule", "chunks"), [(1, "1f1b", 1), (2, "1f1b", 1), (2, "interleaved_1f1b", 2)]
)
def test_zero_with_pipeline(pool4, stage, schedule, chunks):
    results = pool4.run(
        pm.train,
        2,
        virtual_stages=chunks,
        pipeline={"schedule": schedule},
        zero_optimization={"stage": stage, "reduce_bucket_size": 500},  # several buckets
        timeout=180,
    )
    _check_parity(results, dp=2)


def test_activation_checkpointing_by_interval(pool4):
    results = pool4.run(pm.train, 2, pipeline={"activation_checkpoint_interval": 2}, timeout=180)
    _check_parity(results, dp=2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit(pool4, precision):
    # 16-bit weights and activations against the fp32 reference: bf16 keeps 8 bits of mantissa
    # (fp16 11), so after three Adam steps the model is within 1% of the reference.
    section = {"enabled": True}
    if precision == "fp16":
        section["initial_scale_power"] = 8
    results = pool4.run(pm.train, 2, **{precision: section}, timeout=180)
    _check_parity(results, dp=2, whole_model_tol=1e-2)


def _activation_peaks(schedule: str) -> list[tuple[int, int]]:
    model = pm.build(4)
    engine, *_ = shardspeed.initialize(
        model=model, config=pm.config(1, 8, 1, pipeline={"schedule": schedule})
    )
    engine.train_batch(pm.micro_batches(0, 1, 8, 0, 1))
    return engine.stage_id, engine.peak_live_micro_batches


def test_1f1b_keeps_at_most_p_micro_batches_alive(pool4):
    # m = 8 micro-batches on p = 4 stages: 1F1B holds at most p on the first stage, GPipe all m.
    one_f_one_b = dict(pool4.run(_activation_peaks, "1f1b"))
    gpipe = dict(pool4.run(_activation_peaks, "gpipe"))
    assert one_f_one_b[0] == 4 and all(one_f_one_b[s] == 4 - s for s in range(4))
    assert gpipe[0] == 8


def _host_syncs_after_first_batch(stages: int) -> list[str]:
    """Where the host waited for the device during 3 train_batch calls after the first."""
    model = pm.build(stages)
    engine, *_ = shardspeed.initialize(model=model, config=pm.config(MICRO, GAS, 1))
    engine.train_batch(pm.micro_batches(0, MICRO, GAS, 0, 1))
    with HostSyncCounter() as syncs:
        for step in range(1, 4):
            engine.train_batch(pm.micro_batches(step, MICRO, GAS, 0, 1))
    return syncs.places


def test_pipelined_steps_wait_for_the_device_once(pool2):
    # Activations move with pre-agreed shapes and the loss stays a tensor: only the gradient norm
    # (overflow, clipping) is read back, once per batch.
    for places in pool2.run(_host_syncs_after_first_batch, 2):
        assert len(places) == 3 and all("zero/optimizer.py" in p for p in places), places


def _bubble(stages: int, gas: int) -> list[dict]:
    model = pm.build(stages)
    engine, *_ = shardspeed.initialize(model=model, config=pm.config(1, gas, 4 // stages))
    engine.train_batch(pm.micro_batches(0, 1, gas, engine.topology.dp_rank, 4 // stages))
    return engine.bubble_report()


def test_bubble_report(pool4):
    report = pool4.run(_bubble, 4, 2)[0]
    assert [r["stage"] for r in report] == [0, 1, 2, 3]
    for r in report:
        assert r["theory"] == pytest.approx(3 / 5)
        assert 0.0 <= r["measured"] < 1.0


# -- checkpoints: pipelined <-> not pipelined ------------------------------------------------------


class _Plain(nn.Module):
    """The same GPT without a pipeline: one module, parameters named as the pipeline names them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = pm.reference_modules()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return pm.reference_forward(self.layers, ids)

    def named_parameters(self, *args, **kwargs):
        yield from self.layers.named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.layers.state_dict(*args, **kwargs)


def _continue_pipelined(path: str, stages: int) -> dict:
    """Load `path` into a `stages`-stage pipeline and train one more step (step STEPS)."""
    model = pm.build(stages)
    dp = torch.distributed.get_world_size() // stages
    gas = GAS * 2 // dp  # the global batch the checkpoint was trained with: 2 replicas x GAS
    engine, *_ = shardspeed.initialize(model=model, config=pm.config(MICRO, gas, dp))
    engine.load_checkpoint(path)
    assert engine.global_steps == pm.STEPS
    engine.train_batch(pm.micro_batches(pm.STEPS, MICRO, gas, engine.topology.dp_rank, dp))
    return {
        "stage": engine.stage_id,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _continue_plain(path: str) -> dict:
    """Load `path` into the unpipelined model on 4 data-parallel ranks; train step STEPS."""
    model = _Plain()
    world = torch.distributed.get_world_size()
    engine, *_ = shardspeed.initialize(
        model=model,
        config=pm.config(MICRO * GAS // world * 2, 1, world, zero_optimization={"stage": 1}),
    )
    engine.load_checkpoint(path)
    ids, labels = pm.global_batch(pm.STEPS, MICRO * GAS * 2)
    micro = ids.shape[0] // world
    rank = engine.global_rank
    loss = pm.loss_fn(
        engine(ids[rank * micro : (rank + 1) * micro]), labels[rank * micro : (rank + 1) * micro]
    )
    engine.backward(loss)
    engine.step()
    return {"stage": 0, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _save_pipelined(path: str) -> None:
    """Two stages x two replicas at ZeRO stage 2 train STEPS steps and save."""
    model = pm.build(2)
    engine, *_ = shardspeed.initialize(
        model=model, config=pm.config(MICRO, GAS, 2, zero_optimization={"stage": 2})
    )
    for step in range(pm.STEPS):
        engine.train_batch(pm.micro_batches(step, MICRO, GAS, engine.topology.dp_rank, 2))
    engine.save_checkpoint(path)


def test_checkpoint_reshards_between_pipelined_and_plain(pool4, tmp_path):
    path = str(tmp_path / "ckpt")
    pool4.run(_save_pipelined, path, timeout=180)
    # Consolidated without any process group: one value per name, the tied embedding once.
    whole = get_fp32_state_dict_from_zero_checkpoint(path)
    assert sorted(whole) == sorted(dict(pm.reference_modules().named_parameters()))
    four_stages = pm.merged_params(pool4.run(_continue_pipelined, path, 4, timeout=180))
    two_stages = pm.merged_params(pool4.run(_continue_pipelined, path, 2, timeout=180))
    plain = pm.merged_params(pool4.run(_continue_plain, path, timeout=180))
    for name, value in plain.items():
        for other in (four_stages, two_stages):
            err = ((other[name] - value).norm() / value.norm()).item()
            assert err <= FP32_TOL, f"{name}: {err:.1e}"


# -- eval_batch and refusals ----------------------------------------------------------------------


def _eval(stages: int) -> tuple:
    model = pm.build(stages)
    dp = torch.distributed.get_world_size() // stages
    engine, *_ = shardspeed.initialize(model=model, config=pm.config(MICRO, GAS, dp))
    data = pm.micro_batches(0, MICRO, GAS, engine.topology.dp_rank, dp)
    loss, logits = engine.eval_batch(data, return_logits=True)
    return float(loss), None if logits is None else tuple(logits.shape)


def test_eval_batch(pool4):
    modules = pm.reference_modules()
    ids, labels = pm.global_batch(0, MICRO * GAS * 2)
    with torch.no_grad():
        expected = pm.loss_fn(pm.reference_forward(modules, ids), labels).item()
    results = pool4.run(_eval, 2)
    for loss, _ in results:
        assert loss == pytest.approx(expected, rel=1e-5)
    shapes = [shape for _, shape in results]
    assert shapes[:2] == [None, None]  # logits live on the last stage
    assert shapes[2] == (MICRO * GAS, pm.SEQ, pm.VOCAB)


def _refusals() -> list[str]:
    messages = []
    model = pm.build(2)
    for extra in (
        {"zero_optimization": {"stage": 3}},
        {"pipeline": {"stages": 4}},
        {"pipeline": {"schedule": "interleaved_1f1b"}},
        {"pipeline": {"schedul": "gpipe"}},
    ):
        with pytest.raises(ConfigError) as err:
            shardspeed.initialize(model=model, config=pm.config(MICRO, GAS, 2, **extra))
        messages.append(str(err.value))
    engine, *_ = shardspeed.initialize(model=model, config=pm.config(MICRO, GAS, 2))
    with pytest.raises(PipelineError, match="train_batch"):
        engine(torch.zeros(1))
    with pytest.raises(PipelineError, match="no_grad"), torch.no_grad():
        engine.train_batch(iter([]))
    with pytest.raises(ValueError, match="mpu"):
        shardspeed.initialize(model=model, mpu=object(), config=pm.config(MICRO, GAS, 2))
    with pytest.raises(ConfigError) as err:  # a pipeline section for a model without stages
        plain = pm.config(MICRO, GAS, 4, pipeline={"schedule": "gpipe"})
        shardspeed.initialize(model=nn.Linear(2, 2), config=plain)
    messages.append(str(err.value))
    return messages


def test_refusals(pool4):
    messages = pool4.run(_refusals)[0]
    assert "stage 3" in messages[0]
    assert "pipeline.stages" in messages[1]
    assert "virtual_stages" in messages[2]
    assert "pipeline.schedul" in messages[3]
    assert "configures a PipelineModule" in messages[4]


def test_bad_data_items_are_explained(pool2):
    with pytest.raises(RankFailure, match="pairs"):
        pool2.run(_bad_items)


def _bad_items() -> None:
    model = pm.build(2)
    engine, *_ = shardspeed.initialize(model=model, config=pm.config(MICRO, GAS, 1))
    engine.train_batch(iter([torch.zeros(2, pm.SEQ, dtype=torch.long)] * GAS))


# -- partitioning (no processes needed) -----------------------------------------------------------


def test_partition_uniform():
    assert partition_uniform(7, 3) == [0, 3, 5, 7]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]


def test_partition_balanced_matches_deepspeed():
    # Expected values printed by deepspeed 0.19.8's runtime.utils.partition_balanced.
    assert partition_balanced([10, 100, 100, 100, 10], 2) == [0, 3, 5]
    assert partition_balanced([0, 1, 1, 1, 1, 1, 1, 0], 4) == [0, 3, 5, 6, 8]
    assert partition_balanced([0, 1, 1, 1, 0], 2) == [0, 3, 5]
    assert partition_balanced([800, 72, 0, 72, 72, 16], 2) == [0, 1, 6]


def test_partition_methods():
    layers = [
        LayerSpec(nn.Embedding, 100, 8),  # 800 parameters
        LayerSpec(nn.Linear, 8, 8),  # 72
        F.gelu,  # no parameters
        LayerSpec(nn.Linear, 8, 8),
        LayerSpec(nn.Linear, 8, 8),
        nn.LayerNorm(8),  # 16
    ]
    assert partition_layers(layers, 2, "uniform") == [0, 3, 6]
    assert partition_layers(layers, 2, "parameters") == [0, 1, 6]
    # Three Linears over two parts: one spread either way, and ties go to the later cut.
    assert partition_layers(layers, 2, "type:linear") == [0, 4, 6]
    assert partition_layers(layers, 3, "TYPE:Linear") == [0, 3, 4, 6]
    with pytest.raises(ValueError, match="no layer"):
        partition_layers(layers, 2, "type:conv")
    with pytest.raises(ValueError, match="profile"):
        partition_layers(layers, 2, "profile")


# -- tuples, tensors without gradients, shapes that change -----------------------------------------


class _Masked(nn.Module):
    """Takes (x, keep) and returns (tanh(linear(x)) where keep, else x; keep): a tuple whose bool
    tensor needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        x, keep = inputs
        return torch.where(keep, torch.tanh(self.linear(x)), x), keep


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, x.sum(-1, keepdim=True) > 0


def _first_of(inputs: tuple) -> torch.Tensor:
    return inputs[0]


def _masked_layers() -> list:
    return [_split, *[LayerSpec(_Masked) for _ in range(4)], _first_of]


def _masked_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Micro-batches of different lengths: the shapes between stages change every time.
    gen = torch.Generator().manual_seed(step)
    rows = micro + step % 3
    return torch.randn(rows, 4, generator=gen), torch.randn(rows, 4, generator=gen)


def _masked_train(stages: int) -> dict:
    model = PipelineModule(
        _masked_layers(),
        num_stages=stages,
        loss_fn=F.mse_loss,
        seed_layers=True,
        partition_method="uniform",
        dynamic_shape=True,
    )
    engine, *_ = shardspeed.initialize(model=model, config=pm.config(2, 3, 1))
    for step in range(2):
        engine.train_batch(iter([_masked_batch(3 * step + m, 2) for m in range(3)]))
    return {"stage": engine.stage_id, "params": dict(model.named_parameters())}


def test_tuples_with_gradient_free_tensors_and_changing_shapes(pool2):
    merged = pm.merged_params(pool2.run(_masked_train, 2))
    layers = _masked_layers()
    modules = {}
    for index, spec in enumerate(layers):
        if isinstance(spec, LayerSpec):
            torch.manual_seed(1234 + index)
            modules[str(index)] = spec.build()
    reference = nn.ModuleDict(modules)
    opt = torch.optim.AdamW(reference.parameters(), lr=pm.LR, weight_decay=0.01)
    for step in range(2):
        loss = 0.0
        for m in range(3):
            x, y = _masked_batch(3 * step + m, 2)
            out = _split(x)
            for index in range(1, 5):
                out = reference[str(index)](out)
            loss = loss + F.mse_loss(out[0], y) / 3
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for name, value in reference.named_parameters():
        err = ((merged[name].detach() - value).norm() / value.norm()).item()
        assert err <= FP32_TOL, f"{name}: {err:.1e}"
