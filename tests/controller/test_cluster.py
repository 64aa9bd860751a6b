"""Multi-node placement on a simulated cluster, and `ray job submit` to a real head on loopback."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
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
    start = [str(VENV_BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=4", "--include-dashboard=true",
             "--disable-usage-stats"]
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=180)
    try:
        yield f"http://127.0.0.1:{dash}", env
    finally:
        subprocess.run([str(VENV_BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_job_submit_runs_the_entry_point(ray_head, tmp_path):
    address, env = ray_head
    entry = (f"{VENV_BIN / 'hybridflow'} recipe=demo recipe.demo_prompts=2 logger.output_root={tmp_path} "
             "logger.run_name=submitted placement.pools.global.devices_per_node=1")
    result = subprocess.run(
        [str(VENV_BIN / "ray"), "job", "submit", f"--address={address}", "--", *entry.split()],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "joined" in result.stdout and "succeeded" in result.stdout
    assert (tmp_path / "submitted" / "metrics.jsonl").is_file()
