"""The OpenEnv server's lifetime, owned by the run (`serve`, around each stage in hybridflow/run/runner.py).

`rollout.agent=openenv:package.module:app` (a FastAPI app, e.g. openenv's `create_app(...)`) or
`openenv:path/to/env.py:MyEnvironment` (an OpenEnv Environment class, served by openenv's own
`create_fastapi_app`): the run starts one server for the run, as a subprocess running uvicorn on
127.0.0.1 at a free port (openenv_serve.py), its output in `<run_dir>/openenv_server.log`; waits for
`/health` until `rollout.openenv.startup_timeout_s` (a server that exits or never answers is an error
naming its command and the end of its log); checks the text mapping against its `/schema`; hands the
rollout its URL in place of the reference; and stops it (its whole process group) when the stage ends,
whether it finished or failed. `openenv:http://host:port`: a server someone else runs; the run only checks
its health and schema.

Why the driver, not the rollout worker: one server for the run, started once however many rollout ranks
there are and whatever restarts the workers go through (trainer.max_restarts tears the groups down; the
server and its sessions' environment code stay), its log in the run directory the driver owns, and
stopped by the driver's `finally` even when a worker was killed. The price: 127.0.0.1 is the driver's
node. A rollout rank on another node cannot reach it, and says so when it starts (the rollout asks the
server for its schema then); serve such a run yourself where the rollout nodes reach it and give its URL.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from hybridflow.agents.environment import AgentError
from hybridflow.agents.failures import EnvironmentFailureError
from hybridflow.agents.hubs.openenv_env import OpenEnvAgent, mapping_functions, text_mapping
from hybridflow.output import console
from hybridflow.registry import load_object

LOG_NAME = "openenv_server.log"
RECORD_NAME = "openenv_server.json"  # url, pid and command of the server the run started
LOOPBACK = "127.0.0.1"
PREFIX = "openenv:"


def free_port() -> int:
    """A port free on loopback now (the server binds it a moment later; a lost race shows in its log)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float) -> Any:
    """GET `url` as JSON; loopback without the environment's proxies."""
    handlers = [urllib.request.ProxyHandler({})] if f"//{LOOPBACK}" in url or "//localhost" in url else []
    with urllib.request.build_opener(*handlers).open(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def wait_healthy(url: str, timeout_s: float, exited: Callable[[], str | None] = lambda: None) -> None:
    """Poll `url`/health until it answers healthy; raise TimeoutError after `timeout_s`, or RuntimeError as
    soon as `exited()` says why the server's process is gone."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while True:
        why = exited()
        if why is not None:
            raise RuntimeError(why)
        try:
            health = _get(f"{url}/health", timeout_s=2.0)
            if isinstance(health, dict) and health.get("status") == "healthy":
                return
            last = f"/health answered {health!r}"
        except (OSError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health did not answer healthy within {timeout_s:g}s (last: {last})")
        time.sleep(0.1)


def server_schemas(url: str, timeout_s: float) -> dict:
    """The server's `/schema` once its `/health` answers, or an AgentError naming the URL."""
    try:
        wait_healthy(url, timeout_s)
        schemas = _get(f"{url}/schema", timeout_s=10.0)
    except (OSError, RuntimeError, ValueError) as exc:
        raise AgentError(f"rollout.agent: the OpenEnv server at {url} does not answer on {socket.gethostname()}: "
                         f"{exc}. A server the run starts listens on the driver's loopback, so a rollout on another "
                         "node cannot reach it: serve it where the rollout nodes do and give openenv:http://host:port "
                         "(rollout.openenv.startup_timeout_s bounds the wait)") from None
    if not isinstance(schemas, dict) or not isinstance(schemas.get("action"), dict):
        raise AgentError(f"rollout.agent: {url}/schema answered {str(schemas)[:200]}, not OpenEnv's schemas "
                         "({'action': ..., 'observation': ...}); is it an OpenEnv server?")
    return schemas


class OpenEnvServer:
    """One OpenEnv server process on loopback: `start` (returns its URL once healthy), `stop`, `log_tail`."""

    def __init__(self, target: str, log_path: Path, max_sessions: int, startup_timeout_s: float) -> None:
        self.target, self.log_path = target, log_path
        self.max_sessions, self.startup_timeout_s = max_sessions, startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.command: list[str] = []

    def start(self) -> str:
        port = free_port()
        self.url = f"http://{LOOPBACK}:{port}"
        self.command = [sys.executable, "-m", "hybridflow.agents.hubs.openenv_serve", self.target,
                        "--host", LOOPBACK, "--port", str(port), "--max-sessions", str(self.max_sessions)]
        package_root = str(Path(__file__).resolve().parents[3])  # hybridflow's parent, for the -m above
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.getcwd(),
                                                                        os.environ.get("PYTHONPATH")) if p)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:  # the child holds its own descriptor
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True)  # its own group: stop takes all of it
        try:
            wait_healthy(self.url, self.startup_timeout_s, self._exited)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise AgentError(f"rollout.agent: the OpenEnv server for {self.target!r} did not become healthy: {exc}.\n"
                             f"Its command: {' '.join(self.command)}\nIts log ({self.log_path}) ends:\n"
                             f"{self.log_tail()}") from None
        return self.url

    def _exited(self) -> str | None:
        code = None if self.process is None else self.process.poll()
        return None if code is None else f"its process exited with status {code}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace_s`; waits for it."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:]) or "(empty)"


# ---- what can be checked before a server runs ----------------------------------------------------------


