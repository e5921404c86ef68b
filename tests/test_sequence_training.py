"""Sequence parallelism trains: a tiny GPT whose attention is Ulysses (`DistributedAttention`) or
ring attention, on sequence shards cut by `UlyssesSPDataLoaderAdapter`, reaches the parameters of
whole-sequence training in one process on the same global batches.

The loss rule under test (docs/sequence-parallel.md): labels are shifted before the cut, each rank
backpropagates its slice's summed token loss over the labelled tokens of the whole batch
(`shard_cross_entropy`), and the engine sums gradients over sequence ranks and averages them over
data-parallel replicas. The reference trains each step on the replicas' whole batches, averaging
the replicas' mean token losses (plain data parallelism). Some labels are ignored (-100), so the
replicas' token counts differ and the global count matters.

The optimizer is SGD with momentum, whose step is proportional to the gradient, so a gradient
scaled wrongly (averaged over the sequence ranks instead of summed) fails; each step's reported
gradient norm, taken over the data x sequence ranks' shards, must equal the reference's.

Tolerance: 5e-5 relative, fp32. Only summation order differs (attention over gathered heads or
ring blocks, the sum of the slices' losses, the reduction), about 1e-7 per step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from reference_training import assert_close_relative
from shardspeed import comm
from shardspeed.runtime.sequence_parallel.ulysses_sp import (
    UlyssesSPDataLoaderAdapter,
    shard_batch,
    shard_cross_entropy,
)
from shardspeed.sequence import DistributedAttention, ring_attention

VOCAB, DIM, HEADS, SEQ, MICRO, STEPS, LR, MOMENTUM = 16, 16, 4, 8, 2, 4, 0.1, 0.9


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on [batch, seq, heads, dim]."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, form: str, group: object) -> None:
        super().__init__()
        self.form, self.group = form, group
        # No qkv bias: the key bias has no gradient (softmax ignores a shift), and AdamW would
        # turn its rounding noise into full-size updates.
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
        self.ulysses = DistributedAttention(_causal, group) if form == "ulysses" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, HEADS, DIM // HEADS).unbind(2)
        if self.form == "whole":
            out = _causal(q, k, v)
        elif self.form == "ulysses":
            out = self.ulysses(q, k, v, 0)
        else:
            sdpa_layout = (t.transpose(1, 2) for t in (q, k, v))
            out = ring_attention(*sdpa_layout, self.group, causal=True).transpose(1, 2)
        return self.out(out.reshape(batch, seq, DIM))


class Block(nn.Module):
    def __init__(self, form: str, group: object) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention = Attention(form, group)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, form: str = "whole", group: object = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block(form, group) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids) + self.positions(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loader_batch(rank: int, index: int) -> dict[str, torch.Tensor]:
    """What rank `rank`'s loader yields as its `index`-th batch (whole sequences)."""
    gen = torch.Generator().manual_seed(100 * rank + index)
    input_ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    labels[torch.rand(MICRO, SEQ, generator=gen) < 0.25] = -100
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": torch.arange(SEQ).expand(MICRO, SEQ),
    }


