"""`init_inference`: greedy generation equal to the plain model's at tensor-parallel sizes 1 and 2
(Hugging Face GPT-2 and Llama, the example GPT), weights loaded from shardspeed and Hugging Face
checkpoints (each rank reading only its pieces), weight-only int8 against fp32, and the config:
misspelled keys, kwargs conflicts, deprecated keys, refusals and `max_out_tokens`."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from shardspeed.config.errors import ConfigError
from shardspeed.inference.config import load_inference_config
from shardspeed.inference.engine import init_inference, policy_from_injection
from shardspeed.inference.quantization import QuantizedLinear, quantize_linears
from shardspeed.inference.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT, MLP, Block, GPTConfig  # noqa: E402

FP32 = {"dtype": torch.float32}
NEW = 5  # new tokens per prompt
# int8 tolerances. Symmetric per-channel rounding moves each weight by at most max|w| / 254; for
# Gaussian rows (max ~ 3.5 sigma) that is ~0.4% of the weights' RMS, and the layers' errors add
# up roughly independently: measured 0.74% relative error of the logits against fp32 on the tiny
# Llama (0.64% split over 2 ranks), so 2% leaves room without hiding a broken scale (a wrong
# scale gives > 50%). Top-1 agreement: a token flips only where its two best logits are within
# that error of each other, which a random-weight model's nearly flat logits make common:
# measured 97.7% (98.4% at tp 2) of 128 positions.
INT8_REL_ERROR = 0.02
INT8_TOP1 = 0.95


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=None,
        )
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=None,
        )
        return transformers.LlamaForCausalLM(config)
    return GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32))


def prompt_ids() -> torch.Tensor:
    return torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))


def plain_greedy(kind: str, seed: int = 0) -> torch.Tensor:
    """The unwrapped model's own greedy generation: prompt plus NEW tokens."""
    model = build(kind, seed).eval()
    with torch.no_grad():
        if kind == "gpt":
            return model.generate(prompt_ids(), NEW, temperature=0)
        return model.generate(prompt_ids(), max_new_tokens=NEW, do_sample=False)


def gpt_policy() -> dict:
    # Only the MLP is split: the example GPT's attention reshapes by the whole width.
    return {MLP: ("proj",)}


def engine_for(kind: str, tp: int, seed: int = 0, **config) -> torch.nn.Module:
    if kind == "gpt":
        config.setdefault("injection_policy", gpt_policy())
    config = {**FP32, **config}
    return init_inference(build(kind, seed), tensor_parallel={"tp_size": tp}, **config)


# -- config ----------------------------------------------------------------------------------


def test_misspelled_keys_are_named_with_their_path():
    with pytest.raises(ConfigError, match=r"unknown key 'dtpye' \(did you mean 'dtype'\?\)"):
        load_inference_config({"dtpye": "fp16"})
    with pytest.raises(ConfigError, match=r"'tensor_parallel.tp_szie' \(did you mean 'tp_size'"):
        load_inference_config(tensor_parallel={"tp_szie": 2})
    with pytest.raises(ConfigError, match=r"unknown key 'quant.weight.bits'"):
        load_inference_config({"dtype": "int8", "quant": {"weight": {"bits": 4}}})


def test_config_and_kwargs_merge_and_conflict(tmp_path):
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "bf16", "max_tokens": 64, "tp": {"tp_size": 1}}))
    config = load_inference_config(str(path), dtype=torch.bfloat16, kernel_inject=True)
    assert config.dtype == "bf16" and config.max_out_tokens == 64
    assert config.replace_with_kernel_inject
    with pytest.raises(ConfigError, match=r"conflicting argument 'dtype': 'bf16' in 'config'"):
        load_inference_config({"dtype": "bf16"}, dtype="fp16")
    with pytest.raises(ConfigError, match=r"both 'max_tokens' and 'max_out_tokens'"):
        load_inference_config({"max_tokens": 8}, max_out_tokens=8)
    assert load_inference_config().dtype == "fp16"  # DeepSpeed's default


