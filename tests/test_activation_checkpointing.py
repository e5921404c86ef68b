"""`shardspeed.checkpointing`: gradients equal to plain autograd, what a checkpoint keeps (measured by
the outermost saved-tensor hooks, which see every tensor autograd keeps for backward), the RNG
streams at recompute, partitioned activations on two tensor-parallel ranks, and configuration.

Gradients are compared bit for bit: the recompute runs the same operations on the same values.
The single-process tests run on the device whose generator the RNG tracker follows (CUDA where
there is one, so on a GPU machine they check the CUDA paths: pinned host copies, device RNG,
synchronization); the two-rank tests run on the CPU over gloo.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardspeed import checkpointing, comm
from shardspeed.checkpointing import checkpoint, get_cuda_rng_tracker
from shardspeed.config import ConfigError
from shardspeed.config.schema import ActivationCheckpointingConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch):
    """Each test starts unconfigured, with no RNG streams."""
    monkeypatch.setattr(checkpointing, "_settings", checkpointing._Settings())
    get_cuda_rng_tracker().reset()
    yield
    get_cuda_rng_tracker().reset()


def saved(fn: Callable, *args: Any, exclude: Iterable[torch.Tensor] = ()) -> tuple[Any, dict]:
    """Run `fn` and return its result and the storages autograd keeps for backward, by address:
    (bytes, device, pinned). Storages of `exclude` (parameters, kept anyway) are left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, tuple[int, str, bool]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip and storage.nbytes():
            storages[storage.data_ptr()] = (
                storage.nbytes(),
                tensor.device.type,
                tensor.is_pinned(),
            )
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn(*args)
    return result, storages


def total(storages: dict) -> int:
    return sum(nbytes for nbytes, _, _ in storages.values())


class Block(nn.Module):
    """A residual MLP block; `p` > 0 adds dropout on the default stream and, if `forked`, inside
    the tracker's model-parallel stream, as Megatron's tensor-parallel layers do."""

    def __init__(self, width: int, p: float = 0.0, forked: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.p = p
        self.forked = forked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if self.p:
            h = F.dropout(h, self.p)
        if self.p and self.forked:
            with get_cuda_rng_tracker().fork():
                h = F.dropout(h, self.p)
        return x + self.fc2(h)


def default_rng_state() -> torch.Tensor:
    """The state of the generator the tracker follows (the device's)."""
    return torch.cuda.get_rng_state() if DEVICE.type == "cuda" else torch.get_rng_state()


def grads(model: nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()] + [t.grad.clone() for t in tensors]
    model.zero_grad()
    for tensor in tensors:
        tensor.grad = None
    return out


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, use: bool) -> torch.Tensor:
    for block in blocks:
        x = checkpoint(block, x) if use else block(x)
    return x


def test_gradients_equal_plain_autograd_and_only_block_inputs_are_kept():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(32) for _ in range(4)).to(DEVICE)
    x = torch.randn(8, 32, device=DEVICE, requires_grad=True)
    results = {}
    for use in (False, True):
        out, kept = saved(run_blocks, blocks, x, use, exclude=blocks.parameters())
        out.square().sum().backward()
        results[use] = grads(blocks, x), total(kept)
    for plain, checkpointed in zip(results[False][0], results[True][0]):
        assert torch.equal(plain, checkpointed)
    block_input = 8 * 32 * 4
    # Each plain block keeps its input and the two 4x-wide activations (fc1's output for gelu,
    # gelu's for fc2); a checkpointed one keeps its input only.
    assert results[False][1] == 4 * (block_input + 2 * 4 * block_input)
    assert results[True][1] == 4 * block_input
    assert checkpointing.calls() >= 4


