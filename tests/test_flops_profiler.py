"""The flops profiler's counts against FLOPs worked out by hand (a multiply-add is 2 FLOPs, bias adds
and elementwise ops are not counted), its per-module numbers, its printout and the engine's flow."""

from __future__ import annotations

import ast
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from shardspeed.profiling.flops_profiler import (
    PEAK_FLOPS_ENV,
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from gpt import GPT, MLP, Block, GPTConfig  # noqa: E402

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)
B, T, C = 2, 8, CFG.n_embd


def linear_flops(rows: int, fan_in: int, fan_out: int) -> int:
    """(rows x in) @ (in x out); the bias add is not counted."""
    return 2 * rows * fan_in * fan_out


def block_flops(b: int = B, t: int = T) -> dict[str, int]:
    """Forward FLOPs of one examples/gpt.py Block on (b, t, C), by part."""
    rows = b * t
    # Per head, q @ k^T is (T x d) @ (d x T) and scores @ v is (T x T) @ (T x d), d = C / n_head;
    # over the n_head heads that is 2 * T * T * C each (the causal mask is not discounted).
    attention = 2 * b * t * t * C + 2 * b * t * t * C
    parts = {
        "attn.qkv": linear_flops(rows, C, 3 * C),
        "attn.proj": linear_flops(rows, C, C),
        "mlp.fc": linear_flops(rows, C, 4 * C),
        "mlp.proj": linear_flops(rows, 4 * C, C),
    }
    parts["attn"] = parts["attn.qkv"] + attention + parts["attn.proj"]
    parts["mlp"] = parts["mlp.fc"] + parts["mlp.proj"]
    parts["sdpa"] = attention
    parts[""] = parts["attn"] + parts["mlp"]
    return parts


def block_backward_flops() -> int:
    """Every Linear's input needs a gradient, so each costs two matmuls back (grad input, grad
    weight); fused attention's backward is 5 matmuls where its forward is 2."""
    f = block_flops()
    linears = f["attn.qkv"] + f["attn.proj"] + f["mlp.fc"] + f["mlp.proj"]
    return 2 * linears + f["sdpa"] * 5 // 2


def profiled(model: nn.Module, run, **kwargs) -> FlopsProfiler:
    prof = FlopsProfiler(model, **kwargs)
    prof.start_profile()
    run()
    prof.stop_profile()
    return prof


def test_linear_counts_two_flops_per_multiply_add_and_no_bias():
    torch.manual_seed(0)
    lin = nn.Linear(5, 7)
    x = torch.randn(3, 4, 5)
    prof = profiled(lin, lambda: lin(x), recompute_fwd_factor=0.5)
    assert prof.get_total_flops() == linear_flops(12, 5, 7) == 840
    assert prof.get_total_macs() == 420
    assert prof.get_total_params() == 5 * 7 + 7
    assert prof.get_total_bwd_flops() is None  # the window held no backward
    assert prof.get_total_fwd_bwd_flops() == 3.5 * 840  # DeepSpeed's (2 + 0.5 + 1) * fwd
    assert prof.get_total_flops(as_string=True) == "840 "
    assert prof.get_total_macs(as_string=True) == "420 MACs"
    assert prof.get_total_params(as_string=True) == "42"
    prof.end_profile()

    x.requires_grad_(True)
    prof = profiled(lin, lambda: lin(x).sum().backward(), recompute_fwd_factor=0.5)
    assert prof.get_total_flops() == 840
    assert prof.get_total_bwd_flops() == 2 * 840  # grad input and grad weight
    assert prof.get_total_fwd_bwd_flops() == 3 * 840  # measured: the factor is not added
    assert prof.get_total_bwd_duration() > 0
    prof.end_profile()


