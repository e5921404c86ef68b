"""The code paths of issues 9-11 on one CUDA device: the MoE layer, block-cache generation, the
hybrid engine, int8 inference, the flops profiler and the comms logger; and stage 3's gather and
reduce streams. Marked `cuda`, skipped without a device; world size 1 (NCCL), so multi-rank paths
stay with the gloo tests."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.comm import free_port
from shardspeed.zero.flat import FlatLayout
from shardspeed.zero.reducer import GradientReducer
from shardspeed.zero.streams import CommStreams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

SMALL = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module", autouse=True)
def process_group():
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
            dist.destroy_process_group()
        owned = not dist.is_initialized()
        shardspeed.init_distributed(dist_backend="nccl")
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(precision)
            if owned and dist.is_initialized():
                dist.destroy_process_group()


def test_moe_layer_on_cuda_equals_cpu():
    from shardspeed.moe.layer import MoE

    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    layer = MoE(16, expert, num_experts=4, k=2, use_rts=False, top2_2nd_expert_sampling=False)
    x = torch.randn(3, 8, 16)
    out_cpu, aux_cpu, counts_cpu = layer(x)
    out_cpu.sum().backward()
    grads_cpu = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    layer.cuda()
    out, aux, counts = layer(x.cuda())
    out.sum().backward()
    torch.testing.assert_close(out.cpu(), out_cpu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux.cpu(), aux_cpu, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts.cpu(), counts_cpu)
    for g, ref in zip((p.grad for p in layer.parameters()), grads_cpu):
        torch.testing.assert_close(g.cpu(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_moe_layer_on_cuda_never_synchronizes(k):
    # What HostSyncCounter checks on CPU, the CUDA runtime checks here: any stream sync raises.
    from shardspeed.moe.layer import MoE

    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    layer = MoE(16, expert, num_experts=4, k=k, capacity_factor=0.5).cuda()
    x = torch.randn(3, 8, 16, device="cuda", requires_grad=True)
    layer(x)  # the first call may set up kernels and caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, l_aux, _ = layer(x)
        (out.square().sum() + l_aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_engine_micro_step_on_cuda_never_synchronizes():
    # Forward, backward and a micro-step inside accumulation wait for nothing; only the boundary
    # step reads the gradient norm.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
    )
    x = torch.randn(4, 16, device=engine.device, dtype=torch.bfloat16)

    def micro_step() -> None:
        engine.backward(engine(x).float().square().mean())
        engine.step()

    for _ in range(4):  # two whole steps: buffers, hooks and optimizer state exist
        micro_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        micro_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    micro_step()
    assert engine.global_steps == 3


def test_block_cache_generation_on_cuda_equals_the_models_own():
    from shardspeed.inference import SamplingParams, generate

    torch.manual_seed(1)
    model = GPT(SMALL).cuda().eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    ours = generate(model, prompts, SamplingParams(max_new_tokens=8))
    for prompt, tokens in zip(prompts, ours):
        own = model.generate(torch.tensor([prompt], device="cuda"), 8, temperature=0.0)
        assert tokens == own[0, len(prompt) :].tolist()


def test_hybrid_engine_on_cuda_generates_like_the_plain_model():
    from shardspeed.inference import SamplingParams

    torch.manual_seed(2)
    model = GPT(SMALL)
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW"},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3},
            "hybrid_engine": {"enabled": True},
        },
    )
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    engine.backward(engine(ids, ids))
    engine.step()
    engine.eval()
    tokens = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=6))
    engine.train()
    plain = GPT(SMALL).cuda().to(torch.bfloat16).eval()
    plain.load_state_dict(engine.consolidated_state_dict())
    own = plain.generate(torch.tensor([[1, 2, 3]], device="cuda"), 6, temperature=0.0)
    assert tokens[0] == own[0, 3:].tolist()


def test_int8_inference_on_cuda_tracks_fp32():
    from shardspeed.inference import init_inference

    torch.manual_seed(3)
    model = GPT(SMALL).cuda().eval()
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    with torch.no_grad():
        reference = model(ids)
    engine = init_inference(copy.deepcopy(model), dtype=torch.int8)
    with torch.no_grad():
        logits = engine(ids)
    # Weight-only int8 per output channel: a few percent of the logits' norm at most.
    assert ((logits - reference).norm() / reference.norm()).item() < 0.05


def test_flops_profiler_on_cuda_counts_as_on_cpu():
    from shardspeed.profiling.flops_profiler import get_model_profile

    torch.manual_seed(4)
    model = GPT(SMALL)
    ids = torch.randint(0, 64, (2, 16))
    cpu = get_model_profile(model, args=[ids], print_profile=False, as_string=False)
    gpu = get_model_profile(model.cuda(), args=[ids.cuda()], print_profile=False, as_string=False)
    assert gpu[0] == cpu[0] and gpu[2] == cpu[2]


def test_comms_logger_on_cuda_records_nccl_collectives():
    from shardspeed import comm
    from shardspeed.config.schema import CommsLoggerConfig

    logger = comm.configure_comms_logger(CommsLoggerConfig(enabled=True))
    try:
        tensor = torch.ones(1024, device="cuda")
        comm.all_reduce(tensor)
        summary = logger.step_summary()
        assert summary["all_reduce"]["bytes"] == 4096 and summary["all_reduce"]["latency_ms"] > 0
    finally:
        comm.configure_comms_logger(CommsLoggerConfig(enabled=False))


# -- stage 3's gather and reduce streams (zero/streams.py) ---------------------------------------

# Enough cycles to keep the compute stream busy for a good part of a second.
BUSY_CYCLES = 1_000_000_000


class ComputeStreamOnly:
    """CUDA's streams, with each side stream being the compute stream: the single-stream run."""

    def Stream(self, device: torch.device | None = None, priority: int = 0) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def stream(self, stream: torch.cuda.Stream) -> torch.cuda.StreamContext:
        return torch.cuda.stream(stream)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def stage3_offloaded_engine():
    # offload_param keeps stage 3 on one rank, and each gather copies the shard from host memory.
    engine, *_ = shardspeed.initialize(
        model=Blocks(),
        config={
            "train_batch_size": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "communication_data_type": "bf16",  # a cast on the reduce stream, and back
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "reduce_bucket_size": 1200,  # a bucket per block
                "offload_param": {"device": "cpu", "pin_memory": True},
            },
        },
    )
    return engine