def test_inputs_without_gradient_keyword_arguments_and_tuple_results():
    torch.manual_seed(0)
    lin = nn.Linear(6, 6).to(DEVICE)
    x = torch.randn(3, 6, device=DEVICE)  # needs no gradient: only the parameters do
    ids = torch.tensor([2, 0, 1], device=DEVICE)

    def f(x, ids, scale, *, shift):
        h = torch.tanh(lin(x))[ids] * scale + shift
        return h, ids.sum(), "label"

    results = []
    for call in (f, lambda *a, **k: checkpoint(f, *a, **k)):
        h, count, label = call(x, ids, 2.0, shift=torch.ones(6, device=DEVICE))
        h.sum().backward()
        results.append((grads(lin), int(count), label))
    assert results[0][1:] == results[1][1:] == (3, "label")
    for plain, checkpointed in zip(results[0][0], results[1][0]):
        assert torch.equal(plain, checkpointed)


def test_no_grad_forward_keeps_nothing():
    lin = nn.Linear(4, 4).to(DEVICE)
    with torch.no_grad():
        out, kept = saved(checkpoint, lin, torch.randn(2, 4, device=DEVICE))
    assert not out.requires_grad and kept == {}


def test_dropout_masks_are_identical_at_recompute():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(16, p=0.3) for _ in range(2)).to(DEVICE)
    x = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    results = []
    for use in (False, True):
        checkpointing.model_parallel_cuda_manual_seed(1234)
        before = get_cuda_rng_tracker().get_states()["model-parallel-rng"]
        run_blocks(blocks, x, use).square().sum().backward()
        after = get_cuda_rng_tracker().get_states()["model-parallel-rng"]
        assert not torch.equal(before, after)  # the forked stream was drawn from
        results.append((grads(blocks, x), after, default_rng_state()))
    for plain, checkpointed in zip(results[0][0], results[1][0]):
        assert torch.equal(plain, checkpointed)
    # The recompute leaves both streams where the forward left them.
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][2], results[1][2])


def test_a_kept_graph_recomputes_again_with_the_same_masks():
    torch.manual_seed(0)
    block = Block(8, p=0.5).to(DEVICE)
    checkpointing.model_parallel_cuda_manual_seed(7)
    out = checkpoint(block, torch.randn(3, 8, device=DEVICE, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    first = grads(block)
    out.backward()
    for a, b in zip(first, grads(block)):
        assert torch.equal(a, b)


def test_cpu_checkpointing_keeps_the_inputs_in_host_memory():
    checkpointing.configure(None, checkpoint_in_cpu=True)
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(8) for _ in range(2)).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    out, kept = saved(run_blocks, blocks, x, True, exclude=blocks.parameters())
    # In pinned memory when they came from a GPU (an asynchronous copy).
    assert sorted(kept.values()) == [(4 * 8 * 4, "cpu", DEVICE.type == "cuda")] * 2
    out.sum().backward()
    checkpointed = grads(blocks, x)
    run_blocks(blocks, x, False).sum().backward()
    for a, b in zip(grads(blocks, x), checkpointed):
        assert torch.equal(a, b)


def test_the_tracker():
    tracker = get_cuda_rng_tracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="'c' was never added"), tracker.fork("c"):
        pass
    torch.manual_seed(5)
    default = torch.rand(3, device=DEVICE)
    torch.manual_seed(5)
    with tracker.fork("a"):
        forked = torch.rand(3, device=DEVICE)
    assert torch.equal(torch.rand(3, device=DEVICE), default)  # the default stream did not move
    torch.manual_seed(1)
    assert torch.equal(forked, torch.rand(3, device=DEVICE))  # stream "a" started from seed 1
    states = tracker.get_states()
    with tracker.fork("a"):
        drawn = torch.rand(3, device=DEVICE)
    tracker.set_states(states)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3, device=DEVICE), drawn)


# -- configuration ---------------------------------------------------------------------------------


