"""Run the `hybridflow` command's code (hybridflow.cli.run_command: `main` less its end of the process)
in this process: `run` for one command, as a `subprocess.CompletedProcess` with its exit status and
what it printed; or, as a module, once per argument list, printing each run's exit status, output,
seconds and whether Ray was started, as JSON.

    python -m tests.e2e.cli_in_one_process '{"case": ["recipe=grpo", ...], ...}'

A fresh interpreter's start is 3.5-5 core-seconds of every command (Python, Hydra, torch and
transformers imported again; measured: a tiny one-rank GRPO run joining a running Ray head took
4.9-5.2 core-seconds in its own `hybridflow` process, two of them 6.6 in one process), so the
whole-stack tests whose claims are about the run, not about the command's process, run it here:
the same code path from Hydra's composition to the exit status. Tests of the process itself (a
driver killed or interrupted, the console's bytes on the terminal, Python-level stdout against
what libraries write to the file descriptors) start `hybridflow` as a user does.

`without_ray` runs a whole run in one process the other way: `hybridflow placement=local` (the
driver and every role in one process, hybridflow/controller/local.py) as a command of its own with
Ray's import blocked, as on a machine without Ray. The whole-stack tests whose claim is not about
Ray (a recipe learns, its metrics, checkpoints on one rank, data, rewards, evaluation, a pipeline's
stages) run so: no Ray worker process to start, import vLLM in and connect (the GRPO learning run,
45.4 -> 34.6 s on a 2-core EPYC, docs/results/ci_times.md). It is a process of its own because the
run's engine, models and process group of one live as long as their process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def run(argv: list[str], env: dict[str, str] | None = None, keep_ray: bool = False) -> subprocess.CompletedProcess:
    """`hybridflow *argv` in this process, with `env` added to the environment for its duration.
    Its Ray connection is closed afterwards (the run's worker processes end with it), whatever the
    outcome, unless `keep_ray` (the refusal tests ask whether a command started Ray at all); stdout
    and stderr are what the run printed through Python's sys.stdout and sys.stderr."""
    from hybridflow import cli

    saved_argv, saved_env = sys.argv, dict(os.environ)
    os.environ.update(env or {})
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv = ["hybridflow", *argv]
    code = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = cli.run_command()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        ray = sys.modules.get("ray")
        if not keep_ray and ray is not None and ray.is_initialized():
            ray.shutdown()
    return subprocess.CompletedProcess(["hybridflow", *argv], code, stdout.getvalue(), stderr.getvalue())


# The `hybridflow` command's entry point, in an interpreter where `import ray` fails
WITHOUT_RAY = Path(__file__).with_name("without_ray_main.py")


def without_ray(args: list[str], output_root: Path, run_name: str, timeout_s: int = 600) -> subprocess.CompletedProcess:
    """`hybridflow placement=local *args` into `output_root/run_name`, a command of its own with Ray's
    import blocked: in the tests' warm interpreter where one runs (tests/warm_workers.py), else a fresh
    one. RAY_ADDRESS is left out of its environment: a module whose other runs join the tests' Ray head
    sets it (tests/ray_head.py), and a one-process run refuses it."""
    from hybridflow.controller.runtime import WORKER_PYTHON_ENV

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    python = os.environ.get(WORKER_PYTHON_ENV) or sys.executable
    return subprocess.run([python, str(WITHOUT_RAY), "placement=local", *args,
                           f"logger.output_root={output_root}", f"logger.run_name={run_name}"],
                          capture_output=True, text=True, timeout=timeout_s, env=env)


def main() -> None:
    results = {}
    for name, argv in json.loads(sys.argv[1]).items():
        start = time.perf_counter()
        done = run(argv, keep_ray=True)
        ray = sys.modules.get("ray")
        results[name] = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
                         "seconds": time.perf_counter() - start,
                         "ray_started": bool(ray is not None and ray.is_initialized())}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
