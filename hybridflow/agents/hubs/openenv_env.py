"""An OpenEnv environment as a HybridFlow agent: `rollout.agent=openenv:<target>`.

OpenEnv (openenv-core 0.3.0) serves an environment over HTTP and WebSocket: its `Environment` class has
`reset(**kwargs) -> Observation` and `step(Action) -> Observation` (pydantic models; the observation
carries `reward` and `done`), and its app (`openenv.core.create_fastapi_app`) gives each WebSocket
connection (`/ws`) a session of its own environment instance; the plain HTTP `/reset` and `/step` build a
new instance per request, so a multi-turn episode needs the WebSocket. Here each trajectory is one
session (kept for the next trajectory's reset when it ends: `OpenEnvAgent`), driven through OpenEnv's
own client (`GenericEnvClient`, dicts in and out):

    reset(**row)      -> the session's reset with the row's columns (the server passes the ones its
                         environment's reset names), its observation as the first observation text
    step(response)    -> the model's turn as an action, the server's step, (observation text, reward, done)

The text <-> type mapping is explicit (`TextMapping`): by default the text fills the action's one string
field (`message` when there are several) and the model reads the observation's one string field; any
other shape needs the user's functions (`rollout.openenv.action`, `rollout.openenv.observation`), and is
refused before the first step, naming the fields and the keys (the server's `/schema` says the fields).

Failures (hybridflow/agents/environment.py): an action the server's schema rejects is the model's bad
call (ValueError, which it learns from); an exception inside the environment, a timeout, a server gone
and a malformed answer are the environment's failures (`OpenEnvFailure`, with its `kind`: exception,
timeout, connection, malformed, capacity; counted in `env/errors/<kind>`). A session that timed out or
lost its connection stays failed for the rest of its trajectory (a late answer would otherwise be read as
the next step's). The server's own lifetime (started on loopback by the run, or pointed at by URL) is
openenv_server.py's, and so is `openenv_agent`, which builds the agent for the rollout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import numbers
import threading
from dataclasses import dataclass
from typing import Any, Callable

from hybridflow.agents.environment import AgentError
from hybridflow.registry import load_object

OPENENV_AGENT = "openenv"  # the agent's name (rows name it in rollout.agent_column with several agents)
OBSERVATION_RESERVED = ("done", "reward", "metadata")  # OpenEnv's Observation base fields, not the text
ACTION_RESERVED = ("metadata",)


class OpenEnvFailure(RuntimeError):
    """A step that failed on the environment's side; `kind` is its `env/errors/<kind>` count."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ActionRejected(ValueError):
    """The server's schema refused the action made from the model's text: the model's call was wrong."""


# ---- text <-> OpenEnv types -------------------------------------------------------------------------


@dataclass(frozen=True)
class TextMapping:
    """How the model's text becomes an action and an observation becomes text: a field, or a function."""

    action_field: str | None = None
    action_fn: Callable[[str], Any] | None = None
    observation_field: str | None = None
    observation_fn: Callable[[dict], Any] | None = None

    def action(self, text: str) -> dict:
        if self.action_fn is None:
            return {self.action_field: text}
        action = self.action_fn(text)  # raising ValueError: the model's text does not make an action
        if hasattr(action, "model_dump"):  # the environment's own Action class
            action = action.model_dump()
        if not isinstance(action, dict):
            raise OpenEnvFailure("malformed", f"rollout.openenv.action returned {type(action).__name__}, not a dict "
                                 "of the action's fields")
        return action

    def observation(self, payload: Any) -> str | None:
        if not isinstance(payload, dict):
            raise OpenEnvFailure("malformed", f"the server's observation is {_short(payload)}, not an object")
        if self.observation_fn is not None:
            try:
                text = self.observation_fn(payload)
            except Exception as exc:  # noqa: BLE001 - the user's function on the server's answer: not the model's fault
                raise OpenEnvFailure("malformed", f"rollout.openenv.observation raised {type(exc).__name__}: {exc} "
                                     f"on {_short(payload)}") from exc
        elif self.observation_field in payload:
            text = payload[self.observation_field]
        else:
            raise OpenEnvFailure("malformed", f"the server's observation {_short(payload)} has no field "
                                 f"{self.observation_field!r}")
        if text is not None and not isinstance(text, str):
            raise OpenEnvFailure("malformed", f"the observation text is {_short(text)}, not a str or None")
        return text or None


