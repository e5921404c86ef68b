"""Optimizer params models, the optimizer factory, Lamb, and the deepspeed.ops drop-ins."""

import copy
import math

import pytest
import torch
from pydantic import ValidationError

from shardspeed.config.optimizer import (
    OPTIMIZER_PARAMS,
    AdagradParams,
    AdamParams,
    AdamWParams,
    LambParams,
    SGDParams,
    canonical_optimizer_name,
)
from shardspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardspeed.ops.lamb import FusedLamb
from shardspeed.optim import Lamb, build_optimizer


def error_type(model, params):
    with pytest.raises(ValidationError) as info:
        model.model_validate(params)
    return info.value.errors()[0]["type"]


def test_params_models_refuse_unknown_keys_and_bad_values():
    assert error_type(AdamParams, {"wieght_decay": 0.1}) == "extra_forbidden"
    assert error_type(AdamParams, {"lr": -1e-3}) == "greater_than_equal"
    assert error_type(AdamParams, {"lr": "0.001"}) == "float_type"  # strict: no string coercion
    assert error_type(AdamParams, {"eps": 0.0}) == "greater_than"
    assert error_type(AdamParams, {"weight_decay": -0.1}) == "greater_than_equal"
    assert error_type(AdamParams, {"betas": [0.9, 1.0]}) == "less_than"
    assert error_type(AdamParams, {"betas": [0.9]}) == "missing"
    assert error_type(LambParams, {"min_coeff": 2.0, "max_coeff": 1.0}) == "value_error"
    assert error_type(SGDParams, {"nesterov": True}) == "value_error"  # needs momentum > 0
    assert error_type(AdagradParams, {"lr_decay": -1.0}) == "greater_than_equal"
    # AMSGrad and foreach exist only on DeepSpeed's torch_adam path.
    assert error_type(AdamParams, {"amsgrad": True}) == "value_error"
    assert error_type(AdamParams, {"foreach": True}) == "value_error"
    assert AdamParams(amsgrad=True, foreach=False, torch_adam=True).amsgrad is True


def test_betas_from_json_list_and_defaults():
    adam = AdamParams.model_validate({"betas": [0.8, 0.95], "lr": 1})
    assert adam.betas == (0.8, 0.95) and adam.lr == 1.0
    defaults = AdamParams()
    assert (defaults.lr, defaults.betas, defaults.eps) == (1e-3, (0.9, 0.999), 1e-8)
    assert defaults.adam_w_mode is True and defaults.torch_adam is False
    lamb = LambParams()
    assert (lamb.max_coeff, lamb.min_coeff, lamb.eps_inside_sqrt) == (10.0, 0.01, False)
    assert SGDParams().lr == 1e-3 and AdagradParams().eps == 1e-10


def test_every_model_hints_gradient_clipping_for_max_grad_norm():
    classic = {"Adam", "AdamW", "Lamb", "SGD", "Adagrad", "Lion", "Muon"}
    # The 1-bit optimizers take DeepSpeed's max_grad_norm as a parameter of their own.
    assert set(OPTIMIZER_PARAMS) == classic | {"OneBitAdam", "ZeroOneAdam", "OneBitLamb"}
    for model in (OPTIMIZER_PARAMS[name] for name in classic):
        assert "gradient_clipping" in model.key_hints["max_grad_norm"]
        assert error_type(model, {"max_grad_norm": 1.0}) == "extra_forbidden"


def test_unhonourable_values_are_refusable():
    assert AdamParams.unsupported_reason("bias_correction") is not None
    assert AdamParams.unsupported_reason("set_grad_none") is not None
    assert LambParams.unsupported_reason("amsgrad") is not None
    assert AdamParams.unsupported_reason("adam_w_mode") is None
    assert LambParams.unsupported_reason("bias_correction") is None
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bias_correction"):
        build_optimizer("Adam", AdamParams(bias_correction=False), model.parameters())


