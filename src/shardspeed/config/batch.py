"""DeepSpeed's batch arithmetic: train_batch_size = micro batch x accumulation steps x data-parallel size."""

from __future__ import annotations

from .errors import ConfigError

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
BATCH_KEYS = (TBS, MICRO, GAS)


def resolve_batch(
    train_batch_size: int | None,
    micro_batch: int | None,
    accumulation_steps: int | None,
    dp_world_size: int,
    auto_keys: frozenset[str] = frozenset(),
) -> tuple[int, int, int]:
    """Return (train_batch_size, micro batch per rank, accumulation steps).

    Any two determine the third with the data-parallel world size, as in DeepSpeed. A key written as
    "auto" (listed in `auto_keys`, passed as None) is filled in only when the other two are given;
    otherwise it could only be guessed, and the error says what to set.
    """
    given = {TBS: train_batch_size, MICRO: micro_batch, GAS: accumulation_steps}
    for key in sorted(auto_keys):
        others = [k for k in BATCH_KEYS if k != key]
        if any(given[k] is None for k in others):
            raise ConfigError(
                f"'{key}' is \"auto\" but the engine cannot derive it: set it to a number, or set "
                f"both '{others[0]}' and '{others[1]}' so that it follows from "
                f"{TBS} = {MICRO} x {GAS} x data-parallel world size ({dp_world_size})"
            )
    tbs, micro, gas = train_batch_size, micro_batch, accumulation_steps
    if tbs is None and micro is None:
        raise ConfigError(
            f"set '{TBS}' or '{MICRO}' (or both): the engine needs a batch size "
            f"({TBS} = {MICRO} x {GAS} x data-parallel world size)"
        )
    if tbs is not None and micro is not None and gas is None:
        gas = _exact_div(tbs, micro * dp_world_size, GAS, tbs, micro, None, dp_world_size)
    elif tbs is not None and micro is None:
        gas = gas or 1
        micro = _exact_div(tbs, gas * dp_world_size, MICRO, tbs, None, gas, dp_world_size)
    elif tbs is None:
        gas = gas or 1
        tbs = micro * gas * dp_world_size
    if tbs != micro * gas * dp_world_size:
        raise ConfigError(
            f"batch sizes disagree: {TBS} ({tbs}) != {MICRO} ({micro}) x {GAS} ({gas}) x "
            f"data-parallel world size ({dp_world_size}) = {micro * gas * dp_world_size}"
        )
    return tbs, micro, gas


def _exact_div(
    total: int,
    divisor: int,
    derived: str,
    tbs: int | None,
    micro: int | None,
    gas: int | None,
    dp: int,
) -> int:
    if total % divisor:
        shown = {TBS: tbs, MICRO: micro, GAS: gas}
        known = ", ".join(f"{k}={v}" for k, v in shown.items() if v is not None)
        raise ConfigError(
            f"cannot derive '{derived}': {known} with data-parallel world size {dp} leaves "
            f"{total} / {divisor} not a whole number ({TBS} = {MICRO} x {GAS} x world size)"
        )
    return total // divisor
