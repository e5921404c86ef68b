"""The shardspeed launcher: hostfiles, resource filters, the commands it builds, and real runs."""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed

from shardspeed import compat
from shardspeed.launcher import cores, entry, runner
from shardspeed.launcher.hostfile import (
    filter_resources,
    parse_hostfile,
    parse_node_specs,
    parse_resource_filter,
    read_hostfile,
    select_resources,
)

POOL = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


# --- hostfile -------------------------------------------------------------------------------------


def test_parse_hostfile_skips_comments_and_blank_lines() -> None:
    text = """
    # the cluster
    worker-0 slots=4
      worker-1   slots=2   # trailing comment
    worker-2 slots=8 max_slots=16
    """
    assert parse_hostfile(text.splitlines()) == {"worker-0": 4, "worker-1": 2, "worker-2": 8}
    assert list(parse_hostfile(["b slots=1", "a slots=1"])) == ["b", "a"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["worker-0 slots=4", "worker-1"], r"hosts:2: expected 'HOST slots=N', got 'worker-1'"),
        (["worker-0 slots=four"], r"hosts:1: expected 'HOST slots=N'"),
        (["worker-0 slots=4x"], r"hosts:1: expected"),
        (["worker-0 4"], r"hosts:1: expected"),
        (["worker-0 slots=0"], r"hosts:1: host 'worker-0' has slots=0"),
        (["a slots=1", "", "a slots=2"], r"hosts:3: host 'a' is listed twice \(first on line 1\)"),
        (["# nothing", ""], r"hosts lists no hosts"),
        (["-oProxyCommand=x slots=1"], r"hosts:1: '-oProxyCommand=x' is not a host name"),
        (["ok slots=1", "a;b slots=1"], r"hosts:2: 'a;b' is not a host name"),
    ],
)
def test_parse_hostfile_errors_name_the_line(lines: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hostfile(lines, source="hosts")


def test_read_hostfile_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("worker-0 slots=2\nbad line here\n")
    with pytest.raises(ValueError, match=f"{path}:2: expected"):
        read_hostfile(path)


# --- include / exclude ----------------------------------------------------------------------------


def test_node_specs() -> None:
    assert parse_node_specs("worker-0@worker-1:2,0,2") == {"worker-0": None, "worker-1": [0, 2]}
    assert parse_node_specs("w:3@w:1") == {"w": [1, 3]}
    assert parse_node_specs("w:3@w") == {"w": None}


@pytest.mark.parametrize("spec", ["", "@w", "w:", ":0", "w:a", "w:0,", "w:-1", "w:0:1"])
def test_bad_node_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError, match="--exclude"):
        parse_node_specs(spec, "--exclude")


def test_include_keeps_hostfile_order_and_named_slots() -> None:
    assert filter_resources(POOL, include="worker-1:2,0@worker-0") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 2],
    }


def test_exclude_removes_slots_and_whole_hosts() -> None:
    assert filter_resources(POOL, exclude="worker-1:0,3@worker-2") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [1, 2],
    }
    assert filter_resources(POOL) == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 1, 2, 3],
        "worker-2": [0, 1],
    }


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        ("worker-9", "", r"--include: host 'worker-9' is not among the available hosts"),
        ("worker-2:2", "", r"--include: host 'worker-2' has no slot 2 \(it has slots 0-1\)"),
        ("", "worker-0:7", r"--exclude: host 'worker-0' has no slot 7"),
        ("", "worker-0@worker-1@worker-2:0,1", r"leaves no slots to run on"),
        ("worker-0", "worker-1", r"mutually exclusive"),
    ],
)
def test_filter_errors(include: str, exclude: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        filter_resources(POOL, include=include, exclude=exclude)


def test_num_nodes_and_num_gpus() -> None:
    assert select_resources(POOL, num_nodes=2) == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 1, 2, 3],
    }
    # As in DeepSpeed, --num_gpus means device ids 0..N-1 on every host.
    assert select_resources(POOL, num_gpus=3) == {h: [0, 1, 2] for h in POOL}
    assert select_resources(POOL, num_nodes=1, num_gpus=1) == {"worker-0": [0]}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "worker-0", "num_gpus": 1}, "cannot be combined"),
        ({"exclude": "worker-0", "num_nodes": 1}, "cannot be combined"),
        ({"num_nodes": 4}, r"--num_nodes 4 but only 3 host\(s\) are available"),
        ({"num_nodes": 0}, "at least 1"),
        ({"num_gpus": 0}, "at least 1"),
    ],
)
def test_select_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        select_resources(POOL, **kwargs)