def string_fields(schema: dict, reserved: tuple[str, ...]) -> list[str]:
    """The properties of a pydantic JSON schema whose type is a string, less the base classes' fields."""
    return [name for name, spec in schema.get("properties", {}).items()
            if name not in reserved and spec.get("type") == "string"]


def text_mapping(schemas: dict, action_fn: Callable | None, observation_fn: Callable | None,
                 where: str) -> TextMapping:
    """The mapping for a server's `/schema` (`{"action": ..., "observation": ...}`, JSON schemas), or an
    AgentError naming the environment, its fields and the key that maps them."""
    action, observation = schemas.get("action", {}), schemas.get("observation", {})
    action_field = observation_field = None
    if action_fn is None:
        fields = string_fields(action, ACTION_RESERVED)
        action_field = "message" if "message" in fields else fields[0] if len(fields) == 1 else None
        others = [f for f in action.get("required", []) if f != action_field]
        if action_field is None or others:
            raise AgentError(
                f"rollout.agent: OpenEnv environment {where}: its action has the string fields {fields} and requires "
                f"{action.get('required', [])}, so the model's text has no one field to fill; give "
                "rollout.openenv.action=path/to/file.py:fn, fn(text) -> dict of the action's fields (raise ValueError "
                "for a text that makes no action: the model's call was wrong)")
    if observation_fn is None:
        fields = string_fields(observation, OBSERVATION_RESERVED)
        observation_field = fields[0] if len(fields) == 1 else "message" if "message" in fields else None
        if observation_field is None:
            raise AgentError(
                f"rollout.agent: OpenEnv environment {where}: its observation has the string fields {fields} "
                f"(of {sorted(observation.get('properties', {}))}), not one the model can read; give "
                "rollout.openenv.observation=path/to/file.py:fn, fn(observation: dict) -> str | None")
    return TextMapping(action_field, action_fn, observation_field, observation_fn)


def mapping_functions(settings) -> tuple[Callable | None, Callable | None]:
    """rollout.openenv.action / .observation loaded (None where not given), or an AgentError naming the key."""
    loaded = []
    for key in ("action", "observation"):
        reference = getattr(settings, key)
        if reference is None:
            loaded.append(None)
            continue
        try:
            fn = load_object(reference)
        except Exception as exc:  # noqa: BLE001 - whatever the import raised, name the key
            raise AgentError(f"rollout.openenv.{key}={reference!r} does not load: {exc}") from exc
        if not callable(fn):
            raise AgentError(f"rollout.openenv.{key}={reference!r} is a {type(fn).__name__}, not a function")
        loaded.append(fn)
    return loaded[0], loaded[1]


# ---- sessions ----------------------------------------------------------------------------------------


