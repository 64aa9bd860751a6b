"""The OpenEnv adapter's parts (hybridflow/agents/hubs): the text <-> action/observation mapping, the
failures' kinds, the config's form, and the server's lifecycle (start on loopback, the health deadline,
stop). The whole run on an OpenEnv environment: tests/e2e/test_openenv.py."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from hybridflow.agents import AgentError, Trajectory, agent_metrics, run_trajectories
from hybridflow.agents.environment import failure_kind, is_call_error
from hybridflow.agents.hubs.openenv_env import (ActionRejected, OpenEnvFailure, TextMapping, as_failure,
                                                json_columns, text_mapping)
from hybridflow.agents.hubs.openenv_server import OpenEnvServer, check_served_target, environment_types, serve
from hybridflow.agents.trajectory import trajectories_to_batch
from hybridflow.batch import Batch
from hybridflow.builders import build_char_tokenizer
from hybridflow.config.schema import OpenEnvConfig, RolloutConfig

FIXTURE = Path(__file__).resolve().parents[1] / "e2e" / "fixtures" / "openenv_counting.py"


def schemas(action: dict, observation: dict, required: tuple[str, ...] = ()) -> dict:
    """OpenEnv's /schema answer for pydantic models of these field types."""
    def model(fields, req):
        return {"properties": {name: {"type": t} for name, t in fields.items()}, "required": list(req)}

    return {"action": model({"metadata": "object", **action}, required),
            "observation": model({"done": "boolean", "reward": "number", "metadata": "object", **observation}, ())}


def test_the_default_mapping_fills_the_one_string_field_and_reads_the_one_string_field():
    mapping = text_mapping(schemas({"guess": "string"}, {"feedback": "string", "tries": "integer"}, ("guess",)),
                           None, None, "Guess")
    assert mapping.action("42") == {"guess": "42"}
    assert mapping.observation({"feedback": "higher", "tries": 1}) == "higher"
    assert mapping.observation({"feedback": "", "tries": 1}) is None  # an empty text adds no tokens
    several = text_mapping(schemas({"message": "string", "tone": "string"}, {"text": "string"}), None, None, "Chat")
    assert several.action("hi") == {"message": "hi"}  # several string fields: `message`, when it is one of them


def test_an_action_or_observation_the_text_cannot_fill_is_refused_naming_the_fields_and_the_key():
    with pytest.raises(AgentError, match=r"Move: its action has the string fields \[\] and requires \['x', 'y'\].*"
                                         r"rollout\.openenv\.action=path/to/file\.py:fn"):
        text_mapping(schemas({"x": "integer", "y": "integer"}, {"text": "string"}, ("x", "y")), None, None, "Move")
    with pytest.raises(AgentError, match=r"requires \['code', 'lang'\]"):  # a second required field stays empty
        text_mapping(schemas({"code": "string", "lang": "string"}, {"text": "string"}, ("code", "lang")),
                     None, None, "Code")
    with pytest.raises(AgentError, match=r"Grid: its observation has the string fields \['a', 'b'\].*"
                                         r"rollout\.openenv\.observation=path/to/file\.py:fn"):
        text_mapping(schemas({"message": "string"}, {"a": "string", "b": "string"}), None, None, "Grid")


def test_the_users_functions_map_any_shape_and_their_faults_are_told_apart():
    def action(text):
        x, y = text.split(",")  # a text that makes no action raises ValueError: the model's call was wrong
        return {"x": int(x), "y": int(y)}

    mapping = text_mapping(schemas({"x": "integer", "y": "integer"}, {"board": "array"}, ("x", "y")), action,
                           lambda obs: " ".join(map(str, obs["board"])), "Move")
    assert mapping.action("1,2") == {"x": 1, "y": 2}
    assert mapping.observation({"board": [1, 0]}) == "1 0"
    with pytest.raises(ValueError):
        mapping.action("nonsense")
    broken = TextMapping(action_fn=lambda text: [text], observation_fn=lambda obs: 3)
    with pytest.raises(OpenEnvFailure, match="returned list, not a dict") as err:
        broken.action("a")
    assert err.value.kind == "malformed" and not is_call_error(err.value)
    with pytest.raises(OpenEnvFailure, match="3, not a str") as err:
        broken.observation({})
    with pytest.raises(OpenEnvFailure, match="rollout.openenv.observation raised KeyError") as err:
        TextMapping(observation_fn=lambda obs: obs["board"]).observation({})  # the user's bug, not the model's
    assert not is_call_error(err.value)
    with pytest.raises(OpenEnvFailure, match="has no field 'text'"):
        TextMapping(observation_field="text").observation({"other": "x"})


