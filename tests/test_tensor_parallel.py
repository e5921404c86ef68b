"""Tensor parallelism on 2 gloo ranks against the unsplit computation in one process.

Each rank builds the unsplit module and its split twin from the same seed and compares outputs,
input gradients and parameter gradients (a split parameter's against the matching slice of the
whole one's). Everything is fp32 and only the order of summation differs (partial sums over
feature slices, then the all-reduce), so the errors are a few ulps: 1e-6 relative for single
layers, 1e-5 for whole models trained a few steps (the issue's tolerances).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.checkpoint.format import Split
from shardspeed.comm import all_reduce
from shardspeed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    auto_tensor_parallel,
    copy_to_tensor_region,
    mark_sequence_parallel,
    policy_from_layer_specs,
    sequence_parallel_parameters,
    tensor_parallel_parameters,
    vocab_parallel_cross_entropy,
)
from shardspeed.tensor_parallel.layers import piece

LAYER_TOL = 1e-6
MODEL_TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tokens(x: torch.Tensor) -> torch.Tensor:
    """This rank's sequence shard (dim -2) of a whole tensor."""
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return x.chunk(size, dim=-2)[rank]


def expected_grad(param: nn.Parameter, whole: torch.Tensor) -> torch.Tensor:
    """What `param` (split or not) must hold, given the unsplit model's tensor `whole`."""
    if getattr(param, "tensor_model_parallel", False):
        return piece(whole, param.partition_dim, None, param.partition_stride)
    return whole


def sum_sequence_parallel_grads(model: nn.Module) -> None:
    """What the engine does: partial gradients of `sequence_parallel` parameters summed."""
    for param in sequence_parallel_parameters(model):
        all_reduce(param.grad)


# -- single layers ------------------------------------------------------------------------------


def linear_cases() -> dict[str, float]:
    torch.manual_seed(0)
    errors: dict[str, float] = {}
    norm, fc1, fc2 = nn.LayerNorm(8), nn.Linear(8, 12), nn.Linear(12, 8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 6, 8)
    g = torch.randn(2, 6, 8)

    # The whole MLP block: y = x + fc2(gelu(fc1(norm(x)))).
    xr = x.clone().requires_grad_()
    (xr + fc2(F.gelu(fc1(norm(xr))))).mul(g).sum().backward()

    # Column then row, replicated activations.
    col, row = ColumnParallelLinear.from_linear(fc1, None), RowParallelLinear.from_linear(fc2, None)
    tp_norm = copy.deepcopy(norm)  # the reference's gradients stay its own
    xp = x.clone().requires_grad_()
    y = xp + row(F.gelu(col(tp_norm(xp))))
    errors["mlp output"] = rel(y, xr + fc2(F.gelu(fc1(norm(xr)))))
    y.mul(g).sum().backward()
    errors["mlp input grad"] = rel(xp.grad, xr.grad)
    for name, layer, whole in [("fc1", col, fc1), ("fc2", row, fc2)]:
        for pname, p in layer.named_parameters():
            errors[f"mlp {name}.{pname} grad"] = rel(
                p.grad, expected_grad(p, getattr(whole, pname).grad)
            )

    # The same block under sequence parallelism: the tokens are split outside the linears.
    sp_norm = nn.LayerNorm(8)
    sp_norm.load_state_dict(norm.state_dict())
    mark_sequence_parallel(sp_norm)
    col = ColumnParallelLinear.from_linear(fc1, None, sequence_parallel=True)
    row = RowParallelLinear.from_linear(fc2, None, sequence_parallel=True)
    xs = tokens(x).clone().requires_grad_()
    y = xs + row(F.gelu(col(sp_norm(xs))))
    errors["sequence output"] = rel(y, tokens(xr + fc2(F.gelu(fc1(norm(xr))))))
    y.mul(tokens(g)).sum().backward()
    errors["sequence input grad"] = rel(xs.grad, tokens(xr.grad))
    block = nn.ModuleDict({"norm": sp_norm, "fc1": col, "fc2": row})
    assert {id(p) for p in sequence_parallel_parameters(block)} == {
        id(sp_norm.weight),
        id(sp_norm.bias),
        id(row.bias),
    }
    sum_sequence_parallel_grads(block)
    for name, whole in [("norm", norm), ("fc1", fc1), ("fc2", fc2)]:
        for pname, p in block[name].named_parameters():
            grad = expected_grad(p, getattr(whole, pname).grad)
            errors[f"sequence {name}.{pname} grad"] = rel(p.grad, grad)

    # gather_output, and a row layer that slices a whole input itself.
    h = torch.randn(2, 6, 12)
    for layer, whole, inp in [
        (ColumnParallelLinear.from_linear(fc1, None, gather_output=True), fc1, x),
        (RowParallelLinear.from_linear(fc2, None, input_is_parallel=False), fc2, h),
    ]:
        whole.zero_grad()
        a, b = inp.clone().requires_grad_(), inp.clone().requires_grad_()
        out, ref = layer(a), whole(b)
        errors[f"{type(layer).__name__} whole io output"] = rel(out, ref)
        gout = torch.randn_like(ref)
        out.mul(gout).sum().backward()
        ref.mul(gout).sum().backward()
        errors[f"{type(layer).__name__} whole io input grad"] = rel(a.grad, b.grad)
        errors[f"{type(layer).__name__} whole io weight grad"] = rel(
            layer.weight.grad, expected_grad(layer.weight, whole.weight.grad)
        )
    return errors


