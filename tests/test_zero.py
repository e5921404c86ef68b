"""ZeRO stages 1 and 2: parity with the fp32 single-process reference, precision, overflow,
memory held per rank against the ZeRO paper's formulas, and the bytes each step moves."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from reference_training import (
    SCHEDULE,
    assert_close_relative,
    batch,
    config,
    make_model,
    reference,
    train,
)
from shardspeed.testing import RankFailure
from shardspeed.zero import reducer as reducer_module
from shardspeed.zero.flat import FlatLayout
from shardspeed.zero.reducer import GradientReducer


def zero(stage: int, **keys) -> dict:
    return {"zero_optimization": {"stage": stage, **keys}}


FULL = {"gradient_clipping": 0.05, "scheduler": SCHEDULE}  # clipping that bites, and a schedule


# Stage 3 twice: with every parameter sharded, and with the default persistence threshold (which
# keeps all of this small model's parameters whole).
STAGES = {
    "s1": zero(1),
    "s2": zero(2),
    "s3": zero(3, stage3_param_persistence_threshold=0),
    "s3-persistent": zero(3),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("world", [2, 4])
def test_stage_matches_reference(pool2, pool4, stage, world):
    # micro 2 on 2 ranks means 2 accumulation steps; two param groups with their own lr and decay.
    pool = pool2 if world == 2 else pool4
    results = pool.run(train, 2, {**STAGES[stage], **FULL}, True)
    expected = reference(clip=0.05, groups=True, schedule=True)
    for result in results:
        assert_close_relative(result["params"], expected, 1e-5)
        assert result["global_steps"] == 5
    assert results[0]["norms"] == results[-1]["norms"]
    # The reported norm is the true global one, summed over shards: compare step 0's.
    model = make_model()
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    assert results[0]["norms"][0] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize(
    "keys",
    [
        {"reduce_scatter": False},
        {"overlap_comm": False},
        {"allgather_partitions": False},
        {"allgather_bucket_size": 7, "reduce_bucket_size": 50},
    ],
    ids=["all-reduce", "no-overlap", "broadcast-gather", "small-buckets"],
)
@pytest.mark.parametrize("stage", [1, 2])
def test_stage_options_keep_parity(pool2, stage, keys):
    results = pool2.run(train, 4, zero(stage, **keys))
    for result in results:
        assert_close_relative(result["params"], reference(), 1e-5)


@pytest.mark.parametrize(("precision", "tol"), [("fp16", 2e-3), ("bf16", 1e-2)])
@pytest.mark.parametrize("stage", ["s1", "s2", "s3"])
def test_half_precision_equals_stage0(pool2, stage, precision, tol):
    stage0 = pool2.run(train, 4, {precision: {"enabled": True}})
    sharded = pool2.run(train, 4, {precision: {"enabled": True}, **STAGES[stage]})
    for a, b in zip(stage0, sharded):
        assert_close_relative(b["params"], a["params"], tol)
        assert b["norms"] == pytest.approx(a["norms"], rel=1e-3)


def inf_on_rank1(stage: int) -> dict:
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={**config(4), **STAGES[stage], "fp16": {"enabled": True, "hysteresis": 1}},
    )
    scales, weights, norms = [], [], []
    for step in range(3):
        x, y = batch(step)
        xs = x[engine.global_rank * 4 :][:4].clone()
        if step == 1 and engine.global_rank == 1:
            xs[0, 0] = float("inf")
        engine.backward(F.mse_loss(engine(xs.half()).float(), y[engine.global_rank * 4 :][:4]))
        engine.step()
        scales.append(engine.loss_scale)
        norms.append(engine.get_global_grad_norm())
        with shardspeed.zero.GatheredParameters(model[0].weight):
            weights.append(model[0].weight.detach().float().clone())
    finite = [math.isfinite(n) for n in norms]
    return {
        "scales": scales,
        "skipped": engine.skipped_steps,
        "same": weights[0].equal(weights[1]),
        "norms": (finite[0], norms[1], finite[2]),
    }


@pytest.mark.parametrize("stage", ["s1", "s2", "s3"])
def test_inf_on_one_rank_skips_everywhere(pool2, stage):
    results = pool2.run(inf_on_rank1, stage)
    for result in results:
        # The skipped step's reported norm is inf, as DeepSpeed's; the others are finite.
        assert result == {
            "scales": [2.0**16, 2.0**15, 2.0**15],
            "skipped": 1,
            "same": True,
            "norms": (True, math.inf, True),
        }


# -- memory and traffic -------------------------------------------------------------------------


def wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)
    )


def measure(stage: int, precision: str) -> dict:
    model = wide_model()
    num_params = sum(p.numel() for p in model.parameters())
    extra = {precision: {"enabled": True}} if precision != "fp32" else {}
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "Adam"},
            **(STAGES["s3"] if stage == 3 else zero(stage)),
            **extra,
        },
    )
    dtype = next(model.parameters()).dtype
    x = torch.randn(4, 64).to(dtype)
    shardspeed.comm.reset_comm_volume()
    engine.backward(engine(x).float().square().mean())
    engine.step()
    volume = shardspeed.comm.comm_volume()
    memory = engine.memory_breakdown()
    return {
        "P": num_params,
        "memory": memory,
        "volume": volume,
        "total": engine.optimizer.layout.total,
    }


MODEL_STATE_FORMULAS = {  # bytes per parameter as (replicated, divided by N)
    ("fp16", 0): (16, 0),
    ("fp16", 1): (4, 12),
    ("fp16", 2): (2, 14),
    ("fp32", 0): (16, 0),
    ("fp32", 1): (8, 8),
    ("fp32", 2): (4, 12),
    # bf16 accumulates gradients in fp32: 2 bytes more per gradient element than the paper's fp16.
    ("bf16", 0): (18, 0),
    ("bf16", 1): (6, 12),
    ("bf16", 2): (2, 16),
    # Stage 3 with every parameter sharded (persistence threshold 0): 16P/N (18P/N for bf16).
    ("fp16", 3): (0, 16),
    ("fp32", 3): (0, 16),
    ("bf16", 3): (0, 18),
}


@pytest.mark.parametrize(("precision", "stage"), sorted(MODEL_STATE_FORMULAS))
@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_follow_the_zero_paper(pool2, pool4, precision, stage, world):
    pool = pool2 if world == 2 else pool4
    replicated, divided = MODEL_STATE_FORMULAS[(precision, stage)]
    for result in pool.run(measure, stage, precision):
        memory, p = result["memory"], result["P"]
        held = memory["total"] - memory["buffers"]
        expected = replicated * p + divided * p / world
        assert held == pytest.approx(expected, rel=0.02), memory


@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_moved_per_step(pool2, stage):
    for result in pool2.run(measure, stage, "fp32"):
        volume, total = result["volume"], result["total"]
        # Reduce-scatter of the gradient buffer (as reduces to owners) and all-gather of the
        # parameter buffer, 4 bytes an element; plus one 4-byte all-reduce of the squared norm.
        assert volume["reduce"]["bytes"] == 4 * total
        assert volume["all_gather"]["bytes"] == 4 * total
        assert volume["all_reduce"] == {"calls": 1, "bytes": 4}


def test_stage3_bytes_moved_per_step(pool2):
    for result in pool2.run(measure, 3, "fp32"):
        volume, total = result["volume"], result["total"]
        # Parameters gathered for forward and again for backward; gradients reduce-scattered.
        assert volume["all_gather"]["bytes"] == 2 * 4 * total
        assert volume["reduce"]["bytes"] == 4 * total
        assert volume["all_reduce"] == {"calls": 1, "bytes": 4}


def test_stage0_bytes_moved_per_step(pool2):
    for result in pool2.run(measure, 0, "fp32"):
        assert result["volume"] == {"all_reduce": {"calls": 1, "bytes": 4 * result["total"]}}


def test_memory_breakdown_is_logged_after_first_step(caplog):
    model = wide_model()
    engine, *_ = shardspeed.initialize(model=model, config={**config(8), **zero(1)})
    with caplog.at_level("INFO", logger="shardspeed"):
        engine.backward(engine(torch.randn(8, 64)).square().mean())
        engine.step()
    assert "model state held per rank after the first step: parameters" in caplog.text


# -- unusual parameters, and refusals -----------------------------------------------------------


class Awkward(nn.Module):
    """An unused layer, a frozen layer, and one weight shared by two modules."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.frozen(x))))


