"""Dry runs (`shardspeed.planning`) against real runs: the same model and config run as every rank
of a world on torch's fake process group with meta tensors, and as real gloo ranks training on real
values, report the same bytes per rank and the same collectives and bytes per step (exactly), so a
dry run is the real code path, not a second model of it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.config.errors import ConfigError
from shardspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardspeed.planning import Cluster, build_model, dry_run, measure_rank
from shardspeed.planning.dry_run import layout_of, sequence_parallel_script
from shardspeed.planning.models import PRESETS, ZERO3_AT_SCALE, causal_lm_batch


@pytest.fixture(autouse=True)
def no_process_group() -> None:
    """A dry run starts its own (fake) process group in this process and refuses to replace a
    live one: an earlier test of the suite may have left its one-process group here."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


SEQ = 16
LLAMA = {
    **PRESETS["llama-tiny"],
    # The same attention code on both sides: on the meta device a dry run runs SDPA as a GPU's
    # flash kernel, where a CPU run takes its own kernel.
    "attn_implementation": "eager",
}


def ds_config(stage: int, offload: dict | None = None, **extra) -> dict:
    """`offload`: the `offload_optimizer` and `offload_param` sections both."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        # Small enough that stage 3 shards some of the tiny model's weights and keeps others.
        "zero_optimization": {"stage": stage}
        | ({"stage3_param_persistence_threshold": 100} if stage == 3 else {})
        | ({"offload_optimizer": offload, "offload_param": offload} if offload else {}),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **extra,
    }


def moe(family: str) -> object:
    """A tiny MoE of `family` (tests/moe_families.py), with eager attention as LLAMA's."""
    from moe_families import family_config

    config = family_config(family)
    config._attn_implementation = "eager"
    return config


