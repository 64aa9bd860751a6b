"""Workers are plain classes: importing any worker file imports neither Ray nor vLLM, so a
worker can be built and tested in a process without them (STYLE 8; the GPU checks rely on it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

WORKER_MODULES = ["workers.actor", "workers.critic", "workers.reference", "workers.reward",
                  "workers.rollout.vllm_rollout", "workers.rollout.hf_rollout"]


@pytest.mark.parametrize("module", WORKER_MODULES)
def test_importing_a_worker_pulls_in_no_ray_or_vllm(module):
    code = f"import sys, {module}; print(sorted(m for m in ('ray', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {module} imported {out.strip()}"


def test_the_ray_side_of_the_controller_is_still_reachable_from_the_package():
    import hybridflow.controller as controller
    from hybridflow.controller.worker_group import RoleSpec

    assert controller.RoleSpec is RoleSpec
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        controller.Nope  # noqa: B018