class Conv1D(nn.Module):
    """Hugging Face's Conv1D (weight [in, out]), without importing transformers."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def fused_case() -> dict:
    """A Conv1D holding q|k|v, split per part (stride 3): the rank's output is its slice of each
    part; the pieces join back with the checkpoint's `Split`."""
    torch.manual_seed(1)
    fused = Conv1D(3 * 8, 8)
    layer = ColumnParallelLinear.from_linear(fused, None, stride=3)
    x = torch.randn(2, 5, 8)
    xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, out = fused(xr), layer(xp)
    g = torch.randn_like(ref)
    ref.mul(g).sum().backward()
    out.mul(piece(g, -1, None, stride=3)).sum().backward()
    return {
        "errors": {
            "output": rel(out, piece(ref, -1, None, stride=3)),
            "input grad": rel(xp.grad, xr.grad),
            "weight grad": rel(layer.weight.grad, expected_grad(layer.weight, fused.weight.grad)),
            "bias grad": rel(layer.bias.grad, expected_grad(layer.bias, fused.bias.grad)),
        },
        "attrs": [(p.partition_dim, p.partition_stride) for p in tensor_parallel_parameters(layer)],
        "pieces": (layer.weight.detach(), layer.bias.detach()),
        "whole": (fused.weight.detach(), fused.bias.detach()),
    }


def vocab_case() -> dict[str, float]:
    """Embedding split by vocabulary, tied output layer and vocab-parallel cross-entropy, against
    nn.Embedding and F.cross_entropy (with ignored targets and a padding row)."""
    torch.manual_seed(2)
    emb = nn.Embedding(16, 8, padding_idx=11)
    ids = torch.randint(0, 16, (3, 4))
    ids[0, 0] = 11
    target = torch.randint(0, 16, (3, 4))
    target[1, :2] = -100
    ref_logits = torch.tanh(emb(ids)) @ emb.weight.t()
    ref_loss = F.cross_entropy(ref_logits.view(-1, 16), target.view(-1))
    ref_loss.backward()

    vemb = VocabParallelEmbedding.from_embedding(emb, None)
    hidden = torch.tanh(vemb(ids))
    # The tied head is a column-parallel layer: the embedding's rows are its outputs.
    logits = copy_to_tensor_region(hidden, None) @ vemb.weight.t()
    losses = vocab_parallel_cross_entropy(logits, target, None)
    loss = losses.sum() / (target != -100).sum()
    loss.backward()
    errors = {
        "loss": rel(loss, ref_loss),
        "per-token loss": rel(
            losses,
            F.cross_entropy(ref_logits.view(-1, 16), target.view(-1), reduction="none").view(3, 4),
        ),
        "weight grad": rel(vemb.weight.grad, expected_grad(vemb.weight, emb.weight.grad)),
        "logits": rel(logits, piece(ref_logits, -1, None)),
    }
    sp = VocabParallelEmbedding.from_embedding(emb, None, sequence_parallel=True)
    errors["sequence output"] = rel(sp(ids.view(1, 12)), tokens(emb(ids.view(1, 12))))
    return errors


