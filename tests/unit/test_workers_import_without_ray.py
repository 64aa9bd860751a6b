"""Workers are plain classes: importing any worker file imports neither Ray nor vLLM, so a
worker can be built and tested in a process without them (STYLE 8; the GPU checks rely on it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

WORKER_MODULES = ["workers.actor", "workers.critic", "workers.reference", "workers.reward",
                  "workers.rollout.vllm_rollout", "workers.rollout.hf_rollout",
                  "recipes.roles"]  # the role specs built from config: how a test or a GPU check builds a worker


# One process imports the modules in turn and names the first that brought Ray or vLLM in: what each
# import adds is checked against what the ones before it left, so a module that pulls either in is
# named as surely as in a process of its own (one process: ~2 s of imports, not ~2 s a module).
IMPORT_EACH = """
import importlib, json, sys
pulled = {}
for module in sys.argv[1:]:
    importlib.import_module(module)
    pulled[module] = sorted(m for m in ('ray', 'vllm') if m in sys.modules)
print(json.dumps(pulled))
"""


def test_importing_a_worker_pulls_in_no_ray_or_vllm():
    out = subprocess.run([sys.executable, "-c", IMPORT_EACH, *WORKER_MODULES], capture_output=True, text=True,
                         check=True).stdout
    pulled = json.loads(out)
    assert list(pulled) == WORKER_MODULES, out  # every module was imported
    first = next((module for module, found in pulled.items() if found), None)
    assert first is None, f"importing {first} imported {pulled[first]}"


def test_a_module_that_pulls_in_ray_is_named():
    out = subprocess.run([sys.executable, "-c", IMPORT_EACH, "workers.actor", "ray", "workers.critic"],
                         capture_output=True, text=True, check=True).stdout
    pulled = json.loads(out)
    assert pulled["workers.actor"] == [] and pulled["ray"] == ["ray"] and next(m for m, f in pulled.items() if f) == "ray"


def test_the_ray_side_of_the_controller_is_still_reachable_from_the_package():
    import hybridflow.controller as controller
    from hybridflow.controller.hosts import Host
    from hybridflow.controller.ray_host import RoleSpec, spawn_workers
    from hybridflow.controller.worker_group import WorkerGroup, wait_all

    assert controller.RoleSpec is RoleSpec and controller.spawn_workers is spawn_workers
    assert (controller.WorkerGroup, controller.wait_all, controller.Host) == (WorkerGroup, wait_all, Host)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        controller.Nope  # noqa: B018
