"""The one-process backend (placement=local: the driver and every role in one process on one device,
hybridflow/controller/local.py) with Ray's import blocked (`sys.modules["ray"] = None`), as on a
machine without Ray: here, that the command, every recipe and every worker import so. The runs
themselves are the e2e tests whose claim is not about Ray, each a `hybridflow placement=local`
command of its own (tests/e2e/cli_in_one_process.py `without_ray`): GRPO learns and PPO's hooks
(tests/e2e/test_rl_recipes.py), the default pipeline's stages (tests/e2e/test_pipeline.py), DPO,
pretraining and the real model's evaluation."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_every_recipe_and_every_worker_import_without_ray():
    modules = ["hybridflow.cli", "hybridflow.run.launch", "hybridflow.run.lifecycle", "hybridflow.run.runner", "hybridflow.run.faults",
               "hybridflow.controller.worker_group", "hybridflow.controller.hosts", "hybridflow.controller.ray_host",
               "hybridflow.controller.pools", "hybridflow.controller.runtime",
               "hybridflow.resharding.sync", "recipes.ppo", "recipes.sft", "recipes.dpo", "recipes.pipeline",
               "recipes.pretrain", "recipes.evaluate", "recipes.demo", "recipes.roles", "workers.actor",
               "workers.critic", "workers.reference", "workers.reward", "workers.rollout.hf_rollout",
               "workers.rollout.exact_rollout", "workers.rollout.vllm_rollout"]
    code = "import sys, importlib; sys.modules['ray'] = None\n" + "".join(
        f"importlib.import_module({m!r})\n" for m in modules) + "print('imported', len(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-4000:]