class EventLoop:
    """One asyncio loop on a daemon thread: every session of a rollout rank runs its client on it, rather
    than a loop and a thread per session (OpenEnv's SyncEnvClient)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="openenv-sessions").start()

    def run(self, coroutine, timeout_s: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise OpenEnvFailure("timeout", f"no answer within {timeout_s:g}s (rollout.tool_timeout_s)") from None


def client_class():
    """OpenEnv's GenericEnvClient, its server errors told apart by their code: a schema that refused the
    action is the model's (ActionRejected), anything else the environment's (OpenEnvFailure)."""
    from openenv.core import GenericEnvClient

    class Client(GenericEnvClient):
        async def _send_and_receive(self, message: dict) -> dict:
            await self._send(message)
            response = await self._receive()
            if response.get("type") != "error":
                return response
            data = response.get("data") or {}
            code, text = str(data.get("code", "UNKNOWN")), str(data.get("message", data))
            if code == "VALIDATION_ERROR":
                raise ActionRejected(f"the environment's action schema refused it: {data.get('errors', text)}"[:300])
            kind = {"CAPACITY_REACHED": "capacity", "EXECUTION_ERROR": "exception"}.get(code, "exception")
            raise OpenEnvFailure(kind, f"the server answered {code}: {text}")

        async def end(self) -> None:
            """Asks the server to end the session and lets it close the WebSocket. (The client's own close
            closes it at once, and openenv 0.3.0's server, closing it too, logs a traceback per session.)"""
            if self._ws is not None:
                ws, self._ws = self._ws, None
                try:
                    await ws.send(json.dumps({"type": "close"}))
                    await asyncio.wait_for(ws.wait_closed(), 4.0)
                finally:
                    await ws.close()

    return Client


def as_failure(error: BaseException) -> BaseException:
    """What a failed client call raises: ActionRejected and OpenEnvFailure as they are, anything else (a
    closed connection, a refused one, an answer that is not JSON) an OpenEnvFailure of its kind."""
    if isinstance(error, (ActionRejected, OpenEnvFailure)):
        return error
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return OpenEnvFailure("timeout", f"no answer in time: {error!r}")
    name = type(error).__name__
    if isinstance(error, (ConnectionError, OSError)) or "ConnectionClosed" in name or "InvalidStatus" in name:
        return OpenEnvFailure("connection", f"the server is unreachable or gone: {name}: {error}")
    if isinstance(error, (ValueError, KeyError, TypeError)):  # json's decode error, a missing key
        return OpenEnvFailure("malformed", f"the server's answer does not parse: {name}: {error}")
    return OpenEnvFailure("exception", f"{name}: {error}")


class OpenEnvSession:
    """One trajectory's session: HybridFlow's environment protocol over one OpenEnv WebSocket session."""

    def __init__(self, agent: "OpenEnvAgent") -> None:
        self.agent, self.stop = agent, agent.stop
        self.client = None
        self.lost: OpenEnvFailure | None = None  # a timeout or a lost connection: the session is unusable

    def reset(self, **row: Any) -> str | None:
        self.client = self.agent.take()
        result = self._call(self.client.reset(**json_columns(row)))
        return self.agent.mapping.observation(result.observation)

    def step(self, response: str) -> tuple[str | None, float, bool]:
        if self.lost is not None:
            raise OpenEnvFailure(self.lost.kind, f"{self.lost} (at an earlier step of this session)")
        action = self.agent.mapping.action(response)
        result = self._call(self.client.step(action))
        reward = 0.0 if result.reward is None else result.reward
        if not isinstance(reward, numbers.Real) or isinstance(reward, bool) or reward != reward:
            raise OpenEnvFailure("malformed", f"the server's reward is {_short(result.reward)}, not a finite number")
        if not isinstance(result.done, bool):
            raise OpenEnvFailure("malformed", f"the server's done is {_short(result.done)}, not a bool")
        return self.agent.mapping.observation(result.observation), float(reward), result.done

    def close(self) -> None:
        """Hands the connection back for the next trajectory's reset, or ends a lost one (best effort)."""
        client, self.client = self.client, None
        if client is None:
            return
        if self.lost is None:
            self.agent.give_back(client)
            return
        try:
            self.agent.loop.run(client.end(), 5.0)
        except Exception:  # noqa: BLE001 - a session of a server that is gone is closed already
            pass

    def _call(self, coroutine) -> Any:
        try:
            return self.agent.loop.run(coroutine, self.agent.timeout_s)
        except (Exception, asyncio.CancelledError) as exc:  # sorted into the model's or the environment's
            failure = as_failure(exc)
            if isinstance(failure, OpenEnvFailure) and failure.kind in ("timeout", "connection"):
                self.lost = failure
            raise failure from exc


class OpenEnvAgent:
    """The factory of sessions (one per trajectory) of the server at `url`, its text mapping checked
    against the server's `/schema` (openenv_server.openenv_agent).

    A trajectory's connection is kept when it ends and the next trajectory resets it (an OpenEnv reset
    starts a new episode on the session's environment): opening a WebSocket and the server's environment
    instance was most of an episode's cost on loopback (16 trajectories of 2 steps: connect and reset
    75-200 ms, each step 15-40 ms, close 16-33 ms, a 2-core CPU). A connection that timed out or was lost
    is not kept. At most as many stay open as trajectories ran at once."""

    def __init__(self, url: str, mapping: TextMapping, stop: tuple[str, ...], timeout_s: float) -> None:
        self.url, self.mapping, self.stop, self.timeout_s = url, mapping, stop, timeout_s
        self.client_cls = client_class()
        self.loop = EventLoop()
        self.idle: list[Any] = []  # connected clients whose trajectory ended
        self.lock = threading.Lock()

    def __call__(self) -> OpenEnvSession:
        return OpenEnvSession(self)

    def take(self) -> Any:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return self.client_cls(base_url=self.url, message_timeout_s=self.timeout_s)

    def give_back(self, client: Any) -> None:
        with self.lock:
            self.idle.append(client)


def json_columns(row: dict) -> dict:
    """The row's columns that JSON carries (the reset's keyword arguments travel as JSON)."""
    out = {}
    for key, value in row.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
