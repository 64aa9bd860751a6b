"""Warm worker processes for the test session: each Ray worker a run starts, and each one-process run
(`tests/e2e/cli_in_one_process.without_ray`), is forked from a server that imported torch,
transformers, vLLM and HybridFlow's workers and recipes once (hybridflow.agents.hubs.warm_interpreter).

A cold worker process imports those first: 15-18 s of a 2-core AMD EPYC per Ray worker with a vLLM
rank (`import vllm.entrypoints.llm` alone ~11 s after torch and transformers), against 1.3-1.7 s
forked from the warm server (measured: an actor importing them, three starts each way). The suite
starts a few hundred such processes. The worker runs the same code either way: Ray's
`default_worker.py` (or the `hybridflow` command's entry point) as `__main__`, with its own argv,
environment, directory and standard streams; only the imports were done before the fork.

The server imports nothing of Ray (its import is blocked while it imports: vLLM imports Ray where it
can, and Ray reads its authentication and system settings from the environment once per process), so
each worker imports Ray itself with its own environment. Ray starts the worker through
`HYBRIDFLOW_WORKER_PYTHON` (hybridflow.controller.runtime: Ray's runtime_env `py_executable`). A
launcher that cannot reach the server runs its program in a cold interpreter: slower, never different.
"""

from __future__ import annotations

import os

from hybridflow.agents.hubs.warm_interpreter import WarmInterpreter
from hybridflow.controller.runtime import WORKER_PYTHON_ENV

# What a run's processes import before their first step (a Ray worker hosting the actor, rollout,
# reward, reference, critic or teacher; a one-process run's driver), in import order
MODULES = ["torch", "torch.distributed.fsdp", "transformers", "peft", "safetensors.torch", "vllm",
           "vllm.entrypoints.llm", "hydra", "omegaconf", "hybridflow.config", "hybridflow.cli",
           "hybridflow.controller.ray_host", "hybridflow.controller.local", "workers.actor", "workers.critic",
           "workers.reference", "workers.reward", "workers.teacher", "workers.rollout.vllm_rollout",
           "workers.rollout", "recipes.ppo", "recipes.sft", "recipes.pipeline", "recipes.distillation",
           "recipes.dpo", "recipes.evaluate"]

# How long a worker waits for the server's imports (17 s alone on a 2-core EPYC; the suite's first tests
# start beside them, and a worker started cold meanwhile would compete with them for the cores)
STARTING_WAIT_S = 300.0

WARMUP = f"""import sys
sys.modules["ray"] = None  # blocked while importing: each worker imports Ray with its own environment
for name in {MODULES!r}:
    try:
        __import__(name)
    except Exception as error:  # the worker imports it itself, and fails there if it must
        print(f"warm workers: import {{name}} failed ({{error}})", flush=True)
del sys.modules["ray"]
for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
    del sys.modules[name]
"""


def start() -> WarmInterpreter:
    """Start the server (its imports run in the background: a launcher waits for them) and point Ray's
    workers at its launcher for every run this process starts or runs."""
    warm = WarmInterpreter([], warmup=WARMUP, starting_wait_s=STARTING_WAIT_S)
    warm.start()
    os.environ[WORKER_PYTHON_ENV] = str(warm.launcher_path)
    return warm


def stop(warm: WarmInterpreter) -> None:
    os.environ.pop(WORKER_PYTHON_ENV, None)
    warm.close()