def test_resource_filter_on_slot_lists() -> None:
    # DeepSpeed's form: hosts map to their slot indices, and a filter may leave nothing.
    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [1, 3], "worker-2": []}
    assert parse_resource_filter(hosts) == hosts
    assert parse_resource_filter(hosts, include_str="worker-1:3@worker-0:1,1") == {
        "worker-0": [1],
        "worker-1": [3],
    }
    assert parse_resource_filter(hosts, exclude_str="worker-0@worker-1:1") == {"worker-1": [3]}
    assert parse_resource_filter(hosts, exclude_str="worker-0@worker-1") == {}
    with pytest.raises(ValueError, match=r"host 'worker-1' has no slot 0 \(it has slots 1, 3\)"):
        parse_resource_filter(hosts, include_str="worker-1:0")
    with pytest.raises(ValueError, match=r"has no slot 0 \(it has slots none\)"):
        parse_resource_filter(hosts, include_str="worker-2:0")
    with pytest.raises(ValueError, match="mutually exclusive"):
        parse_resource_filter({}, include_str="a", exclude_str="b")


def test_runner_offers_deepspeeds_helper_names() -> None:
    assert runner.parse_resource_filter is parse_resource_filter
    assert runner._parse_hostfile is parse_hostfile
    assert compat.resolve("deepspeed.utils.numa") == "shardspeed.compat.deepspeed.utils.numa"
    from shardspeed.compat.deepspeed.utils.numa import parse_range_list

    assert parse_range_list is cores.parse_range_list


# --- argument parsing -----------------------------------------------------------------------------


def test_script_args_pass_through_untouched() -> None:
    args = runner.parse_args(
        ["--num_gpus=2", "-H", "hf", "train.py", "--deepspeed_config", "ds.json", "--num_gpus", "7",
         "--", "-i", "x y"]
    )  # fmt: skip
    assert (args.num_gpus, args.hostfile, args.user_script) == (2, "hf", "train.py")
    assert args.user_args == ["--deepspeed_config", "ds.json", "--num_gpus", "7", "--", "-i", "x y"]


def test_launcher_defaults() -> None:
    args = runner.parse_args(["train.py"])
    assert args.master_port is None  # on one node torchrun's own, else 29500
    assert args.master_addr is None and args.num_gpus is None and args.hostfile is None
    assert runner.parse_args(["--num_procs", "3", "t.py"]).num_gpus == 3
    assert runner.parse_args(["--num_accelerators", "3", "t.py"]).num_gpus == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--launcher_arg", "x", "t.py"], "unrecognized launcher flag '--launcher_arg'"),
        (["--launcher", "lsf", "t.py"], "--launcher 'lsf' is not one of pdsh, ssh, openmpi"),
        (["--num_gpus", "2"], "missing the script"),
        (["--module", "--no_python", "t.py"], "cannot be used together"),
        (["--num_procs", "0", "t.py"], "--num_procs must be at least 1, got 0"),
        (["--num_accelerators=-1", "t.py"], "--num_accelerators must be at least 1, got -1"),
        (["--num_nodes", "0", "t.py"], "--num_nodes must be at least 1, got 0"),
        (["--bind_core_list", "0-3", "t.py"], "only takes effect with --bind_cores_to_rank"),
        (
            ["--bind_cores_to_rank", "--bind_core_list", "4-2", "t.py"],
            "--bind_core_list: bad core list '4-2': range '4-2' ends before it starts",
        ),
    ],
)
def test_parse_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        runner.parse_args(argv)
    assert message in capsys.readouterr().err


# --- commands built -------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_default_hostfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep a /job/hostfile on the test machine from changing what the planning tests see."""
    monkeypatch.setattr(runner, "DEFAULT_HOSTFILE", str(tmp_path / "no-hostfile"))


def _plan(
    argv: list[str], environ: dict[str, str] | None = None, cwd: str = "/work dir", devices: int = 2
) -> list[runner.Launch]:
    args = runner.parse_args(argv)
    return runner.plan_launches(args, environ or {}, cwd, count_local_devices=lambda: devices)


