"""verifiers (v1) environments, unchanged: `rollout.environment=verifiers:<id>` trains on an installed
verifiers taskset (its package id, a hub id `owner/name@version`, or `path/to/env.py`), loaded with
`rollout.environment_args` (the env's own config, as its `--env.*` flags would give it:
`{taskset: {...}, agent: {harness: {...}, max_turns: 4}}`).

What runs is verifiers' own: its taskset's tasks are the data rows (`rows`, written to files by
`python -m hybridflow.agents.hubs.verifiers_env`), its `Env.run_episode` plays each row (the harness's
chat loop, the task's stop conditions and tools, its timeouts), and its rubric scores the trace:
the trace's weighted total is the sample's score and each reward function's own score is kept as
`reward/<name>` (the `environment` reward function reads them, hybridflow/rewards/builtin.py).
The model is reached through the rollout engine's OpenAI-compatible endpoint: each episode's
client (`EvalClientConfig`) points at its sample's base URL, through verifiers' own interception
server, so the trained tokens are the ones the engine sampled (hybridflow/agents/endpoint.py).

Refused, with the reason (docs/agents.md):
  - a runtime other than `subprocess` (docker, podman, apptainer, modal, prime, e2b): a container or a
    remote sandbox, with its tunnel back to the interception server, is not started by a training run;
    every seat runs in verifiers' local subprocess runtime, which is set when the arguments leave it out;
  - a harness that must run in a container (`NEEDS_CONTAINER`: codex, claude_code, and the other
    third-party programs): on the trainer's host it would leak host state both ways;
  - an env with more than one agent seat (user-sim, best-of-n, judges): the endpoint records one
    trajectory per sample, and two seats' calls would mix in it.
A taskset in a `.py` file that has tools (a `vf.Toolset`): verifiers serves each as `python -m <its module>` in
a subprocess, so the file's folder is put on PYTHONPATH (which the subprocess runtime passes on); its
tool calls need `rollout.tool_call_parser` (hybridflow/agents/tool_calls.py).
The in-house chat program of the `null` and `bash` harnesses is a PEP 723 script that verifiers
prepares with `uv sync`, which needs the package index. Its declared packages are verifiers' own
dependencies, so the trainer's interpreter already holds them: `local_chat_program` registers that
interpreter as the script's prepared one in the subprocess runtime's cache (the class-level table the
runtime keeps for exactly this: scripts prepared once per process), and no network is needed. The
interpreter registered is a warm one's launcher (hybridflow/agents/hubs/warm_interpreter.py): the program,
which the harness starts once per episode and turn, is forked from a server process that imported its
modules once, instead of a fresh interpreter importing them each time (1.5-2 s of a 2-core CPU).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib.util
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import torch

from hybridflow.agents.environment import AgentError
from hybridflow.agents.hubs.warm_interpreter import WarmInterpreter, imported_modules
from hybridflow.agents.trajectory import Trajectory, trajectories_to_batch
from hybridflow.batch import Batch
from hybridflow.data.rows import write_rows

INSTALL = "pip install -e '.[envs]' (or pip install verifiers==0.4.0)"
TASK_COLUMN = "verifiers_task"  # a row's task data, as verifiers writes it on a trace
CHAT_PROGRAM_PACKAGES = ("openai", "mcp", "httpx", "httpx2", "tenacity", "certifi")  # its PEP 723 header
LOCAL_HARNESSES = ("null", "bash")  # the harnesses that run verifiers' chat program
API_KEY_VARIABLE = "HYBRIDFLOW_ENDPOINT_KEY"  # the loopback endpoint takes no key; a variable no one sets
MALFORMED_TOOL_CALL = "malformed_tool_call"  # the env/errors/<kind> of a call rollout.tool_call_parser rejected
# The chat program's first `client.chat` imports openai's chat resources and builds their pydantic models (most
# of a warm program's CPU, py-spy: 6 of 15 s in ModelMetaclass.__new__); the warm server does it once. No
# connection is opened.
OPENAI_CLIENT_WARMUP = ("import openai\nclient = openai.AsyncOpenAI(api_key='-', base_url='http://127.0.0.1:9/v1')\n"
                        "client.chat.completions.create\n")


def import_verifiers():
    """`verifiers.v1`, or an ImportError saying what to install."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(f"rollout.environment=verifiers:... needs the verifiers package (0.4.0, its v1 API), "
                          f"which does not import: {exc}; fix: {INSTALL}") from exc
    return vf


