"""Trajectories of token ids, and the turn loop that grows many of them at once.

Token in, token out: a trajectory is the prompt's ids followed by response ids, each either
sampled by the model (loss mask True, with the sampler's log-prob) or encoded from an
observation (loss mask False). The model's ids are appended as the sampler returned them and
are never decoded and re-encoded, so what is trained is exactly what was sampled (re-encoding
the decoded text can give other ids: the multi-turn drift peers' users report). Text is decoded
only to be read (by the environment and the reward).

The loop is written against a `generate` function (a batch of token-id prompts in, sampled ids
and log-probs out), so its logic is tested without an engine; the vLLM rollout passes one that
submits every live trajectory's next turn in one call, so the engine's continuous batching
covers the turns of all trajectories together.

Limits: at most `max_turns` model turns and `max_tokens` response tokens (model and
observation tokens together; the response width). A trajectory stopped by either is counted as
truncated. It always ends with model tokens: an observation that does not fit is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hybridflow.agents.environment import (AgentError, call_with_row, check_step_result, error_observation,
                                           failure_kind, is_call_error)
from hybridflow.batch import Batch
from hybridflow.rewards.calls import run_sync



@dataclass(frozen=True)
class TurnRequest:
    prompt_ids: list[int]  # the prompt and the trajectory so far: token ids, as sampled and observed
    max_tokens: int  # what is left of the trajectory's token budget
    seed: int | None
    stop: tuple[str, ...]  # the environment's texts that end a turn (EOS always does)


# requests -> per request (sampled ids, their log-probs, stopped by the max_tokens limit)
GenerateFn = Callable[[list[TurnRequest]], list[tuple[list[int], list[float], bool]]]


@dataclass
class Trajectory:
    prompt_ids: list[int]
    env: Any
    agent: str  # the agent's name, for messages
    seed: int | None = None
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    last_response: str = ""  # the text of the model's last turn (the final answer)
    turns: int = 0
    tool_errors: int = 0  # every failed environment step: the model read an error observation
    env_steps: int = 0  # environment steps called
    env_failures: int = 0  # failed steps that were the environment's, not the call's (is_call_error)
    first_failure: str = ""  # the first of them, for the message that names it
    failure_kinds: dict[str, int] = field(default_factory=dict)  # env_failures by kind (environment.failure_kind)
    reward: float = 0.0
    truncated: bool = False
    done: bool = False

    def add_model_turn(self, ids: list[int], log_probs: list[float]) -> None:
        self.response_ids += ids
        self.loss_mask += [True] * len(ids)
        self.log_probs += log_probs
        self.turns += 1

    def add_observation(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [False] * len(ids)
        self.log_probs += [0.0] * len(ids)


def run_trajectories(trajectories: list[Trajectory], rows: list[dict], generate: GenerateFn, tokenizer,
                     max_turns: int, max_tokens: int, timeout_s: float) -> None:
    """Grow every trajectory until its environment says done, the model ends with EOS, or a
    limit stops it. Each round submits the next turn of every live trajectory in one call."""
    try:
        _reset(trajectories, rows, tokenizer, max_tokens, timeout_s)
        _run_turns(trajectories, generate, tokenizer, max_turns, max_tokens, timeout_s)
    finally:
        _close(trajectories)


def _run_turns(trajectories: list[Trajectory], generate: GenerateFn, tokenizer, max_turns: int, max_tokens: int,
               timeout_s: float) -> None:
    live = [t for t in trajectories if not t.done]
    while live:
        outputs = generate([TurnRequest(t.prompt_ids + t.response_ids, max_tokens - len(t.response_ids),
                                        _turn_seed(t), tuple(getattr(t.env, "stop", ()))) for t in live])
        stepping = []
        for t, (ids, log_probs, hit_length) in zip(live, outputs):
            t.add_model_turn(list(ids), list(log_probs))
            t.last_response = tokenizer.decode(ids, skip_special_tokens=True)  # read, never re-encoded
            if hit_length:  # out of tokens mid-turn: nothing complete to act on
                t.truncated = t.done = True
            else:
                stepping.append(t)
        _step(stepping, tokenizer, max_turns, max_tokens, timeout_s)
        live = [t for t in live if not t.done]


def _close(trajectories: list[Trajectory]) -> None:
    """Ends each environment that holds something outside this process (an OpenEnv server's session:
    its optional `close()`), all at once, each within 10 s; whatever a close raises is dropped."""
    calls = [t.env.close for t in trajectories if callable(getattr(t.env, "close", None))]
    if calls:
        run_sync(calls, 10.0, len(calls), False)


def _turn_seed(t: Trajectory) -> int | None:
    # A different seed per turn of one sample, derived from the sample's seed: reproducible, and
    # turns do not repeat each other's random draws.
    return None if t.seed is None else (t.seed * 1_000_003 + t.turns) % (2**31 - 1)


def _reset(trajectories: list[Trajectory], rows: list[dict], tokenizer, max_tokens: int, timeout_s: float) -> None:
    calls = [lambda t=t, row=row: call_with_row(t.env.reset, row) for t, row in zip(trajectories, rows)]
    for i, (t, outcome) in enumerate(zip(trajectories, run_sync(calls, timeout_s, len(calls) or 1, False))):
        if outcome.timed_out or outcome.error is not None:
            cause = f"timed out after {timeout_s}s" if outcome.timed_out else f"raised {outcome.error!r}"
            raise AgentError(f"sample {i}: agent {t.agent!r}: reset {cause}; reset runs once per sample before "
                             "the first turn and must succeed (rollout.tool_timeout_s bounds it)")
        if outcome.value is not None:
            if not isinstance(outcome.value, str):
                raise AgentError(f"sample {i}: agent {t.agent!r}: reset returned {type(outcome.value).__name__}; "
                                 "return the first observation as a str, or None")
            ids = tokenizer.encode(outcome.value, add_special_tokens=False)
            if len(ids) >= max_tokens:
                raise AgentError(f"sample {i}: agent {t.agent!r}: the first observation has {len(ids)} tokens, "
                                 f"no fewer than rollout.max_response_tokens={max_tokens}; raise it")
            t.add_observation(ids)


def _step(stepping: list[Trajectory], tokenizer, max_turns: int, max_tokens: int, timeout_s: float) -> None:
    """Every trajectory's environment step at once (threads, one deadline each): a slow tool
    delays the round by at most `timeout_s`, however many trajectories call it."""
    if not stepping:
        return
    calls = [lambda t=t: check_step_result(t.env.step(t.last_response), t.agent) for t in stepping]
    for t, outcome in zip(stepping, run_sync(calls, timeout_s, len(calls), False)):
        ended_by_model = t.response_ids[-1] == tokenizer.eos_token_id
        if outcome.ok:
            observation, reward, done = outcome.value
            t.reward += reward
        else:
            t.tool_errors += 1
            message = f"timed out after {timeout_s:g}s" if outcome.timed_out else \
                f"{type(outcome.error).__name__}: {outcome.error}"
            if outcome.timed_out or not is_call_error(outcome.error):
                t.env_failures += 1
                kind = failure_kind(outcome.error, outcome.timed_out)
                t.failure_kinds[kind] = t.failure_kinds.get(kind, 0) + 1
                t.first_failure = t.first_failure or message
            observation, done = error_observation(t.env, message), False
        t.env_steps += 1
        if done or ended_by_model:
            t.done = True
            continue
        ids = tokenizer.encode(observation or "", add_special_tokens=False)
        if t.turns >= max_turns or len(t.response_ids) + len(ids) + 1 > max_tokens:
            t.truncated = t.done = True  # no turn left, or the observation and one more model token do not fit
        else:
            t.add_observation(ids)


def trajectories_to_batch(trajectories: list[Trajectory], prompts: Batch, width: int, pad_token_id: int,
                          tokenizer) -> Batch:
    """The prompts with the rollout's outputs: `response_ids` (B, R) right-padded,
    `response_mask` (B, R) True on every response token (attention), `loss_mask` (B, R) True on
    the model's tokens, `sampler_log_probs` (B, R) 0 outside the loss mask; per sample
    `agent_turns`, `agent_tool_errors`, `agent_truncated` (B,); objects `response` (the last
    turn's text: the final answer), `trajectory` (all the response text) and `agent_reward`."""
    size = len(trajectories)
    ids = torch.full((size, width), pad_token_id, dtype=torch.long)  # (B, R)
    response_mask = torch.zeros((size, width), dtype=torch.bool)
    loss = torch.zeros((size, width), dtype=torch.bool)
    log_probs = torch.zeros((size, width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        n = len(t.response_ids)
        ids[i, :n] = torch.tensor(t.response_ids, dtype=torch.long)
        response_mask[i, :n] = True
        loss[i, :n] = torch.tensor(t.loss_mask, dtype=torch.bool)
        log_probs[i, :n] = torch.tensor(t.log_probs, dtype=torch.float32)
    tensors = {"response_ids": ids, "response_mask": response_mask, "loss_mask": loss, "sampler_log_probs": log_probs,
               "agent_turns": torch.tensor([t.turns for t in trajectories], dtype=torch.float32),
               "agent_tool_errors": torch.tensor([t.tool_errors for t in trajectories], dtype=torch.float32),
               "agent_truncated": torch.tensor([t.truncated for t in trajectories], dtype=torch.float32),
               "agent_env_steps": torch.tensor([t.env_steps for t in trajectories], dtype=torch.float32),
               "agent_env_failures": torch.tensor([t.env_failures for t in trajectories], dtype=torch.float32)}
    objects = {"response": [t.last_response for t in trajectories],
               "trajectory": [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajectories],
               "agent_reward": [t.reward for t in trajectories],
               "finish_reason": ["length" if t.truncated else "stop" for t in trajectories],
               "agent_failure": [f"agent {t.agent!r}: {t.first_failure}" if t.first_failure else ""
                                 for t in trajectories],
               "agent_failure_kinds": [dict(t.failure_kinds) for t in trajectories]}
    return prompts.union(Batch(tensors=tensors, objects=objects))


def agent_metrics(samples: Batch, prefix: str = "agent/") -> dict[str, float]:
    """`agent/turns_mean`, `agent/tool_errors` (per step, summed), `agent/truncated` (fraction),
    `agent/observation_tokens_mean`, `agent/env_failures` (summed) and `agent/env_failure_fraction`
    (of the environment steps called), `env/errors/<kind>` for each kind of failure the step met
    (timeout, connection, exception, malformed, ...), and for a hub environment `agent/unchained_calls`
    (summed: model calls that extended no earlier one and were left off the trajectory,
    hybridflow/agents/endpoint.py); empty for a batch that no agent rolled out."""
    if "agent_turns" not in samples:
        return {}
    observation_tokens = (samples["response_mask"] & ~samples["loss_mask"]).sum(dim=1).float()
    kinds = failure_kind_counts(samples).items()
    errors = {f"val/env/errors/{kind}": n for kind, n in kinds} if prefix.startswith("val/") else \
        {f"env/errors/{kind}": n for kind, n in kinds}
    if "env_unchained_calls" in samples:  # a hub environment's calls left off their sample's trajectory
        errors[f"{prefix}unchained_calls"] = float(samples["env_unchained_calls"].sum())
    return {**errors, f"{prefix}turns_mean": float(samples["agent_turns"].mean()),
            f"{prefix}tool_errors": float(samples["agent_tool_errors"].sum()),
            f"{prefix}truncated": float(samples["agent_truncated"].mean()),
            f"{prefix}observation_tokens_mean": float(observation_tokens.mean()),
            f"{prefix}env_failures": float(samples["agent_env_failures"].sum()),
            f"{prefix}env_failure_fraction": env_failure_fraction(samples)}


def env_failure_fraction(samples: Batch) -> float:
    """The share of a batch's environment steps that failed on the environment's side (0 without steps)."""
    steps = float(samples["agent_env_steps"].sum())
    return float(samples["agent_env_failures"].sum()) / steps if steps else 0.0


def failure_kind_counts(samples: Batch) -> dict[str, float]:
    """The batch's environment failures by kind (only the kinds it met): kind -> count."""
    counts: dict[str, float] = {}
    for kinds in samples.objects.get("agent_failure_kinds", []):
        for kind, n in (kinds or {}).items():
            counts[kind] = counts.get(kind, 0.0) + float(n)
    return counts
