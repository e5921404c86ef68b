"""How much memory the model states (parameters, gradients, optimizer states) need under ZeRO.

:func:`model_state_bytes` gives the ZeRO paper's per-rank byte counts (Rajbhandari et al., SC'20,
arXiv:1910.02054, section 5 and Table 1). The ``estimate_zero*_model_states_mem_needs*`` functions
carry DeepSpeed's names and arguments and print a table of offload options, as
``deepspeed.runtime.zero.stage_1_and_2`` and ``deepspeed.runtime.zero.stage3`` do; their numbers follow
DeepSpeed 0.19.8's arithmetic, which counts a few things the paper does not (see each docstring).
"""

from __future__ import annotations

from numbers import Integral, Real

from torch import nn

# Bytes per parameter of each piece of model state.
_HALF = 2  # an fp16/bf16 parameter or gradient
_FP32 = 4  # an fp32 parameter, gradient or master weight
_ADAM_STATES = 8  # Adam's fp32 momentum and variance

_PRECISION_BYTES = {"fp16": _HALF, "bf16": _HALF, "fp32": _FP32}

# DeepSpeed's estimators count an fp32 gradient partition beside the 16-bit one, which the paper does
# not: 18 bytes a parameter where the paper has 2 + K = 14 (K = 12 for Adam).
_DS_PARTITIONED = _HALF + _FP32 + _FP32 + _ADAM_STATES
# What DeepSpeed counts on the CPU once the optimizer is offloaded: fp32 gradients, master weights and
# Adam's states.
_DS_OFFLOADED = _FP32 + _FP32 + _ADAM_STATES

_GIB = 2**30