def test_deprecated_mp_size_moves_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        config = load_inference_config({"mp_size": 2, "replace_method": "auto"})
    assert config.tensor_parallel.tp_size == 2
    assert "'mp_size' is deprecated: use 'tensor_parallel.tp_size'" in caplog.text
    assert "'replace_method' is deprecated and no longer needed" in caplog.text
    with pytest.raises(ConfigError, match="both the deprecated 'mp_size' and"):
        load_inference_config({"mp_size": 2, "tensor_parallel": {"tp_size": 2}})


def test_unhonoured_keys_are_refused_by_path():
    with pytest.raises(ConfigError) as err:
        load_inference_config(
            {"use_triton": True, "zero": {"stage": 3}, "moe": {"ep_size": 2}, "tm": False}
        )
    problems = "\n".join(err.value.problems)
    for key in ("use_triton", "zero", "moe.ep_size", "triangular_masking"):
        assert f"'{key}' is a DeepSpeed inference key that shardspeed does not honour" in problems
    # Defaults, and sections that disable themselves, are accepted.
    load_inference_config({"use_triton": False, "moe": False, "quant": {"enabled": False}})
    with pytest.raises(ConfigError, match="'quant' acts only with 'dtype' int8"):
        load_inference_config({"quant": {"weight": {"q_groups": 2}}})
    with pytest.raises(ConfigError, match="checkpoint description"):
        load_inference_config(checkpoint={"type": "Megatron", "checkpoints": []})


def test_a_disabled_section_still_refuses_keys_not_honoured():
    # `enabled: false` means what it means in the training config: the feature is off, and a
    # key shardspeed does not honour inside the section is still refused, by its path.
    with pytest.raises(ConfigError, match=r"'moe\.ep_size' is a DeepSpeed inference key"):
        load_inference_config({"moe": {"enabled": False, "ep_size": 2}})
    with pytest.raises(ConfigError, match=r"'tensor_parallel\.tp_grain_size'"):
        load_inference_config({"tensor_parallel": {"enabled": False, "tp_grain_size": 32}})
    assert not load_inference_config({"moe": {"enabled": False}}).moe.enabled


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA graphs run on CUDA")
def test_cuda_graph_is_refused_without_cuda():
    with pytest.raises(ConfigError, match="'enable_cuda_graph' needs a CUDA device"):
        init_inference(build("gpt"), enable_cuda_graph=True, **FP32)


def test_dtype_casts_the_model():
    assert init_inference(build("gpt")).module.wte.weight.dtype == torch.float16  # the default
    engine = init_inference(build("llama"), dtype="bf16")
    assert {p.dtype for p in engine.parameters()} == {torch.bfloat16}


def test_kernel_inject_compiles_the_forward():
    engine = init_inference(build("gpt"), replace_with_kernel_inject=True, **FP32)
    # Compiled lazily (inductor on the first call takes tens of seconds on CPU: not run here).
    assert engine.is_compiled and engine.module._compiled_call_impl is not None


def test_max_out_tokens_caps_prompt_plus_new_tokens():
    engine = init_inference(build("gpt2"), max_out_tokens=10, min_out_tokens=3, **FP32)
    ids = prompt_ids()  # 6 tokens
    assert engine.generate(ids, max_new_tokens=4).shape == (2, 10)
    with pytest.raises(ValueError, match="is 11 tokens, above the engine's max_out_tokens 10"):
        engine.generate(ids, max_new_tokens=5)
    with pytest.raises(ValueError, match="above the engine's max_out_tokens 10"):
        engine.generate([[1] * 9], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="fewer than min_out_tokens 3"):
        engine.generate([[1] * 8], SamplingParams(max_new_tokens=1))


