"""The opt-in ``deepspeed`` import alias (shardspeed.compat)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from shardspeed import compat

# Imports a DeepSpeed script makes, checked for identity with shardspeed's own modules.
DEEPSPEED_SCRIPT = """
import os, sys

import deepspeed
import deepspeed.comm
import deepspeed.comm as ds_comm
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime import zero
from deepspeed.runtime.lr_schedules import WarmupLR

import shardspeed
import shardspeed.compat
import shardspeed.ops.adam
import shardspeed.optim.lr_schedules

assert deepspeed is shardspeed and deepspeed.__name__ == "shardspeed"
assert deepspeed.comm is shardspeed.comm and ds_comm is shardspeed.comm
assert sys.modules["deepspeed.comm"] is shardspeed.comm
assert deepspeed.comm.__spec__.name == "shardspeed.comm"
assert FusedAdam is shardspeed.ops.adam.FusedAdam
assert zero is shardspeed.zero
assert WarmupLR is shardspeed.optim.lr_schedules.WarmupLR

try:
    import deepspeed.no_such_module
except ImportError as error:
    assert "'shardspeed.no_such_module'" in str(error), error
else:
    raise AssertionError("deepspeed.no_such_module imported")

before = len(sys.meta_path)
shardspeed.compat.install()
assert len(sys.meta_path) == before, "a second install() added another finder"

assert __name__ == "__main__"
assert sys.path[0] == os.path.dirname(os.path.realpath(__file__))
print("ARGV", sys.argv[1:])
"""


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_compat_runs_an_unmodified_deepspeed_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(DEEPSPEED_SCRIPT)
    result = _run(["-m", "shardspeed.compat", str(script), "a b", "--deepspeed_config", "c.json"],
                  tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "ARGV ['a b', '--deepspeed_config', 'c.json']" in result.stdout


def test_entry_compat_flag_installs_the_alias(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(DEEPSPEED_SCRIPT)
    env = {**os.environ, "LOCAL_RANK": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "shardspeed.launcher.entry", "--compat", str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "ARGV ['--local_rank=0']" in result.stdout


def test_alias_does_not_leak_into_a_plain_process(tmp_path: Path) -> None:
    # An installed DeepSpeed may legitimately be importable here; what must not happen is that
    # importing shardspeed alone makes "deepspeed" resolve to it.
    probe = (
        "import importlib.util, sys\n"
        "import shardspeed, shardspeed.alias, shardspeed.compat\n"
        "spec = importlib.util.find_spec('deepspeed')\n"
        "assert sys.modules.get('deepspeed') is not shardspeed\n"
        "assert spec is None or not isinstance(spec.loader, shardspeed.alias._AliasLoader)\n"
        "assert not any(isinstance(f, shardspeed.alias._AliasFinder) for f in sys.meta_path)\n"
    )
    result = _run(["-c", probe], tmp_path)
    assert result.returncode == 0, result.stderr


def test_names_map_by_longest_prefix() -> None:
    assert compat.shardspeed_name("deepspeed") == "shardspeed"
    assert compat.shardspeed_name("deepspeed.comm.comm") == "shardspeed.comm.comm"
    assert compat.shardspeed_name("deepspeed.runtime.engine") == "shardspeed.runtime.engine"
    assert compat.shardspeed_name("deepspeed.runtime.zero.stage3") == "shardspeed.zero.stage3"
    assert (
        compat.shardspeed_name("deepspeed.runtime.lr_schedules") == "shardspeed.optim.lr_schedules"
    )
    assert compat.shardspeed_name("deepspeedx") is None
    assert compat.shardspeed_name("torch.nn") is None


def test_install_refuses_when_deepspeed_is_already_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    before = list(sys.meta_path)
    with pytest.raises(RuntimeError, match="install the shardspeed alias before"):
        compat.install()
    assert sys.meta_path == before


def test_compat_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert compat.main([]) == 2
    assert "usage: python -m shardspeed.compat script.py" in capsys.readouterr().err