def adamw_engine(model: nn.Module, stage: int, **zero_options: Any) -> Any:
    """`model` under AdamW (lr 0.01, no weight decay), global batch 8, at ZeRO `stage`."""
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_batch_size": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
            **zero(stage, **zero_options),
        },
    )
    return engine


def train_awkward(stage: int, ignore_unused: bool = True) -> list[torch.Tensor]:
    model = Awkward()
    engine = adamw_engine(model, stage, ignore_unused_parameters=ignore_unused)
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    rank, world = engine.global_rank, engine.dp_world_size
    part = 8 // world
    for _ in range(3):
        engine.backward(F.mse_loss(engine(x[rank * part :][:part]), y[rank * part :][:part]))
        engine.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
def test_unused_frozen_and_shared_parameters(pool2, stage):
    expected = train_awkward(0)  # one process: the plain reference path
    initial = [p.detach() for p in Awkward().parameters()]
    for params in pool2.run(train_awkward, stage):
        assert_close_relative(params[2:4], expected[2:4], 1e-5)  # a (its weight shared with b)
        for i in (0, 1, 5, 6):  # frozen, then unused (no gradient, no decay): unchanged
            assert params[i].equal(initial[i])


def test_unused_parameters_refused_when_asked(pool2):
    with pytest.raises(
        RankFailure, match=r"parameters received no gradient: unused\.bias, unused\.weight"
    ):
        pool2.run(train_awkward, 2, False)