def _whole(name: str, value: object, minimum: int) -> int:
    """`value` as an int, if it is a whole number >= `minimum` (7.5e9 is accepted: sizes get written so)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if not isinstance(value, Integral) and not float(value).is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}")
    return int(value)


def model_state_bytes(
    num_params: int,
    dp_world_size: int,
    stage: int,
    precision: str = "fp16",
    optimizer_state_bytes_per_param: int = _ADAM_STATES,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> dict[str, float]:
    """Model-state bytes held by one data-parallel rank under ZeRO `stage` (0 = plain data parallel).

    fp16/bf16 keep 2-byte parameters and gradients, 4-byte fp32 master weights and
    `optimizer_state_bytes_per_param` (8 for Adam) of fp32 optimizer state, so K = 4 + 8 = 12 and the
    paper's per-rank totals for P parameters over N ranks are: stage 0 (4 + K)P, stage 1 4P + KP/N,
    stage 2 2P + (2 + K)P/N, stage 3 (4 + K)P/N. Stage 1 partitions the master weights and optimizer
    states, stage 2 also the gradients, stage 3 also the parameters.

    fp32 keeps 4-byte parameters and gradients and the parameters are the master weights, so there is
    no extra copy: 16P, 8P + 8P/N, 4P + 12P/N and 16P/N with Adam. That holds while the parameters sit
    where the optimizer steps: when only one of them is offloaded, the optimizer needs its own fp32
    copy, counted as master weights.

    `offload_optimizer` (stages 1-3) moves the master weights and optimizer states to the CPU and
    `offload_param` (stage 3) the parameter partition. Gradients are counted on the device, where the
    backward pass produces them. Returns "parameters", "gradients", "master_weights",
    "optimizer_states" and their "total", split into "device_total" and "cpu_total".
    """
    params = _whole("num_params", num_params, 0)
    ranks = _whole("dp_world_size", dp_world_size, 1)
    state_bytes = _whole("optimizer_state_bytes_per_param", optimizer_state_bytes_per_param, 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if precision not in _PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(_PRECISION_BYTES)}, got {precision!r}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if offload_param and stage != 3:
        raise ValueError("offload_param needs ZeRO stage 3: only stage 3 partitions the parameters")

    width = _PRECISION_BYTES[precision]

    def per_rank(bytes_per_param: int, partitioned_from: int) -> float:
        """Bytes for one rank of a state that is partitioned from stage `partitioned_from` on."""
        return bytes_per_param * params / (ranks if stage >= partitioned_from else 1)

    separate_master = width != _FP32 or offload_param != offload_optimizer
    parts = {
        "parameters": per_rank(width, 3),
        "gradients": per_rank(width, 2),
        "master_weights": per_rank(_FP32, 1) if separate_master else 0.0,
        "optimizer_states": per_rank(state_bytes, 1),
    }
    on_cpu = {
        "parameters": offload_param,
        "gradients": False,
        "master_weights": offload_optimizer,
        "optimizer_states": offload_optimizer,
    }
    cpu_total = sum((size for name, size in parts.items() if on_cpu[name]), 0.0)
    total = sum(parts.values())
    return {**parts, "total": total, "device_total": total - cpu_total, "cpu_total": cpu_total}


def _check_setup(num_gpus_per_node: int, num_nodes: int, additional_buffer_factor: float) -> None:
    _whole("num_gpus_per_node", num_gpus_per_node, 1)
    _whole("num_nodes", num_nodes, 1)
    if isinstance(additional_buffer_factor, bool) or not isinstance(additional_buffer_factor, Real):
        raise ValueError(
            f"additional_buffer_factor must be a number, got {additional_buffer_factor!r}"
        )
    if additional_buffer_factor <= 0:
        raise ValueError(
            f"additional_buffer_factor must be positive, got {additional_buffer_factor!r}"
        )


def _numel(param: nn.Parameter) -> int:
    # A parameter partitioned ZeRO-3 style is empty; its full size is in ds_numel.
    return int(getattr(param, "ds_numel", param.numel()))


def _total_params(model: nn.Module) -> int:
    # parameters() yields a shared (tied) parameter once. DeepSpeed dedups by data_ptr() instead,
    # which is 0 for every tensor of a meta-device model and would count just one of them.
    return sum(_numel(param) for param in model.parameters())


def _largest_layer_params(model: nn.Module) -> int:
    """Parameters held directly by the module that holds the most: what ZeRO-3 gathers at once."""
    return max(
        (sum(_numel(p) for p in module.parameters(recurse=False)) for module in model.modules()),
        default=0,
    )


def _print_table(
    stage: int,
    total_params: int,
    largest_layer_params: int | None,
    num_gpus_per_node: int,
    num_nodes: int,
    rows: list[tuple[int, int, str]],
) -> None:
    nodes = f"{num_nodes} node{'s' if num_nodes > 1 else ''}"
    gpus = f"{num_gpus_per_node} GPU{'s' if num_gpus_per_node > 1 else ''} per node"
    model = f"{total_params:,} parameters"
    if largest_layer_params is not None:
        model += f", {largest_layer_params:,} in the largest layer"
    print(
        f"ZeRO stage {stage} model states (parameters, gradients, optimizer states), estimated for\n"
        f"  hardware: {nodes}, {gpus}\n"
        f"  model:    {model}\n"
        "(per CPU: host memory of one node; GiB = 2**30 bytes)"
    )
    print(f" {'per CPU':>10} | {'per GPU':>9} | options")
    for cpu_bytes, gpu_bytes, options in rows:
        print(f" {cpu_bytes / _GIB:7.2f}GiB | {gpu_bytes / _GIB:6.2f}GiB | {options}")


def _device(offloaded: bool) -> str:
    return "cpu" if offloaded else "none"


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(CPU bytes per node, bytes per GPU) for ZeRO-2 model states, by DeepSpeed 0.19.8's arithmetic.

    Per GPU without offload: the 16-bit parameters (2P) plus this GPU's share of 18 bytes a parameter
    (16-bit and fp32 gradients, fp32 master weights, Adam's two states); the paper's 2P + 14P/N has no
    fp32 gradients. With `cpu_offload` only the 16-bit parameters stay (the paper would also keep the
    gradient partition). Per node CPU, times `additional_buffer_factor`: without offload every
    process on the node holds an fp32 copy of the model while loading it (4P each); with offload the
    larger of 4P per GPU over all nodes and the offloaded 16 bytes a parameter (fp32 gradients, master
    weights, Adam states), not divided among the nodes: DeepSpeed's own choices, kept for its figures.
    """
    params = _whole("total_params", total_params, 0)
    _check_setup(num_gpus_per_node, num_nodes, additional_buffer_factor)
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_bytes = _HALF * params
        cpu_bytes = params * max(_FP32 * total_gpus, _DS_OFFLOADED) * additional_buffer_factor
    else:
        gpu_bytes = _HALF * params + int(_DS_PARTITIONED * params / total_gpus)
        cpu_bytes = params * _FP32 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_bytes), int(gpu_bytes)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print ZeRO-2 memory needs for a model of `total_params` parameters, with and without
    optimizer offload (figures from :func:`estimate_zero2_model_states_mem_needs`). Returns None,
    as DeepSpeed's does.
    """
    params = _whole("total_params", total_params, 0)
    rows = []
    for offload in (True, False):
        cpu_bytes, gpu_bytes = estimate_zero2_model_states_mem_needs(
            params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor
        )
        rows.append((cpu_bytes, gpu_bytes, f"offload_optimizer={_device(offload)}"))
    _print_table(2, params, None, num_gpus_per_node, num_nodes, rows)


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print ZeRO-2 memory needs for `model` (tied parameters counted once), as
    :func:`estimate_zero2_model_states_mem_needs_all_cold` does. Returns None, as DeepSpeed's does.
    """
    estimate_zero2_model_states_mem_needs_all_cold(
        _total_params(model), num_gpus_per_node, num_nodes, additional_buffer_factor
    )


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(CPU bytes per node, bytes per GPU, largest-layer bytes) for ZeRO-3, by DeepSpeed 0.19.8.

    Every GPU keeps room for the largest layer gathered whole at 4 bytes a parameter. On top, per GPU:
    without offload its share of 18 bytes a parameter (the paper's 16, plus fp32 gradients); with
    `cpu_offload` its share of the 16-bit parameters (2P/N); with `cpu_offload_params` as well,
    nothing. `cpu_offload_params` counts only together with `cpu_offload`, as in DeepSpeed.

    Per node CPU, times `additional_buffer_factor`: the node's share of the offloaded state, 16 bytes a
    parameter (fp32 gradients, master weights, Adam states) or 18 with the 16-bit parameters too.
    Without `zero_init` every process first loads the whole model in fp32 (4P per GPU on the node),
    so the larger figure counts; without offload and with `zero_init` only the largest layer is ever
    whole in fp32 on the CPU.
    """
    params = _whole("total_params", total_params, 0)
    largest = _whole("largest_layer_params", largest_layer_params, 0)
    _check_setup(num_gpus_per_node, num_nodes, additional_buffer_factor)
    total_gpus = num_nodes * num_gpus_per_node
    node_share = 1 / num_nodes
    largest_layer_bytes = _FP32 * largest
    if cpu_offload:
        offloaded = _DS_OFFLOADED + (_HALF if cpu_offload_params else 0)
        gpu_bytes = largest_layer_bytes
        if not cpu_offload_params:
            gpu_bytes += int(_HALF * params / total_gpus)
        if zero_init:
            cpu_bytes = params * offloaded * node_share * additional_buffer_factor
        else:
            loading = _FP32 * num_gpus_per_node
            cpu_bytes = params * max(loading, offloaded * node_share) * additional_buffer_factor
    else:
        gpu_bytes = largest_layer_bytes + int(_DS_PARTITIONED * params / total_gpus)
        whole_in_fp32 = largest if zero_init else params
        cpu_bytes = whole_in_fp32 * _FP32 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_bytes), int(gpu_bytes), largest_layer_bytes


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print ZeRO-3 memory needs for a model of `total_params` parameters whose largest layer has
    `largest_layer_params`, for each offload and zero_init choice (figures from
    :func:`estimate_zero3_model_states_mem_needs`). Returns None, as DeepSpeed's does.
    """
    params = _whole("total_params", total_params, 0)
    largest = _whole("largest_layer_params", largest_layer_params, 0)
    rows = []
    # Parameter offload only comes with optimizer offload, so three offload choices, each with and
    # without zero_init.
    for offload_optimizer, offload_param in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu_bytes, gpu_bytes, _ = estimate_zero3_model_states_mem_needs(
                params,
                largest,
                num_gpus_per_node,
                num_nodes,
                offload_optimizer,
                offload_param,
                zero_init,
                additional_buffer_factor,
            )
            options = (
                f"offload_param={_device(offload_param)}, "
                f"offload_optimizer={_device(offload_optimizer)}, zero_init={int(zero_init)}"
            )
            rows.append((cpu_bytes, gpu_bytes, options))
    _print_table(3, params, largest, num_gpus_per_node, num_nodes, rows)


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print ZeRO-3 memory needs for `model` (tied parameters counted once; the largest layer is the
    module holding the most parameters directly), as
    :func:`estimate_zero3_model_states_mem_needs_all_cold` does. Returns None, as DeepSpeed's does.
    """
    estimate_zero3_model_states_mem_needs_all_cold(
        _total_params(model),
        _largest_layer_params(model),
        num_gpus_per_node,
        num_nodes,
        additional_buffer_factor,
    )