def test_configure_from_a_dict_and_a_json_file_with_arguments_overriding(tmp_path):
    assert not checkpointing.is_configured()
    checkpointing.configure(
        None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}}
    )
    assert checkpointing.is_configured() and checkpointing._settings.cpu
    path = tmp_path / "ds.json"
    section = {
        "partition_activations": True,
        "profile": True,
        "synchronize_checkpoint_boundary": True,
    }
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": section}))
    # Megatron's call: num_checkpoints sizes contiguous buffers in DeepSpeed, so it is accepted.
    checkpointing.configure(None, str(path), profile=False, num_checkpoints=24)
    settings = checkpointing._settings
    assert (settings.partition, settings.cpu, settings.synchronize, settings.profile) == (
        True,
        False,
        True,
        False,
    )
    checkpointing.reset()  # DeepSpeed's reset frees buffers and keeps the settings
    assert checkpointing._settings == settings


@pytest.mark.parametrize(
    ("config", "arguments", "message"),
    [
        (
            {"partition_activation": True},
            {},
            "unknown key 'activation_checkpointing.partition_activation' (did you mean "
            "'partition_activations'?)",
        ),
        (
            {"cpu_checkpointing": "yes"},
            {},
            "'activation_checkpointing.cpu_checkpointing': Input should be a valid boolean",
        ),
        ({}, {"checkpoint_in_cpu": 1}, "configure(checkpoint_in_cpu=...): Input should be"),
        ({}, {"num_checkpoints": 0}, "configure(num_checkpoints=...): Input should be greater"),
    ],
)
def test_bad_settings_are_refused_with_their_key(config, arguments, message):
    with pytest.raises(ConfigError) as err:
        checkpointing.configure(None, {"activation_checkpointing": config}, **arguments)
    assert message in str(err.value)
    assert not checkpointing.is_configured()


def test_contiguous_memory_settings_are_accepted_as_the_layout_they_ask_for():
    # DeepSpeed's contiguous buffers keep saved inputs from fragmenting memory, which torch's
    # caching allocator does already; Megatron scripts pass these on every run.
    checkpointing.configure(
        None,
        {"activation_checkpointing": {"contiguous_memory_optimization": True}},
        contiguous_checkpointing=True,
        num_checkpoints=4,
    )
    assert checkpointing.is_configured()
    checkpointing.reset()


def test_the_section_must_be_an_object():
    with pytest.raises(ConfigError, match="'activation_checkpointing' must be an object"):
        checkpointing.configure(None, {"activation_checkpointing": True})


def test_the_engine_applies_a_section_and_profile_logs_forward_and_recompute(caplog):
    checkpointing.configure_from_config(
        ActivationCheckpointingConfig(profile=True, synchronize_checkpoint_boundary=True), None
    )
    assert checkpointing.is_configured()
    before = checkpointing.calls()
    lin = nn.Linear(4, 4).to(DEVICE)
    with caplog.at_level(logging.INFO, logger="shardspeed"):
        checkpoint(lin, torch.randn(2, 4, device=DEVICE)).sum().backward()
    assert checkpointing.calls() == before + 1
    assert "activation checkpoint: forward took" in caplog.text
    assert "activation checkpoint: recompute took" in caplog.text


def test_partition_without_tensor_parallelism_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        checkpointing.configure(None, partition_activations=True)
    assert "partition_activations has no effect without tensor parallelism" in caplog.text


# -- two tensor-parallel ranks ---------------------------------------------------------------------