def test_injection_policy_maps_to_column_and_row_layers():
    policy = policy_from_injection(build("gpt"), {Block: ("attn.proj", "mlp.proj")})
    assert policy["row"] == [
        rf"^blocks\.{i}\.{layer}\.proj$" for i in range(2) for layer in ("attn", "mlp")
    ]
    assert r"^blocks\.0\.attn\.qkv$" in policy["column"]
    assert r"^blocks\.1\.mlp\.fc$" in policy["column"]
    with pytest.raises(ConfigError, match="no layer of GPT is called 'o_proj'"):
        policy_from_injection(build("gpt"), {Block: "o_proj"})


# -- one rank --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt"])
def test_greedy_equals_the_plain_model(kind):
    engine = engine_for(kind, 1)
    torch.testing.assert_close(
        engine.generate(prompt_ids(), max_new_tokens=NEW), plain_greedy(kind)
    )
    # shardspeed's form gives the same new tokens.
    new = engine.generate(prompt_ids().tolist(), SamplingParams(max_new_tokens=NEW))
    assert new == plain_greedy(kind)[:, -NEW:].tolist()


def test_left_padding_and_eos_like_hugging_face():
    model = build("gpt2").eval()
    plain = model.generate(prompt_ids(), max_new_tokens=NEW, do_sample=False)
    eos = int(plain[1, 7])  # row 1 stops at its second new token
    expected = model.generate(
        prompt_ids(), max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=63
    )
    engine = init_inference(model, **FP32)
    got = engine.generate(prompt_ids(), max_new_tokens=NEW, eos_token_id=eos, pad_token_id=63)
    torch.testing.assert_close(got, expected)
    # A left-padded batch: each row's new tokens are those of its prompt alone.
    ids = prompt_ids()
    ids[0, :2] = 0
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    alone = engine.generate(ids[:1, 2:], max_new_tokens=NEW)
    assert out[0, -NEW:].tolist() == alone[0, -NEW:].tolist()
    assert out[1].tolist() == plain[1].tolist()
    with pytest.raises(ValueError, match="left padding"):
        engine.generate(ids, attention_mask=mask.flip(1), max_new_tokens=NEW)


def test_int8_is_close_to_fp32_at_a_quarter_of_the_weight_memory():
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = build("llama").eval()(ids).logits
        engine = init_inference(build("llama"), dtype="int8")
        logits = engine(ids).logits
    report = engine.quantization_report
    assert report.skipped == ["lm_head"] and len(report.quantized) == 14
    error = ((logits - reference).norm() / reference.norm()).item()
    top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert error < INT8_REL_ERROR and top1 >= INT8_TOP1, (error, top1)
    # int8 weights plus one fp32 scale per output channel: 1/4 + 1/in_features of fp32.
    layers = [m for m in engine.module.modules() if isinstance(m, QuantizedLinear)]
    expected = sum(m.out_features * (m.in_features + 4) for m in layers)
    assert report.bytes_after == expected and report.ratio < 0.27
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.module.model.modules())


def test_int8_groups_and_tied_heads_left_out():
    model = build("gpt2")  # GPT-2 ties its head to the token embedding
    report = quantize_linears(model, skip=(), groups=2)
    assert report.skipped == ["lm_head"]
    assert model.transformer.h[0].attn.c_attn.weight_scale.shape == (96, 2)


# -- two ranks -------------------------------------------------------------------------------


def generate_tp2() -> dict:
    rank = torch.distributed.get_rank()
    out = {k: engine_for(k, 2).generate(prompt_ids(), max_new_tokens=NEW) for k in ("gpt2", "gpt")}
    # A group given directly: the two ranks of the world.
    given = {"tp_group": torch.distributed.group.WORLD}
    out["tp_group"] = init_inference(build("gpt2"), tensor_parallel=given, **FP32).generate(
        prompt_ids(), max_new_tokens=NEW
    )
    llama = engine_for("llama", 2)
    out["llama"] = llama.generate(prompt_ids(), max_new_tokens=NEW)
    torch.manual_seed(100 + rank)  # different global generators: the engine must agree anyway
    out["sampled"] = llama.generate(prompt_ids(), max_new_tokens=NEW, do_sample=True)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out["fp32_logits"] = build("llama").eval()(ids).logits
        out["int8_logits"] = engine_for("llama", 2, dtype="int8")(ids).logits
    return out