def train_stage3(streams: CommStreams | None) -> list[torch.Tensor]:
    engine = stage3_offloaded_engine()
    optimizer = engine.optimizer
    if streams is not None:
        optimizer.sharded_params.streams = optimizer.reducer.streams = streams
    gen = torch.Generator().manual_seed(6)
    try:
        for _ in range(3):
            x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 8, generator=gen)
            x, y = x.to(engine.device), y.to(engine.device)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
        torch.cuda.synchronize()
        with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return [p.detach().cpu().clone() for p in engine.module.parameters()]
    finally:
        engine.destroy()


def test_stage3_side_streams_are_cuda_streams_and_equal_one_stream():
    engine = stage3_offloaded_engine()
    optimizer = engine.optimizer
    streams = optimizer.sharded_params.streams
    assert streams is optimizer.reducer.streams is CommStreams.for_device(engine.device)
    compute = torch.cuda.current_stream()
    assert isinstance(streams.gather, torch.cuda.Stream) and streams.gather != compute
    assert isinstance(streams.reduce, torch.cuda.Stream) and streams.reduce != compute
    assert streams.gather != streams.reduce
    engine.destroy()
    # The side streams change where the work runs, not what it computes: bit for bit the same.
    side = train_stage3(None)
    single = train_stage3(CommStreams(ComputeStreamOnly()))
    for i, (a, b) in enumerate(zip(side, single, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs from the single-stream run"


def test_stage3_gather_runs_beside_the_compute_stream():
    engine = stage3_offloaded_engine()
    sharded = engine.optimizer.sharded_params
    unit = next(u for u, unit in enumerate(sharded.units) if not unit.persistent)
    sharded.gather(unit)
    expected = sharded.buffers[unit].clone()
    sharded.release(unit)
    torch.cuda.synchronize()
    sharded._launch(unit)  # the copy from host memory and the all-gather, on the gather stream
    torch.cuda._sleep(BUSY_CYCLES)  # compute queued after the launch
    sharded.streams.gather.synchronize()
    assert not torch.cuda.current_stream().query(), "the gather waited for later compute"
    sharded.gather(unit)  # the compute stream waits for the gather stream
    assert torch.equal(sharded.buffers[unit], expected)
    engine.destroy()


def test_reduction_runs_beside_the_compute_stream():
    device = torch.device("cuda")
    layout = FlatLayout.of([[torch.zeros(3), torch.zeros(2, 2)]])
    grads = torch.arange(1.0, 8.0, device=device)
    reducer = GradientReducer(
        layout, 100, None, torch.float32, torch.bfloat16, 0.5, 0.5, grads=grads, device=device
    )
    assert reducer.streams is CommStreams.for_device(device)
    reducer.reset()
    reducer.active = True
    torch.cuda.synchronize()
    reducer.mark_ready(0)
    reducer.mark_ready(1)  # the bucket is complete: cast and scaled on the reduce stream
    torch.cuda._sleep(BUSY_CYCLES)
    reducer.streams.reduce.synchronize()
    assert not torch.cuda.current_stream().query(), "the reduction waited for later compute"
    assert reducer.finish() == []  # the compute stream waits for the reduce stream
    assert grads.tolist() == [0.25 * v for v in range(1, 8)]
