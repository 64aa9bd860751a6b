"""Multi-node placement on a simulated cluster, and `ray job submit` to a real head on loopback."""

from __future__ import annotations

import json
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
from tests.e2e import cli_in_one_process

VENV_BIN = Path(sys.executable).parent


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_pool_spanning_two_nodes_places_ranks_on_both(two_workers):
    """On the module's simulated cluster (a start of its own was CI's time, tests/budget.py)."""
    import ray

    cluster, _ = two_workers
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
        group.shutdown()  # the nodes' slots free for the module's next runs
    finally:
        ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    port, dash = _free_port(), _free_port()
    # Token authentication (on by default for local clusters since Ray 2.59): the head and the
    # submitting client share one generated token.
    # A killed worker's SIGKILL by process id after 250 ms, not 5 s (docs/controller.md: a cluster of your own).
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_kill_worker_timeout_milliseconds": "250"}
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
        _wait_for_http(f"http://127.0.0.1:{dash}/api/version", env["RAY_AUTH_TOKEN"], head, timeout_s=180)
        yield f"http://127.0.0.1:{dash}", env
    finally:
        _stop_group(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


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


def _wait_for_http(url: str, token: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Until `url` answers 200: the dashboard's port opens before its HTTP server serves, and a job
    submitted in between had its connection closed without a response (seen once in CI)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start --head exited with status {process.returncode} before {url} answered")
        try:
            request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise TimeoutError(f"the Ray head's dashboard did not answer {url} within {timeout_s} s")


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
    # the demo's own checks (it was a whole-stack run of its own before: CI's time, tests/budget.py)
    run_dir = tmp_path / "submitted"
    assert result.stdout.count(f"run directory {run_dir}") == 2  # printed at start and end
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["step"] == 0 and metrics[0]["demo/samples"] == 2
    assert metrics[0]["demo/rollout_ranks"] == 1 and metrics[0]["demo/response_tokens"] > 0
    assert (run_dir / "base_model" / "config.json").is_file() and (run_dir / "data" / "val.parquet").is_file()


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


# ---- placement plans, shared storage and node loss on a simulated cluster (docs/cluster.md) ----

GRPO = ["recipe=grpo", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_response_tokens=4",
        "trainer.val_prompts=8", "data.synthetic.train_rows=200", "data.synthetic.val_rows=16",
        "actor.samples_per_micro_batch=8", "trainer.val_every_steps=0", "trainer.export_hf=false"]
REWARD_FILE = '''
def score(response, ground_truth):
    return float(response.strip() == ground_truth)
'''


def _cluster(worker_nodes: int, cpus: int = 2):
    """A head that hosts no pool (0 CPU slots: the driver's node, as on a real cluster) and worker
    nodes of `cpus` slots each; its own GCS port, no dashboard, so other Rays here are untouched."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "gcs_server_port": _free_port(),
                                                            "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=cpus) for _ in range(worker_nodes)]
    cluster.wait_for_nodes()
    return cluster, workers


@pytest.fixture(scope="module")
def two_workers():
    cluster, workers = _cluster(2)
    try:
        yield cluster, workers
    finally:
        cluster.shutdown()


def _hybridflow(args: list[str], address: str, output_root: Path, run_name: str) -> subprocess.CompletedProcess:
    """A run on the simulated cluster, the command's code in this process (tests/e2e/cli_in_one_process.py);
    the run that loses its nodes is a command of its own (its nodes go while it runs)."""
    return cli_in_one_process.run([*GRPO, *args, f"ray.address={address}", f"logger.output_root={output_root}",
                                   f"logger.run_name={run_name}"], env={"PYTHONPATH": str(REPO_ROOT)})


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _plan(run_dir: Path) -> dict:
    """Where the stage's pools landed: the "nodes" section of its plan file."""
    return json.loads((run_dir / "plan.json").read_text())["nodes"]


def _pool_nodes(plan: dict, pool: str) -> list[str]:
    return [n["node_id"] for n in plan["pools"][pool]["nodes"]]


def test_a_plan_that_cannot_fit_is_refused_before_any_worker_starts(two_workers, tmp_path):
    cluster, _ = two_workers
    result = _hybridflow(["placement.pools.global.nodes=2", "placement.pools.global.cpus_per_device=2",
                          "trainer.total_steps=1"], cluster.address, tmp_path, "refused")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "placement plan refused: pool 'global' needs 2 node(s) with {CPU: 4} free each" in result.stderr
    assert result.stderr.count("free {CPU: 2} of {CPU: 2}") == 2  # each worker node named with what it has
    assert "free {} of {}" in result.stderr  # the head: no slots
    logs = tmp_path / "refused" / "logs"
    assert not list(logs.rglob("*rank*.log")), "a worker started"
    assert "placement group" not in result.stderr  # the old failure waited 60 s on one; how long the refusal
    # takes is bench/refusal_seconds.py's to measure


def test_shared_storage_check_names_the_node_and_the_path(two_workers, tmp_path):
    import ray

    from hybridflow.controller.storage import StorageError, check_storage

    cluster, workers = two_workers
    ray.init(address=cluster.address, log_to_driver=False, namespace="storage-check")
    try:
        nodes = {w.node_id: f"worker-{i}" for i, w in enumerate(workers)}
        check_storage(nodes, {"model.path": str(tmp_path)}, {}, str(tmp_path))  # all good: no error
        with pytest.raises(StorageError) as caught:
            check_storage(nodes, {"model.path": str(tmp_path / "missing")}, {"reward.fn": str(tmp_path / "r.py")},
                          str(tmp_path / "no_run_dir"))
        text = str(caught.value)
        for name in nodes.values():
            assert f"node {name}: model.path={tmp_path / 'missing'}: no such file or directory" in text
            assert f"node {name}: reward.fn={tmp_path / 'r.py'}: not on this node's disk" in text
            assert f"node {name}: run directory {tmp_path / 'no_run_dir'}: no such directory" in text
    finally:
        ray.shutdown()


def test_code_files_travel_with_the_job_to_every_node(two_workers, tmp_path):
    """A reward file the worker nodes cannot see on disk still loads there: the job shipped it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from hybridflow.controller.runtime import connect

    cluster, workers = two_workers
    reward_file = tmp_path / "shipped_reward.py"
    reward_file.write_text(REWARD_FILE)
    reference = f"{reward_file}:score"
    assert connect(address=cluster.address, num_cpus=None, dashboard=False, dashboard_host="127.0.0.1",
                   namespace="ship", log_to_driver=False, code_files=[str(reward_file)]).startswith("joined")
    try:
        reward_file.unlink()  # gone from the (shared) disk: only the shipped copy is left

        @ray.remote(num_cpus=0)
        def score_there(ref: str) -> float:
            from hybridflow.registry import load_object

            return load_object(ref)(response=" 4", ground_truth="4")

        strategy = NodeAffinitySchedulingStrategy(workers[1].node_id, soft=False)
        assert ray.get(score_there.options(scheduling_strategy=strategy).remote(reference)) == 1.0
    finally:
        ray.shutdown()


@pytest.mark.slow  # ~90 s: two GRPO runs on a 2-node cluster
@pytest.mark.parametrize("layout", ["fsdp_across_nodes", "tp2_rollout_on_its_own_node"])
def test_grpo_layouts_across_nodes(two_workers, tmp_path, layout):
    """One FSDP group across the two nodes; and two pools that each fill a node (the case that once
    picked the same node for both), the rollout's a TP-2 engine, with a reward file the job ships."""
    cluster, workers = two_workers
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(REWARD_FILE)
    args = {"fsdp_across_nodes": ["placement.pools.global.nodes=2", "placement.pools.global.devices_per_node=1",
                                  "placement.pools.global.cpus_per_device=2"],
            # 2 -> 2: the actor's FSDP group fills one node, the rollout engine at TP 2 the other
            "tp2_rollout_on_its_own_node": ["placement.pools.global.devices_per_node=2",
                                            "+placement.pools.gen={nodes:1,devices_per_node:2}",
                                            "placement.roles.rollout=gen", "rollout.tensor_parallel_size=2",
                                            f"reward.fn={reward_file}:score", "weight_sync.checksum_every_steps=1"]}[layout]
    result = _hybridflow([*args, "trainer.total_steps=2"], cluster.address, tmp_path, layout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    plan = _plan(tmp_path / layout)
    used = {n for pool in plan["pools"] for n in _pool_nodes(plan, pool)}
    assert used == {w.node_id for w in workers}
    rows = _rows(tmp_path / layout)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["weight_sync/bytes_received_per_rank"] > 0
    if layout == "tp2_rollout_on_its_own_node":
        assert _pool_nodes(plan, "global") != _pool_nodes(plan, "gen")
        assert [n["ranks"] for n in plan["pools"]["gen"]["nodes"]] == [[0, 1]]
        assert plan["pools"]["gen"]["roles"] == ["rollout"] and "actor" in plan["pools"]["global"]["roles"]
        out = result.stdout
        first = [i for i, line in enumerate(out.splitlines())
                 if line.startswith("hybridflow: placement plan (2 of 3 node(s)")]
        assert first and first[0] < 5, out[:3000]  # among the console's first lines
        assert "shared storage checked on 2 node(s)" in out and "1 code file(s)" in out
        assert rows[0]["weight_sync/verified_tensors"] > 0  # the engine on the other node holds the actor's weights


RESUMABLE = ["trainer.total_steps=3", "trainer.save_every_steps=1", "placement.pools.global.devices_per_node=1",
             "placement.pools.global.cpus_per_device=2"]
COMPARED = ["reward/score", "actor/loss", "actor/grad_norm", "actor/entropy", "response/length_mean"]


@pytest.mark.slow  # ~4 min: an uninterrupted GRPO run, then one that loses its node twice
def test_a_node_lost_mid_run_is_named_and_the_run_finishes(tmp_path):
    """One run, both recoveries: its node is removed once the step-1 checkpoint is complete, and the
    run names it and resumes at once on the spare node; that node is removed once the step-2
    checkpoint is complete, and the run names it, waits for a node to join (8 s later) and resumes
    there. Steps 2 and 3 match the uninterrupted run. (One run for the two cases: each start of the
    stack is a minute of CI's time on a 2-core CPU, tests/budget.py.)"""
    cluster, workers = _cluster(2)
    try:
        straight = _hybridflow(RESUMABLE, cluster.address, tmp_path, "straight")
        assert straight.returncode == 0, straight.stdout[-4000:] + straight.stderr[-4000:]
        expected = {r["step"]: r for r in _rows(tmp_path / "straight")}

        run_dir = tmp_path / "lost"
        out = tmp_path / "lost.out"
        removed, removed_at = [], []
        with out.open("w") as sink:  # Popen: the nodes are removed and added from this (main) thread, as Ray needs
            cmd = [str(VENV_BIN / "hybridflow"), *GRPO, *RESUMABLE, "trainer.max_restarts=2", "placement.node_wait_s=120",
                   f"ray.address={cluster.address}", f"logger.output_root={tmp_path}", "logger.run_name=lost"]
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                   "PYTHONPATH": str(REPO_ROOT)})
            for step in (1, 2):
                marker = run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE"
                deadline = time.monotonic() + 400
                while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert marker.exists(), out.read_text()[-4000:]
                node = next(w for w in workers if w.node_id in _pool_nodes(_plan(run_dir), "global"))
                removed_at.append(time.time())
                cluster.remove_node(node)
                removed.append(node)
                workers = [w for w in workers if w is not node]
            time.sleep(8)  # no node left: the run waits (placement.node_wait_s), then resumes on the one that joins
            joined = cluster.add_node(num_cpus=2)
            returncode = proc.wait(timeout=400)
        stdout = out.read_text()
        assert returncode == 0, stdout[-4000:]
        restarts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
        assert [r["error"] for r in restarts] == ["NodeLostError", "NodeLostError"], restarts
        for restart, node, at in zip(restarts, removed, removed_at):
            print(f"node loss named {restart['time'] - at:.1f} s after the node was removed")
            assert restart["time"] - at < 30
            assert f"({node.node_id[:8]}) left the cluster; it hosted pool 'global' (" in restart["message"]
            assert "rank(s) 0" in restart["message"]
        assert stdout.count("waiting up to 120 s (placement.node_wait_s)") == 1  # the second loss only
        assert _pool_nodes(_plan(run_dir), "global") == [joined.node_id]  # re-planned
        rows = {r["step"]: r for r in _rows(run_dir)}
        assert sorted(rows) == [1, 2, 3] and rows[3]["trainer/restarts"] == 2
        for step in (2, 3):
            for key in COMPARED:
                assert rows[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-6), (step, key)
    finally:
        cluster.shutdown()


# ---- placement=auto on the simulated cluster (docs/placement.md) ----


def test_placement_auto_refuses_a_run_no_plan_fits_before_any_worker_starts(two_workers, tmp_path):
    cluster, _ = two_workers
    result = _hybridflow(["placement=auto", "rollout.kv_cache_space_gib=4096", "trainer.total_steps=1"],
                         cluster.address, tmp_path, "auto-refused")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "placement=auto on 2 node(s) x 2 cpu device(s)" in result.stderr  # the head (0 slots) is not a node
    assert "no plan fits" in result.stderr and "4096.00 GiB  vLLM KV cache" in result.stderr
    assert not list((tmp_path / "auto-refused" / "logs").rglob("*rank*.log")), "a worker started"


@pytest.mark.slow  # ~60 s: one GRPO run on the pools the planner chose
def test_placement_auto_runs_the_planned_pools_on_the_simulated_cluster(two_workers, tmp_path):
    cluster, _ = two_workers
    result = _hybridflow(["placement=auto", "trainer.total_steps=2"], cluster.address, tmp_path, "auto")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = tmp_path / "auto"
    saved = json.loads((run_dir / "plan.json").read_text())
    assert (saved["cluster"]["nodes"], saved["cluster"]["devices_per_node"]) == (2, 2)
    planned = {name: (p["nodes"], p["devices_per_node"]) for name, p in saved["plan"]["pools"].items()}
    reserved = _plan(run_dir)  # what Ray reserved, node by node: the plan handed over, not the config's pools
    assert {name: (len(_pool_nodes(reserved, name)), p["devices_per_node"]) for name, p in reserved["pools"].items()} \
        == planned
    rows = _rows(run_dir)
    assert [r["plan/predicted_step_s"] for r in rows] == [saved["prediction"]["step_s"]] * 2
    assert all(r["timing/step_s"] > 0 and "plan/predicted_generate_s" in r for r in rows)
    assert "placement=auto chose" in result.stdout + result.stderr