@pytest.mark.parametrize("stage", [0, 2])
def test_unused_parameters_refused_on_one_rank(stage):
    # One rank has no gradient reducer to notice; the check must not depend on it.
    with pytest.raises(RuntimeError, match=r"parameters received no gradient: unused\.bias"):
        train_awkward(stage, False)


def no_sync_stage2() -> str:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, config={**config(4), **zero(2)})
    try:
        with engine.no_sync():
            pass
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_no_sync_refused_at_stage2(pool2):
    assert all("not available with ZeRO stage 2" in r for r in pool2.run(no_sync_stage2))


class Custom(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])


def test_untested_client_optimizer_gets_whole_tensors_unless_declared_elementwise():
    """An optimizer shardspeed does not know is stepped on whole tensors (right for any
    optimizer); 'zero_allow_untested_optimizer' declares it element-wise: DeepSpeed's flat shards."""
    for allow, whole in ((False, True), (True, False)):
        model = make_model()
        engine, *_ = shardspeed.initialize(
            model=model,
            optimizer=Custom(model.parameters()),
            config={"train_batch_size": 8, "zero_allow_untested_optimizer": allow, **zero(1)},
        )
        assert engine.zero_optimization_stage() == 1
        plan = engine.optimizer.plan
        assert plan.region_whole == (whole,) * len(plan.region_params)


def nonfinite_fp32(stage: int) -> None:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, config={**config(4), **zero(stage)})
    x, y = batch(0)
    xs = x[engine.global_rank * 4 :][:4].clone()
    if engine.global_rank == 1:
        xs[0, 0] = float("nan")
    engine.backward(F.mse_loss(engine(xs), y[engine.global_rank * 4 :][:4]))
    engine.step()


@pytest.mark.parametrize("stage", [1, 2])
def test_nonfinite_fp32_gradient_names_the_parameter_on_every_rank(pool2, stage):
    with pytest.raises(RankFailure) as err:
        pool2.run(nonfinite_fp32, stage)
    text = str(err.value)
    assert (
        text.count("NonFiniteGradientError: non-finite gradient (inf or NaN) in parameter '4.") == 2
    )


