"""The verifiers adapter's load-time checks (hybridflow/agents/hubs/verifiers_env.py), without an engine:
its rows, and what it refuses, each naming the key and why."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

from hybridflow.agents.environment import AgentError  # noqa: E402
from hybridflow.agents.hubs.verifiers_env import TASK_COLUMN, VerifiersEnvironment  # noqa: E402

SUMS = str(Path(__file__).resolve().parents[1] / "e2e" / "fixtures" / "verifiers_arith.py")
NULL = {"agent": {"harness": {"id": "null"}}}


def test_its_tasks_are_rows_that_rebuild_the_same_task():
    env = VerifiersEnvironment(SUMS, NULL)
    rows = env.rows()
    assert len(rows) == 36 and rows[0]["prompt"] == [{"role": "user", "content": "1+1="}]
    task = env.task(rows[5], 5)
    assert (task.data.prompt, task.data.answer, task.data.idx) == ("1+6=", "7", 5)
    with pytest.raises(AgentError, match=f"no {TASK_COLUMN!r} column"):
        env.task({"prompt": "1+1="}, 0)


@pytest.mark.parametrize("arguments, named", [
    ({"agent": {"harness": {"id": "null"}, "runtime": {"type": "docker"}}},
     "rollout.environment_args.agent.runtime.type='docker' is refused"),
    ({"agent": {"harness": {"id": "codex"}}}, "runs harness 'codex', which must run in a container"),
    ({"id": "user-sim"}, "the env has 2 agent seats ['assistant', 'user']"),
    ({"taskset": {"id": "other"}}, "names another taskset than rollout.environment"),
    ({"agent": {"no_such_key": 1}}, "does not load"),
])
def test_what_cannot_run_here_is_refused_with_the_reason(arguments, named):
    with pytest.raises(AgentError, match=None) as error:
        VerifiersEnvironment(SUMS, arguments)
    assert named in str(error.value)