def test_gpt_block_matches_hand_count_per_module():
    torch.manual_seed(0)
    block = Block(CFG)
    x = torch.randn(B, T, C, requires_grad=True)
    prof = profiled(block, lambda: block(x).sum().backward())
    expected = block_flops()
    for name in ("", "attn", "attn.qkv", "attn.proj", "mlp", "mlp.fc", "mlp.proj"):
        profile = prof.module_profile(block.get_submodule(name))
        assert profile.flops == expected[name], name
        assert profile.macs == expected[name] // 2
    for norm in (block.ln_1, block.ln_2):
        assert prof.module_profile(norm).flops == 0  # elementwise: not counted
    for name, module in block.named_modules():
        assert prof.module_profile(module).params == sum(p.numel() for p in module.parameters())
        assert prof.module_profile(module).name == name
    assert prof.get_total_params() == 4 * C + (3 * C * C + 3 * C) + (C * C + C) + 8 * C * C + 5 * C
    assert prof.get_total_bwd_flops() == block_backward_flops()
    prof.end_profile()


def test_whole_gpt_is_blocks_plus_head_also_inside_a_wrapper():
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (B, T))
    head = linear_flops(B * T, C, CFG.vocab_size)
    expected = CFG.n_layer * block_flops()[""] + head
    expected_bwd = CFG.n_layer * block_backward_flops() + 2 * head
    # Returning the loss, then through a wrapper (the tracker then names it after the wrapper).
    steps = (lambda: model(idx, idx).backward(), lambda: nn.Sequential(model)(idx).sum().backward())
    for step in steps:
        prof = profiled(model, step)
        assert prof.get_total_flops() == expected
        assert prof.get_total_bwd_flops() == expected_bwd
        for block in model.blocks:
            assert prof.module_profile(block).flops == block_flops()[""]
            assert prof.module_profile(block.attn.qkv).flops == block_flops()["attn.qkv"]
        assert prof.module_profile(model.lm_head).flops == head
        assert prof.module_profile(model.wte).flops == 0
        assert prof.module_profile(model.wte).params == CFG.vocab_size * C
        assert prof.get_total_params() == model.num_parameters()
        prof.end_profile()


def test_checkpoint_recompute_counts_as_backward():
    torch.manual_seed(0)
    block = Block(CFG)

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=False)

    wrapped = Checkpointed()
    x = torch.randn(B, T, C, requires_grad=True)
    with set_checkpoint_early_stop(False):  # recompute the whole forward
        prof = profiled(wrapped, lambda: wrapped(x).sum().backward())
    assert prof.get_total_flops() == block_flops()[""]
    assert prof.module_profile(block).flops == block_flops()[""]  # the recompute is not forward
    assert prof.get_total_bwd_flops() == block_backward_flops() + block_flops()[""]
    prof.end_profile()

    # By default torch stops recomputing once it has what backward needs: here before the last
    # matmul, whose output nothing saved. The profiler counts what ran.
    prof = profiled(wrapped, lambda: wrapped(x).sum().backward())
    recomputed = block_flops()[""] - block_flops()["mlp.proj"]
    assert prof.get_total_bwd_flops() == block_backward_flops() + recomputed
    prof.end_profile()


def test_latency_is_positive_and_nested_consistently():
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (B, T))
    prof = FlopsProfiler(model)
    prof.start_profile()
    began = time.perf_counter()
    model(idx)
    wall = time.perf_counter() - began
    prof.stop_profile()
    total = prof.get_total_duration()
    assert 0 < total <= wall
    assert prof.get_total_duration(as_string=True).endswith("s")
    for module in model.modules():
        children = sum(prof.module_profile(c).duration for c in module.children())
        assert prof.module_profile(module).duration >= children
    blocks = [prof.module_profile(b).duration for b in model.blocks]
    assert all(d > 0 for d in blocks)
    # The ModuleList is never called: its latency is its blocks'.
    assert prof.module_profile(model.blocks).duration == pytest.approx(sum(blocks))
    assert prof.module_profile(model.blocks[0]).flops_per_second > 0
    assert prof.get_total_bwd_duration() is None
    prof.end_profile()


