"""Multi-machine runs end to end on this machine, talking to 127.0.0.1 only:

- `ray up` with cluster/local.yaml pointed at an sshd of the test's own on 127.0.0.1, a training
  job submitted through the cluster's job server, and `ray down`, leaving no process behind;
- an autoscaling cluster (Ray's fake multi-node provider: nodes are real raylets on this machine)
  that grows when a run asks for more workers than the head has.

Both start and stop Ray with the `ray` CLI, whose `ray stop` ends every Ray process of this user:
no other Ray cluster of the test session runs while this module does (modules run one by one).
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from localnet import free_port, wait_for_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
BIN = str(Path(sys.executable).parent)
RAY_PROCESSES = ("raylet", "gcs_server")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", **extra}


def _ray_processes() -> list[str]:
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if any(name in (process.info["name"] or "") or f"/{name} " in command
               for name in RAY_PROCESSES):
            found.append(f"{process.pid} {command[:120]}")
    return found


@pytest.fixture
def no_ray_running():
    # A cluster an earlier test shut down may take a few seconds to exit.
    deadline = time.monotonic() + 30
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes() == [], "another Ray cluster is running; this test stops all of them"
    yield
    subprocess.run(["ray", "stop", "--force"], env=_env(), capture_output=True, timeout=120)


class Sshd:
    """OpenSSH's server on 127.0.0.1, accepting one key for the current user, with HOME set to a
    folder of the test (so `ray up` writes nothing into the real home)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = free_port()
        self.home = folder / "home"
        self.home.mkdir(parents=True)
        self.key = folder / "id_ed25519"
        for key in (folder / "host_ed25519", self.key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                           check=True)
        shutil.copy(f"{self.key}.pub", folder / "authorized_keys")
        # Login shells reset PATH; the remote side finds this interpreter's `ray` and `python`.
        (self.home / ".bashrc").write_text(f'export PATH="{BIN}:$PATH"\n')
        config = folder / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1",
            f"HostKey {folder / 'host_ed25519'}",
            f"AuthorizedKeysFile {folder / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
            f"PidFile {folder / 'sshd.pid'}", f"SetEnv HOME={self.home}", "",
        ]))
        Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory
        self.process = subprocess.Popen(
            ["/usr/sbin/sshd", "-D", "-f", str(config), "-E", str(folder / "sshd.log")]
        )
        if not wait_for_port(self.port, timeout_s=20):
            raise RuntimeError(f"sshd did not start: {(folder / 'sshd.log').read_text()}")

    @property
    def proxy_command(self) -> str:
        # Ray's YAML has no SSH port setting; a ProxyCommand reaches the port (bash's /dev/tcp).
        return f"bash -c 'exec 3<>/dev/tcp/127.0.0.1/{self.port}; cat <&3 & exec cat >&3'"

    def stop(self) -> None:
        """The server and every session it started (Ray's SSH control masters among them)."""
        try:
            processes = [self.process, *psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            processes = []
        for process in processes:
            try:
                process.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        self.process.wait(timeout=10)


@pytest.fixture
def sshd(tmp_path):
    if not shutil.which("/usr/sbin/sshd") or not shutil.which("rsync"):
        pytest.skip("needs openssh-server and rsync (.ci/run installs them)")
    if os.geteuid() != 0:
        pytest.skip("sshd needs root for its privilege separation directory")
    server = Sshd(tmp_path / "ssh")
    yield server
    server.stop()


def _loopback_config(sshd: Sshd, tmp_path: Path) -> tuple[Path, int]:
    """cluster/local.yaml with the head at 127.0.0.1 through the test's sshd."""
    config = yaml.safe_load((ROOT / "cluster" / "local.yaml").read_text())
    gcs_port, dashboard_port = free_port(), free_port()
    config["cluster_name"] = f"loopback-{os.getpid()}"
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["auth"] = {"ssh_user": getpass.getuser(), "ssh_private_key": str(sshd.key),
                      "ssh_proxy_command": sshd.proxy_command}
    # The YAML's setup installs the project with pip, which would download torch; this
    # interpreter has it already. Check instead that the file mount delivered the project.
    config["setup_commands"] = ["test -f ~/ray-elastic-train/pyproject.toml"]
    config["head_start_ray_commands"] = [
        command.replace("--port=6379", f"--port={gcs_port} --dashboard-port={dashboard_port} "
                        "--num-cpus=2 --include-dashboard=true")
        for command in config["head_start_ray_commands"]
    ]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, dashboard_port


def test_ray_up_submit_and_down_on_loopback(no_ray_running, sshd, tmp_path, mnist_dir):
    config, dashboard_port = _loopback_config(sshd, tmp_path)
    # As the README says: the cluster's token, which the YAML's file mount copies to the node.
    subprocess.run(["ray", "get-auth-token", "--generate"], env=_env(), check=True,
                   capture_output=True, timeout=60)
    up = subprocess.run(["ray", "up", "-y", "--no-config-cache", str(config)], cwd=ROOT,
                        env=_env(), capture_output=True, text=True, timeout=300,
                        stdin=subprocess.DEVNULL)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert (sshd.home / "ray-elastic-train" / "app" / "train.py").is_file(), "file_mounts"
    assert (sshd.home / ".ray" / "auth_token").read_bytes() == \
        (Path.home() / ".ray" / "auth_token").read_bytes(), "the token reaches the node"
    assert not (sshd.home / "ray-elastic-train" / ".venv").exists(), "venvs stay behind"
    try:
        job = subprocess.run(
            ["ray", "job", "submit", "--address", f"http://127.0.0.1:{dashboard_port}", "--",
             "python", "-m", "app.train", "--dataset", "mnist", "--data-dir", str(mnist_dir),
             "--epochs", "1", "--storage-path", str(tmp_path / "runs"), "--name", "loopback"],
            # The head requires the cluster's token (RAY_AUTH_MODE=token in the YAML).
            env=_env(RAY_AUTH_MODE="token"), capture_output=True, text=True, timeout=300,
            stdin=subprocess.DEVNULL,
        )
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in job.stdout + job.stderr
        assert "Best validation accuracy" in job.stdout
        assert (tmp_path / "runs" / "loopback" / "checkpoint_epoch_0001" / "state.pt").is_file()
    finally:
        down = subprocess.run(["ray", "down", "-y", str(config)], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    deadline = time.monotonic() + 30
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes() == [], "ray down left Ray processes behind"


FAKE_HEAD_NODE_ID = "f" * 51 + "00000"


def test_autoscaling_cluster_grows_for_an_elastic_run(no_ray_running, tmp_path):
    """A head with no CPUs and a 1-CPU worker type (at most 2): an elastic run of 1-2 workers
    makes the autoscaler start worker nodes and trains on two of them."""
    gcs_port = free_port()
    import ray._private.services

    node_ip = ray._private.services.get_node_ip_address()
    config = {
        "cluster_name": "fake-autoscaling", "max_workers": 2, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 1,
        "provider": {
            # Ray's fake multi-node provider, named as an external provider (the wheel lacks the
            # defaults file that type "fake_multinode" would load).
            "type": "external",
            "module": "ray.autoscaler._private.fake_multi_node.node_provider."
                      "FakeMultiNodeProvider",
            "gcs_address": f"{node_ip}:{gcs_port}", "launch_multiple": True,
            "head_node_id": FAKE_HEAD_NODE_ID,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "worker.cpu": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0,
                           "max_workers": 2},
        },
        "head_node_type": "ray.head.default", "auth": {}, "docker": {}, "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }
    path = tmp_path / "autoscaling.json"
    path.write_text(json.dumps(config))
    start = subprocess.run(
        ["ray", "start", "--head", "--num-cpus=0", f"--port={gcs_port}",
         "--include-dashboard=false", f"--autoscaling-config={path}"],
        env=_env(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1",
                 RAY_enable_autoscaler_v2="1", RAY_CLOUD_INSTANCE_ID=FAKE_HEAD_NODE_ID,
                 RAY_OVERRIDE_NODE_ID_FOR_TESTING=FAKE_HEAD_NODE_ID),
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert start.returncode == 0, start.stdout[-2000:] + start.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "app.train", "--address", f"{node_ip}:{gcs_port}",
         "--dataset", "digits", "--num-workers", "1-2", "--epochs", "20",
         "--resize-interval", "2", "--storage-path", str(tmp_path / "runs"), "--name", "grow"],
        # `ray start` clusters use token authentication (the token is in ~/.ray/auth_token).
        env=_env(RAY_AUTH_MODE="token"), capture_output=True, text=True, timeout=400,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = (tmp_path / "runs" / "grow" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    world_sizes = [int(row.split(",")[header.index("world_size")]) for row in rows[1:]]
    assert max(world_sizes) == 2, world_sizes
    status = subprocess.run(["ray", "status", "--address", f"{node_ip}:{gcs_port}"],
                            env=_env(RAY_AUTH_MODE="token"), capture_output=True, text=True,
                            timeout=60)
    # The head had no CPU: every worker ran on a node the autoscaler launched.
    assert "2 worker.cpu" in status.stdout, status.stdout


def _start(args: list[str], home: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ray", "start", *args], env=_env(HOME=str(home), **env),
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_a_node_joins_only_with_the_clusters_token(no_ray_running, tmp_path):
    """What the YAMLs set up across machines: a head with RAY_AUTH_MODE=token, and worker nodes
    that join with the head's token (file-mounted to ~/.ray/auth_token) and only with it."""
    head_home, worker_home = tmp_path / "head", tmp_path / "worker"
    head_home.mkdir()
    worker_home.mkdir()
    generated = subprocess.run(["ray", "get-auth-token", "--generate"],
                               env=_env(HOME=str(head_home)), capture_output=True, text=True,
                               timeout=60)
    assert generated.returncode == 0, generated.stderr
    token = head_home / ".ray" / "auth_token"
    assert token.is_file()
    port = free_port()
    head = _start(["--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false"],
                  head_home, RAY_AUTH_MODE="token")
    assert head.returncode == 0, head.stdout[-2000:] + head.stderr[-2000:]
    address = f"127.0.0.1:{port}"
    worker_args = [f"--address={address}", "--num-cpus=1", "--resources={\"joined\": 1}"]

    refused = _start(worker_args, worker_home, RAY_AUTH_MODE="token")
    assert refused.returncode != 0, "a node without the cluster's token must not join"
    assert "token" in (refused.stdout + refused.stderr).lower()

    # The token where the YAMLs' file mount puts it.
    (worker_home / ".ray").mkdir()
    (worker_home / ".ray" / "auth_token").write_bytes(token.read_bytes())
    joined = _start(worker_args, worker_home, RAY_AUTH_MODE="token")
    assert joined.returncode == 0, joined.stdout[-2000:] + joined.stderr[-2000:]

    count = subprocess.run(
        [sys.executable, "-c", "import ray; ray.init(address='%s', log_to_driver=False); "
         "print(sum(n['Resources'].get('joined', 0) for n in ray.nodes() if n['Alive']))"
         % address],
        env=_env(HOME=str(head_home), RAY_AUTH_MODE="token"), capture_output=True, text=True,
        timeout=120,
    )
    assert count.stdout.strip().splitlines()[-1] == "1.0", count.stdout + count.stderr