def test_canonical_names_follow_deepspeed_case_rules():
    assert canonical_optimizer_name("adam") == "Adam"
    assert canonical_optimizer_name("ADAMW") == "AdamW"
    assert canonical_optimizer_name("lamb") == "Lamb"
    assert canonical_optimizer_name("Adagrad") == "Adagrad"
    # Non-native types are torch.optim attribute names: exact case only.
    assert canonical_optimizer_name("SGD") == "SGD"
    assert canonical_optimizer_name("sgd") is None
    assert canonical_optimizer_name("AdamWW") is None


def run_steps(model, optimizer, steps=3):
    """Apply `steps` updates with fixed, seeded gradients; return the flat parameters."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def fresh_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def test_adam_is_decoupled_by_default_and_l2_with_adam_w_mode_false():
    kw = {"lr": 0.1, "weight_decay": 0.5}
    base = fresh_model()

    def ours(name, params):
        m = copy.deepcopy(base)
        return run_steps(m, build_optimizer(name, params, m.parameters()))

    def torchs(cls):
        m = copy.deepcopy(base)
        return run_steps(m, cls(m.parameters(), foreach=False, **kw))

    adamw_ref, adam_ref = torchs(torch.optim.AdamW), torchs(torch.optim.Adam)
    assert not torch.allclose(adamw_ref, adam_ref, atol=1e-3)  # the two modes really differ

    default = ours("Adam", AdamParams(**kw))
    l2 = ours("Adam", AdamParams(adam_w_mode=False, **kw))
    adamw_type = ours("AdamW", AdamWParams(adam_w_mode=False, **kw))  # AdamW ignores the flag
    torch.testing.assert_close(default, adamw_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l2, adam_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adamw_type, adamw_ref, rtol=1e-5, atol=1e-6)


def test_adam_factory_classes_defaults_and_fused():
    params = fresh_model().parameters
    opt = build_optimizer("Adam", AdamParams(), params())
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["weight_decay"] == 0.0  # FusedAdam's default, not torch AdamW's 0.01
    assert opt.defaults["fused"] is True
    assert (
        type(build_optimizer("Adam", AdamParams(adam_w_mode=False), params())) is torch.optim.Adam
    )
    # DeepSpeed's torch_adam path builds torch.optim.AdamW with torch's own default decay.
    torch_path = build_optimizer("AdamW", AdamWParams(torch_adam=True, foreach=True), params())
    assert torch_path.defaults["weight_decay"] == 0.01 and torch_path.defaults["foreach"] is True
    assert not torch_path.defaults["fused"]
    with pytest.raises(TypeError, match="LambParams"):
        build_optimizer("Lamb", AdamParams(), params())
    # Group dicts holding generators still reach torch intact after the fused-eligibility check.
    groups = [{"params": params(), "weight_decay": 0.2}]
    grouped = build_optimizer("Adam", AdamParams(), groups)
    assert len(grouped.param_groups[0]["params"]) == 2
    assert grouped.param_groups[0]["weight_decay"] == 0.2 and grouped.defaults["fused"] is True


def test_sgd_and_adagrad_are_torchs():
    params = fresh_model().parameters
    sgd = build_optimizer("SGD", SGDParams(lr=0.2, momentum=0.9, nesterov=True), params())
    assert type(sgd) is torch.optim.SGD
    assert (sgd.defaults["lr"], sgd.defaults["momentum"], sgd.defaults["nesterov"]) == (
        0.2,
        0.9,
        True,
    )
    ada = build_optimizer("Adagrad", AdagradParams(lr_decay=0.1), params())
    assert type(ada) is torch.optim.Adagrad and ada.defaults["lr_decay"] == 0.1


def reference_lamb(
    params,
    grads_per_step,
    lr,
    betas,
    eps,
    wd,
    bias_correction,
    eps_inside_sqrt,
    min_coeff,
    max_coeff,
):
    """LAMB written out per tensor, in float64, following DeepSpeed's FusedLamb kernel."""
    beta1, beta2 = betas
    params = [p.double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    coeffs_per_step = []
    for t, grads in enumerate(grads_per_step, start=1):
        coeffs = []
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            denom = (v[i] + eps).sqrt() if eps_inside_sqrt else v[i].sqrt() + eps
            update = m[i] / denom + wd * p
            w_norm, u_norm = p.norm().item(), update.norm().item()
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
            step = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t) if bias_correction else lr
            params[i] = p - step * coeff * update
            coeffs.append(coeff)
        coeffs_per_step.append(coeffs)
    return params, coeffs_per_step


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_matches_per_tensor_reference(eps_inside_sqrt, bias_correction):
    gen = torch.Generator().manual_seed(3)
    # Weights far larger, comparable to, far smaller than the update, and zero: the trust ratio
    # clamps at max_coeff, stays free, clamps at min_coeff, and is 1.
    shapes_scales = [((5, 4), 40.0), ((7,), 1.0), ((6,), 0.001), ((3,), 0.0)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * k) for s, k in shapes_scales]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]
    hyper = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-3, wd=0.1, min_coeff=0.02, max_coeff=5.0)
    expected, coeffs = reference_lamb(
        [p.detach() for p in params],
        grads,
        bias_correction=bias_correction,
        eps_inside_sqrt=eps_inside_sqrt,
        **hyper,
    )
    opt = Lamb(
        params,
        lr=0.05,
        betas=(0.8, 0.9),
        eps=1e-3,
        weight_decay=0.1,
        min_coeff=0.02,
        max_coeff=5.0,
        bias_correction=bias_correction,
        eps_inside_sqrt=eps_inside_sqrt,
    )
    for step_grads, step_coeffs in zip(grads, coeffs):
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        assert opt.get_lamb_coeffs() == pytest.approx(step_coeffs, rel=1e-5)
    for p, ref in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), ref, rtol=1e-5, atol=1e-6)
    first = coeffs[0]
    assert first[0] == 5.0 and 0.02 < first[1] < 5.0 and first[2] == 0.02 and first[3] == 1.0
    assert opt.state[params[0]]["step"] == 2