def importable_id(environment_id: str) -> str:
    """The taskset id verifiers imports: `path/to/env.py` is imported under its file name first."""
    if not environment_id.endswith(".py"):
        return environment_id
    path = Path(environment_id).expanduser().resolve()
    if not path.is_file():
        raise AgentError(f"rollout.environment: {environment_id!r} is not a file; name an installed verifiers "
                         "taskset, or a .py file that defines one (exported in __all__)")
    name = path.stem
    # verifiers starts a taskset's tool servers as `python -m <their module>` in a subprocess (its
    # subprocess runtime, which inherits this environment): the file's folder must be importable there too
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(path.parent) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(path.parent), *filter(None, paths)])
    loaded = sys.modules.get(name)
    if loaded is None or Path(getattr(loaded, "__file__", "") or "").resolve() != path:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return name


def env_config(taskset_id: str, arguments: dict[str, Any]):
    """The env's config from `rollout.environment_args`, every seat in the subprocess runtime."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import resolve_env_config

    data = copy.deepcopy(arguments)
    taskset = data.setdefault("taskset", {})
    if taskset.get("id", taskset_id) != taskset_id:
        raise AgentError(f"rollout.environment_args.taskset.id={taskset['id']!r} names another taskset than "
                         f"rollout.environment (verifiers:{taskset_id}); drop it from the arguments")
    taskset["id"] = taskset_id
    try:
        roles = list(agent_config_fields(resolve_env_config(data)))
        if len(roles) != 1:
            raise AgentError(f"rollout.environment=verifiers:{taskset_id}: the env has {len(roles)} agent seats "
                             f"{roles}; only single-seat envs are trained (the endpoint records one trajectory per "
                             "sample, and several seats' calls would mix in it)")
        for role in roles:
            seat = data.setdefault(role, {})
            runtime = (seat.get("runtime") or {}).get("type", "subprocess")
            if runtime != "subprocess":
                raise AgentError(f"rollout.environment_args.{role}.runtime.type={runtime!r} is refused: a training "
                                 "run starts no container or remote sandbox (nor its tunnel back to the model); "
                                 "use subprocess (the default here)")
            seat["runtime"] = {"type": "subprocess"}
        return resolve_env_config(data)
    except (ValueError, TypeError, ModuleNotFoundError) as exc:
        if isinstance(exc, AgentError):
            raise
        raise AgentError(f"rollout.environment=verifiers:{taskset_id} with rollout.environment_args={arguments!r} "
                         f"does not load: {exc}") from exc


def check_harnesses(config) -> None:
    from verifiers.v1.utils.loaders import harness_class

    for role, harness in config.agent_harnesses().items():
        if harness_class(harness.id).NEEDS_CONTAINER:
            raise AgentError(f"rollout.environment: seat {role!r} runs harness {harness.id!r}, which must run in a "
                             "container (it installs and drives a third-party program); a training run starts no "
                             f"container. Use a harness that runs locally: {list(LOCAL_HARNESSES)} "
                             f"(rollout.environment_args={{{role}: {{harness: {{id: null}}}}}})")


def local_chat_program(launcher: Path) -> None:
    """Register `launcher` (a warm interpreter's, running this interpreter) as the prepared one for verifiers'
    chat program (module docstring)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    missing = [m for m in CHAT_PROGRAM_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"verifiers' chat program needs {missing} in this interpreter ({sys.executable}); "
                          f"fix: {INSTALL}")
    table = getattr(SubprocessRuntime, "_interpreters", None)
    if not isinstance(table, dict) or not isinstance(getattr(SubprocessRuntime, "scripts_dir", None), str):
        raise RuntimeError("verifiers' SubprocessRuntime no longer keeps its prepared scripts in _interpreters and "
                           "scripts_dir (verifiers 0.4.0 does): hybridflow/agents/hubs/verifiers_env.py "
                           "local_chat_program must follow the installed version")
    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if not path.exists() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    table[str(path)] = str(launcher)


class VerifiersEnvironment:
    """One verifiers env, loaded in the process that runs its episodes (hybridflow/agents/hubs)."""

    def __init__(self, environment_id: str, arguments: dict[str, Any]) -> None:
        import_verifiers()
        from verifiers.v1.utils.loaders import load_environment

        self.name = f"verifiers:{environment_id}"
        self.config = env_config(importable_id(environment_id), arguments)
        check_harnesses(self.config)
        from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

        # the chat program's imports held warm in one server process (hybridflow/agents/hubs/warm_interpreter.py),
        # started by the first rollout (the driver's checks load the env too): each episode's program is forked
        # from it instead of a fresh interpreter importing them again
        self.warm = WarmInterpreter(imported_modules(CHAT_PROGRAM_SOURCE), warmup=OPENAI_CLIENT_WARMUP)
        weakref.finalize(self, self.warm.close)
        local_chat_program(self.warm.launcher_path)
        self.env = load_environment(self.config)
        self.task_type = type(self.env.taskset).task_type()

    # ---- data ------------------------------------------------------------------------------------
    def rows(self, limit: int | None = None) -> list[dict]:
        """The taskset's tasks as data rows: `prompt` (chat messages, what the harness sends first),
        `verifiers_task` (the task's data) and `data_source`."""
        rows = []
        for task in self.env.taskset:
            if limit is not None and len(rows) >= limit:
                break
            rows.append({"prompt": prompt_messages(task.data), TASK_COLUMN: task.data.model_dump(mode="json"),
                         "data_source": self.name})
        return rows

    def task(self, row: dict, sample: int):
        data = row.get(TASK_COLUMN)
        if not isinstance(data, dict):
            raise AgentError(f"sample {sample}: the row has no {TASK_COLUMN!r} column; write the rows of "
                             f"{self.name} with python -m hybridflow.agents.hubs.verifiers_env")
        return self.task_type(self.task_type.data_type().model_validate(data), self.env.taskset.config.task)

    # ---- one phase -------------------------------------------------------------------------------
    def rollout(self, prompts: Batch, endpoint, phase) -> Batch:
        """Every row's episode, its model calls served by `endpoint` in this `phase`; the batch of an
        agent rollout (hybridflow/agents/trajectory.py) with `env_rewards` per sample."""
        local_chat_program(self.warm.launcher_path)  # this env's (another env loaded here since may have closed its own)
        self.warm.start()
        rows = [{k: prompts.objects[k][i] for k in prompts.objects} for i in range(len(prompts))]
        tasks = [self.task(row, i) for i, row in enumerate(rows)]
        keys = endpoint.open_phase(phase.version, phase.seeds, phase.budget, phase.generate, phase.temperature)
        try:
            episodes = asyncio.run(self._episodes(tasks, [endpoint.base_url(k) for k in keys]))
        finally:
            records = endpoint.close_phase()
        samples = [self._sample(i, records[k], e, phase) for i, (k, e) in enumerate(zip(keys, episodes))]
        trajectories = [t for t, _ in samples]
        out = trajectories_to_batch(trajectories, with_prompts(prompts, trajectories, phase), phase.budget,
                                    phase.pad_token_id, phase.tokenizer)
        out.objects["env_rewards"] = [r for _, r in samples]
        out.tensors["env_unchained_calls"] = torch.tensor([float(records[k].unchained_calls()) for k in keys])
        return out

    async def _episodes(self, tasks: list, base_urls: list[str]) -> list:
        from verifiers.v1.clients import EvalClientConfig, ModelContext

        async with self.env.serving():
            return await asyncio.gather(*(
                self.env.run_episode(task, ModelContext(model="policy", client=EvalClientConfig(
                    base_url=url, api_key_var=API_KEY_VARIABLE))) for task, url in zip(tasks, base_urls)))

    def _sample(self, i: int, record, episode, phase) -> tuple[Trajectory, dict | None]:
        """The sample's trajectory (its last call's chain) and its rewards (None: the episode failed)."""
        call = record.trajectory()
        failure = _failure(episode) or ("" if call is not None else "the agent made no model call")
        if call is None:  # nothing sampled: an empty response on the row's own prompt
            t = Trajectory(prompt_ids=[], env=None, agent=self.name)
        else:
            t = Trajectory(prompt_ids=list(call.root_ids), env=None, agent=self.name, response_ids=list(call.response_ids),
                           loss_mask=list(call.loss_mask), log_probs=list(call.log_probs), last_response=call.reply,
                           turns=_chain_length(record))
        t.truncated = record.truncated or (call is not None and call.finish_reason == "length")
        t.env_steps = 1
        if record.malformed_tool_calls:  # the model's bad calls, returned to the agent as text: env/errors/<kind>
            t.failure_kinds[MALFORMED_TOOL_CALL] = record.malformed_tool_calls
        if failure and not (record.truncated and record.refused):  # a budget refusal is a truncation, not a fault
            t.env_failures, t.first_failure = 1, f"sample {i}: {failure}"
        if failure:
            return t, None
        trace = episode.traces[0]
        rewards = {"score": float(trace.reward)}
        rewards.update({name: float(r.score) for name, r in trace.rewards.items() if r is not None})  # None: unscored
        t.reward = rewards["score"]
        return t, rewards


def prompt_messages(data) -> list[dict]:
    """The messages a chat harness opens with: the task's system prompt, then its prompt."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    return messages + [m.model_dump(mode="json", exclude_none=True) for m in data.prompt or []]


def with_prompts(prompts: Batch, trajectories: list[Trajectory], phase) -> Batch:
    """`prompts` with each row's prompt ids replaced by its trajectory's first prompt, as the endpoint
    rendered and the engine read it (left-padded to data.max_prompt_tokens)."""
    width = phase.max_prompt_tokens
    ids = torch.full((len(prompts), width), phase.pad_token_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, t in enumerate(trajectories):
        root = t.prompt_ids or prompts["prompt_ids"][i][prompts["prompt_mask"][i]].tolist()
        if len(root) > width:
            raise AgentError(f"sample {i}: {t.agent}'s first prompt, as its harness sent it, has {len(root)} tokens, "
                             f"more than data.max_prompt_tokens={width}; raise data.max_prompt_tokens")
        ids[i, width - len(root):] = torch.tensor(root, dtype=torch.long)
        mask[i, width - len(root):] = True
    return Batch(tensors={**prompts.tensors, "prompt_ids": ids, "prompt_mask": mask}, objects=dict(prompts.objects),
                 meta=dict(prompts.meta))


def _chain_length(record) -> int:
    n, i = 0, len(record.calls) - 1
    while i is not None:
        n, i = n + 1, record.calls[i].parent
    return n


def _failure(episode) -> str:
    """The episode's first error as 'Type: message', '' when it and its traces went through."""
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if not errors and episode.traces:
        return ""
    if not errors:
        return "the episode ran no agent"
    return f"{errors[0].type}: {errors[0].message[:300]}"


def main(argv: list[str] | None = None) -> None:
    """Write an env's tasks as row files: python -m hybridflow.agents.hubs.verifiers_env <id> <out_dir>
    [--args JSON] [--val-rows N]: the last N tasks (default 10% of them, at least one) go to val.jsonl."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m hybridflow.agents.hubs.verifiers_env")
    parser.add_argument("environment")
    parser.add_argument("out_dir")
    parser.add_argument("--args", default="{}", help="rollout.environment_args as JSON")
    parser.add_argument("--val-rows", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None, help="read at most this many tasks")
    ns = parser.parse_args(argv)
    rows = VerifiersEnvironment(ns.environment, json.loads(ns.args)).rows(ns.limit)
    val = ns.val_rows if ns.val_rows is not None else max(1, len(rows) // 10)
    if len(rows) <= val:
        raise SystemExit(f"{ns.environment}: {len(rows)} tasks, not more than --val-rows={val}")
    out = Path(ns.out_dir)
    write_rows(rows[: len(rows) - val], out / "train.jsonl")
    write_rows(rows[len(rows) - val:], out / "val.jsonl")
    print(f"{out / 'train.jsonl'}: {len(rows) - val} rows; {out / 'val.jsonl'}: {val} rows")


if __name__ == "__main__":
    main()