def test_print_model_profile_tree_depth_top_modules_and_file(tmp_path, capsys):
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (B, T))
    prof = profiled(model, lambda: model(idx))
    out = tmp_path / "sub" / "profile.txt"
    prof.print_model_profile(profile_step=3, module_depth=2, top_modules=2, output_file=out)
    text = out.read_text()
    assert "Profile Summary at step 3:" in text
    assert number_to_string(prof.get_total_flops()) in text
    assert text.splitlines().count("depth 2:") == 1 and "depth 3:" not in text
    macs_depth_1 = next(
        line for line in text.split("depth 1:")[1].splitlines() if "MACs" in line
    ).split(" - ")[1]
    assert len(ast.literal_eval(macs_depth_1)) == 2  # top 2 of 5 module classes
    assert "\nGPT: " in text
    assert "\n  (blocks) ModuleList: " in text
    assert "\n    (0) Block: " in text and "\n    (1) Block: " in text
    assert "(attn)" not in text  # depth 3
    assert "in_features=16, out_features=256, bias=False" in text  # lm_head's own repr
    assert capsys.readouterr().out == ""  # written to the file only

    prof.print_model_profile()
    shown = capsys.readouterr().out
    assert "\n        (qkv) Linear: " in shown  # all depths
    assert "depth 4:" in shown
    prof.print_model_aggregated_profile(module_depth=0)
    expected = {
        "params     ": params_to_string(model.num_parameters()),
        "MACs       ": prof.get_total_macs(as_string=True),
        "fwd latency": prof.get_total_duration(as_string=True),
    }
    assert capsys.readouterr().out.splitlines()[1:] == [
        "depth 0:",
        *(f"    {label} - {{'GPT': '{value}'}}" for label, value in expected.items()),
    ]
    prof.end_profile()
    prof.print_model_profile()  # after end_profile: nothing to print
    assert capsys.readouterr().out == ""


def test_get_model_profile_with_input_shape(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    flops = linear_flops(4, 6, 10) + linear_flops(4, 10, 3)
    params = 6 * 10 + 10 + 10 * 3 + 3
    out = tmp_path / "p.txt"
    got = get_model_profile(model, input_shape=(4, 6), as_string=False, output_file=out)
    assert got == (flops, flops // 2, params)
    assert "(0) Linear" in out.read_text()
    assert model.training  # its mode is given back
    as_strings = get_model_profile(model, input_shape=(4, 6), print_profile=False, warm_up=0)
    assert as_strings == (number_to_string(flops), macs_to_string(flops // 2), str(params))
    kwargs_only = get_model_profile(model, kwargs={"input": torch.ones(4, 6)}, print_profile=False)
    assert kwargs_only == as_strings
    with pytest.raises(ValueError, match="mode"):
        get_model_profile(model, input_shape=(4, 6), mode="backward")
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(model)


def test_get_model_profile_generate_mode():
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (1, 4))
    flops, _, _ = get_model_profile(
        model, args=[idx, 2], mode="generate", print_profile=False, as_string=False
    )
    # Two new tokens: forwards over 4 then 5 positions.
    assert flops == sum(
        CFG.n_layer * block_flops(1, t)[""] + linear_flops(t, C, CFG.vocab_size) for t in (4, 5)
    )


def test_ignore_list_leaves_modules_out_of_the_breakdown(capsys):
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (B, T))
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[MLP])
    model(idx)
    prof.stop_profile()
    with pytest.raises(ValueError, match="not a profiled module"):
        prof.module_profile(model.blocks[0].mlp)
    with pytest.raises(ValueError, match="not a profiled module"):
        prof.module_profile(model.blocks[0].mlp.fc)  # what an ignored module holds
    # As in DeepSpeed, an ignored module's FLOPs stay in its parent's (no timing of its own).
    assert prof.module_profile(model.blocks[0]).flops == block_flops()[""]
    prof.print_model_profile(top_modules=10)
    shown = capsys.readouterr().out
    assert "(mlp) MLP: ignored (counted in its parent)" in shown
    assert "'MLP'" not in shown and "(fc) Linear" not in shown
    prof.end_profile()


def test_engine_flow_forward_only_then_estimate(capsys):
    """DeepSpeed's engine: start before the forward, stop after it, print and end at step()."""
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (B, T))

    class Engine:
        world_size = 4
        dp_world_size = 2
        mp_world_size = 2

        def train_micro_batch_size_per_gpu(self) -> int:
            return B

    prof = FlopsProfiler(model, ds_engine=Engine(), recompute_fwd_factor=1.0)
    prof.start_profile(ignore_list=None)
    loss = model(idx, idx)
    prof.stop_profile()
    loss.backward()  # outside the window
    assert _get_current_dispatch_mode() is None
    assert prof.get_total_bwd_flops() is None
    fwd = prof.get_total_flops()
    assert prof.get_total_fwd_bwd_flops() == 4 * fwd
    prof.print_model_profile(profile_step=1, detailed=False)
    shown = capsys.readouterr().out
    assert "world size:" in shown and "model parallel size:" in shown
    assert "fwd flops of model = fwd flops per GPU * mp_size:" in shown
    assert number_to_string(2 * fwd) in shown
    assert "fwd+bwd flops per GPU = 4 * fwd flops per GPU (estimate):" in shown
    assert "Detailed Profile" not in shown
    prof.end_profile()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not prof.started


