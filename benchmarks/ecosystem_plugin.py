"""pytest plugin of benchmarks/ecosystem_tests.py (loaded with `-p ecosystem_plugin`).

It turns off the skips that only say "this needs a GPU", so the projects' DeepSpeed tests run on
this CPU as they are, and writes every test's outcome (and the first line of its error) to the
JSON-lines file $ECOSYSTEM_OUT. The skips come in three forms, each turned off where it is made:
- transformers' and accelerate's decorators (unittest skips decided at import): replaced by the
  identity before any test module imports them;
- pytest `skipif` marks whose reason names a GPU (PEFT's own `require_torch_gpu`): dropped;
- a module-level `pytest.skip` whose reason names a GPU or accelerator (PEFT's GPU test module):
  ignored.
Every other skip (a missing package, `@slow`, bf16/fp16 support of the device) stays.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re

import pytest

_GPU_ONLY = re.compile(r"\b(GPUs?|CUDA|hardware accelerators?)\b", re.IGNORECASE)

_DECORATORS = {
    "transformers.testing_utils": (
        "require_torch_accelerator",
        "require_torch_gpu",
        "require_torch_multi_accelerator",
        "require_torch_multi_gpu",
    ),
    "accelerate.test_utils.testing": (
        "require_cuda",
        "require_cuda_or_hpu",
        "require_cuda_or_xpu",
        "require_multi_device",
        "require_multi_gpu",
        "require_non_cpu",
    ),
}
_DECORATORS["accelerate.test_utils"] = _DECORATORS["accelerate.test_utils.testing"]


def _identity(test_case):
    return test_case


def _turn_off_decorators() -> None:
    for module_name, names in _DECORATORS.items():
        with contextlib.suppress(ImportError):
            module = importlib.import_module(module_name)
            for name in names:
                if hasattr(module, name):
                    setattr(module, name, _identity)


_pytest_skip = pytest.skip


def _skip(reason: str = "", *, allow_module_level: bool = False, **kwargs) -> None:
    if allow_module_level and _GPU_ONLY.search(reason):
        return
    _pytest_skip(reason, allow_module_level=allow_module_level, **kwargs)


# Code that catches `pytest.skip.Exception` must still see pytest's own: every other skip raises.
_skip.Exception = _pytest_skip.Exception  # type: ignore[attr-defined]


def pytest_configure(config) -> None:
    _turn_off_decorators()
    pytest.skip = _skip


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        item.own_markers[:] = [
            m
            for m in item.own_markers
            if not (m.name == "skipif" and _GPU_ONLY.search(str(m.kwargs.get("reason", ""))))
        ]


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        return report.longrepr[2]
    # A collection error is only text: its last "E   ..." line names the exception.
    errors = [line[1:].strip() for line in str(report.longrepr).splitlines() if line[:2] == "E "]
    return errors[-1] if errors else str(report.longrepr or "")


def _write(test_id: str, outcome: str, message: str) -> None:
    line = {"id": test_id, "outcome": outcome, "message": " ".join(message.split())[:300]}
    with open(os.environ["ECOSYSTEM_OUT"], "a") as out:
        out.write(json.dumps(line) + "\n")


def pytest_collectreport(report) -> None:
    if report.failed:  # a module that does not import
        _write(report.nodeid, "error", _message(report))


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.skipped or report.failed:
        outcome = "error" if report.when == "setup" and report.failed else report.outcome
        _write(report.nodeid, outcome, "" if report.passed else _message(report))
