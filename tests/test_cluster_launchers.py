"""Cluster launchers: `shardspeed --launcher pdsh|openmpi|mpich|impi|mvapich|slurm`, the scripts that
`srun` and `mpirun` start without torchrun, and DeepSpeed's launcher flags.

The first part builds command lines and reads rank layouts without any tool. The second installs
the real tools from Debian's packages (once: skipped when they are there), starts a local Slurm
(slurmctld + slurmd), an sshd on a loopback port for pdsh, and runs `tests/cluster_job.py` as a
2-rank job through each. Every job trains the same model at ZeRO 1 on the same batches in a world of
2 gloo ranks, so its final parameters must equal the `shardspeed` launcher's local run bit for bit:
the reductions are the same calls in the same order, only the way the processes started differs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardspeed.comm import discovery
from shardspeed.launcher import cluster, mpi, runner

TESTS = Path(__file__).resolve().parent
JOB = str(TESTS / "cluster_job.py")
PYTHON = sys.executable
SHARDSPEED = str(Path(sys.executable).with_name("shardspeed"))
ENTRY = [PYTHON, "-u", "-m", runner.ENTRY_MODULE, "--no_local_rank"]


# --- rank layouts from MPI and Slurm variables ------------------------------------------------------


def test_openmpi_layout_on_one_node_meets_on_loopback() -> None:
    environ = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
               "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    assert discovery.discover(environ) == discovery.Layout(
        1, 2, 1, 2, "127.0.0.1", 29500, "OpenMPI"
    )
    environ.update(MASTER_ADDR="node7", MASTER_PORT="1234")
    assert discovery.adopt(environ) is not None
    assert {k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                    "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node7", "MASTER_PORT": "1234",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
          "MASTER_ADDR": "a"}, (3, 4, 1, 2, "a", "MPICH/Intel MPI")),
        ({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "0",
          "MV2_COMM_WORLD_LOCAL_SIZE": "2"}, (0, 2, 0, 2, "127.0.0.1", "MVAPICH")),
        # Slurm: rank 0 runs on the first host of the step's node list, which hosts the store.
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
          "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),3",
          "SLURM_STEP_NODELIST": "gpu[07-09,12],cpu1"}, (5, 6, 1, 3, "gpu07", "Slurm")),
        # mpirun inside a Slurm allocation: the batch step's SLURM_* describe the allocation.
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "8",
          "SLURM_STEP_ID": "0"}, (0, 2, 0, 2, "127.0.0.1", "OpenMPI")),
        # Azure ML's OpenMPI jobs name the first node.
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "AZUREML_EXPERIMENT_ID": "x",
          "AZ_BATCH_MASTER_NODE": "10.0.0.4:6105"}, (2, 4, 0, 2, "10.0.0.4", "OpenMPI")),
    ],
)  # fmt: skip
def test_layouts_of_each_launcher_family(environ: dict, expected: tuple) -> None:
    layout = discovery.discover(environ)
    assert layout is not None
    rank, size, local_rank, local_size, addr, source = expected
    assert layout == discovery.Layout(rank, size, local_rank, local_size, addr, 29500, source)


def test_no_launcher_and_batch_scripts_are_not_ranks() -> None:
    assert discovery.discover({}) is None
    # sbatch's script sees SLURM_PROCID=0 of the allocation's tasks but is no step: plain python.
    assert (
        discovery.discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}) is None
    )
    # torchrun's variables win; a world of one keeps the one-process start-up.
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1",
                "OMPI_COMM_WORLD_RANK": "1"}  # fmt: skip
    assert discovery.adopt(dict(torchrun)) is None
    one = {"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
    assert discovery.adopt(one, allowed=False) is None and "RANK" not in one


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "on several nodes, and MASTER_ADDR is not set"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "MPI_LOCALRANKID and MPI_LOCALNRANKS are not"),
        ({"PMI_RANK": "x", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
         "PMI_RANK='x' is not an integer"),
        ({"PMI_RANK": "2", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
         "rank 2 of 2, local rank 0 of 2: these do not fit"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
          "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(y3)"}, "is not Slurm's format"),
    ],
)  # fmt: skip
def test_incomplete_layouts_are_refused_naming_the_variable(environ: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        discovery.discover(environ)


def test_slurm_host_lists() -> None:
    assert discovery.first_host("node-a") == "node-a"
    assert discovery.first_host("rack[2-3]n[001-004],x") == "rack2n001"
    assert [discovery.tasks_on_node("4,2(x2),1", i) for i in range(4)] == [4, 2, 2, 1]


def test_nccl_without_a_gpu_is_refused_naming_the_backend() -> None:
    code = (
        "import shardspeed\n"
        "try:\n    shardspeed.init_distributed(dist_backend='nccl')\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "init_distributed(dist_backend='nccl'): the nccl backend needs a CUDA GPU" in done.stdout
    assert "dist_backend='gloo'" in done.stdout, done.stderr


def test_init_distributed_without_discovery_refuses_a_larger_world(tmp_path: Path) -> None:
    code = (
        "import shardspeed\n"
        "try:\n    shardspeed.init_distributed(dist_backend='gloo', auto_mpi_discovery=False)\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    env = {"PATH": os.environ["PATH"], "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    done = subprocess.run(
        [PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "init_distributed: auto_mpi_discovery=False, but RANK" in done.stdout, done.stderr
    assert "OpenMPI started this process as rank 0 of 2" in done.stdout


# --- command lines --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_default_hostfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "DEFAULT_HOSTFILE", str(tmp_path / "no-hostfile"))


def _hostfile(tmp_path: Path, text: str = "node-a slots=2\nnode-b slots=2\n") -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def _plan(argv: list[str], environ: dict | None = None) -> runner.Launch:
    [launch] = runner.plan_launches(
        runner.parse_args(argv), environ or {"HOME": "/nonexistent"}, "/work",
        count_local_devices=lambda: 2, which=lambda name: f"/opt/bin/{name}",
        find_tool=lambda launcher: f"/opt/bin/{cluster.TOOLS[launcher].names[0]}",
    )  # fmt: skip
    return launch


def test_pdsh_command_runs_each_nodes_torchrun(tmp_path: Path) -> None:
    launch = _plan(
        ["-H", _hostfile(tmp_path), "--ssh_port", "2200", "--launcher_args", "-u 30",
         "--venv_script", "/env/bin/activate", "t.py", "--x", "50%"],
        {"HOME": "/nonexistent", "PDSH_SSH_ARGS_APPEND": "-i key"},
    )  # fmt: skip
    assert launch.argv[:8] == ["pdsh", "-S", "-f", "1024", "-w", "node-a,node-b", "-u", "30"]
    shell = launch.argv[8]
    # pdsh's %n is the node rank; a % of the user's is doubled so pdsh leaves it alone.
    assert "--node_rank %n --master_addr node-a --master_port 29500" in shell
    assert shell.startswith("cd /work && . /env/bin/activate && export PYTHONPATH=/work ")
    assert shell.endswith("shardspeed.launcher.entry t.py --x 50%%")
    assert launch.env["PDSH_RCMD_TYPE"] == "ssh"
    assert launch.env["PDSH_SSH_ARGS_APPEND"] == "-i key -tt -p 2200"
    assert launch.stop == (signal.SIGINT, signal.SIGINT)


def test_pdsh_needs_the_same_slots_on_every_node(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"every node needs the same slots \(node-a: 0,1, node-b: 0\)"
    ):
        _plan(["-H", _hostfile(tmp_path, "node-a slots=2\nnode-b slots=1\n"), "--launcher", "pdsh",
               "t.py"])  # fmt: skip
    launch = _plan(["-H", _hostfile(tmp_path, "a slots=2\nb slots=1\n"), "--num_gpus", "1", "t.py"])
    assert "--nproc_per_node 1 --nnodes 2" in launch.argv[-1]


def test_mpi_command_lines(tmp_path: Path) -> None:
    hostfile = _hostfile(tmp_path)
    env = {"HOME": "/nonexistent", "NCCL_DEBUG": "INFO", "UCX_TLS": "rc"}
    launch = _plan(
        ["-H", hostfile, "--launcher", "openmpi", "--master_port", "7", "t.py", "a b"], env
    )
    assert launch.argv[0] == "/opt/bin/mpirun.openmpi"
    [(path, text)] = launch.files.items()
    assert text == "node-a slots=2\nnode-b slots=2\n"
    assert launch.argv[1:] == [
        "-n", "4", "-hostfile", path, "--mca", "btl", "^openib", "--mca", "btl_tcp_if_include",
        "eth0", "-x", "UCX_TLS=rc", "-x", "NCCL_DEBUG=INFO", "-x", "PYTHONPATH=/work",
        "-x", "MASTER_PORT=7", "-x", "MASTER_ADDR=node-a", *ENTRY, "t.py", "a b",
    ]  # fmt: skip
    launch = _plan(["-H", hostfile, "--launcher", "openmpi", "--launcher_args",
                    "--mca btl_tcp_if_include lo", "t.py"])  # fmt: skip
    assert "eth0" not in launch.argv and launch.argv[8:11] == ["--mca", "btl_tcp_if_include", "lo"]

    launch = _plan(["-H", hostfile, "--launcher", "mpich", "--compat", "t.py"])
    assert launch.argv == [
        "/opt/bin/mpirun.mpich", "-n", "4", "-ppn", "2", "-genv", "PYTHONPATH", "/work",
        "-genv", "MASTER_PORT", "29500", "-genv", "MASTER_ADDR", "node-a", "-genv", "WORLD_SIZE",
        "4", "-genv", "LOCAL_SIZE", "2", "-hosts", "node-a,node-b", *ENTRY, "--compat", "t.py",
    ]  # fmt: skip


def test_impi_and_mvapich_command_lines(tmp_path: Path) -> None:
    hosts = {"node-a": 1, "node-b": 1}
    program = ["python", "t.py"]
    assert mpi.impi_command(hosts, {"K": "v"}, program, ["-l"]) == [
        "mpirun", "-ppn", "1", "-l", "-genv", "K", "v", "-genv", "WORLD_SIZE", "2",
        "-genv", "LOCAL_SIZE", "1", "-genv", "I_MPI_PIN", "0", "-genv", "LOCAL_WORLD_SIZE", "1",
        "-hosts", "node-a,node-b",
        "-n", "1", "-env", "RANK", "0", "-env", "LOCAL_RANK", "0", "python", "t.py", ":",
        "-n", "1", "-env", "RANK", "1", "-env", "LOCAL_RANK", "0", "python", "t.py",
    ]  # fmt: skip
    command = mpi.mvapich_command(hosts, "/tmp/h", {"MV2_SUPPORT_DL": "0"}, program)
    assert command[:8] == ["mpirun", "-np", "2", "-ppn", "1", "--hostfile", "/tmp/h", "-env"]
    pairs = dict(zip(command[8:-2:3], command[9:-2:3]))
    assert pairs["MV2_SUPPORT_DL"] == "0" and pairs["MV2_SMP_USE_CMA"] == "0"
    assert command[-2:] == program
    with pytest.raises(ValueError, match=r"--launcher impi starts the same number of processes"):
        mpi.impi_command({"a": 2, "b": 1}, {}, program)


def test_slurm_command_line(tmp_path: Path) -> None:
    launch = _plan(
        ["-H", _hostfile(tmp_path), "--launcher", "slurm", "--launcher_args", "-p gpu",
         "--include", "node-b", "--force_multi", "--enable_each_rank_log", str(tmp_path / "logs"), "t.py"],
    )  # fmt: skip
    prefix = launch.argv[launch.argv.index("--no_local_rank") + 1]
    assert prefix.startswith(f"--rank_log={tmp_path / 'logs'}{os.sep}")
    assert launch.argv == [
        "/opt/bin/srun", "-n", "2", "-p", "gpu", "--nodelist=node-b", "--export=ALL", *ENTRY,
        prefix, "t.py",
    ]  # fmt: skip
    # srun's ranks find rank 0's host in their node list: no MASTER_ADDR unless one is given.
    assert launch.env["MASTER_PORT"] == "29500" and "MASTER_ADDR" not in launch.env
    launch = _plan(["-H", _hostfile(tmp_path), "--launcher", "slurm", "--num_nodes", "2",
                    "--num_gpus", "1", "t.py"])  # fmt: skip
    assert launch.argv[:5] == ["/opt/bin/srun", "-n", "2", "--nodes=2", "--ntasks-per-node=1"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--launcher", "openmpi", "--include", "node-a"], "--include/--exclude cannot be used"),
        (["--launcher", "mpich", "--num_gpus", "1"], "--num_nodes/--num_gpus cannot be used"),
        (["--launcher", "slurm", "--ssh_port", "22"], "--launcher slurm uses no ssh"),
        (["--launcher", "impi", "--ssh_port", "22"], "plm_rsh_args"),
        (["--launcher", "slurm", "--max_restarts", "1"], "starts the ranks without torchrun"),
        (["--launcher", "slurm", "--include", "node-a:1"], "srun places tasks on a node itself"),
    ],
)
def test_flags_a_launcher_cannot_honour_are_refused(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _plan(["-H", _hostfile(tmp_path), "--force_multi", *flags, "t.py"])


def test_one_node_runs_torchrun_here_unless_forced(tmp_path: Path) -> None:
    launch = _plan(["--num_procs", "2", "--launcher", "slurm", "--venv_script", "/v", "t.py"])
    assert launch.argv[:5] == ["sh", "-c", '. /v && exec "$@"', "sh", PYTHON]
    assert "torch.distributed.run" in launch.argv and not launch.remote
    launch = _plan(["--num_procs", "2", "--launcher", "slurm", "--force_multi", "t.py"])
    assert launch.argv[:3] == ["/opt/bin/srun", "-n", "2"]
    # --no_ssh starts this node only, whatever the launcher.
    launch = _plan(["-H", _hostfile(tmp_path), "--no_ssh", "--node_rank", "1", "--force_multi",
                    "--launcher", "openmpi", "t.py"])  # fmt: skip
    assert "torch.distributed.run" in launch.argv


def test_log_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert runner.parse_args(["-q", "t.py"]).log_level == "error"
    assert runner.parse_args(["--log_level", "debug", "t.py"]).log_level == "debug"
    assert runner.parse_args(["--enable_each_rank_log", "None", "t.py"]).rank_log_prefix is None
    afile = tmp_path / "f"
    afile.write_text("")
    with pytest.raises(SystemExit):
        runner.parse_args(["--enable_each_rank_log", str(afile), "t.py"])
    assert "is a file; name a directory" in capsys.readouterr().err


# --- the real tools -------------------------------------------------------------------------------

PACKAGES = ["slurm-wlm", "openmpi-bin", "mpich", "pdsh", "openssh-server", "munge"]
BINARIES = ["slurmctld", "slurmd", "srun", "mpirun.openmpi", "mpirun.mpich", "pdsh", "ssh", "sshd"]


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _install_tools() -> None:
    if all(_which(name) for name in BINARIES):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("the cluster tools are not installed and apt-get (as root) is not available")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update"], env=env, check=True, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES], env=env,
                   check=True, capture_output=True)  # fmt: skip


def _start_slurm(root: Path) -> tuple[str, list[Path]]:
    """A one-node Slurm cluster: slurmctld and slurmd as root, auth/none, state in `root`."""
    for name in ("spool", "state"):
        (root / name).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=shardspeedtest
SlurmctldHost=localhost
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
MpiDefault=none
ReturnToService=2
SlurmdSpoolDir={root}/spool
StateSaveLocation={root}/state
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName=localhost CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run([_which("slurmctld"), "-f", str(conf), "-i"], env=env, check=True)
    subprocess.run([_which("slurmd"), "-f", str(conf), "-N", "localhost"], env=env, check=True)
    for _ in range(100):  # until the node reports idle
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
        if state.stdout.strip() == "idle":
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the test Slurm node did not come up: {state.stdout} {state.stderr}")
    return str(conf), [root / "slurmd.pid", root / "slurmctld.pid"]


def _start_sshd(root: Path) -> tuple[str, Path, Path]:
    """An sshd on a loopback port with generated keys, and an ssh alias for it: the way users
    reach their nodes (~/.ssh/config), here in the system config so every ssh client sees it."""
    for key in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / key)],
                       check=True)  # fmt: skip
    shutil.copy(root / "id.pub", root / "authorized_keys")
    port = _free_port()
    (root / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {root}/host_key\n"
        f"AuthorizedKeysFile {root}/authorized_keys\nPidFile {root}/sshd.pid\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\nStrictModes no\n"
    )
    os.makedirs("/run/sshd", exist_ok=True)
    subprocess.run([_which("sshd"), "-f", str(root / "sshd_config"), "-E", str(root / "sshd.log")],
                   check=True)  # fmt: skip
    alias = f"shardspeed-test-{os.getpid()}"
    config = Path(f"/etc/ssh/ssh_config.d/{alias}.conf")
    config.write_text(
        f"Host {alias}\n  HostName 127.0.0.1\n  Port {port}\n  User {os.environ.get('USER', 'root')}\n"
        f"  IdentityFile {root}/id\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
        "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
    )
    return alias, config, root / "sshd.pid"


@pytest.fixture(scope="session")
def tools(tmp_path_factory: pytest.TempPathFactory):
    """The installed tools running on this machine; yields the environment jobs run in."""
    if os.geteuid() != 0:
        pytest.skip("the test Slurm and sshd run as root")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("a 2-rank Slurm job needs 2 CPUs")
    _install_tools()
    root = tmp_path_factory.mktemp("cluster")
    pid_files: list[Path] = []
    config = None
    try:
        conf, slurm_pids = _start_slurm(root)
        pid_files += slurm_pids
        alias, config, sshd_pid = _start_sshd(root)
        pid_files.append(sshd_pid)
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "PDSH_", "SLURM_",
                                      "OMPI_", "PMI_"))}  # fmt: skip
        # OpenMPI refuses to run as root unless told twice.
        env.update(SLURM_CONF=conf, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        yield {"env": env, "alias": alias}
    finally:
        for path in pid_files:  # the daemons this fixture started, by their pids
            if path.exists():
                os.kill(int(path.read_text().split()[0]), signal.SIGTERM)
        if config is not None:
            config.unlink(missing_ok=True)


def _run(command: list[str], env: dict, out: Path) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _reports(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _assert_trained_like(out: Path, reference: Path) -> None:
    params = load_file(out / "params.safetensors")
    expected = load_file(reference / "params.safetensors")
    assert params.keys() == expected.keys() and params
    for name, want in expected.items():
        assert torch.equal(params[name], want), name


@pytest.fixture(scope="session")
def local_run(tools: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference: the shardspeed launcher's own 2-process run on this machine (torchrun),
    with --save_pid, --venv_script and --enable_each_rank_log."""
    root = tmp_path_factory.mktemp("local")
    venv = root / "activate"
    venv.write_text("export SHARDSPEED_TEST_VENV=sourced\n")
    logs = root / "logs"
    command = [SHARDSPEED, "--num_procs", "2", "--master_port", str(_free_port()), "--save_pid",
               "--venv_script", str(venv), "--enable_each_rank_log", str(logs), JOB,
               str(root / "out")]  # fmt: skip
    launcher = subprocess.Popen(command, env=tools["env"], cwd=root, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    _, stderr = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, stderr
    return {"out": root / "out", "logs": logs, "pid": launcher.pid, "stderr": stderr}


def test_local_run_flags(local_run: dict) -> None:
    reports = _reports(local_run["out"])
    # --save_pid: while the job ran, /tmp/<launcher pid>.deepspeed held the pid of the process the
    # launcher started, torchrun, the ranks' parent; it is gone after.
    for report in reports:
        assert report["pid_file"] == f"{report['parent']}\n"
    assert not Path(f"/tmp/{local_run['pid']}.deepspeed").exists()
    # --venv_script was sourced before the ranks started; the script got --local_rank.
    assert [r["venv"] for r in reports] == ["sourced", "sourced"]
    assert [r["argv"][-1] for r in reports] == ["--local_rank=0", "--local_rank=1"]
    # --enable_each_rank_log: each rank's output in <dir>/<start time>_rank<N>.log.
    logs = sorted(local_run["logs"].iterdir())
    assert [log.name.split("_", 1)[1] for log in logs] == ["rank0.log", "rank1.log"]
    assert len({log.name.split("_")[0] for log in logs}) == 1
    for rank, log in enumerate(logs):
        assert f"cluster_job rank {rank} of 2 done" in log.read_text()
    assert "cluster_job rank" not in local_run["stderr"]


def test_pdsh_over_ssh(tools: dict, local_run: dict, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{tools['alias']} slots=2\n")
    venv = tmp_path / "activate"
    venv.write_text("export SHARDSPEED_TEST_VENV=sourced\n")
    done = _run(
        [SHARDSPEED, "-H", str(hostfile), "--launcher", "pdsh", "--force_multi", "--master_addr",
         "127.0.0.1", "--master_port", str(_free_port()), "--venv_script", str(venv),
         "--no_local_rank", JOB, str(tmp_path / "out")],
        tools["env"], tmp_path,
    )  # fmt: skip
    assert "shardspeed: pdsh -S -f 1024 -w " in done.stderr  # the command, at the info level
    _assert_trained_like(tmp_path / "out", local_run["out"])
    assert [r["venv"] for r in _reports(tmp_path / "out")] == ["sourced", "sourced"]


def test_ssh_check_and_no_ssh_check(tools: dict, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nonexistent.invalid slots=1\n")
    command = [SHARDSPEED, "-H", str(hostfile), "--launcher", "pdsh", "--force_multi", "t.py"]
    checked = subprocess.run(command, env=tools["env"], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 2
    assert (
        "host 'nonexistent.invalid' was not reachable by ssh without a password" in checked.stderr
    )
    assert "pdsh -S" not in checked.stderr  # refused before anything started
    unchecked = subprocess.run([*command[:-1], "--no_ssh_check", "-q", "t.py"], env=tools["env"],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
    assert unchecked.returncode != 0
    assert "not reachable by ssh" not in unchecked.stderr
    assert "nonexistent.invalid" in unchecked.stderr  # pdsh's own failure to reach it
    assert "shardspeed: " not in unchecked.stderr.replace("shardspeed: error", "")  # --quiet


def test_openmpi_through_shardspeed_and_mpirun_around_the_script(
    tools: dict, local_run: dict, tmp_path: Path
) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    _run(
        [SHARDSPEED, "-H", str(hostfile), "--launcher", "openmpi", "--force_multi", "--no_ssh_check",
         "--launcher_args", "--mca btl_tcp_if_include lo", "--master_port", str(_free_port()),
         "--enable_each_rank_log", str(tmp_path / "logs"), JOB, str(tmp_path / "launcher")],
        tools["env"], tmp_path,
    )  # fmt: skip
    _assert_trained_like(tmp_path / "launcher", local_run["out"])
    reports = _reports(tmp_path / "launcher")
    assert [r["env"]["LOCAL_RANK"] for r in reports] == ["0", "1"]
    assert all(r["argv"] == [str(tmp_path / "launcher")] for r in reports)  # no --local_rank
    assert len(list((tmp_path / "logs").glob("*_rank[01].log"))) == 2
    # A script that mpirun starts directly reads OMPI_COMM_WORLD_* in init_distributed.
    env = {**tools["env"], "MASTER_PORT": str(_free_port())}
    _run([_which("mpirun.openmpi"), "-n", "2", "-x", "MASTER_PORT", PYTHON, JOB,
          str(tmp_path / "direct")], env, tmp_path)  # fmt: skip
    _assert_trained_like(tmp_path / "direct", local_run["out"])
    assert [r["env"]["MASTER_ADDR"] for r in _reports(tmp_path / "direct")] == ["127.0.0.1"] * 2


def test_mpich_through_shardspeed(tools: dict, local_run: dict, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    _run(
        [SHARDSPEED, "-H", str(hostfile), "--launcher", "mpich", "--force_multi", "--no_ssh_check",
         "--master_port", str(_free_port()), JOB, str(tmp_path / "out")],
        tools["env"], tmp_path,
    )  # fmt: skip
    _assert_trained_like(tmp_path / "out", local_run["out"])


def test_intel_mpi_command_runs_under_hydra(tools: dict, local_run: dict, tmp_path: Path) -> None:
    # Intel MPI's mpirun is MPICH's Hydra process manager; the command DeepSpeed's impi launcher
    # builds (per-rank -env RANK/LOCAL_RANK sections) runs unchanged under MPICH's.
    args = runner.parse_args(["--launcher", "impi", "--master_port", str(_free_port()), JOB,
                              str(tmp_path / "out")])  # fmt: skip
    exports = {**runner.remote_environment(tools["env"], str(tmp_path)),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.master_port)}  # fmt: skip
    launch = cluster.rank_launch("impi", args, {"localhost": [0, 1]}, exports,
                                 runner.rank_program(args), "", _which("mpiexec.hydra"))  # fmt: skip
    _run(launch.argv, {**tools["env"], **launch.env}, tmp_path)
    _assert_trained_like(tmp_path / "out", local_run["out"])


def test_tools_that_are_not_the_named_mpi_are_refused(tools: dict) -> None:
    # Debian's mpirun is OpenMPI's, and MVAPICH2 is not packaged: both refused, saying why.
    with pytest.raises(ValueError, match=r"--launcher impi needs Intel MPI's mpirun .* says"):
        cluster.find_tool("impi")
    with pytest.raises(ValueError, match=r"--launcher mvapich needs MVAPICH2's mpirun"):
        cluster.find_tool("mvapich")
    assert cluster.find_tool("openmpi").endswith("mpirun.openmpi")


def test_slurm_through_shardspeed_and_srun_around_the_script(
    tools: dict, local_run: dict, tmp_path: Path
) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    _run(
        [SHARDSPEED, "-H", str(hostfile), "--launcher", "slurm", "--force_multi",
         "--master_port", str(_free_port()), "--enable_each_rank_log", str(tmp_path / "logs"),
         JOB, str(tmp_path / "launcher")],
        tools["env"], tmp_path,
    )  # fmt: skip
    _assert_trained_like(tmp_path / "launcher", local_run["out"])
    for rank in range(2):
        [log] = (tmp_path / "logs").glob(f"*_rank{rank}.log")
        assert f"cluster_job rank {rank} of 2 done" in log.read_text()
    # srun around the script: init_distributed reads SLURM_PROCID/NTASKS/LOCALID and the host of
    # rank 0 from the step's node list.
    env = {**tools["env"], "MASTER_PORT": str(_free_port())}
    _run(["srun", "-n", "2", PYTHON, JOB, str(tmp_path / "direct")], env, tmp_path)
    _assert_trained_like(tmp_path / "direct", local_run["out"])
    reports = _reports(tmp_path / "direct")
    assert [r["env"]["MASTER_ADDR"] for r in reports] == ["localhost"] * 2
    assert [r["env"]["LOCAL_WORLD_SIZE"] for r in reports] == ["2"] * 2


SLEEPER = """
import os, sys, time
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
time.sleep(300)
"""


def test_stopping_a_pdsh_launch_stops_the_nodes_ranks(tools: dict, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{tools['alias']} slots=2\n")
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    started = tmp_path / "started"
    started.mkdir()
    launcher = subprocess.Popen(
        [SHARDSPEED, "-H", str(hostfile), "--launcher", "pdsh", "--force_multi", "--master_addr",
         "127.0.0.1", "--master_port", str(_free_port()), "--no_local_rank", "-q",
         str(tmp_path / "sleeper.py"), str(started)],
        env=tools["env"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(600):
            if len(list(started.iterdir())) == 2:
                break
            time.sleep(0.1)
        ranks = [int(path.name) for path in started.iterdir()]
        assert len(ranks) == 2
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 128 + signal.SIGTERM
        for _ in range(300):  # the hang-up reaches torchrun, which stops its workers
            if not any(Path(f"/proc/{pid}").exists() for pid in ranks):
                break
            time.sleep(0.1)
        assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    finally:
        if launcher.poll() is None:
            launcher.kill()