def test_lamb_built_from_config_and_fused_lamb_agree():
    base = fresh_model()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    from_config = build_optimizer("Lamb", LambParams(lr=0.01, weight_decay=0.01), a.parameters())
    assert type(from_config) is Lamb
    fused = FusedLamb(b.parameters(), lr=0.01, weight_decay=0.01)
    torch.testing.assert_close(run_steps(a, from_config), run_steps(b, fused), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLamb(b.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedLamb(b.parameters(), max_grad_norm=1.0)


def test_fused_adam_and_cpu_adam_drop_ins_step_like_torch():
    base = fresh_model()

    def result(make):
        m = copy.deepcopy(base)
        return run_steps(m, make(m.parameters()))

    adamw = result(lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.3))
    adam = result(lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.3))
    kw = {"lr": 0.1, "weight_decay": 0.3}
    torch.testing.assert_close(result(lambda p: FusedAdam(p, **kw)), adamw)
    torch.testing.assert_close(result(lambda p: FusedAdam(p, adam_w_mode=False, **kw)), adam)
    torch.testing.assert_close(result(lambda p: DeepSpeedCPUAdam(p, **kw)), adamw)
    torch.testing.assert_close(result(lambda p: DeepSpeedCPUAdam(p, adamw_mode=False, **kw)), adam)

    m = copy.deepcopy(base)
    keep = FusedAdam(m.parameters(), set_grad_none=False)
    run_steps(m, keep, steps=1)
    keep.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(m.parameters(), amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DeepSpeedCPUAdam(m.parameters(), amsgrad=True)
    half = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="fp32_optimizer_states"):
        DeepSpeedCPUAdam(half)
    DeepSpeedCPUAdam(half, fp32_optimizer_states=False).step()