def test_tensor_parallel_greedy_equals_the_plain_model(pool2):
    ranks = pool2.run(generate_tp2)
    for kind in ("gpt2", "llama", "gpt"):
        for result in ranks:
            torch.testing.assert_close(result[kind], plain_greedy(kind))
    for result in ranks:
        torch.testing.assert_close(result["tp_group"], plain_greedy("gpt2"))
    assert torch.equal(ranks[0]["sampled"], ranks[1]["sampled"])
    for result in ranks:
        logits, reference = result["int8_logits"], result["fp32_logits"]
        assert ((logits - reference).norm() / reference.norm()).item() < INT8_REL_ERROR
        assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= INT8_TOP1


def save_shardspeed_checkpoint(directory: str) -> None:
    """A checkpoint of the tiny Llama saved by training ranks split 2 ways (stage 0)."""
    import shardspeed

    model = build("llama")
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "tensor_parallel": {"autotp_size": 2},
        },
    )
    engine.save_checkpoint(directory, tag="step0")


def load_tp2(path: str) -> dict:
    from shardspeed.checkpoint.format import ByteReader

    read = 0
    original = ByteReader.read

    def counting(self, name: str, offset: int, length: int) -> bytes:
        nonlocal read
        read += length
        return original(self, name, offset, length)

    ByteReader.read = counting
    try:
        engine = engine_for("llama", 2, seed=1, checkpoint=path)  # other weights: all are read
    finally:
        ByteReader.read = original
    own = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    return {"tokens": engine.generate(prompt_ids(), max_new_tokens=NEW), "read": read, "own": own}


def test_checkpoints_load_each_rank_its_piece(pool2, tmp_path):
    expected = plain_greedy("llama")
    assert not torch.equal(plain_greedy("llama", seed=1), expected)
    hf_dir, ours = tmp_path / "hf", tmp_path / "ours"
    build("llama").save_pretrained(hf_dir)
    pool2.run(save_shardspeed_checkpoint, str(ours))
    for path in (hf_dir, ours / "step0"):
        for result in pool2.run(load_tp2, str(path)):
            torch.testing.assert_close(result["tokens"], expected)
            # Exactly this rank's pieces plus the replicated tensors, not the whole model.
            assert result["read"] == result["own"], (path.name, result)
    # One rank reads the whole model, from the pieces the two training ranks saved.
    for path in (hf_dir, ours):  # a save directory: its `latest` names the tag
        engine = engine_for("llama", 1, seed=1, checkpoint=str(path))
        torch.testing.assert_close(engine.generate(prompt_ids(), max_new_tokens=NEW), expected)


def int8_generate_tp2() -> torch.Tensor | str:
    engine = engine_for("llama", 2, dtype="int8")
    try:
        return engine.generate(prompt_ids(), max_new_tokens=NEW)
    except ValueError as err:  # returned, not raised: a raising rank costs the pool a restart
        return str(err)


def test_int8_tensor_parallel_generation(pool2):
    for tokens in pool2.run(int8_generate_tp2):
        assert isinstance(tokens, torch.Tensor), tokens
        assert tokens.shape == (2, 6 + NEW)


def test_int8_gpt2_conv1d_generates():
    """GPT-2's Conv1D weights are stored [in, out]: the int8 copy of the transpose must be laid
    out for the int8 kernel (it refused a non-contiguous one)."""
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = build("gpt2").eval()(prompt).logits
        engine = init_inference(build("gpt2"), dtype="int8")
        logits = engine(prompt).logits
        out = engine.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert ((logits - reference).norm() / reference.norm()).item() < INT8_REL_ERROR
    assert out.shape == (1, 12)