def plain_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Causal softmax attention written out, registered with transformers as "plain": sequence
    parallelism refuses eager attention (it needs a mask over the whole sequence), and SDPA runs
    as a GPU's flash kernel on meta but as the CPU's (uncounted by torch's FLOP counter) on a
    CPU, so this gives both sides the same attention code."""
    del attention_mask, kwargs  # causal over the whole sequence, as flash runs it
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, 1) for t in (key, value))
    seq = query.shape[-2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()
    scores = (query @ key.transpose(-1, -2)) * scaling
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return (probs @ value).transpose(1, 2), None


def _register_plain_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register("plain", plain_attention)


_register_plain_attention()  # on import: the pool's ranks import this module too


# A pipeline as DeepSpeed users write one: layer specs, an embedding tied to the output head, a
# loss function, the partition balanced by parameters. No LayerNorm: in bf16 the statistics it
# keeps for backward are bf16 on a CPU but fp32 on a GPU, and so on meta.
PIPE_VOCAB, PIPE_DIM = 64, 32


class PipeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(PIPE_DIM, 4 * PIPE_DIM), nn.Linear(4 * PIPE_DIM, PIPE_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def pipe_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def pipe_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, PIPE_VOCAB), labels.reshape(-1))


def pipeline() -> PipelineModule:
    tied = {"tied_weight_attr": "weight"}
    layers = [
        TiedLayerSpec("embed", nn.Embedding, PIPE_VOCAB, PIPE_DIM, **tied),
        *[LayerSpec(PipeBlock) for _ in range(3)],
        TiedLayerSpec("embed", nn.Embedding, PIPE_VOCAB, PIPE_DIM, forward_fn=pipe_head, **tied),
    ]
    return PipelineModule(layers, num_stages=2, loss_fn=pipe_loss)


def pipe_batch(micro_batch: int, seq_len: int, device: torch.device) -> tuple:
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
    return ids, ids


CASES = {
    "zero0": (LLAMA, ds_config(0)),
    "zero1": (LLAMA, ds_config(1)),
    "zero2": (LLAMA, ds_config(2)),
    "zero3": (LLAMA, ds_config(3)),
    "tensor": (LLAMA, ds_config(1, tensor_parallel={"autotp_size": 2})),
    "expert": (moe("qwen3_moe"), ds_config(2, expert_parallel={"enabled": True, "autoep_size": 2})),
    # 2 stages, with data parallelism 2 at 4 ranks.
    "pipeline": (pipeline, ds_config(1)),
    # ALST's Ulysses over 2 ranks, with data parallelism 2 at 4 ranks.
    "sequence": (
        {**LLAMA, "attn_implementation": "plain"},
        ds_config(3, sequence_parallel_size=2),
    ),
    # ZeRO-Offload of the optimizer and of stage 3's shards to host memory.
    "offload": (LLAMA, ds_config(3, offload={"device": "cpu"})),
}
BATCHES = {"pipeline": pipe_batch}


def real_rank(case: str, world: int) -> dict:
    """One gloo rank of a real run: the model on the CPU with values, trained the dry run's way."""
    source, config = CASES[case]
    torch.manual_seed(0)
    model = build_model(source, "cpu")
    with sequence_parallel_script(model, config) as mpu:
        engine, *_ = shardspeed.initialize(model=model, config=config, mpu=mpu)
        batch = BATCHES.get(case, causal_lm_batch)
        plan = dataclasses.asdict(measure_rank(engine, Cluster(1, world), batch, SEQ))
    return plan | {"layout": layout_of(engine, SEQ)}


def comparable(plan: dict) -> dict:
    """What must agree. Memory by kind in all places: a CPU run has no host beside its device,
    while a dry run, like a GPU run, keeps the optimizer's step counters on the host."""
    memory = {kind: sum(where.values()) for kind, where in plan["memory"].items()}
    keys = ("rank", "collectives", "startup", "coordinates", "activations_per_micro_batch")
    return {"memory": memory, **{key: plan[key] for key in keys}}


@pytest.mark.parametrize("case", sorted(set(CASES) - {"expert"}))
def test_a_dry_run_reports_what_real_ranks_hold_and_send(pool2, pool4, case):
    for pool, world in ((pool2, 2), (pool4, 4)):
        if case == "tensor" and world == 2:
            continue  # tensor x data needs 4 ranks to have both
        real = pool.run(real_rank, case, world)
        source, config = CASES[case]
        dry = dry_run(source, config, Cluster(1, world), ranks=range(world), seq_len=SEQ,
                      batch=BATCHES.get(case), backend="gloo")  # fmt: skip
        assert all(want["layout"] == dry.layout for want in real), (case, world)
        for want, got in zip(real, dry.ranks):
            assert comparable(dataclasses.asdict(got)) == comparable(want), (case, world)
            assert got.flops_per_step == want["flops_per_step"]
    if case == "offload":
        # Where a GPU run keeps them: masters, optimizer states and the shard in host memory.
        for plan in dry.ranks:
            assert plan.memory["optimizer_states"]["device"] == 0, plan.memory
            assert plan.memory["optimizer_states"]["host"] > 0, plan.memory
            assert plan.memory["parameters"]["host"] > 0, plan.memory
    if case == "pipeline":
        # Each of the 2 micro-batches' activations forward and gradients back, in bf16.
        assert dry.layout["pipeline_partition"] == [0, 3, 5]  # ties go to the later cut
        nbytes = 2 * ds_config(1)["train_micro_batch_size_per_gpu"] * SEQ * PIPE_DIM * 2
        for plan in dry.ranks:
            p2p = {c.kind: (c.bytes, c.count) for c in plan.collectives if c.group_size == 2}
            assert p2p["send"] == p2p["recv"] == (nbytes, 2), plan.rank
        # Asked for alone, a second stage's rank first runs (unreported) the rank sending to it.
        alone = dry_run(source, config, Cluster(1, 4), ranks=[3], seq_len=SEQ, batch=pipe_batch,
                        backend="gloo")  # fmt: skip
        assert alone.ranks == [dry.ranks[3]]


def test_activations_count_a_received_input_and_not_the_weights():
    """What a later pipeline stage saves of its received input (a leaf that needs a gradient, not
    a parameter) is activation memory; its weights and their views are not."""
    from shardspeed.zero.accounting import saved_activation_bytes

    layer = nn.Linear(8, 8, bias=False)
    received = torch.randn(4, 8).requires_grad_()
    with saved_activation_bytes(layer) as counted:
        layer(received).sum().backward()
    assert counted[0] == received.numel() * 4  # the input Linear saves; its weight is not counted


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_offload_to_nvme_is_refused_naming_its_key(key):
    """Swap files would be written on this machine; offload to host memory is planned."""
    config = ds_config(3)
    config["zero_optimization"][key] = {"device": "nvme", "nvme_path": "/tmp"}
    with pytest.raises(ConfigError, match=rf"'zero_optimization\.{key}\.device' is 'nvme'"):
        dry_run(LLAMA, config, Cluster(1, 2))


@pytest.mark.parametrize("stage", [1, 3])
def test_gradient_reduction_calls_do_not_grow_with_the_ranks_owning_a_bucket(stage):
    """Buckets of 3,000 elements, param groups and stage-3 units of up to 16k: as on NCCL (the
    dry run's default), each region holds at most a bucket and goes out as one reduce-scatter,
    so a step makes as many calls at 64 ranks as at 4, none a reduce per owning rank."""
    calls = {}
    for cluster in (Cluster(1, 4), Cluster(8, 8)):
        config = ds_config(stage)
        config["zero_optimization"]["reduce_bucket_size"] = 3000
        plan = dry_run(LLAMA, config, cluster, seq_len=SEQ, steps=1).ranks[0]
        calls[cluster.world_size] = {
            c.kind: c.count for c in plan.collectives if c.kind in ("reduce", "reduce_scatter")
        }
    assert calls[4] == calls[64] and set(calls[64]) == {"reduce_scatter"}


def routed_apart(plan: dict) -> tuple[dict, list[int]]:
    """What must agree rank by rank, and what depends on which rank received which rows: the
    all-to-alls' payloads, the activations and the FLOPs."""
    mine = comparable(plan)
    routed = [plan["activations_per_micro_batch"], plan["flops_per_step"]]
    del mine["memory"]["activations"], mine["activations_per_micro_batch"]
    for entry in mine["collectives"]:
        if entry["kind"] == "all_to_all":
            routed.append(entry["bytes"])
            entry["bytes"] = 0
    return mine, routed


def test_a_dry_run_of_expert_parallelism_reports_what_real_ranks_hold_and_send(pool2, pool4):
    """Qwen3-MoE with 4 experts over expert groups of 2, at 2 and 4 ranks (ZeRO 2). Meta tensors
    carry no router values, so a dry run takes the stated routing (balanced: each expert gets
    pairs / experts rows, `moe.expert_parallel.stated_routing`) and runs the real all-to-alls.
    Rank by rank everything agrees with real gloo ranks but what depends on which rank received
    which rows; that agrees summed over the ranks (every row goes out and comes back once)."""
    source, config = CASES["expert"]
    for pool, world in ((pool2, 2), (pool4, 4)):
        real = [routed_apart(plan) for plan in pool.run(real_rank, "expert", world)]
        dry = dry_run(source, config, Cluster(1, world), ranks=range(world), seq_len=SEQ,
                      backend="gloo")  # fmt: skip
        planned = [routed_apart(dataclasses.asdict(plan)) for plan in dry.ranks]
        assert [mine for mine, _ in planned] == [mine for mine, _ in real], world
        assert any(c["kind"] == "all_to_all" for c in planned[0][0]["collectives"])
        sums = [[sum(column) for column in zip(*(routed for _, routed in side))]
                for side in (planned, real)]  # fmt: skip
        assert sums[0] == sums[1], world


REAL_SIZE = {**ZERO3_AT_SCALE, "train_micro_batch_size_per_gpu": 1}


@pytest.mark.parametrize(("model", "nodes"), [("llama3-8b", 8), ("llama3-70b", 512)])
def test_a_plan_at_real_size_gives_the_zero_formulas(tmp_path, capsys, model, nodes):
    """64 ranks of 8B and 4,096 of 70B, as rank 0 only, through the command's JSON. Per rank:
    16-bit parameter shards, fp32 gradient shards (shardspeed accumulates them in fp32, as
    DeepSpeed's estimator counts), fp32 masters and Adam's two states, over N; stage 3 keeps
    parameters under its persistence threshold whole (the norms), and shards are padded."""
    from shardspeed.planning.cli import main
    from shardspeed.zero.estimate import model_state_bytes

    config = tmp_path / "ds.json"
    config.write_text(json.dumps(REAL_SIZE))
    status = main([model, str(config), "--nodes", str(nodes), "--gpus-per-node", "8",
                   "--seq-len", "256", "--json"])  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    assert status == 0 and plan["over_memory"] == []
    world, params = nodes * 8, plan["parameters"]
    paper = model_state_bytes(params, world, 3, "bf16")
    memory = plan["memory"]["0"]
    persistent = 2 * sum(  # the norms' weights, kept whole
        n for n in _norm_sizes(model)
    )
    assert memory["parameters"]["bytes"] == pytest.approx(paper["parameters"] + persistent, 1e-3)
    assert memory["gradients"]["bytes"] == pytest.approx(2 * paper["gradients"], 1e-3)
    states = paper["master_weights"] + paper["optimizer_states"]
    assert memory["optimizer_states"]["bytes"] == pytest.approx(states, 1e-3)
    steps = {c["kind"]: c for c in plan["collectives"]["0"]}
    assert steps["reduce_scatter"]["group_size"] == world
    assert steps["reduce_scatter"]["link"] == "inter-node"
    # Every gradient goes out once, in fp32 (padding aside).
    assert steps["reduce_scatter"]["bytes"] == pytest.approx(4 * params, 1e-3)
    assert plan["step_time"]["0"]["total"] > 0


def _norm_sizes(model: str) -> list[int]:
    from shardspeed.planning.models import PRESETS

    config = PRESETS[model]
    return [config["hidden_size"]] * (2 * config["num_hidden_layers"] + 1)


@pytest.mark.parametrize(("nodes", "ep"), [(8, 64), (64, 256)])
def test_a_deepseek_v3_like_plan_gives_the_zero_formulas_with_experts_over_their_groups(nodes, ep):
    """DeepSeek-V3's widths and 256 experts, top 8, four layers (one dense), at 64 ranks (expert
    groups of 64) and 512 (groups of 256, each expert on 2 ranks), ZeRO 2, rank 0. Per rank: the
    16-bit dense weights whole and 1/ep of the experts; fp32 gradient shards and 12 bytes a
    parameter of optimizer states over all N (dense over N, experts over ep x N / ep); each MoE
    block's four row exchanges carry the stated routing's tokens x 8 rows, plus its counts."""
    from shardspeed.planning.models import PRESETS

    model = {**PRESETS["deepseek-v3"], "num_hidden_layers": 4, "first_k_dense_replace": 1}
    config = {**REAL_SIZE, "zero_optimization": {"stage": 2},
              "expert_parallel": {"enabled": True, "autoep_size": ep}}  # fmt: skip
    seq = 128
    result = dry_run(model, config, Cluster(nodes, 8), seq_len=seq, steps=1)
    world, total = nodes * 8, result.parameters
    blocks, experts = 3, model["n_routed_experts"]
    expert = blocks * experts * 3 * model["hidden_size"] * model["moe_intermediate_size"]
    memory = {kind: sum(where.values()) for kind, where in result.ranks[0].memory.items()}
    assert memory["parameters"] == 2 * (total - expert + expert // ep)
    assert memory["gradients"] == pytest.approx(4 * total / world, 1e-3)
    assert memory["optimizer_states"] == pytest.approx(12 * total / world, 1e-3)
    (exchange,) = [c for c in result.ranks[0].collectives if c.kind == "all_to_all"]
    rows = seq * model["num_experts_per_tok"] * model["hidden_size"] * 2  # bf16
    assert (exchange.group_size, exchange.link) == (ep, "inter-node")
    assert exchange.bytes == blocks * (4 * rows + 8 * experts)


def test_a_layout_that_cannot_fit_is_reported_with_the_rank_and_the_bytes_over(tmp_path):
    """70B at ZeRO 3 on one node of 8: 16 bytes a parameter over 8 ranks is 141 GB a rank."""
    result = dry_run("llama3-70b", REAL_SIZE, Cluster(1, 8), ranks=(3,), seq_len=128, steps=1)
    ((rank, over),) = result.over_memory()
    device = result.ranks[0].bytes_at("device")
    assert rank == 3 and over == device - 80 * 2**30 and over > 60e9


# Published runs: (model, cluster, DeepSpeed-style config, sequence length, checkpointing, published
# tokens/s per GPU, source). Error bound: 25%, see docs/planning.md.
PUBLISHED = {
    "torchtitan Llama 3.1 8B, 8 H100, FSDP, local batch 2": (
        "llama3-8b",
        Cluster(1, 8, "H100-SXM"),
        {**REAL_SIZE, "train_micro_batch_size_per_gpu": 2},
        8192,
        False,  # selective checkpointing recomputes little
        5762,
        "pytorch/torchtitan docs/performance.md, Table 1 (FSDP, no compile)",
    ),
}
ERROR_BOUND = 0.25


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_step_time_model_is_within_its_bound_of_published_runs(name):
    model, cluster, config, seq, checkpointing, published, _ = PUBLISHED[name]
    result = dry_run(model, config, cluster, seq_len=seq, steps=1,
                     activation_checkpointing=checkpointing)  # fmt: skip
    seconds = result.step_time(result.ranks[0]).total
    predicted = result.tokens_per_step / seconds / cluster.world_size
    assert abs(predicted / published - 1) < ERROR_BOUND, (predicted, published)


def test_per_rank_checkpoint_reads_and_traffic_do_not_grow_with_the_world(tmp_path):
    """The checkpoint of a whole world, each rank's part of the save run as that rank on the fake
    group (files as headers, holes for the bytes). Rank 1's load opens the index, rank 0's file
    and its own, at 4 ranks and 8 alike, and reads no more of the index at 8: rank 0 validates
    every file's header and the index once and shares its verdict. Rank 1's save sends its own
    report to rank 0 and receives only verdicts."""
    from shardspeed import comm
    from shardspeed.checkpoint import format as ckpt_format
    from shardspeed.planning.checkpoints import engine_as, file_opens, world_checkpoint
    from shardspeed.planning.dry_run import fake_world

    opened, moved, read = {}, {}, {}
    for world in (4, 8):
        cluster, root = Cluster(1, world), tmp_path / str(world)
        tag = world_checkpoint(LLAMA, ds_config(3), cluster, root)
        for rank in (0, 1):
            with fake_world(rank, cluster):
                engine = engine_as(rank, LLAMA, ds_config(3))
                ckpt_format.reset_bytes_read()
                with file_opens(root) as opens:
                    engine.load_checkpoint(str(root))
                read[world, rank] = ckpt_format.bytes_read()
                target = tmp_path / f"saved{world}-{rank}"
                (target / ".saved.partial").mkdir(parents=True)  # what rank 0 makes
                comm.reset_comm_volume()
                engine.save_checkpoint(str(target), tag="saved")
                moved[world, rank] = comm.comm_volume()
            opened[world, rank] = dict(opens)
    files = {f"rank{r:05d}.safetensors" for r in range(8)}
    assert set(opened[8, 0]) - files == {"latest", "manifest.json", "index.jsonl"}
    assert files <= set(opened[8, 0])
    assert opened[4, 1] == opened[8, 1]
    assert set(opened[8, 1]) == {"latest", "index.jsonl", *sorted(files)[:2]}
    # Rank 1 reads its share of the index, which does not grow; rank 0 reads all of it.
    assert "manifest.json" not in read[8, 1]
    assert read[8, 1]["index.jsonl"] <= read[4, 1]["index.jsonl"] < read[4, 0]["index.jsonl"]
    assert read[8, 0]["index.jsonl"] == (tag / "index.jsonl").stat().st_size
    # What the index gives a rank is what the manifest says, for any range of any tensor.
    manifest, index = ckpt_format.parse_manifest(tag), ckpt_format.ManifestIndex(tag)
    for name, entry in manifest["tensors"].items():
        numel = torch.Size(entry["shape"]).numel()
        for start, length in ((0, numel), (numel // 3, numel // 2), (numel - 1, 1)):
            want = sorted(
                p for p in entry["pieces"] if p[3] and p[2] < start + length and start < p[2] + p[3]
            )
            assert sorted(index.pieces(name, start, length)) == want, (name, start, length)
    # Rank 1 gathers nobody's report; rank 0 receives all of them.
    assert "all_gather" not in moved[8, 1] and moved[4, 1].keys() == moved[8, 1].keys()
    gathered = {key: moved[key]["gather"]["bytes"] for key in moved}
    assert gathered[8, 1] <= gathered[4, 1] < gathered[4, 0] < gathered[8, 0]