class Blocks(nn.Module):
    """Blocks in a ModuleList (one gather unit each), block 0 called twice, tied embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(torch.tanh(self.blocks[0](h)))


def train_blocks(stage_keys: dict) -> list[torch.Tensor]:
    model = Blocks()
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_batch_size": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            **stage_keys,
        },
    )
    gen = torch.Generator().manual_seed(3)
    rank, world = engine.global_rank, engine.dp_world_size
    for _ in range(4):
        idx = torch.randint(0, 16, (8, 5), generator=gen)
        mine = idx[rank * (8 // world) :][: 8 // world]
        logits = engine(mine[:, :-1])
        engine.backward(F.cross_entropy(logits.reshape(-1, 16), mine[:, 1:].reshape(-1)))
        engine.step()
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


def test_stage3_units_repeated_block_and_tied_weights(pool2):
    expected = train_blocks(zero(0))
    for params in pool2.run(train_blocks, STAGES["s3"]):
        assert_close_relative(params, expected, 1e-5)


def modify_under_gather() -> dict:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, config={**config(4), **STAGES["s3"]})
    weight = model[2].weight
    released = weight.numel()
    with shardspeed.zero.GatheredParameters(weight, modifier_rank=1):
        if engine.global_rank == 1:
            weight.data.fill_(0.5)
    with shardspeed.zero.GatheredParameters(weight):
        seen = weight.detach().clone()
    masters = engine.optimizer.masters
    return {
        "released": released,
        "all_half": bool((seen == 0.5).all()),
        "master_has_half": any(bool((m == 0.5).any()) for m in masters),
        "after": weight.numel(),
    }


def test_gathered_parameters_modifier_rank(pool2):
    for result in pool2.run(modify_under_gather):
        assert result == {"released": 0, "all_half": True, "master_has_half": True, "after": 0}


def test_zero_init_then_stage3_matches_reference(pool2):
    results = pool2.run(train, 4, STAGES["s3"], False, True)
    for result in results:
        assert_close_relative(result["params"], reference(), 1e-5)


def build_under_init() -> dict:
    """Bytes of parameter values held while the model is built under zero.Init, at every step."""
    created: list[torch.Tensor] = []
    peaks: list[int] = []

    def held() -> int:
        return sum(
            p.untyped_storage().nbytes() + (p.ds_tensor.nbytes if hasattr(p, "ds_tensor") else 0)
            for p in created
        )

    def on_register(module, name, param):
        if param is not None:
            created.append(param)
            peaks.append(held())

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(on_register)
    try:
        with shardspeed.zero.Init():
            model = wide_model()
    finally:
        handle.remove()
    peaks.append(held())
    largest = max(m.weight.ds_numel + m.bias.ds_numel for m in model if isinstance(m, nn.Linear))
    return {
        "peak": max(peaks),
        "final": peaks[-1],
        "model": 4 * sum(p.ds_numel for p in model.parameters()),
        "largest_module": 4 * largest,
        "empty": all(p.numel() == 0 for p in model.parameters()),
    }


def test_zero_init_never_holds_the_whole_model(pool2):
    for r in pool2.run(build_under_init):
        assert r["empty"]
        padding = 4 * 2 * 6  # at most one element of padding per parameter and rank
        assert r["final"] <= r["model"] / 2 + padding
        assert r["peak"] <= r["model"] / 2 + r["largest_module"] + padding


def gathered_peak(prefetch: int) -> dict:
    model = Blocks()
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_batch_size": 8,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            **zero(
                3,
                stage3_param_persistence_threshold=0,
                stage3_prefetch_bucket_size=prefetch,
                stage3_max_reuse_distance=0,
            ),
        },
    )
    idx = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the first step records the unit order that prefetching follows
        engine.backward(F.cross_entropy(engine(idx).reshape(-1, 16), idx.reshape(-1)))
        engine.step()
    return {
        "peak": engine.memory_breakdown()["gathered_peak"],
        "volume": shardspeed.comm.comm_volume(),
    }


def test_stage3_prefetch_keeps_one_more_unit_alive(pool2):
    off = pool2.run(gathered_peak, 0)[0]["peak"]
    on = pool2.run(gathered_peak, 10**6)[0]["peak"]
    block = 4 * (8 * 8 + 8)  # one Linear(8, 8) unit, fp32
    tied = 4 * 16 * 8  # the shared embedding/head weight: persistent, always whole
    # Without prefetch or reuse: the tied weight and two blocks (block 0 is called twice, so it
    # stays gathered while block 2 runs backward). Prefetching adds at most one unit in flight.
    assert off == tied + 2 * block
    assert off < on <= off + block


def save_model(directory: str, flag: bool) -> str:
    model = Blocks()
    keys = zero(
        3, stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=flag
    )
    engine, *_ = shardspeed.initialize(
        model=model,
        config={"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **keys},
    )
    idx = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(0))
    engine.backward(F.cross_entropy(engine(idx).reshape(-1, 16), idx.reshape(-1)))
    engine.step()
    try:
        engine.save_16bit_model(directory)
    except shardspeed.ConfigError as err:
        return str(err)
    return "saved"


def test_save_16bit_model_gathers_at_stage3(pool2, tmp_path):
    from safetensors.torch import load_file

    assert pool2.run(save_model, str(tmp_path), True) == ["saved", "saved"]
    state = load_file(str(tmp_path / "model.safetensors"))
    plain = Blocks()
    plain.load_state_dict(state, strict=True)
    assert plain.blocks[1].weight.shape == (8, 8)
    # One SGD step from the same start: the saved weights moved, and agree with a one-process run.
    expected = Blocks()
    opt = torch.optim.SGD(expected.parameters(), lr=0.1)
    idx = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(expected(idx).reshape(-1, 16), idx.reshape(-1)).backward()
    torch.nn.utils.clip_grad_norm_(expected.parameters(), 1.0)
    opt.step()
    for (name, a), b in zip(plain.state_dict().items(), expected.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name


def test_save_16bit_model_needs_the_flag_at_stage3(pool2, tmp_path):
    for message in pool2.run(save_model, str(tmp_path), False):
        assert "stage3_gather_16bit_weights_on_model_save" in message
    assert not (tmp_path / "model.safetensors").exists()


# -- the reduction and gather hot path -----------------------------------------------------------


def test_reducer_plans_owners_once_and_scales_only_kept_pieces(monkeypatch):
    # One process: a group of one sends nothing, so what the reducer does to the bucket is all
    # there is to see. Two shards of 7 elements padded to 8: this rank keeps the first 4.
    shardspeed.comm.init_distributed()
    layout = FlatLayout.of([[torch.zeros(3), torch.zeros(2, 2)]], shards=2)
    grads = torch.arange(1.0, 9.0)
    received = []
    reducer = GradientReducer(
        layout, 100, None, torch.float32, torch.float32, 1.0, 0.5,
        collective="reduce", grads=grads, region_ranks=(0,),
        on_reduced=lambda offset, piece: received.append((offset, piece.tolist())),
    )  # fmt: skip
    calls = []
    owners = FlatLayout.owners
    monkeypatch.setattr(FlatLayout, "owners", lambda *args: calls.append(args) or owners(*args))
    for _ in range(2):
        grads.copy_(torch.arange(1.0, 9.0))
        reducer.reset()
        reducer.active = True
        reducer.mark_ready(0)
        reducer.mark_ready(1)
        assert reducer.finish() == []
        # The kept piece is scaled; the other rank's piece, dropped anyway, is left as it was.
        assert grads.tolist() == [0.5, 1.0, 1.5, 2.0, 5.0, 6.0, 7.0, 8.0]
    assert received == [(0, [0.5, 1.0, 1.5, 2.0])] * 2
    assert calls == []  # who owns what was worked out when the buckets were laid out


class Sometimes(nn.Module):
    """A layer used on even steps only; 27 elements, which the layout pads to 28 on 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) if use_b else h