def test_single_node_torchrun_command(tmp_path: Path) -> None:
    missing = str(tmp_path / "none")
    [launch] = _plan(
        ["--master_port", "1234", "--max_restarts", "2", "--no_local_rank", "--compat",
         "--include", "localhost:1", "train.py", "--lr", "0.1"],
        environ={"HOME": missing},
    )  # fmt: skip
    assert launch.argv == [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--nnodes", "1",
        "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", "1234",
        "--max_restarts", "2", "--module", "shardspeed.launcher.entry", "--no_local_rank", "--compat",
        "train.py", "--lr", "0.1",
    ]  # fmt: skip
    assert launch.env == {"HOME": missing, "CUDA_VISIBLE_DEVICES": "1"}
    assert not launch.remote


def test_default_process_count_follows_local_devices() -> None:
    [launch] = _plan(["t.py"], devices=3)
    assert launch.argv[launch.argv.index("--nproc_per_node") + 1] == "3"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    [launch] = _plan(["--num_procs", "2", "t.py"], devices=0)
    assert launch.argv[launch.argv.index("--nproc_per_node") + 1] == "2"


def test_slots_index_into_visible_devices() -> None:
    [launch] = _plan(["-i", "localhost:0,2", "t.py"], {"CUDA_VISIBLE_DEVICES": "4,5,6"}, devices=3)
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "4,6"
    # Set but empty means "no GPUs": the processes run on the CPU and the variable is left alone.
    [launch] = _plan(["--num_procs", "2", "t.py"], {"CUDA_VISIBLE_DEVICES": ""})
    assert launch.env["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(ValueError, match="lists 1 device"):
        _plan(["--num_procs", "2", "t.py"], {"CUDA_VISIBLE_DEVICES": "3"})


def test_missing_explicit_hostfile_and_extra_nodes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        _plan(["-H", str(tmp_path / "nope"), "t.py"])
    with pytest.raises(ValueError, match="--num_nodes 2 but only 1 host"):
        _plan(["--num_nodes", "2", "t.py"])


def _hostfile(tmp_path: Path) -> str:
    path = tmp_path / "hostfile"
    path.write_text("worker-0 slots=4\nworker-1 slots=4\n")
    return str(path)


def test_multi_node_ssh_commands(tmp_path: Path) -> None:
    cwd = str(tmp_path / "my project")
    launches = _plan(
        ["-H", _hostfile(tmp_path), "-i", "worker-0:1,3@worker-1", "--ssh_port", "2222",
         "--launcher", "ssh", "train.py", "--name", "run one", 'say "hi"', "it's"],
        environ={"HOME": str(tmp_path), "NCCL_DEBUG": "INFO", "UNRELATED": "x"},
        cwd=cwd,
    )  # fmt: skip
    assert [launch.remote for launch in launches] == [True, True]
    for node_rank, (launch, host, devices) in enumerate(
        zip(launches, ["worker-0", "worker-1"], ["1,3", "0,1,2,3"])
    ):
        assert launch.argv[:5] == ["ssh", "-tt", "-p", "2222", host]
        words = shlex.split(launch.argv[5])
        assert words[:3] == ["cd", cwd, "&&"]
        exports = words[4 : words.index("&&", 3)]
        assert exports == [
            "NCCL_DEBUG=INFO", f"PYTHONPATH={cwd}", f"CUDA_VISIBLE_DEVICES={devices}",
        ]  # fmt: skip
        torchrun = words[words.index("exec") + 1 :]
        nproc = str(len(devices.split(",")))
        assert torchrun == [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", nproc, "--nnodes", "2",
            "--node_rank", str(node_rank), "--master_addr", "worker-0", "--master_port", "29500",
            "--module", "shardspeed.launcher.entry",
            "train.py", "--name", "run one", 'say "hi"', "it's",
        ]  # fmt: skip


def test_remote_command_survives_a_real_shell(tmp_path: Path) -> None:
    cwd = tmp_path / "dir with 'quotes' and spaces"
    cwd.mkdir()
    probe = "import os, sys; print(repr((os.getcwd(), os.environ['ODD'], sys.argv[1:])))"
    args = ["a b", 'say "hi"', "it's", "$HOME", "`id`", "--local_rank=0"]
    argv = runner.ssh_command("host", str(cwd), {"ODD": "x 'y' \"z\" $PATH"},
                              [sys.executable, "-c", probe, *args])  # fmt: skip
    shown = subprocess.run(["sh", "-c", argv[-1]], capture_output=True, text=True, check=True)
    assert eval(shown.stdout) == (str(cwd), "x 'y' \"z\" $PATH", args)


def test_environment_propagation(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("# mine\nA=from home\nB=home\n\n")
    (cwd / ".deepspeed_env").write_text("B = from cwd \n")
    environ = {
        "HOME": str(home),
        "PYTHONPATH": "/lib",
        "NCCL_SOCKET_IFNAME": "eth0",
        "UCX_TLS": "tcp",
        "MLFLOW_RUN": "7",
        "MV2_X": "1",
        "CUDA_VISIBLE_DEVICES": "0",
        "PATH": "/bin",
    }
    assert runner.remote_environment(environ, str(cwd)) == {
        "PYTHONPATH": f"{cwd}:/lib",
        "NCCL_SOCKET_IFNAME": "eth0",
        "UCX_TLS": "tcp",
        "MLFLOW_RUN": "7",
        "MV2_X": "1",
        "A": "from home",
        "B": "from cwd",
    }
    custom = tmp_path / "custom_env"
    custom.write_text("C=1\n")
    assert runner.remote_environment({"HOME": str(home), "DS_ENV_FILE": str(custom)}, str(cwd)) == {
        "PYTHONPATH": str(cwd),
        "C": "1",
    }
    custom.write_text("C=1\nnot an assignment\n")
    with pytest.raises(ValueError, match=f"{custom}:2: expected KEY=VALUE"):
        runner.remote_environment({"HOME": str(home), "DS_ENV_FILE": str(custom)}, str(cwd))


def test_no_ssh_runs_only_this_node(tmp_path: Path) -> None:
    [launch] = _plan(["-H", _hostfile(tmp_path), "--no_ssh", "--node_rank", "1", "t.py"])
    argv = launch.argv
    assert not launch.remote
    assert argv[argv.index("--nnodes") + 1 : argv.index("--master_port")] == [
        "2", "--node_rank", "1", "--master_addr", "worker-0",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--node_rank between 0 and 1"):
        _plan(["-H", _hostfile(tmp_path), "--no_ssh", "t.py"])


def test_first_failure_stops_the_others() -> None:
    sleeper = runner.Launch(["sleep", "30"], dict(os.environ), remote=False)
    failer = runner.Launch(["sh", "-c", "sleep 0.2; exit 3"], dict(os.environ), remote=False)
    start = time.monotonic()
    assert runner.run_launches([sleeper, failer]) == 3
    assert time.monotonic() - start < 10
    ok = runner.Launch(["true"], dict(os.environ), remote=False)
    assert runner.run_launches([ok, ok]) == 0


# --- real runs ------------------------------------------------------------------------------------

SCRIPT = """
import argparse, os, sys
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, required=True)
args = parser.parse_args()
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank())])
dist.all_reduce(value)
assert args.local_rank == int(os.environ["LOCAL_RANK"])
with open(os.path.join(args.out, f"rank{dist.get_rank()}"), "w") as handle:
    handle.write(f"{value.item()} {dist.get_world_size()} {os.environ['CROSS_SIZE']} ")
    handle.write(os.environ["MASTER_PORT"])
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _shardspeed() -> str:
    return str(Path(sys.executable).with_name("shardspeed"))


def test_real_run_on_two_processes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    result = subprocess.run(
        [_shardspeed(), "--num_procs", "2", "--master_port", str(port), str(script),
         "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # Each rank saw the all-reduced sum 0 + 1, a world of 2 and one node.
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert {p.read_text() for p in out.iterdir()} == {f"1.0 2 1 {port}"}


def test_launches_started_together_meet_on_ports_of_their_own(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    outs = [tmp_path / "out0", tmp_path / "out1"]
    for out in outs:
        out.mkdir()
    # Each torchrun binds the port it meets on as it picks it: no window in which both take one.
    command = [_shardspeed(), "--num_procs", "2", str(script), "--out"]
    launches = [
        subprocess.Popen(
            [*command, str(out)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for out in outs
    ]
    logs = [launch.communicate(timeout=120)[0] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], logs
    ports = set()
    for out in outs:
        reports = {p.read_text() for p in out.iterdir()}
        assert len(reports) == 1, reports  # both ranks of a launch met in one group
        value, world, nodes, port = reports.pop().split()
        assert (value, world, nodes) == ("1.0", "2", "1")
        ports.add(port)
    assert len(ports) == 2


def test_failing_script_fails_the_launcher(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    result = subprocess.run(
        [_shardspeed(), "--num_procs", "1", "--master_port", str(_free_port()), str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0


# --- the per-process entry point ------------------------------------------------------------------

REPORT = """
import json, os, sys
keys = ("LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
report = {"argv": sys.argv, "name": __name__, "path0": sys.path[0],
          "env": [os.environ.get(key) for key in keys]}
with open(os.environ["REPORT_TO"], "w") as handle:
    json.dump(report, handle)
"""


@pytest.fixture
def report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the REPORT script writes; sys.argv and sys.path are restored after the test."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for key in ("LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("REPORT_TO", str(tmp_path / "report.json"))
    return tmp_path / "report.json"


def test_entry_runs_script_like_python(
    tmp_path: Path, report: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script_dir = tmp_path / "scripts"
    script_dir.mkdir()
    (script_dir / "train.py").write_text(REPORT)
    for key, value in {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                       "GROUP_WORLD_SIZE": "3"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    assert entry.main(["scripts/train.py", "a b", "--x"]) == 0
    result = json.loads(report.read_text())
    assert result == {
        "argv": ["scripts/train.py", "a b", "--x", "--local_rank=2"],
        "name": "__main__",
        "path0": str(script_dir.resolve()),
        "env": ["4", "1", "3"],
    }


def test_entry_runs_a_module(tmp_path: Path, report: Path) -> None:
    (tmp_path / "my_trainer.py").write_text(REPORT)
    sys.path.insert(0, str(tmp_path))
    assert entry.main(["--no_local_rank", "--module", "my_trainer", "--y"]) == 0
    result = json.loads(report.read_text())
    assert result["argv"] == [str(tmp_path / "my_trainer.py"), "--y"]
    assert result["name"] == "__main__"


LEAVES_GROUP_OPEN = """
import sys
import torch.distributed as dist
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
sys.exit(0)
"""


def test_entry_closes_the_group_a_finished_script_left_open(tmp_path: Path, report: Path) -> None:
    # Left to interpreter shutdown, the group's threads can abort a process that succeeded.
    script = tmp_path / "train.py"
    script.write_text(LEAVES_GROUP_OPEN)
    init_method = f"file://{tmp_path / 'rendezvous'}"
    assert entry.main(["--no_local_rank", str(script), init_method]) == 0
    assert not torch.distributed.is_initialized()


def test_entry_execs_a_program_without_python(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_execvp(file: str, argv: list[str]) -> None:
        calls.append((file, argv))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execvp", fake_execvp)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit):
        entry.main(["--no_python", "./train.sh", "x"])
    assert calls == [("./train.sh", ["./train.sh", "x", "--local_rank=1"])]


def test_entry_needs_local_rank_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit, match="LOCAL_RANK is not set"):
        entry.main(["train.py"])
    with pytest.raises(SystemExit, match="unknown flag '--bogus'"):
        entry.main(["--bogus", "train.py"])


def test_one_node_meets_on_a_port_torchrun_binds_itself() -> None:
    [launch] = _plan(["--num_procs", "2", "t.py"])
    argv = launch.argv
    assert argv[argv.index("--nnodes") : argv.index("--module")] == [
        "--nnodes",
        "1",
        "--standalone",
    ]
    assert "--master_port" not in argv and "--master_addr" not in argv
    # An explicit port or address keeps the fixed rendezvous.
    for flags in (["--master_port", "1234"], ["--master_addr", "127.0.0.2"]):
        [launch] = _plan([*flags, "t.py"])
        assert "--standalone" not in launch.argv and flags[1] in launch.argv


def test_busy_default_port_is_replaced_on_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    def port_of(launch: runner.Launch) -> str:
        return launch.argv[launch.argv.index("--master_port") + 1]

    address = ["--master_addr", "127.0.0.1"]  # with no port given, the default one if it is free
    monkeypatch.setattr(runner, "port_is_free", lambda port: True)
    assert port_of(_plan([*address, "t.py"], devices=1)[0]) == "29500"
    monkeypatch.setattr(runner, "port_is_free", lambda port: False)
    assert port_of(_plan([*address, "t.py"], devices=1)[0]) != "29500"
    assert port_of(_plan(["--master_port", "29500", "t.py"], devices=1)[0]) == "29500"


# --- core binding ---------------------------------------------------------------------------------


def test_parse_range_list() -> None:
    assert cores.parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    assert cores.parse_range_list("7") == [7]
    assert cores.parse_range_list("3-3") == [3]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,2-6,5-9", "'5-9' is not above the cores before it"),
        ("8,2-6", "'2-6' is not above"),
        ("1,1", "'1' is not above"),
        ("1,6-2", "range '6-2' ends before it starts"),
        ("", "'' is neither a number nor a range"),
        ("0, 1", "' 1' is neither"),
        ("-1", "'-1' is neither"),
        ("1-2-3", "'1-2-3' is neither"),
    ],
)
def test_parse_range_list_errors(text: str, message: str) -> None:
    with pytest.raises(
        ValueError, match=f"bad core list {re.escape(repr(text))}: {re.escape(message)}"
    ):
        cores.parse_range_list(text)


def test_cores_for_rank_share_equally_and_leave_the_remainder() -> None:
    listed = [0, 2, 3, 4, 6, 8, 9]
    assert [cores.cores_for_rank(listed, 3, rank) for rank in range(3)] == [[0, 2], [3, 4], [6, 8]]
    assert cores.cores_for_rank(listed, 1, 0) == listed
    with pytest.raises(ValueError, match=r"2 core\(s\) for 3 processes"):
        cores.cores_for_rank([0, 1], 3, 0)


def test_bind_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 0, 1, 2, 5})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, mask: pinned.append(sorted(mask)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cores.bind_this_process(None, 2, 1) == [2, 3]
    assert pinned == [[2, 3]] and os.environ["OMP_NUM_THREADS"] == "2"
    assert cores.bind_this_process("1-3,5", 2, 1) == [3, 5]
    with pytest.raises(ValueError, match=r"cores \[4\], which this process may not use"):
        cores.bind_this_process("0-5", 3, 2)
    assert pinned == [[2, 3], [3, 5]]


def test_bind_flags_reach_every_worker() -> None:
    [launch] = _plan(["--bind_cores_to_rank", "--bind_core_list", "0-3", "t.py", "--x"])
    after_entry = launch.argv[launch.argv.index(runner.ENTRY_MODULE) + 1 :]
    assert after_entry == ["--bind_cores_to_rank", "--bind_core_list=0-3", "t.py", "--x"]
    [launch] = _plan(["--bind_cores_to_rank", "t.py"])
    assert launch.argv[launch.argv.index(runner.ENTRY_MODULE) + 1 :] == [
        "--bind_cores_to_rank", "t.py",
    ]  # fmt: skip


def test_entry_binds_before_running_the_target(
    tmp_path: Path, report: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pinned = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, mask: pinned.append(sorted(mask)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    (tmp_path / "train.py").write_text(REPORT)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = ["--bind_cores_to_rank", "--bind_core_list=2-7", str(tmp_path / "train.py")]
    assert entry.main(argv) == 0
    assert pinned == [[5, 6, 7]] and os.environ["OMP_NUM_THREADS"] == "3"
    assert json.loads(report.read_text())["argv"][1:] == ["--local_rank=1"]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(SystemExit, match="--bind_cores_to_rank needs LOCAL_WORLD_SIZE"):
        entry.main(argv)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "7")
    with pytest.raises(SystemExit, match=r"6 core\(s\) for 7 processes"):
        entry.main(["--bind_cores_to_rank", "--bind_core_list=2-7", "t.py"])


BIND_REPORT = """
import os, sys
rank = os.environ["LOCAL_RANK"]
with open(os.path.join(sys.argv[1], "rank" + rank), "w") as handle:
    handle.write(f"{sorted(os.sched_getaffinity(0))} {os.environ['OMP_NUM_THREADS']}")
"""


def test_real_run_binds_each_process_to_its_cores(tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(BIND_REPORT)
    allowed = sorted(os.sched_getaffinity(0))
    share = len(allowed) // 2
    result = subprocess.run(
        [_shardspeed(), "--num_procs", "2", "--master_port", str(_free_port()), "--no_local_rank",
         "--bind_cores_to_rank", str(script), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        expected = allowed[share * rank : share * (rank + 1)]
        assert (tmp_path / f"rank{rank}").read_text() == f"{expected} {share}"


# --- the shardspeed command above the launcher and the tuner ----------------------------------------


def test_console_scripts_name_functions_that_exist() -> None:
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    section = pyproject.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', section, re.MULTILINE))
    assert scripts["shardspeed"] == "shardspeed.cli:main"
    for name, target in scripts.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name


def test_the_runner_leaves_autotuning_to_the_shardspeed_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert runner.main(["--autotuning", "tune", "train.py"]) == 2
    assert "--autotuning is run by the shardspeed command" in capsys.readouterr().err