def test_parallel_linears_equal_the_unsplit_layers(pool2):
    for rank_errors in pool2.run(linear_cases):
        bad = {k: v for k, v in rank_errors.items() if not v <= LAYER_TOL}
        assert not bad, bad


def test_fused_column_splits_each_part_and_joins_back(pool2):
    results = pool2.run(fused_case)
    for result in results:
        bad = {k: v for k, v in result["errors"].items() if not v <= LAYER_TOL}
        assert not bad, bad
        # Conv1D keeps [in, out]: the outputs (dim 1) are split, the bias along dim 0.
        assert result["attrs"] == [(1, 3), (0, 3)]
    for i, (dim, stride) in enumerate(results[0]["attrs"]):
        joined = Split(dim, 2, stride).join([r["pieces"][i] for r in results])
        assert torch.equal(joined, results[0]["whole"][i])


def test_vocab_parallel_embedding_and_cross_entropy(pool2):
    for rank_errors in pool2.run(vocab_case):
        bad = {k: v for k, v in rank_errors.items() if not v <= LAYER_TOL}
        assert not bad, bad


# -- Hugging Face models ------------------------------------------------------------------------


def build_hf(kind: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=128,
            n_positions=32,
            n_embd=64,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertModel(config)


def train_hf(kind: str, sequence_parallel: bool, steps: int = 3) -> dict[str, float]:
    """The unsplit model and its split twin trained side by side: logits, every gradient (split
    ones against the matching slice) at each step, and the parameters at the end."""
    ref, model = build_hf(kind), build_hf(kind)
    auto_tensor_parallel(model, None, sequence_parallel=sequence_parallel)
    assert tensor_parallel_parameters(model)
    assert bool(sequence_parallel_parameters(model)) == sequence_parallel
    make = torch.optim.SGD if kind == "gpt2" else torch.optim.Adam
    # SGD for GPT-2: its key bias has an exactly-zero gradient, whose rounding noise Adam would
    # turn into full steps that no two summation orders agree on. Adam for Llama at a small lr:
    # its first steps move every element by about lr whatever the gradient's size, so rounding
    # differences grow with lr (1e-3: 7e-6 relative in later gradients; 1e-4: 8e-7), while three
    # steps still change the weights by about 1% (a wrong update would show far above 1e-5).
    options = {"lr": 0.05, "momentum": 0.9} if kind == "gpt2" else {"lr": 1e-4}
    opt_ref, opt = make(ref.parameters(), **options), make(model.parameters(), **options)
    gen = torch.Generator().manual_seed(5)
    errors: dict[str, float] = {}
    for step in range(steps):
        ids = torch.randint(0, 128, (2, 8), generator=gen)
        out_ref, out = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
        errors[f"step {step} logits"] = rel(out.logits, out_ref.logits)
        out_ref.loss.backward()
        out.loss.backward()
        sum_sequence_parallel_grads(model)
        for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
            errors[f"step {step} {name} grad"] = rel(p.grad, expected_grad(p, p_ref.grad))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        errors[f"{name} after {steps} steps"] = rel(p.detach(), expected_grad(p, p_ref.detach()))
    return errors


def bert_forward(sequence_parallel: bool) -> dict[str, float]:
    ref, model = build_hf("bert"), build_hf("bert")
    auto_tensor_parallel(model, None, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # padding: the attention mask reaches the split attention
    out_ref, out = (
        ref(input_ids=ids, attention_mask=mask),
        model(input_ids=ids, attention_mask=mask),
    )
    return {
        "hidden": rel(out.last_hidden_state, out_ref.last_hidden_state),
        "pooled": rel(out.pooler_output, out_ref.pooler_output),
    }


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tensor", "sequence"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_split_trains_like_the_whole(pool2, kind, sequence_parallel):
    pytest.importorskip("transformers")
    for rank_errors in pool2.run(train_hf, kind, sequence_parallel):
        bad = {k: v for k, v in rank_errors.items() if not v <= MODEL_TOL}
        assert not bad, bad


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tensor", "sequence"])
def test_bert_split_forward_equals_the_whole(pool2, sequence_parallel):
    pytest.importorskip("transformers")
    for rank_errors in pool2.run(bert_forward, sequence_parallel):
        bad = {k: v for k, v in rank_errors.items() if not v <= MODEL_TOL}
        assert not bad, bad


def split_shapes(kind: str) -> dict:
    """What the split GPT-2 / Llama hold: parameter shapes and attributes, attention sizes."""
    model = auto_tensor_parallel(build_hf(kind), None)
    attn = model.get_submodule(
        "transformer.h.0.attn" if kind == "gpt2" else "model.layers.0.self_attn"
    )
    return {
        "params": {
            n: (tuple(p.shape), p.partition_dim, p.partition_stride)
            for n, p in model.named_parameters()
            if getattr(p, "tensor_model_parallel", False)
        },
        "attn": {
            a: getattr(attn, a)
            for a in ("num_heads", "split_size", "num_key_value_groups")
            if hasattr(attn, a)
        },
    }


def test_split_parameters_carry_their_attributes(pool2):
    pytest.importorskip("transformers")
    gpt2, llama = pool2.run(split_shapes, "gpt2")[0], pool2.run(split_shapes, "llama")[0]
    assert gpt2["params"]["transformer.h.0.attn.c_attn.weight"] == ((64, 96), 1, 3)
    assert gpt2["params"]["transformer.h.0.attn.c_attn.bias"] == ((96,), 0, 3)
    assert gpt2["params"]["transformer.h.0.attn.c_proj.weight"] == ((32, 64), 0, 1)
    assert gpt2["params"]["transformer.h.0.mlp.c_fc.weight"] == ((64, 128), 1, 1)
    assert "transformer.h.0.attn.c_proj.bias" not in gpt2["params"]  # added once, whole
    assert gpt2["attn"] == {"num_heads": 2, "split_size": 32}
    assert llama["params"]["model.layers.0.self_attn.q_proj.weight"] == ((32, 64), 0, 1)
    assert llama["params"]["model.layers.0.self_attn.k_proj.weight"] == ((16, 64), 0, 1)
    assert llama["params"]["model.layers.0.self_attn.o_proj.weight"] == ((64, 32), 1, 1)
    assert llama["params"]["model.layers.0.mlp.down_proj.weight"] == ((64, 64), 1, 1)
    assert llama["attn"] == {"num_key_value_groups": 2}
    assert not any("embed" in n or "lm_head" in n or "norm" in n for n in llama["params"])


# -- a user's model, by policy ------------------------------------------------------------------

HEAD_DIM = 4


class UserAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        # No q/k biases: the key bias's gradient is exactly zero but for rounding noise.
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        shape = (
            *q.shape[:-1],
            -1,
            HEAD_DIM,
        )  # from q: the whole sequence under sequence parallelism

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(shape).transpose(-2, -3)

        att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.out(att.transpose(-2, -3).reshape(*q.shape[:-1], -1))


class UserBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = UserAttention(dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class UserNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(UserBlock(16) for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


USER_POLICY = {"column": [r"attn\.w[qkv]$", r"\.up$"], "row": [r"attn\.out$", r"\.down$"]}
USER_SPECS = [  # the same, as DeepSpeed's partition_config.layer_specs (parameter names)
    {"patterns": [r".*\.attn\.w[qkv]\.weight$", r".*\.up\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.attn\.out\.weight$", r".*\.down\.weight$"], "partition_type": "row"},
]


def user_model(policy: object, sequence_parallel: bool) -> dict[str, float]:
    ref, model = UserNet(), UserNet()
    auto_tensor_parallel(model, None, policy=policy, sequence_parallel=sequence_parallel)
    assert type(model.blocks[0].attn.wq) is ColumnParallelLinear
    assert type(model.blocks[1].down) is RowParallelLinear
    assert type(model.head) is nn.Linear
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(6))
    target = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(7))
    out_ref, out = ref(ids), model(ids)
    F.cross_entropy(out_ref.view(-1, 32), target.view(-1)).backward()
    F.cross_entropy(out.view(-1, 32), target.view(-1)).backward()
    sum_sequence_parallel_grads(model)
    errors = {"output": rel(out, out_ref)}
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        errors[f"{name} grad"] = rel(p.grad, expected_grad(p, p_ref.grad))
    return errors


@pytest.mark.parametrize(
    "policy, sequence_parallel",
    [(USER_POLICY, False), (USER_SPECS, False), (USER_POLICY, True)],
    ids=["policy", "layer-specs", "policy-sequence"],
)
def test_user_model_by_policy(pool2, policy, sequence_parallel):
    for rank_errors in pool2.run(user_model, policy, sequence_parallel):
        bad = {k: v for k, v in rank_errors.items() if not v <= LAYER_TOL * 10}
        assert not bad, bad


def test_layer_specs_become_a_policy():
    assert policy_from_layer_specs(USER_SPECS) == {
        "column": USER_SPECS[0]["patterns"],
        "row": USER_SPECS[1]["patterns"],
    }


# -- errors -------------------------------------------------------------------------------------


def refusals() -> dict[str, str]:
    import transformers

    def message(make) -> str:
        try:
            make()
        except (ValueError, TypeError) as exc:
            return str(exc)
        return "no error"

    def odd_heads() -> None:
        config = transformers.GPT2Config(
            vocab_size=32, n_embd=48, n_layer=1, n_head=3, n_positions=8
        )
        auto_tensor_parallel(transformers.GPT2LMHeadModel(config), None)

    def one_kv_head() -> None:
        config = transformers.LlamaConfig(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=1,
        )
        auto_tensor_parallel(transformers.LlamaForCausalLM(config), None)

    return {
        "odd heads": message(odd_heads),
        "one kv head": message(one_kv_head),
        "unknown": message(lambda: auto_tensor_parallel(UserNet(), None)),
        "columns only": message(
            lambda: auto_tensor_parallel(UserNet(), None, policy={"column": [r"\.up$"]})
        ),
        "bad key": message(lambda: auto_tensor_parallel(UserNet(), None, policy={"rows": ["x"]})),
        "bad spec": message(
            lambda: auto_tensor_parallel(UserNet(), None, policy=[{"patterns": "up"}])
        ),
        "uneven": message(lambda: ColumnParallelLinear(4, 5, None)),
        "sequence not split": message(
            lambda: auto_tensor_parallel(
                UserNet(), None, policy=USER_POLICY, sequence_parallel=True
            )(torch.zeros(1, 5, dtype=torch.long))
        ),
    }


def test_refusals(pool2):
    pytest.importorskip("transformers")
    messages = pool2.run(refusals)[0]
    assert "3 attention heads of size 16 do not split over 2" in messages["odd heads"]
    assert "k_proj: 1 attention heads of size 8 do not split over 2" in messages["one kv head"]
    unknown = messages["unknown"]
    assert "no layer matches the built-in rules" in unknown
    assert "blocks.0.attn.wq" in unknown and "policy" in unknown and "layer_specs" in unknown
    assert "only blocks.0.up, blocks.1.up" in messages["columns only"]
    assert "'column' and 'row', not ['rows']" in messages["bad key"]
    assert "'patterns'" in messages["bad spec"]
    assert "does not split into 2" in messages["uneven"]
    assert "cannot split dim -2 of a (1, 5, 16) tensor over 2" in messages["sequence not split"]