def train_sometimes(stage: int, bucket: int = 500_000_000) -> dict:
    model = Sometimes()
    engine = adamw_engine(model, stage, reduce_bucket_size=bucket)
    gen = torch.Generator().manual_seed(7)
    rank, world = engine.global_rank, engine.dp_world_size
    part = 8 // world
    pooled = []
    for step in range(4):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 3, generator=gen)
        out = engine(x[rank * part :][:part], step % 2 == 0)
        engine.backward(F.mse_loss(out, y[rank * part :][:part]))
        engine.step()
        reducer = engine.optimizer.reducer
        if reducer is not None:
            pooled.append(sorted(buffer.data_ptr() for buffer in reducer.pool))
            for buffer in reducer.pool:
                buffer.fill_(float("nan"))  # what a bucket does not write must not leak on
    return {"params": [p.detach().clone() for p in model.parameters()], "pooled": pooled}


@pytest.mark.parametrize("bucket", [500_000_000, 8], ids=["one-bucket", "two-buckets"])
def test_stage2_bucket_buffers_are_reused_and_never_leak(pool2, bucket):
    expected = train_sometimes(0)["params"]
    for result in pool2.run(train_sometimes, 2, bucket):
        assert_close_relative(result["params"], expected, 1e-5)
        # The same storages every step (none allocated per micro-step), at most two in flight
        # and one being filled.
        pooled = result["pooled"]
        assert 1 <= len(pooled[0]) <= 3
        assert all(step == pooled[0] for step in pooled)