def reference(data: int, sequence: int) -> tuple[list[torch.Tensor], list[float]]:
    """Parameters and each step's gradient norm of whole-sequence training in one process: at
    step k, replica g trains on the batch that the adapter gives its sequence group then, the
    (k // sp)-th of its rank k % sp."""
    model = TinyGPT()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    norms = []
    for step in range(STEPS):
        losses = []
        for replica in range(data):
            batch = loader_batch(replica * sequence + step % sequence, step // sequence)
            logits = model(batch["input_ids"], batch["position_ids"])
            shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
            losses.append(F.cross_entropy(logits.reshape(-1, VOCAB), shifted.reshape(-1)))
        (sum(losses) / data).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


def train(
    form: str, sequence: int, stage: int, mesh_param: bool
) -> tuple[list[torch.Tensor], list[float]]:
    """STEPS optimizer steps on every rank, each on one adapter item (gradient accumulation 1)."""
    world = comm.get_world_size()
    data = world // sequence
    # The mesh is built once per world and sizes: initialize hands out these same groups.
    topology = comm.Topology.build(sequence_parallel=sequence)
    group = topology.get_sequence_parallel_group()
    model = TinyGPT(form, group)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        # SGD, not Adam: its step is proportional to the gradient, so a wrong scale shows.
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
    }
    if not mesh_param:
        config["sequence_parallel_size"] = sequence
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
        mesh_param=(data, sequence) if mesh_param else None,
    )
    assert engine.train_batch_size() == MICRO * data and engine.dp_world_size == data
    assert engine.get_sequence_parallel_group() is group
    rank = comm.get_rank()
    own_batches = [loader_batch(rank, i) for i in range((STEPS + sequence - 1) // sequence)]
    adapter = UlyssesSPDataLoaderAdapter(
        own_batches,
        sp_rank=topology.sp_rank,
        sp_group=group,
        sp_world_size=sequence,
        device="cpu",
        ring_size=2 if form == "ring" else 1,
    )
    norms = []
    for _, batch in zip(range(STEPS), adapter):
        logits = engine(batch["input_ids"], batch["position_ids"])
        engine.backward(shard_cross_entropy(logits, batch["shift_labels"], group))
        engine.step()
        norms.append(engine.get_global_grad_norm())  # over the data x sequence ranks' shards
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()], norms


CASES = [
    pytest.param(2, "ulysses", 1, False, id="ulysses-sp2-zero1"),
    pytest.param(2, "ulysses", 3, True, id="ulysses-sp2-zero3-mesh_param"),
    pytest.param(2, "ring", 1, False, id="ring-sp2-zero1"),
    pytest.param(2, "ring", 3, False, id="ring-sp2-zero3"),
    pytest.param(4, "ulysses", 1, True, id="ulysses-sp2xdp2-zero1-mesh_param"),
    pytest.param(4, "ulysses", 3, False, id="ulysses-sp2xdp2-zero3"),
    pytest.param(4, "ulysses", 0, False, id="ulysses-sp2xdp2-zero0"),
]


@pytest.mark.parametrize(("world", "form", "stage", "mesh_param"), CASES)
def test_sequence_parallel_training_equals_whole_sequence_training(
    request, world, form, stage, mesh_param
):
    sequence = 2
    results = request.getfixturevalue(f"pool{world}").run(train, form, sequence, stage, mesh_param)
    expected, expected_norms = reference(world // sequence, sequence)
    for params, norms in results:
        assert_close_relative(params, expected, 5e-5)
        assert norms == pytest.approx(expected_norms, rel=1e-5)


def train_with_loss(entry: str, loss_form: str, said: str | None) -> tuple[list, list] | str:
    """Ulysses at sp 2 on 2 ranks, set up through `mesh_param` or the `mpu` that
    register_with_transformers returns, with the loss each rank backpropagates either its part
    (sharded) or the whole, all-gathered differentiably as DeepSpeed's ALST tutorial does
    (replicated); `said`: the config's 'sequence_parallel.loss'. Parameters and norms, or the
    error initialize's engine raised."""
    from torch.distributed.nn.functional import all_gather

    from shardspeed.runtime.sequence_parallel import parallel_state_sp

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 0.0,
    }
    if said is not None:
        config["sequence_parallel"] = {"loss": said}
    if entry == "mpu":
        parallel_state_sp.initialize_sequence_parallel(2)
        group = parallel_state_sp.get_sequence_parallel_group()
        setup = {"mpu": parallel_state_sp}
    else:
        group = comm.Topology.build(sequence_parallel=2).get_sequence_parallel_group()
        setup = {"mesh_param": (1, 2)}
    model = TinyGPT("ulysses", group)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, **setup
    )
    rank = comm.get_rank()
    own = [loader_batch(rank, i) for i in range(STEPS // 2)]
    adapter = UlyssesSPDataLoaderAdapter(own, rank, group, 2, "cpu")
    norms = []
    try:
        for _, batch in zip(range(STEPS), adapter):
            logits = engine(batch["input_ids"], batch["position_ids"])
            loss = shard_cross_entropy(logits, batch["shift_labels"], group)
            if loss_form == "replicated":
                loss = sum(all_gather(loss, group=group))
            engine.backward(loss)
            engine.step()
            norms.append(engine.get_global_grad_norm())
    except shardspeed.ConfigError as error:
        return str(error)
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("entry", ["mesh_param", "mpu"])
@pytest.mark.parametrize(
    ("loss_form", "said"),
    [("sharded", None), ("replicated", None), ("replicated", "replicated")],
)
def test_the_loss_convention_is_read_from_the_first_loss(pool2, entry, loss_form, said):
    """Whichever way the loss is spread over the sequence ranks, a config that says nothing (or
    says the same) trains like whole sequences: the same parameters and the same gradient norm
    at every step (a replicated loss reduced as a sharded one would double both)."""
    expected, expected_norms = reference(1, 2)
    for params, norms in pool2.run(train_with_loss, entry, loss_form, said):
        assert_close_relative(params, expected, 5e-5)
        assert norms == pytest.approx(expected_norms, rel=1e-5)


@pytest.mark.parametrize(
    ("entry", "loss_form", "said"),
    [("mesh_param", "replicated", "sharded"), ("mpu", "sharded", "replicated")],
)
def test_a_loss_convention_the_loss_contradicts_stops_the_run(pool2, entry, loss_form, said):
    for message in pool2.run(train_with_loss, entry, loss_form, said):
        assert f"'sequence_parallel.loss' is '{said}', but the loss handed to backward()" in (
            message
        )
        assert f"Set 'sequence_parallel.loss' to '{loss_form}' or leave it out" in message
        seen = "the same value on every" if loss_form == "replicated" else "a different value"
        assert seen in message


def test_the_slice_is_cut_after_the_labels_are_shifted():
    batch = {
        "input_ids": torch.arange(8).view(1, 8),
        "labels": torch.arange(10, 18).view(1, 8),
        "position_ids": torch.arange(8).view(1, 8),
        "note": "kept",
    }
    first, second = (shard_batch(batch, rank, 2) for rank in (0, 1))
    assert "labels" not in first and first["note"] == "kept"
    # rank 0's last token is scored against rank 1's first label
    assert first["shift_labels"].tolist() == [[11, 12, 13, 14]]
    assert second["shift_labels"].tolist() == [[15, 16, 17, -100]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7]]
    balanced = shard_batch(batch, 0, 2, ring_size=2)
    assert balanced["position_ids"].tolist() == [[0, 1, 6, 7]]
    with pytest.raises(ValueError, match="not a multiple of the sequence-parallel size 3"):
        shard_batch(batch, 0, 3)
    with pytest.raises(ValueError, match="needs 'labels' and 'position_ids'"):
        shard_batch({"input_ids": batch["input_ids"]}, 0, 2)


def _adapter_items() -> dict:
    """Each rank's loader yields two batches of its own; the adapter's items, in order."""
    rank = comm.get_rank()
    group = comm.Topology.build(sequence_parallel=2).get_sequence_parallel_group()
    own = [
        {
            "input_ids": (100 * rank + 10 * i + torch.arange(4 + 2 * rank)).view(1, -1),
            "labels": torch.full((1, 4 + 2 * rank), 10 * rank + i),
            "position_ids": torch.arange(4 + 2 * rank).view(1, -1),
            "source": f"rank {rank} batch {i}",
        }
        for i in range(2)
    ]
    adapter = UlyssesSPDataLoaderAdapter(own, rank, group, 2, "cpu")
    items = [(item["source"], item["input_ids"].tolist()) for item in adapter]
    return {"length": len(adapter), "items": items}


def test_the_adapter_trains_the_group_on_each_ranks_batch_in_turn(pool2):
    for rank, seen in enumerate(pool2.run(_adapter_items)):
        assert seen["length"] == 4
        # rank 0's batches have 4 tokens, rank 1's 6: each rank takes its half of each
        half = {0: 2, 1: 3}
        assert seen["items"] == [
            (
                f"rank {source} batch {i}",
                [[100 * source + 10 * i + rank * half[source] + t for t in range(half[source])]],
            )
            for i in range(2)
            for source in range(2)
        ]


def _initialize_refusals() -> list[str]:
    """What initialize says to sizes that do not fit a world of 2."""
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {}}}
    asks = [
        ({**config, "sequence_parallel_size": 3}, None),
        (config, (2, 2)),  # 4 ranks' worth
        ({**config, "sequence_parallel_size": 1}, (1, 2)),
        ({**config, "sequence_parallel_size": 2, "data_parallel_size": 2}, None),
    ]
    messages = []
    for given, mesh_param in asks:
        with pytest.raises(ValueError) as caught:
            shardspeed.initialize(model=nn.Linear(2, 2), config=given, mesh_param=mesh_param)
        messages.append(str(caught.value))
    return messages


def test_sizes_that_do_not_fit_the_world_are_refused(pool2):
    indivisible, too_many, disagreeing, wrong_data = pool2.run(_initialize_refusals)[0]
    assert "sequence_parallel_size 3 must divide the world size 2" in indivisible
    assert "'data_parallel_size' is 2, but the world of 2 ranks" in too_many
    assert "mesh_param=(1, 2) but the config says 'sequence_parallel_size': 1" in disagreeing
    assert "has 1 data-parallel ranks" in wrong_data
    with pytest.raises(ValueError, match=r"mesh_param must be .* two positive integers"):
        shardspeed.initialize(model=nn.Linear(2, 2), config={}, mesh_param=(2,))
