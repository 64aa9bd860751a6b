"""Multi-node placement on a simulated cluster, and `ray job submit` to a real head on loopback."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, spawn_workers
from tests.conftest import REPO_ROOT
from tests.controller.workers import EchoWorker

VENV_BIN = Path(sys.executable).parent


def test_pool_spanning_two_nodes_places_ranks_on_both():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
                 log_to_driver=False)
        group = spawn_workers(ResourcePool(PoolSpec("wide", nodes=2, devices_per_node=2)),
                              {"echo": RoleSpec(EchoWorker)})["echo"]
        nodes = group.node_ids()
        assert len(set(nodes)) == 2, f"ranks landed on {nodes}"
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3]  # node-major rank order
        assert {i["node_id"] for i in group.whoami()} == set(nodes)
        assert group.all_reduce_rank() == [10.0] * 4  # 1+2+3+4 across both nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    port, dash = _free_port(), _free_port()
    # Token authentication (on by default for local clusters since Ray 2.59): the head and the
    # submitting client share one generated token.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # `--block` keeps the head's processes under this one process group, so teardown stops this
    # head only; `ray stop` would kill every Ray instance on the machine, a user's runs included.
    start = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=4", "--include-dashboard=true",
             "--disable-usage-stats"]
    # Ports the agents would otherwise take at fixed defaults, which another Ray on this machine holds.
    # Its own temp dir: the head records itself in <temp-dir>/ray_current_cluster, which a plain
    # ray.init() elsewhere on the machine would otherwise try to join after this test.
    temp_dir = tempfile.mkdtemp(prefix="hf-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    start.append(f"--temp-dir={temp_dir}")
    start += [f"--{flag}={_free_port()}" for flag in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                       "runtime-env-agent-port", "metrics-export-port",
                                                       "ray-client-server-port")]
    head = subprocess.Popen(start, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        _wait_for_port(dash, head, timeout_s=180)
        yield f"http://127.0.0.1:{dash}", env
    finally:
        _stop_group(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_port(port: int, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start --head exited with status {process.returncode} before its dashboard "
                               f"listened on port {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(1)
    raise TimeoutError(f"the Ray head's dashboard did not listen on port {port} within {timeout_s} s")


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the head, then SIGKILL to what is left of its group (raylet, GCS, workers)."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass


def _submit(address: str, env: dict, entry: list[str]) -> subprocess.CompletedProcess:
    """`ray job submit`, retried while the head's job agent is still starting: `ray start`
    returns before the agent registers, and a submission then gets "No available agent"."""
    deadline = time.monotonic() + 120
    while True:
        result = subprocess.run([str(VENV_BIN / "ray"), "job", "submit", f"--address={address}", "--", *entry],
                                env=env, capture_output=True, text=True, timeout=600)
        if "No available agent" not in result.stderr or time.monotonic() > deadline:
            return result
        time.sleep(3)


def test_ray_job_submit_runs_the_entry_point(ray_head, tmp_path):
    address, env = ray_head
    entry = (f"{VENV_BIN / 'hybridflow'} recipe=demo recipe.demo_prompts=2 logger.output_root={tmp_path} "
             "logger.run_name=submitted placement.pools.global.devices_per_node=1")
    result = _submit(address, env, entry.split())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "joined" in result.stdout and "succeeded" in result.stdout
    assert (tmp_path / "submitted" / "metrics.jsonl").is_file()


def test_local_start_ignores_a_stale_cluster_record():
    """A head killed without `ray stop` leaves its address in <ray temp dir>/ray_current_cluster;
    the embedded default must still start its own Ray, not try to join that dead cluster."""
    temp_dir = tempfile.mkdtemp(prefix="hf-ray-", dir="/tmp")
    try:
        (Path(temp_dir) / "ray").mkdir()
        (Path(temp_dir) / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # nothing listens there
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=temp_dir, PYTHONPATH=str(REPO_ROOT))
        code = ("import ray; from hybridflow.controller.runtime import connect; "
                "print('mode:', connect(address=None, num_cpus=1, dashboard=False, dashboard_host='127.0.0.1', "
                "namespace='stale-record')); ray.shutdown()")
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "mode: local" in result.stdout
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