def gathers_two_param_groups(stage: int) -> dict:
    model = wide_model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=[{"params": weights}, {"params": biases, "weight_decay": 0.0}],
        config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "Adam"},
            **(STAGES["s3"] if stage == 3 else zero(stage)),
        },
    )
    shardspeed.comm.reset_comm_volume()
    engine.backward(engine(torch.randn(4, 64)).square().mean())
    engine.step()
    return {"volume": shardspeed.comm.comm_volume(), "total": engine.optimizer.layout.total}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_gather_for_the_regions_of_a_group(pool2, stage):
    # Two param groups make two regions; their shards go out in one all-gather (at stage 3 one
    # per gather of the unit: for forward, then for backward).
    for result in pool2.run(gathers_two_param_groups, stage):
        gathers, total = result["volume"]["all_gather"], result["total"]
        gathered = 2 if stage == 3 else 1
        assert gathers == {"calls": gathered, "bytes": gathered * 4 * total}


def train_scattering(stage: str, extra: dict) -> dict:
    # The path NCCL takes (one reduce-scatter per bucket that lines up with the shards), run on
    # gloo, where one reduce per owner is the faster and so the default.
    reducer_module._GLOO_SCATTERS = True
    try:
        shardspeed.comm.reset_comm_volume()
        result = train(2, {**STAGES[stage], **extra}, True)
        return {**result, "volume": shardspeed.comm.comm_volume()}
    finally:
        reducer_module._GLOO_SCATTERS = False


@pytest.mark.parametrize("stage", ["s1", "s2", "s3"])
@pytest.mark.parametrize(
    "extra", [{}, {"fp16": {"enabled": True, "initial_scale_power": 8}}], ids=["fp32", "fp16"]
)
def test_reduce_scatter_path_matches_reference(pool2, stage, extra):
    # Two param groups: two regions, each one bucket whose pieces line up with the shards.
    results = pool2.run(train_scattering, stage, extra)
    if extra:
        expected, tol = pool2.run(train, 2, {**STAGES[stage], **extra}, True), 2e-3
    else:
        expected, tol = [{"params": reference(groups=True)}] * 2, 1e-5
    for result, want in zip(results, expected):
        assert_close_relative(result["params"], want["params"], tol)
        assert "reduce" not in result["volume"]
        assert result["volume"]["reduce_scatter"]["calls"] > 0


@pytest.mark.parametrize("stage", ["s1", "s2", "s3"])
def test_buckets_smaller_than_a_param_group_still_go_out_as_reduce_scatters(pool2, stage):
    # Buckets of 100 elements, param groups of 144 and 356: each group is sharded as regions of
    # at most a bucket (one per bucket, its pieces in line with the shards), not as one region
    # whose buckets would each go out as a reduce per owning rank.
    small = {"zero_optimization": {**STAGES[stage]["zero_optimization"], "reduce_bucket_size": 100}}
    for result in pool2.run(train_scattering, stage, small):
        assert_close_relative(result["params"], reference(groups=True), 1e-5)
        assert "reduce" not in result["volume"]