def test_client_errors_become_the_models_or_the_environments_failures_by_kind():
    assert is_call_error(as_failure(ActionRejected("schema")))  # the model's bad call, which it learns from
    kinds = {as_failure(ConnectionRefusedError("refused")).kind: "connection",
             as_failure(asyncio.TimeoutError()).kind: "timeout",
             as_failure(ValueError("Expecting value: line 1")).kind: "malformed",  # json's decode error
             as_failure(RuntimeError("boom")).kind: "exception"}
    assert set(kinds) == set(kinds.values())
    assert not any(is_call_error(as_failure(e)) for e in (ValueError("x"), KeyError("k"), TypeError("t")))
    assert failure_kind(None, timed_out=True) == "timeout"
    assert failure_kind(ConnectionError("gone")) == "connection" and failure_kind(RuntimeError()) == "exception"
    assert failure_kind(OpenEnvFailure("capacity", "full")) == "capacity"
    assert json_columns({"prompt": "1+1=", "n": 2, "blob": object()}) == {"prompt": "1+1=", "n": 2}


class Flaky:
    """Step 1 answers, step 2 fails with the row's kind; `closed` counts close() calls."""
    closed = 0
    stop = ()

    def reset(self, kind):
        self.kind, self.steps = kind, 0

    def step(self, response):
        self.steps += 1
        if self.steps == 1:
            return "ok", 0.5, False
        raise OpenEnvFailure(self.kind, f"planted {self.kind}")

    def close(self):
        Flaky.closed += 1


def test_failures_are_counted_by_kind_and_every_session_is_closed():
    tok = build_char_tokenizer()
    eos = tok.eos_token_id
    a = tok.encode("a", add_special_tokens=False)

    def generate(requests):
        return [(a, [-0.1], False) if len(r.prompt_ids) < 8 else ([eos], [-0.1], False) for r in requests]

    rows = [{"kind": "connection"}, {"kind": "malformed"}, {"kind": "connection"}]
    trajectories = [Trajectory([5], Flaky(), "openenv", seed=i) for i in range(3)]
    Flaky.closed = 0
    run_trajectories(trajectories, rows, generate, tok, max_turns=4, max_tokens=16, timeout_s=5.0)
    assert Flaky.closed == 3
    prompts = Batch(objects={"prompt": ["x"] * 3})
    samples = trajectories_to_batch(trajectories, prompts, 16, 0, tok)
    metrics = agent_metrics(samples)
    assert metrics["env/errors/connection"] == 2 and metrics["env/errors/malformed"] == 1
    assert metrics["agent/env_failures"] == 3
    assert agent_metrics(samples, prefix="val/agent/")["val/env/errors/connection"] == 2


def test_rollout_agent_takes_an_openenv_target_beside_the_other_forms(tmp_path):
    cfg = RolloutConfig(agent=[f"openenv:{FIXTURE}:Counting", "hybridflow.data.calculator:calc"])
    assert cfg.agent == [f"openenv:{FIXTURE}:Counting", "hybridflow.data.calculator:calc"]
    assert RolloutConfig(agent="openenv:http://10.0.0.5:8000/").agent == ["openenv:http://10.0.0.5:8000"]
    assert RolloutConfig(agent="openenv:envs.echo.server.app:app").agent == ["openenv:envs.echo.server.app:app"]
    with pytest.raises(ValueError, match="two OpenEnv environments"):
        RolloutConfig(agent=["openenv:http://a:1", "openenv:http://b:2"])
    with pytest.raises(ValueError, match=r"openenv:http://host:port"):
        RolloutConfig(agent="openenv:http://a:1/ws/x")
    with pytest.raises(ValueError, match="does not exist"):
        RolloutConfig(agent=f"openenv:{tmp_path}/missing.py:Env")
    with pytest.raises(ValueError, match=r"rollout.openenv.action='nope'"):
        OpenEnvConfig(action="nope")
    with pytest.raises(ValueError, match="rollout.openenv.max_sessions"):
        OpenEnvConfig(max_sessions=0)
    with pytest.raises(ValueError, match=r"only with an OpenEnv environment in rollout.agent"):  # a key nothing reads
        RolloutConfig(agent=["hybridflow.data.calculator:calc"], openenv=OpenEnvConfig(stop=["?"]))


