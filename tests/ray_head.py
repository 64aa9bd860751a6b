"""One Ray head per test process, joined by the whole-stack runs of the modules that ask for it.

A `hybridflow` run started without `ray.address` starts a Ray instance of its own and stops it at
the end: 6-8 s and ~10 core-seconds on a 2-core CPU, every run (measured: the same tiny GRPO run took
44-48 s and 70-73 core-s with its own Ray, 37-38 s and 60-62 core-s joining a running head). A run
joins the head named by RAY_ADDRESS as it would under `ray job submit` (hybridflow.controller.runtime),
so a module that asks for the `shared_ray_head` fixture (tests/conftest.py) has its runs join one
head instead, and a module that drives worker groups from the test process (the `ray_local` fixture)
connects to that head as its driver. Modules whose claim is the local start itself (tests/controller/test_cluster.py's stale
cluster record, the refusals before Ray starts in tests/e2e/test_preflight.py) do not ask for it; a
single test can leave it with `monkeypatch.delenv("RAY_ADDRESS")`.

The head is a child process blocked on its stdin: when the test process ends, however it ends, the
pipe closes and the head stops its Ray.

    python -m tests.ray_head   # prints the head's address, then serves until stdin closes
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Logical CPU slots: more than any test's pools ask for (a run's own start asks for its slots + 1);
# the processes still share the machine's cores, as those of a local start do.
HEAD_CPUS = 32


def start_head() -> tuple[subprocess.Popen, str]:
    """The head process and its address. It takes Ray's token from the environment (tests/conftest.py
    sets one for the whole test session), as the runs that join it do."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.ray_head"], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    address = proc.stdout.readline().strip()  # once Ray is up (EOF: it failed to start)
    if not address:
        proc.kill()
        raise RuntimeError(f"the tests' Ray head did not start (exit {proc.wait()}): run "
                           f"`python -m tests.ray_head` in {REPO_ROOT} to see why")
    return proc, address


def stop_head(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    import ray

    from hybridflow.controller.runtime import RAY_SYSTEM_CONFIG

    ray.init(address="local", num_cpus=HEAD_CPUS, include_dashboard=False, log_to_driver=False,
             configure_logging=False, namespace="hybridflow-tests-head", _system_config=RAY_SYSTEM_CONFIG)
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the test process closes the pipe (or exits)
    ray.shutdown()


if __name__ == "__main__":
    main()