def _partitioned(cpu: bool) -> dict:
    """On each of 2 tensor-parallel ranks (same inputs and weights): gradients, kept bytes and
    all-gathers with partitioned activations, against the same run without checkpointing."""
    checkpointing.configure_from_config(
        ActivationCheckpointingConfig(partition_activations=True, cpu_checkpointing=cpu),
        comm.Topology.build(tensor_parallel=2),
    )
    torch.manual_seed(0)
    # Dropout on the default stream only: a forked stream differs per rank, so the blocks' outputs
    # would too, and partitioning needs inputs that are the same on every tensor-parallel rank
    # (as the outputs of Megatron's row-parallel layers are).
    blocks = nn.ModuleList(Block(16, p=0.2, forked=False) for _ in range(3))
    x = torch.randn(6, 16, requires_grad=True)
    odd = torch.randn(3, 5)  # 15 elements: pieces of 8, the last padded

    def forward(use: bool) -> tuple[torch.Tensor, weakref.ref]:
        h = x * 2  # an input nothing else keeps
        probe = weakref.ref(h)
        h = run_blocks(blocks, h, use)
        extra = checkpoint(lambda a, b: a.sum() * b.sum(), h, odd) if use else h.sum() * odd.sum()
        return extra, probe

    out = {}
    for use in (False, True):
        torch.manual_seed(99)  # the blocks' dropout draws from the CPU generator
        comm.reset_comm_volume()
        (loss, probe), kept = saved(forward, use, exclude=blocks.parameters())
        out[f"freed{use}"] = probe() is None
        loss.backward()
        out[f"grads{use}"] = grads(blocks, x)
        out[f"kept{use}"] = sorted(nbytes for nbytes, _, _ in kept.values())
        out[f"devices{use}"] = {device for _, device, _ in kept.values()}
        out[f"gathers{use}"] = comm.comm_volume().get("all_gather", {"calls": 0, "bytes": 0})
    out["equal"] = all(torch.equal(a, b) for a, b in zip(out.pop("gradsFalse"), out["gradsTrue"]))
    out["grads"] = out.pop("gradsTrue")
    return out


@pytest.mark.parametrize("cpu", [False, True])
def test_partitioned_activations_keep_half_on_two_ranks(pool2, cpu):
    ranks = pool2.run(_partitioned, cpu)
    whole = 6 * 16 * 4
    for result in ranks:
        assert result["equal"]
        # Three blocks keep half their input each; the last function half of h and 8 of 15.
        assert result["keptTrue"] == sorted([whole // 2] * 4 + [8 * 4])
        assert result["devicesTrue"] == {"cpu"}
        assert result["freedTrue"] and not result["freedFalse"]  # plain fc1 keeps its input
        # Each recompute gathers its pieces back: 5 inputs, padded sizes.
        assert result["gathersTrue"] == {"calls": 5, "bytes": 4 * whole + 16 * 4}
        assert result["gathersFalse"]["calls"] == 0
    for a, b in zip(ranks[0]["grads"], ranks[1]["grads"]):
        assert torch.equal(a, b)


def _seeds() -> dict:
    checkpointing.configure(comm.Topology.build(tensor_parallel=2))
    checkpointing.model_parallel_cuda_manual_seed(42)
    with get_cuda_rng_tracker().fork():
        forked = torch.rand(4, device=DEVICE)
    return {"default": torch.rand(4, device=DEVICE).cpu(), "forked": forked.cpu()}


def test_model_parallel_seed_differs_per_tensor_parallel_rank(pool2):
    first, second = pool2.run(_seeds)
    assert torch.equal(first["default"], second["default"])
    assert not torch.equal(first["forked"], second["forked"])
    torch.manual_seed(42 + 2718 + 1)
    assert torch.equal(second["forked"], torch.rand(4, device=DEVICE).cpu())


def _engine_with_section(uses_checkpoint: bool) -> tuple[bool, bool, list[str]]:
    """initialize() with an activation_checkpointing section; (configured, cpu, warnings)."""
    import shardspeed

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.layer, x) if uses_checkpoint else self.layer(x)

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("shardspeed").addHandler(handler)
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "activation_checkpointing": {"cpu_checkpointing": True},
    }
    engine, *_ = shardspeed.initialize(model=Net(), config=config)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    logging.getLogger("shardspeed").removeHandler(handler)
    return checkpointing.is_configured(), checkpointing._settings.cpu, warnings


def test_initialize_applies_the_section_and_warns_when_nothing_checkpoints(pool2):
    # DeepSpeed reads the section only if the script calls configure(); here initialize applies
    # it, and a model that never checkpoints is told so once.
    configured, cpu, warnings = pool2.run(_engine_with_section, True)[0]
    assert configured and cpu and not warnings
    _, _, warnings = pool2.run(_engine_with_section, False)[0]
    assert any("never called shardspeed.checkpointing.checkpoint" in w for w in warnings)
