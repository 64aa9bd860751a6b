"""References to a user's Python objects in config (`reward.fn`, `rollout.agent`, ...): their form
checked, and a file path made absolute, when the config is checked.

A reference is `package.module:name` or `path/to/file.py:name`; the object is loaded later
(`hybridflow.registry.load_object`), inside Ray workers whose working directory is not the driver's,
so a file path is made absolute here. Standard library only: the schema imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def absolute_reference(reference: str) -> str:
    """`path/to/file.py:name` with the path made absolute (the object is loaded inside Ray workers,
    whose working directory is not the driver's); `package.module:name` as it is.

    Raises ValueError for any other form and FileNotFoundError for a file that does not exist;
    callers put the config key into the message."""
    target, sep, attr = reference.rpartition(":")
    if not (sep and target and attr):
        raise ValueError(f"{reference!r} is not 'package.module:name' or 'path/to/file.py:name'")
    if not target.endswith(".py"):
        return reference
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"file {path} does not exist")
    return f"{path}:{attr}"


def check_agent_references(value: Any, key: str) -> list[str]:
    """`rollout.agent` as a list of references (None: none); a `file.py:Name` path is made
    absolute, because the rollout loads it inside Ray workers whose working directory differs."""
    references = [] if value is None else [value] if isinstance(value, str) else list(value)
    checked = []
    for reference in references:
        if str(reference).startswith(OPENENV_PREFIX):
            checked.append(check_openenv_reference(str(reference), key, value, checked))
            continue
        try:
            checked.append(absolute_reference(str(reference)))
        except ValueError:
            raise ValueError(f"config {key}={value!r} is invalid: each entry is 'path/to/file.py:Name' or "
                             "'package.module:Name' (a tool function, a list of them, or an environment class)") from None
        except FileNotFoundError as exc:
            raise ValueError(f"config {key}={value!r} is invalid: {exc}") from None
    return checked


# rollout.environment's hubs (hybridflow/agents/hubs): each hub's class, by import path, so the schema
# checks a name without importing the hub's package
ENVIRONMENT_HUBS = {"verifiers": "hybridflow.agents.hubs.verifiers_env:VerifiersEnvironment"}


def check_environment(value: Any, key: str = "rollout.environment") -> str:
    """`rollout.environment` as '<hub>:<id>' ('' : none); a `.py` file's path is made absolute (the rollout
    loads it inside Ray workers, whose working directory differs)."""
    if value in (None, ""):
        return ""
    hub, sep, ident = str(value).partition(":")
    if not sep or hub not in ENVIRONMENT_HUBS or not ident.strip():
        raise ValueError(f"config {key}={value!r} is invalid: name an environment as '<hub>:<id>' with a hub of "
                         f"{sorted(ENVIRONMENT_HUBS)}, e.g. verifiers:my_env (an installed verifiers taskset, or "
                         "verifiers:path/to/env.py), or leave it empty")
    ident = ident.strip()
    if ident.endswith(".py"):
        path = Path(ident).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"config {key}={value!r} is invalid: file {path} does not exist")
        ident = str(path)
    return f"{hub}:{ident}"


OPENENV_PREFIX = "openenv:"  # rollout.agent=openenv:<target>: an OpenEnv environment (hybridflow/agents/hubs)


def check_openenv_reference(reference: str, key: str, value: Any, checked: list[str]) -> str:
    """`openenv:<target>` with its target checked: a server's URL (http://host:port, which the run only
    health-checks), or a reference to a FastAPI app or an OpenEnv Environment class (which the run serves
    on loopback), its file path made absolute. One OpenEnv environment per run."""
    target = reference[len(OPENENV_PREFIX):]
    if any(r.startswith(OPENENV_PREFIX) for r in checked):
        raise ValueError(f"config {key}={value!r} is invalid: it names two OpenEnv environments; a run drives one "
                         "(its agent is called 'openenv')")
    if target.startswith(("http://", "https://")):
        host = target.split("://", 1)[1].split("/", 1)[0]
        if not host or target.rstrip("/").count("/") > 2:
            raise ValueError(f"config {key}={value!r} is invalid: {target!r} is not a server's base URL; give "
                             "openenv:http://host:port (the server's /health, /schema and /ws are under it)")
        return OPENENV_PREFIX + target.rstrip("/")
    try:
        return OPENENV_PREFIX + absolute_reference(target)
    except ValueError:
        raise ValueError(f"config {key}={value!r} is invalid: after 'openenv:' give a server's URL "
                         "(openenv:http://host:port), its app (openenv:package.module:app or openenv:path/to/app.py:app) "
                         "or its Environment class (openenv:path/to/env.py:MyEnvironment)") from None
    except FileNotFoundError as exc:
        raise ValueError(f"config {key}={value!r} is invalid: {exc}") from None


TOOL_CALL_PARSER_KEY = "rollout.tool_call_parser"


def tool_call_parser_names() -> list[str]:
    """vLLM's registered tool-call parser names (its `--tool-call-parser` choices)."""
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


def check_tool_call_parser(name: str) -> list[str]:
    """Problems with `rollout.tool_call_parser`=`name` ('' : none): vLLM must be installed and know it
    (hybridflow/agents/tool_calls.py parses with it)."""
    if not name:
        return []
    try:
        names = tool_call_parser_names()
    except ImportError as exc:
        return [f"config {TOOL_CALL_PARSER_KEY}={name!r} is invalid: tool calls are parsed by vLLM's tool parsers, "
                f"and vLLM does not import ({exc}); install vllm (rollout=vllm needs it), or unset the key"]
    if name in names:
        return []
    return [f"config {TOOL_CALL_PARSER_KEY}={name!r} is invalid: not one of vLLM's tool-call parsers {names}; name "
            "the one for the model's family (hermes: Qwen2.5/Qwen3, Hermes and <tool_call>{json}</tool_call> templates; llama3_json, "
            "mistral, ...), as `vllm serve --tool-call-parser` takes it"]