def test_mfu_from_argument_or_environment(monkeypatch, capsys):
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    prof = profiled(lin, lambda: lin(x).sum().backward())
    prof.print_model_profile(detailed=False)
    assert "fwd MFU = fwd FLOPS per GPU / peak FLOPS:" in (shown := capsys.readouterr().out)
    assert f"n/a (peak unknown: pass peak_flops or set {PEAK_FLOPS_ENV})" in shown
    prof.end_profile()

    prof = profiled(lin, lambda: lin(x).sum().backward(), peak_flops=1e9)
    prof.print_model_profile(detailed=False)
    shown = capsys.readouterr().out
    assert "% of 1 GFLOPS" in shown
    assert "fwd+bwd MFU" in shown and "bwd latency:" in shown
    prof.end_profile()

    monkeypatch.setenv(PEAK_FLOPS_ENV, "2e12")
    assert FlopsProfiler(lin).peak_flops == 2e12
    assert FlopsProfiler(lin, peak_flops=5.0).peak_flops == 5.0
    monkeypatch.setenv(PEAK_FLOPS_ENV, "fast")
    with pytest.raises(ValueError, match=PEAK_FLOPS_ENV):
        FlopsProfiler(lin)
    with pytest.raises(ValueError, match="peak_flops"):
        FlopsProfiler(lin, peak_flops=0)


def test_reset_and_restart():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    prof = FlopsProfiler(lin)
    prof.start_profile()
    lin(x)
    prof.reset_profile()  # counts from here
    lin(x)
    lin(x)
    assert prof.get_total_flops() == 2 * linear_flops(2, 4, 4)
    prof.start_profile()  # a second start begins a fresh window
    lin(x)
    prof.end_profile()
    assert _get_current_dispatch_mode() is None


def test_number_formats_are_deepspeeds():
    assert number_to_string(1.5e9) == "1.5 G"
    assert number_to_string(0) == "0 "
    assert number_to_string(1234, units="K", precision=1) == "1.2 K"
    assert macs_to_string(2.5e6) == "2.5 MMACs"
    assert flops_to_string(3e12) == "3 TFLOPS"
    assert params_to_string(1.3e9) == "1.3 B"
    assert params_to_string(125e6) == "125 M"
    assert duration_to_string(0.0123) == "12.3 ms"


def test_engine_profiles_its_profile_step(tmp_path):
    """The `flops_profiler` section: the engine profiles step `profile_step` (forward and
    backward of its first micro-step) and writes the report to `output_file`."""
    import shardspeed

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    out = tmp_path / "flops.txt"
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW"},
            "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(out)},
        },
    )
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 16))
        engine.backward(engine(ids, ids))
        engine.step()
    report = out.read_text()
    assert "Profile Summary at step 1" in report
    assert report.count("Profile Summary") == 1  # one step only
    assert "bwd flops per GPU (measured)" in report
    assert engine.flops_profiler is not None and not engine.flops_profiler.started