def test_what_the_run_will_serve_is_checked_before_it_starts(tmp_path):
    from hybridflow.registry import load_object

    counting = load_object(f"{FIXTURE}:Counting")
    assert [c.__name__ for c in environment_types(counting)] == ["CountAction", "CountObservation"]
    check_served_target(f"{FIXTURE}:Counting", OpenEnvConfig(), None, None)
    check_served_target(f"{FIXTURE}:app", OpenEnvConfig(), None, None)
    single = tmp_path / "single.py"
    single.write_text(f"import sys; sys.path.insert(0, {str(FIXTURE.parent)!r})\n"
                      "from openenv_counting import Counting\n"
                      "class Single(Counting):\n    SUPPORTS_CONCURRENT_SESSIONS = False\n")
    with pytest.raises(AgentError, match="does not declare SUPPORTS_CONCURRENT_SESSIONS"):
        check_served_target(f"{single}:Single", OpenEnvConfig(), None, None)
    check_served_target(f"{single}:Single", OpenEnvConfig(max_sessions=1), None, None)
    with pytest.raises(AgentError, match="is a int; name an ASGI app"):
        check_served_target("os:F_OK", OpenEnvConfig(), None, None)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_server_starts_on_loopback_answers_sessions_and_stops(tmp_path):
    """An app (openenv's create_fastapi_app in the fixture) served by the run's lifecycle: healthy, its
    schema mapped, a session reset and stepped through openenv's client, then stopped, process gone."""
    from hybridflow.agents.hubs.openenv_server import openenv_agent

    server = OpenEnvServer(f"{FIXTURE}:app", tmp_path / "server.log", max_sessions=4, startup_timeout_s=60)
    url = server.start()
    try:
        assert url.startswith("http://127.0.0.1:")
        agent = openenv_agent(url, OpenEnvConfig(), timeout_s=10.0)
        session = agent()
        assert session.reset(turns=1, prompt="1+1=") == "go:"
        assert session.step("12ab") == ("=2;", 0.5, True)
        session.close()
        assert len(agent.idle) == 1  # the connection is kept: the next trajectory resets it
        again = agent()
        assert again.reset(turns=2) == "go:" and again.step("x") == ("=0;", 0.0, False) and not agent.idle
        again.close()
    finally:
        server.stop()
    assert not server.alive() and gone(server.process.pid)
    assert "Uvicorn running on http://127.0.0.1" in (tmp_path / "server.log").read_text()


def test_a_server_that_never_becomes_healthy_is_an_error_naming_its_command_and_log(tmp_path):
    hangs = tmp_path / "hangs.py"
    hangs.write_text("import time\nprint('loading a very large environment', flush=True)\ntime.sleep(60)\napp = None\n")
    server = OpenEnvServer(f"{hangs}:app", tmp_path / "hangs.log", max_sessions=1, startup_timeout_s=10)
    started = time.monotonic()
    with pytest.raises(AgentError) as err:
        server.start()
    message = str(err.value)
    assert time.monotonic() - started < 30
    assert "did not become healthy" in message and "within 10s" in message
    assert "hybridflow.agents.hubs.openenv_serve" in message and f"{hangs}:app" in message  # its command
    assert "loading a very large environment" in message  # the end of its log
    assert gone(server.process.pid)
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no module named envs.secret')\n")
    server = OpenEnvServer(f"{broken}:app", tmp_path / "broken.log", max_sessions=1, startup_timeout_s=60)
    with pytest.raises(AgentError, match=r"(?s)its process exited with status 1.*no module named envs.secret"):
        server.start()


def test_a_url_is_only_checked_and_the_config_the_run_gets_names_the_served_server(tmp_path):
    """serve(): for an Environment class the rollout gets the URL of the server the run started; the
    server is stopped when the stage ends."""
    from hybridflow.config.schema import HybridFlowConfig

    config = HybridFlowConfig(rollout=RolloutConfig(agent=[f"openenv:{FIXTURE}:Counting"]))
    with serve(config, tmp_path) as served:
        url = served.rollout.agent[0][len("openenv:"):]
        assert url.startswith("http://127.0.0.1:")
        import json

        pid = json.loads((tmp_path / "openenv_server.json").read_text())["pid"]
        assert not gone(pid)
        plain = HybridFlowConfig(rollout=RolloutConfig(agent=[f"openenv:{url}"]))
        with serve(plain, tmp_path / "other") as pointed:  # a URL: checked, not started
            assert pointed.rollout.agent == [f"openenv:{url}"]
        assert not (tmp_path / "other" / "openenv_server.json").exists() and not gone(pid)
    assert gone(pid)


DRIVER = """
import sys, time
from pathlib import Path
from hybridflow.agents.hubs.openenv_server import OpenEnvServer
out = Path(sys.argv[1])
server = OpenEnvServer(sys.argv[2], out / "server.log", 1, 60)
server.start()
(out / "pid").write_text(str(server.process.pid))
time.sleep(600)
"""


def test_a_server_whose_run_was_killed_exits_by_itself(tmp_path):
    """A driver killed by SIGKILL runs no `finally`: the server (in a process group of its own, so that its
    stop takes all of it) notices its parent is gone and exits, leaving no orphan."""
    import signal
    import subprocess
    import sys

    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), f"{FIXTURE}:app"],
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    deadline = time.monotonic() + 90
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.2)
    pid = int((tmp_path / "pid").read_text())
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(pid), f"the server {pid} outlived its killed run"
    assert "is gone; exiting" in (tmp_path / "server.log").read_text()