def environment_types(cls: type) -> tuple[type, type]:
    """(Action class, Observation class) of an OpenEnv Environment subclass: its generic arguments
    (`Environment[MyAction, MyObservation, State]`), else the annotations of its `step`."""
    import typing

    from openenv.core import Action, Environment, Observation

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if typing.get_origin(base) is Environment and len(args) >= 2 and all(inspect.isclass(a) for a in args[:2]):
                return args[0], args[1]
    try:
        hints = typing.get_type_hints(cls.step)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: the message below says what to write
        hints = {}
    action, observation = hints.get("action"), hints.get("return")
    if inspect.isclass(action) and issubclass(action, Action) and inspect.isclass(observation) \
            and issubclass(observation, Observation):
        return action, observation
    raise AgentError(f"rollout.agent: OpenEnv environment {cls.__name__}: its Action and Observation classes are not "
                     f"known; subclass Environment[MyAction, MyObservation, State] or annotate "
                     "step(self, action: MyAction) -> MyObservation")


def check_served_target(target: str, settings, action_fn, observation_fn) -> None:
    """What the run will serve loads and maps to text (an Environment class: against its own types'
    schemas; an app: against its /schema once served), or an AgentError naming the fix."""
    try:
        from openenv.core import Environment
    except ImportError as exc:
        raise ImportError(f"rollout.agent=openenv:...: openenv-core is not installed ({exc}); "
                          "pip install 'hybridflow[envs]' or openenv-core==0.3.0") from None
    try:
        obj = load_object(target)
    except Exception as exc:  # noqa: BLE001 - whatever the import raised, name the reference
        raise AgentError(f"rollout.agent: openenv:{target} does not load: {type(exc).__name__}: {exc}") from exc
    if inspect.isclass(obj) and issubclass(obj, Environment):
        action, observation = environment_types(obj)
        text_mapping({"action": action.model_json_schema(), "observation": observation.model_json_schema()},
                     action_fn, observation_fn, obj.__name__)
        if settings.max_sessions > 1 and not getattr(obj, "SUPPORTS_CONCURRENT_SESSIONS", False):
            raise AgentError(f"rollout.agent: OpenEnv environment {obj.__name__} does not declare "
                             "SUPPORTS_CONCURRENT_SESSIONS = True, and a rollout runs one session per trajectory at "
                             f"once (rollout.openenv.max_sessions={settings.max_sessions}); declare it if its instances "
                             "share no state, or set rollout.openenv.max_sessions=1 with one trajectory per step")
        return
    if not callable(obj) or not hasattr(obj, "router"):
        raise AgentError(f"rollout.agent: openenv:{target} is a {type(obj).__name__}; name an ASGI app (openenv's "
                         "create_app(...) / create_fastapi_app(...)) or an OpenEnv Environment subclass")


def openenv_agent(target: str, settings, timeout_s: float) -> Callable[[], Any]:
    """The agent of `rollout.agent=openenv:<target>`. A URL: the server is asked for its health and schema
    now (a rollout rank that cannot reach it stops here, named). A reference (an app or an Environment
    class): checked as far as it can be without a server (it loads; an Environment class's action and
    observation map to text); the run serves it and hands the rollout its URL (openenv_server.py)."""
    action_fn, observation_fn = mapping_functions(settings)
    stop = tuple(settings.stop)
    if not target.startswith(("http://", "https://")):
        check_served_target(target, settings, action_fn, observation_fn)
        return _NotServed(target)
    schemas = server_schemas(target, timeout_s=settings.startup_timeout_s)
    return OpenEnvAgent(target, text_mapping(schemas, action_fn, observation_fn, target), stop, timeout_s)


class _NotServed:
    """An OpenEnv target the run has not served (a rollout built without the run around it)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __call__(self) -> Any:
        raise AgentError(f"rollout.agent: OpenEnv environment {self.target!r} is not served: the run serves it on "
                         "loopback and hands the rollout its URL (hybridflow.agents.hubs.openenv_server.serve); "
                         "outside a run give openenv:http://host:port")


# ---- the run's side ------------------------------------------------------------------------------------


@contextmanager
def serve(config, run_dir: Path) -> Iterator[Any]:
    """The config the stage runs with, its OpenEnv server started (or pointed at, and checked) for the
    stage's length; a config without `openenv:` in rollout.agent as it is. On the way out the server is
    stopped; an environment-failure stop or an agent error leaving the stage carries the end of its log."""
    references = [r for r in (config.rollout.agent or []) if r.startswith(PREFIX)]
    if not references:
        yield config
        return
    target, settings = references[0][len(PREFIX):], config.rollout.openenv
    action_fn, observation_fn = mapping_functions(settings)
    server, served = None, False
    try:
        if target.startswith(("http://", "https://")):
            url = target
        else:
            server = OpenEnvServer(target, run_dir / LOG_NAME, settings.max_sessions, settings.startup_timeout_s)
            url = server.start()
            (run_dir / RECORD_NAME).write_text(json.dumps({"url": url, "pid": server.process.pid, "target": target,
                                                           "command": server.command}, indent=1))
            console.say(f"hybridflow: OpenEnv server for {target} at {url} (pid {server.process.pid}, log "
                        f"{run_dir / LOG_NAME})")
        text_mapping(server_schemas(url, settings.startup_timeout_s), action_fn, observation_fn, target)
        agents = [PREFIX + url if r.startswith(PREFIX) else r for r in config.rollout.agent]
        served = True
        yield dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, agent=agents))
    except (EnvironmentFailureError, AgentError) as exc:
        if server is None or not served:
            raise
        state = "running" if server.alive() else f"exited with status {server.process.poll()}"
        raise type(exc)(f"{exc}\nThe OpenEnv server ({server.url}, {state}); its log ({server.log_path}) ends:\n"
                        f"{server.log_tail()}") from exc
    finally:
        if server is not None:
            server.stop()
