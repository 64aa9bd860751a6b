"""Shared fixtures: one Ray instance per test module, the tiny model built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for one test module (Ray workers can import the tests package)."""
    import ray

    ray.init(
        address="local",  # a new instance, never a cluster another process started
        num_cpus=8,
        include_dashboard=False,
        namespace="hybridflow-tests",
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The default tiny Qwen2 model + character tokenizer, built once per test session."""
    from hybridflow.builders import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
