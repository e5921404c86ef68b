"""Fast checks of the demo's model (examples/gpt.py) and corpus (examples/corpus.py), and that its
training script (examples/train_gpt.py) resumes from its checkpoints."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from corpus import ByteDataset, build_corpus, stdlib_docstrings_fresh  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

SMALL = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def stdlib_bytes(tmp_path_factory) -> bytes:
    return build_corpus(cache_dir=tmp_path_factory.mktemp("corpus"))


def test_forward_shapes():
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, 256, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, 256)
    loss = model(idx, torch.randint(0, 256, (3, 17)))
    assert loss.shape == ()


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, 256, (4, SMALL.block_size))
    loss = model(idx, torch.randint(0, 256, idx.shape)).item()
    assert abs(loss - math.log(256)) < 0.1


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, 256, (2, SMALL.block_size))
    model(idx, idx).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_default_model_size_is_small():
    n = GPT().num_parameters()
    assert 100_000 < n < 5_000_000


def test_too_long_sequence_is_refused():
    model = GPT(SMALL)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, SMALL.block_size + 1, dtype=torch.long))


def test_tie_head_shares_the_token_embedding():
    untied, tied = GPT(SMALL), GPT(SMALL, tie_head=True)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.num_parameters() - tied.num_parameters() == 256 * SMALL.n_embd


def test_torch_init_keeps_pytorch_defaults():
    """init="torch" (the benchmarks' model): the same weights as the same layers built by hand
    under the same seed, e.g. N(0, 1) embeddings instead of GPT-2's N(0, 0.02)."""
    torch.manual_seed(0)
    model = GPT(SMALL, init="torch")
    torch.manual_seed(0)
    expected = torch.nn.Embedding(256, SMALL.n_embd).weight
    assert torch.equal(model.wte.weight, expected)
    with pytest.raises(ValueError, match="init"):
        GPT(SMALL, init="xavier")


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.8, 5), (0.0, None)])
def test_generate_length(temperature, top_k):
    torch.manual_seed(0)
    model = GPT(SMALL)
    prompt = torch.tensor([list(b"def ")])
    out = model.generate(prompt, 50, temperature=temperature, top_k=top_k)  # runs past block_size
    assert out.shape == (1, 4 + 50)
    assert torch.equal(out[:, :4], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < 256
    assert model.training  # mode restored


def test_generate_is_reproducible_with_generator():
    torch.manual_seed(0)
    model = GPT(SMALL)
    prompt = torch.tensor([list(b"x")])
    a = model.generate(prompt, 20, top_k=10, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 20, top_k=10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


def test_state_dict_round_trips_through_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = GPT(SMALL)
    save_file(model.state_dict(), str(tmp_path / "m.safetensors"))  # no shared tensors
    again = GPT(GPTConfig.from_dict(SMALL.to_dict()))
    again.load_state_dict(load_file(str(tmp_path / "m.safetensors")))
    idx = torch.randint(0, 256, (1, 8))
    assert torch.equal(model(idx), again(idx))


def test_stdlib_corpus_is_nontrivial_text(stdlib_bytes):
    assert 200_000 < len(stdlib_bytes) < 8_000_000
    text = stdlib_bytes.decode("utf-8")
    assert "# module json" in text
    assert "Return" in text


def test_stdlib_corpus_is_deterministic(stdlib_bytes, tmp_path):
    # A fresh build (not the cached file) gives the same bytes, and the cache returns them too.
    assert stdlib_docstrings_fresh() == stdlib_bytes
    first = build_corpus(cache_dir=tmp_path)
    assert build_corpus(cache_dir=tmp_path) == first == stdlib_bytes
    assert len(list(tmp_path.iterdir())) == 1


def test_stdlib_corpus_ignores_the_callers_patches(stdlib_bytes, tmp_path, monkeypatch):
    # Launchers replace hooks such as threading.excepthook; the corpus must not depend on that.
    import threading

    def hook(args):
        """A replacement hook with a docstring long enough to be collected if it leaked in."""

    monkeypatch.setattr(threading, "excepthook", hook)
    assert build_corpus(cache_dir=tmp_path) == stdlib_bytes


def test_user_text_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes("héllo world\n".encode())
    assert build_corpus(cache_dir=tmp_path / "c", data_file=str(f)) == "héllo world\n".encode()


def test_dataset_windows_are_shifted_by_one():
    data = bytes(range(200))
    ds = ByteDataset(data, block_size=16)
    assert len(ds) == (200 - 17) // 16 + 1
    for i in (0, 5, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == torch.long and x.shape == y.shape == (16,)
        assert torch.equal(x[1:], y[:-1])
        assert x[0].item() == 16 * i and y[-1].item() == 16 * i + 16
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_dataset_on_corpus_is_deterministic(stdlib_bytes):
    a = ByteDataset(stdlib_bytes, block_size=64)
    b = ByteDataset(stdlib_bytes, block_size=64)
    assert len(a) > 1000
    for i in (0, 123, len(a) - 1):
        assert torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1])
        assert torch.equal(a[i][0][1:], a[i][1][:-1])


def test_dataset_refuses_tiny_corpus():
    with pytest.raises(ValueError):
        ByteDataset(b"abc", block_size=8)


def _train(tmp_path: Path, out: str, *args: str) -> str:
    """A tiny one-process run of the demo script; returns its output."""
    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_bytes(bytes(range(32, 127)) * 200)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    tiny = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "32"]
    command = [sys.executable, str(EXAMPLES / "train_gpt.py"), "--data", str(text)]
    command += ["--out", str(tmp_path / out), "--threads", "1", "--sample_tokens", "8", *tiny]
    proc = subprocess.run(
        [*command, *args], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_demo_resumes_from_its_checkpoints(tmp_path):
    from safetensors.torch import load_file

    _train(tmp_path, "straight", "--steps", "7")
    first = _train(tmp_path, "resumed", "--steps", "5", "--checkpoint-every", "2")
    assert "resumed from" not in first
    ckpt = tmp_path / "resumed" / "checkpoints"
    # Saved at steps 2, 4 and 5 (the last); the newest two are kept.
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "global_step4",
        "global_step5",
        "latest",
        "zero_to_fp32.py",
    ]

    again = _train(tmp_path, "resumed", "--steps", "7", "--checkpoint-every", "2", "--resume")
    assert f"resumed from {ckpt / 'global_step5'} at step 5" in again
    assert "trained 2 steps" in again
    assert (ckpt / "latest").read_text() == "global_step7"
    straight = load_file(str(tmp_path / "straight" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name

    # Without --resume the script starts over, and says what it could have resumed.
    fresh = _train(tmp_path, "resumed", "--steps", "1")
    assert "starting from step 0 (--resume would continue from" in fresh


def test_rlhf_example_raises_its_reward(tmp_path):
    """The hybrid-engine RLHF loop, one process at ZeRO-3: the mean reward of the last iterations
    is well above the first ones' (the policy learns to emit vowels)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "rlhf.py"), "--iterations", "30", "--new-tokens", "16"],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line[:4].strip().isdigit()]
    rewards = [float(row[1]) for row in rows]
    assert len(rewards) == 30
    # Chance is 5/256 (2%); 30 REINFORCE steps take it past 10% (measured: about 0.5).
    assert sum(rewards[:5]) / 5 < 0.06 and sum(rewards[-5:]) / 5 > 0.1, rewards
