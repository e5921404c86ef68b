"""Generation over the block KV cache (shardspeed.inference): cached greedy decoding against
uncached recomputation and against the models' own generate, continuous batching against solo
runs, sampling, stop tokens and the cache's bookkeeping."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shardspeed.inference import (
    BlockKVCache,
    ContinuousBatcher,
    GPTAdapter,
    HFCausalLMAdapter,
    OutOfBlocksError,
    RecomputeAdapter,
    SamplingParams,
    adapter_for,
    choose_next,
    filtered_probs,
    generate,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from gpt import GPT, GPTConfig  # noqa: E402

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 8, 7, 6, 5]]
GREEDY = SamplingParams(max_new_tokens=10)


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    # Four query heads share two key/value heads (grouped-query attention).
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config)


def solo(model: nn.Module, prompt: list[int], params: SamplingParams) -> list[int]:
    return generate(model, [prompt], params)[0]


def test_gpt_greedy_cached_matches_uncached_and_own_generate(gpt):
    gpt.train()
    assert isinstance(adapter_for(gpt), GPTAdapter)
    cached = generate(gpt, PROMPTS, GREEDY, block_size=4, max_batch_size=3)
    assert gpt.training  # put back after generation
    gpt.eval()
    uncached = generate(gpt, PROMPTS, GREEDY, use_cache=False)
    own = [
        gpt.generate(torch.tensor([p]), 10, temperature=0)[0, len(p) :].tolist() for p in PROMPTS
    ]
    assert cached == uncached == own
    # The same prompts as one unpadded tensor.
    assert generate(gpt, torch.tensor([[1, 2, 3], [4, 5, 6]]), GREEDY)[0] == own[0]


@pytest.mark.parametrize(
    "make, kv_heads", [(tiny_gpt2, 4), (tiny_llama, 2)], ids=["gpt2", "llama-gqa"]
)
def test_hf_greedy_matches_hf_generate(make, kv_heads):
    torch.manual_seed(0)
    model = make().eval()
    model.generation_config.eos_token_id = None
    batcher = ContinuousBatcher(model, max_batch_size=3, cache_blocks=16, block_size=4)
    assert isinstance(batcher.adapter, HFCausalLMAdapter)
    assert batcher.cache.num_kv_heads == kv_heads
    ids = [batcher.add_request(p, GREEDY) for p in PROMPTS]
    results = batcher.run()
    cached = [results[i] for i in ids]
    # Decode steps ran sequences of different lengths in one batch.
    assert batcher.stats.peak_batch_size == 3
    uncached = generate(model, PROMPTS, GREEDY, use_cache=False)
    reference = [
        model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    ]
    assert cached == uncached == reference
    assert batcher.cache.blocks_in_use() == 0


@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_multi_token_step_over_padded_past_matches_full_forward(gpt, which):
    # Sequences of 5 and 2 cached tokens take 3 new tokens each in one forward: the new tokens
    # attend causally among themselves and to right-aligned pasts of different lengths.
    torch.manual_seed(0)
    model = gpt if which == "gpt" else tiny_llama().eval()
    adapter = adapter_for(model)
    cache = adapter.make_cache(num_blocks=8, block_size=2)
    seqs = [[7, 3, 9, 1, 4, 2, 8, 5], [6, 2, 3, 1, 9]]
    for s in (0, 1):
        cache.add_sequence(s)
    with torch.inference_mode():
        adapter.forward([seqs[0][:5], seqs[1][:2]], [0, 1], cache)
        step = adapter.forward([seqs[0][5:], seqs[1][2:]], [0, 1], cache)
        for s in (0, 1):
            logits = model(torch.tensor([seqs[s]]))
            full = (logits.logits if which == "llama" else logits)[0, -1]
            torch.testing.assert_close(step[s], full, atol=1e-5, rtol=1e-5)
    assert [cache.length(0), cache.length(1)] == [8, 5]


def test_continuous_batching_matches_solo_runs(gpt):
    lengths = [1, 12, 5, 8, 3, 10]
    new_tokens = [10, 2, 7, 4, 9, 3]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(max_new_tokens=n) for n in new_tokens]
    expected = [solo(gpt, p, q) for p, q in zip(prompts, params)]

    runs = {}
    for continuous in (True, False):
        # 4-token blocks: each request reserves 3 or 4 of the 9, so at most two or three run
        # at once and admission waits for blocks as well as for batch room.
        batcher = ContinuousBatcher(gpt, 3, 9, 4, continuous=continuous)
        ids = [batcher.add_request(p, q) for p, q in zip(prompts, params)]
        results = batcher.run()
        assert [results[i] for i in ids] == expected
        assert batcher.cache.blocks_in_use() == 0
        assert batcher.stats.peak_blocks_in_use <= 9
        assert batcher.stats.tokens_generated == sum(new_tokens)
        assert batcher.stats.waited_for_blocks > 0
        runs[continuous] = batcher.stats
    assert runs[True].joined_while_running > 0
    assert runs[False].joined_while_running == 0
    assert runs[True].steps < runs[False].steps


def test_seeded_sampling_is_reproducible_and_batch_independent(gpt):
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    alone = solo(gpt, [3, 1, 4], seeded)
    assert solo(gpt, [3, 1, 4], seeded) == alone
    others = [SamplingParams(max_new_tokens=5, temperature=1.0), SamplingParams(8, 0.8, seed=3)]
    batched = generate(gpt, [[2, 7], [3, 1, 4], [1, 1, 1, 1]], [others[0], seeded, others[1]])
    assert batched[1] == alone
    assert solo(gpt, [3, 1, 4], SamplingParams(12, 1.0, seed=8)) != alone


def test_top_k_one_and_tiny_top_p_are_greedy(gpt):
    greedy = generate(gpt, PROMPTS, GREEDY)
    top1 = SamplingParams(max_new_tokens=10, temperature=1.5, top_k=1, seed=0)
    assert generate(gpt, PROMPTS, top1) == greedy
    tiny_p = SamplingParams(max_new_tokens=10, temperature=1.5, top_p=1e-6, seed=0)
    assert generate(gpt, PROMPTS, tiny_p) == greedy


def test_filtering_keeps_top_k_and_the_nucleus():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    probs = torch.softmax(logits, dim=-1)[0]  # sorted order: 4, 0, 1, 2, 3
    top2 = filtered_probs(logits, 1.0, top_k=2, top_p=None)[0]
    keep = probs * torch.tensor([1.0, 0, 0, 0, 1])
    torch.testing.assert_close(top2, keep / keep.sum())
    # Probabilities 0.636, 0.234, 0.086, 0.032, 0.012 in that order; cumulative 0.636, 0.870,
    # 0.956, 0.988: the nucleus is the shortest prefix reaching top_p.
    for top_p, kept in ((0.5, [4]), (0.85, [4, 0]), (0.9, [4, 0, 1]), (0.96, [4, 0, 1, 2])):
        nucleus = filtered_probs(logits, 1.0, top_k=None, top_p=top_p)[0]
        assert sorted(nucleus.nonzero().flatten().tolist()) == sorted(kept)
        torch.testing.assert_close(nucleus.sum(), torch.tensor(1.0))


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    draws = 20000
    params = [SamplingParams(max_new_tokens=1, temperature=0.7)] * draws
    gen = torch.Generator().manual_seed(0)
    tokens = choose_next(logits.expand(draws, -1), params, [gen] * draws)
    freq = torch.bincount(tokens, minlength=5).float() / draws
    # Binomial standard deviation is at most 0.0036 here; 0.015 is over four of them.
    torch.testing.assert_close(freq, torch.softmax(logits / 0.7, dim=0), atol=0.015, rtol=0)
    # Greedy rows in the same batch take the argmax.
    mixed = choose_next(torch.stack([logits, logits.flip(0)]), [GREEDY, params[0]], [None, gen])
    assert mixed[0].item() == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 4, "top_k": 0}, "top_k"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 4, "stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_token_ends_request_early(gpt):
    full = solo(gpt, PROMPTS[1], GREEDY)
    stop = full[4]
    cut = full[: full.index(stop) + 1]
    params = SamplingParams(max_new_tokens=10, stop_token_ids=[stop])
    batcher = ContinuousBatcher(gpt, 4, 16, 4)
    ids = [batcher.add_request(PROMPTS[1], params), batcher.add_request(PROMPTS[0], GREEDY)]
    results = batcher.run()
    assert results[ids[0]] == cut and len(cut) < 10
    assert results[ids[1]] == solo(gpt, PROMPTS[0], GREEDY)
    assert batcher.cache.blocks_in_use() == 0


def test_block_cache_tables_alignment_and_freeing():
    cache = BlockKVCache(2, 2, 3, num_blocks=4, block_size=2)
    assert (
        cache.bytes() == 2 * 2 * 4 * 2 * 2 * 3 * 4
    )  # layers, k/v, blocks, slots, heads, dim, fp32
    cache.add_sequence("a")
    cache.add_sequence("b")
    ka = torch.arange(2 * 3 * 3, dtype=torch.float32).view(2, 3, 3) + 1
    kb = -torch.ones(2, 1, 3)
    for layer in range(2):
        cache.append("a", layer, ka, ka * 10)
        cache.append("b", layer, kb, kb)
    assert (cache.length("a"), cache.length("b")) == (3, 1)
    assert len(cache.block_table("a")) == 2 and cache.blocks_in_use() == 3
    k, v, lengths = cache.gather(["b", "a"], 1)
    assert k.shape == (2, 2, 3, 3) and lengths.tolist() == [1, 3]
    torch.testing.assert_close(k[1], ka)
    torch.testing.assert_close(v[1], ka * 10)
    torch.testing.assert_close(k[0, :, 2:], kb)
    assert k[0, :, :2].abs().sum() == 0  # left padding is zeros
    # A layer may not run ahead of the step its other layers are in.
    cache.append("b", 0, kb, kb)
    with pytest.raises(ValueError, match="out of step"):
        cache.append("b", 0, kb, kb)
    cache.free("a")
    cache.free("b")
    assert cache.blocks_in_use() == 0


def test_out_of_blocks_and_too_long_requests(gpt):
    cache = BlockKVCache(1, 1, 2, num_blocks=2, block_size=2)
    cache.add_sequence(0)
    cache.append(0, 0, torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))
    with pytest.raises(OutOfBlocksError, match="needs 1 more blocks"):
        cache.append(0, 0, torch.zeros(1, 2, 2), torch.zeros(1, 2, 2))
    assert cache.length(0) == 3 and cache.blocks_in_use() == 2  # nothing taken or written

    batcher = ContinuousBatcher(gpt, 2, cache_blocks=3, block_size=4)
    with pytest.raises(ValueError, match="whole cache has 3 blocks"):
        batcher.add_request(list(range(10)), SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="positions"):
        batcher.add_request([1] * 60, SamplingParams(max_new_tokens=10))
    assert not batcher.has_pending()


class Bigram(nn.Module):
    """Next-token logits from the current token alone: causal, with no cache to offer."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(16, 16)
        self.seen_training: list[bool] = []

    def forward(self, ids: torch.Tensor):
        self.seen_training.append(self.training)
        return type("Output", (), {"logits": self.table(ids)})()


def test_plain_module_runs_uncached():
    torch.manual_seed(0)
    model = Bigram()
    assert isinstance(adapter_for(model), RecomputeAdapter)
    out = generate(model, [[3], [1, 2]], SamplingParams(max_new_tokens=6), max_batch_size=1)
    for prompt, tokens in zip([[3], [1, 2]], out):
        expected, last = [], prompt[-1]
        for _ in range(6):
            last = int(model.table.weight[last].argmax())
            expected.append(last)
        assert tokens == expected
    assert model.training and not any(model.seen_training)
