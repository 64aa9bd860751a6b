"""Whether a config can run: the rules across its sections, and those that ask the runtime.

The schema (`hybridflow/config/schema.py`) checks each section by itself in its dataclasses'
`__post_init__`, importing nothing but the config package and the standard library. What spans
sections (hooks x recipe, the async schedule x everything it needs) or asks the runtime (the
registered losses, estimators and step hooks, the schedule a staleness chooses, vLLM's adapter
limits, the precision this hardware computes in) is here, in two kinds of pure functions that
return problems and never change the config:

- `config_problems(config)`: what the config alone shows; `hybridflow.config.to_config` raises them
  for every composed config, before anything starts;
- `plan_problems(config, plan)`: what the stage's plan shows (the rollout layout on its pools, the
  step's samples over the actor's ranks, what the async schedule needs of the placement), run once
  the plan is decided (`hybridflow.run.stage.prepare_stage`), still before Ray starts.

`resolved(config)` is the config as this machine runs it: model.dtype/rollout.dtype=auto and a null
weight_sync.probe_tolerance filled in, as a copy. Each problem names the key, the value and what is
allowed (`need`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from hybridflow.algos import (ADVANTAGE_ESTIMATORS, KL_CONTROLLERS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES,
                              check_estimator)
from hybridflow.config.engines import ROLLOUT_ENGINES, rollout_engine
from hybridflow.config.model_facts import ModelFacts
from hybridflow.config.references import check_tool_call_parser as check_tool_call_parser_name
from hybridflow.config.recipes import recipe_spec
from hybridflow.config.schema import Dtype, HybridFlowConfig, model_heads, model_layers
from hybridflow.planning.layout import overlap_problems, rollout_layout_problems
from hybridflow.planning.plan import Plan
from hybridflow.precision import device_of, resolve_dtypes
from hybridflow.resharding.adapter import UNSERVED_MODULES, VLLM_LORA_RANKS
from hybridflow.resharding.verify import probe_tolerance
from hybridflow.rewards.builtin import REWARD_FUNCTIONS
from hybridflow.rollout_schedules import Schedule, schedule_class
from hybridflow.training.hooks import STEP_HOOKS, check_step_hooks


def need(ok: bool, key: str, value: Any, allowed: str) -> list[str]:
    """[] when `ok`, else the one problem: the key, the value and what is allowed."""
    return [] if ok else [f"config {key}={value!r} is invalid: {allowed}"]


def resolved(config: HybridFlowConfig) -> HybridFlowConfig:
    """A copy of `config` as this machine runs it: model.dtype/rollout.dtype=auto become the dtypes it
    computes in (hybridflow/precision.py), a null weight_sync.probe_tolerance the tolerance for them, a
    null rollout.sleep_level the level the run's sync allows (`sleep_level`)."""
    model, rollout = resolve_dtypes(config.model.dtype.value, config.rollout.dtype.value,
                                    device_of(config.placement.device.value))
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=Dtype(model)),
                                 rollout=dataclasses.replace(config.rollout, dtype=Dtype(rollout)))
    if config.weight_sync.probe_tolerance is None and not recipe_spec(config.recipe.name).pipeline:
        tolerance = probe_tolerance(model, rollout, model_layers(config.model))
        config = dataclasses.replace(config, weight_sync=dataclasses.replace(config.weight_sync,
                                                                             probe_tolerance=tolerance))
    if config.rollout.sleep_level is None and not recipe_spec(config.recipe.name).pipeline:
        config = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,
                                                                         sleep_level=sleep_level(config)))
    return config


def sleep_level(config: HybridFlowConfig) -> int:
    """rollout.sleep_level=null's choice: 2 (a sleep discards the engine's weights) when every sync
    rewrites every weight, 1 when the adapter sync leaves the base weights as they are."""
    return 1 if lora_sync(config)[0] == "adapter" else 2


def first_problems(checks: list[Callable[[], list[str]]]) -> list[str]:
    """The problems of the first check that finds any (a later check may assume what an earlier one refuses)."""
    for check in checks:
        problems = check()
        if problems:
            return problems
    return []


def config_problems(config: HybridFlowConfig) -> list[str]:
    """What the config alone shows (`resolved` first: the precision rule reads the resolved dtypes)."""
    checks = [lambda: check_registered_names(config), lambda: check_reward_names(config),
              lambda: check_environment_reward(config), lambda: check_tool_call_parser(config),
              lambda: check_rollout_engine(config), lambda: check_exact_engine(config),
              lambda: check_truncated_sampling(config),
              lambda: check_precision(config), lambda: check_lora_sync(config), lambda: check_local_backend(config)]
    if not recipe_spec(config.recipe.name).pipeline:  # a pipeline's stages compose their own configs, each checked
        checks += [lambda: check_tiny_model_context(config), lambda: check_hooks(config),
                   lambda: check_algorithm_needs(config), lambda: check_rollout_correction(config),
                   lambda: check_schedule(config)]
    return first_problems(checks)


def plan_problems(config: HybridFlowConfig, plan: Plan, schedule: type[Schedule] | None = None) -> list[str]:
    """What the stage's `plan` shows: the rollout layout on its pools, the step over the actor's ranks,
    and what the async schedule needs of the placement (`schedule`: the class trainer.max_staleness chooses,
    where the caller has it; else asked here)."""
    return first_problems([lambda: check_rollout_layout(config, plan), lambda: check_sequence_parallel(config, plan),
                           lambda: check_step_split(config, plan), lambda: check_overlap(config, plan, schedule)])


def check_lora_sync(config: HybridFlowConfig) -> list[str]:
    """weight_sync.lora=adapter needs a LoRA actor whose adapter vLLM can serve; an adapter sync needs an
    engine that keeps its base weights across a sleep (rollout.sleep_level 1)."""
    problems = need(config.weight_sync.lora != "adapter" or config.actor.lora.rank > 0, "weight_sync.lora",
                    config.weight_sync.lora, "serves a LoRA adapter, and actor.lora.rank is 0: set actor.lora.rank, "
                    "or weight_sync.lora=auto")
    unserved = adapter_unserved(config) if config.weight_sync.lora == "adapter" and not problems else ""
    problems += need(not unserved, "weight_sync.lora", config.weight_sync.lora,
                     f"{unserved}: set weight_sync.lora=folded (or auto, which chooses it here)")
    return problems or need(config.rollout.sleep_level != 2 or lora_sync(config)[0] != "adapter",
                            "rollout.sleep_level", config.rollout.sleep_level,
                            "discards the engine's weights at every sleep, and this run's adapter sync "
                            f"({lora_sync(config)[1]}) never sends the base weights back: set rollout.sleep_level=1 "
                            "(or null, which chooses it here), or weight_sync.lora=folded")


def check_local_backend(config: HybridFlowConfig) -> list[str]:
    """placement.backend=local runs the driver and every role in one process on one device: refuse
    what needs more (pools, devices, a cluster, processes to kill or hang), naming the fix."""
    problems: list[str] = []
    p = config.placement
    if not p.one_process:
        return problems
    fix = "use placement=local (one pool of one device), or placement.backend=ray"
    problems += need(len(p.pools) == 1, "placement.pools", sorted(p.pools),
            f"placement.backend=local runs one process on one device, so one pool: {fix}")
    if problems:
        return problems
    (name, pool), = p.pools.items()
    problems += need(pool.nodes == 1 and pool.devices_per_node == 1, f"placement.pools.{name}", f"{pool.nodes} node(s) x "
            f"{pool.devices_per_node} device(s)", f"placement.backend=local runs on one device: set "
            f"placement.pools.{name}.devices_per_node=1 and nodes=1 ({fix})")
    problems += need(not p.planner.auto, "placement.planner.auto", True,
            "placement=auto plans pools over a Ray cluster; placement.backend=local has one process on one device: "
            "use placement=local")
    problems += need(config.ray.address is None, "ray.address", config.ray.address,
            "placement.backend=local joins no cluster: unset ray.address, or use placement.backend=ray")
    faults = [f"{f.kind} of {f.role}" for f in config.trainer.fault_injection if f.kind in ("kill", "hang")]
    problems += need(not faults, "trainer.fault_injection", faults, "a fault that kills or hangs a worker process would "
            "kill or hang the one process of placement.backend=local: use placement.backend=ray for them")
    return problems


def check_registered_names(config: HybridFlowConfig) -> list[str]:
    """Names that must be registered: advantage estimators (or a custom 'module:function', imported and
    checked now), KL estimators and controllers, policy losses and loss aggregations; and the schedule's
    rule on old log-probs."""
    problems: list[str] = []
    a, actor, t = config.algorithm, config.actor, config.trainer
    known = ADVANTAGE_ESTIMATORS.names()
    problems += need(a.advantage_estimator in known or ":" in a.advantage_estimator,
            "algorithm.advantage_estimator", a.advantage_estimator, f"one of {known}, or 'module:function'")
    if a.advantage_estimator not in known:  # a custom one: import it and check its signature now
        try:
            check_estimator(a.advantage_estimator)
        except Exception as exc:  # noqa: BLE001 - whatever the import raised, refuse the config with it
            problems += need(False, "algorithm.advantage_estimator", a.advantage_estimator, str(exc))
    problems += need(a.kl_penalty_estimator in KL_ESTIMATORS.names(), "algorithm.kl_penalty_estimator",
            a.kl_penalty_estimator, f"one of {KL_ESTIMATORS.names()}")
    problems += need(a.kl_controller in KL_CONTROLLERS.names(), "algorithm.kl_controller", a.kl_controller,
            f"one of {KL_CONTROLLERS.names()}")
    problems += need(actor.policy_loss in POLICY_LOSSES.names(), "actor.policy_loss", actor.policy_loss,
            f"one of {POLICY_LOSSES.names()}")
    problems += need(actor.loss_aggregation in LOSS_AGGREGATIONS.names(), "actor.loss_aggregation", actor.loss_aggregation,
            f"one of {LOSS_AGGREGATIONS.names()}")
    problems += need(actor.kl_loss_estimator in KL_ESTIMATORS.names(), "actor.kl_loss_estimator", actor.kl_loss_estimator,
            f"one of {KL_ESTIMATORS.names()}")
    problems += need(not schedule_class(t.max_staleness).stale or t.old_log_probs != "auto", "trainer.old_log_probs",
            t.old_log_probs,
            f"trainer.max_staleness={t.max_staleness} trains on samples from an older policy: choose the "
            "correction, trainer.old_log_probs=actor (recomputed, with algorithm.rollout_correction) or "
            "trainer.old_log_probs=sampler (clip against the sampler)")
    return problems


def check_reward_names(config: HybridFlowConfig) -> list[str]:
    """Each reward function named without a colon is a registered one (hybridflow/rewards/builtin.py)."""
    known = REWARD_FUNCTIONS.names()
    return [problem for spec, key in zip(config.reward.function_specs(), config.reward.function_keys())
            for problem in need(":" in spec.fn or spec.fn in REWARD_FUNCTIONS, key if key == "reward.fn" else f"{key}.fn",
                                spec.fn,
                                f"not a registered reward function ({', '.join(known)}); a custom one is written "
                                "'package.module:name' or 'path/to/file.py:name'")]


def check_environment_reward(config: HybridFlowConfig) -> list[str]:
    """A hub environment (rollout.environment) is rewarded by its own rubric, the `environment` reward
    function, which has nothing to read without one."""
    environment, specs = config.rollout.environment, config.reward.function_specs()
    uses = [key for spec, key in zip(specs, config.reward.function_keys()) if spec.fn == "environment"]
    if environment:
        return need(bool(uses), "reward.fn", config.reward.fn,
                    f"rollout.environment={environment} is rewarded by its own rubric: set reward.fn=environment "
                    "(or add {fn: environment} to reward.functions beside your own)")
    return need(not uses, (uses[0] if uses[0] == "reward.fn" else f"{uses[0]}.fn") if uses else "reward.fn", "environment",
                "the environment reward function scores a hub environment's episodes: set rollout.environment "
                "(docs/agents.md), or name another reward function")


def check_rollout_correction(config: HybridFlowConfig) -> list[str]:
    """A rollout correction preset compares the sampler's log-probs with the actor's recomputed π_old: a run
    that clips against the sampler has no π_old of its own to correct towards."""
    problems: list[str] = []
    preset, t = config.algorithm.rollout_correction, config.trainer
    problems += need(preset in ("auto", "none") or t.old_log_probs != "sampler", "algorithm.rollout_correction", preset,
            "corrects from the sampler's log-probs to the actor's recomputed π_old, and trainer.old_log_probs=sampler "
            "clips against the sampler itself (nothing to correct): set trainer.old_log_probs=actor (or auto), or "
            "algorithm.rollout_correction=none")
    return problems


def check_tool_call_parser(config: HybridFlowConfig) -> list[str]:
    """rollout.tool_call_parser names one of vLLM's tool-call parsers (hybridflow/agents/tool_calls.py)."""
    return check_tool_call_parser_name(config.rollout.tool_call_parser)


def check_rollout_engine(config: HybridFlowConfig) -> list[str]:
    """rollout.backend names an engine (`hybridflow.config.engines`) that can do what the rollout asks."""
    problems: list[str] = []
    engine = rollout_engine(config.rollout.backend)
    which = "rollout.agent" if config.rollout.agent else "rollout.environment" if config.rollout.environment else ""
    problems += need(not which or engine.agents, "rollout.backend", config.rollout.backend,
            f"agent rollouts ({which}) run on an engine that runs them: "
            f"{[e.name for e in ROLLOUT_ENGINES.values() if e.agents]}")
    head = "computes with the actor's output head: set actor.fp32_lm_head=true instead" if engine.exact else \
        "computes its output head in rollout.dtype"
    problems += need(not config.rollout.fp32_lm_head or engine.fp32_lm_head, "rollout.fp32_lm_head", True,
            f"rollout.backend={config.rollout.backend} {head}; engines that compute it in float32: "
            f"{[e.name for e in ROLLOUT_ENGINES.values() if e.fp32_lm_head]} (or set it to false)")
    return problems


def check_truncated_sampling(config: HybridFlowConfig) -> list[str]:
    """Truncated sampling in a recipe that trains on its samples. The engines sample from the top-k /
    top-p filtered distribution and report its renormalised log-probs (what was sampled from: μ), while
    the actor scores the same tokens over the whole vocabulary; every token's ratio π/μ is then off by
    the mass the filter cut (mean |Δ log p| 0.35 at top_p=0.7 on the tiny model against 2e-7 at 1.0),
    and the update trains a policy nobody samples (TRL #6789, prime-rl #3235). Refused rather than
    replayed in the actor: the actor's own kept set differs from the sampler's at its edge, where a
    sampled token would get log-prob -inf (docs/reliability.md)."""
    rollout = config.rollout
    truncated = rollout.top_p < 1.0 or rollout.top_k != -1
    return need(not (truncated and recipe_spec(config.recipe.name).rl_reward), "rollout.top_p/top_k",
                (rollout.top_p, rollout.top_k), f"recipe={config.recipe.name} trains on its samples, and the "
                "engine's log-probs of a truncated distribution never equal the actor's whole-vocabulary ones "
                "(truncated sampling bias): set rollout.top_p=1.0 rollout.top_k=-1 (temperature still applies); "
                "truncated sampling stays available to recipe=evaluate")


def check_exact_engine(config: HybridFlowConfig) -> list[str]:
    """An exact engine (`RolloutEngine.exact`: the actor's module, in the layout of the actor's π_old pass;
    hybridflow/training/exact_layout.py) samples what π_old computes only where nothing else intervenes:
    π_old recomputed, no filter on the distribution, each sample trained in the batch it was generated
    in, the engine's dtype the actor's."""
    if not rollout_engine(config.rollout.backend).exact:
        return []
    backend, t, rollout = config.rollout.backend, config.trainer, config.rollout
    problems = need(t.old_log_probs != "sampler", "trainer.old_log_probs", t.old_log_probs,
            f"rollout.backend={backend} makes the sampler's log-probs the actor's recomputed π_old bit for bit, and "
            "=sampler skips that pass (the mismatch would then be read from the update's forward, another layout): "
            "set trainer.old_log_probs=auto or actor")
    problems += need(rollout.top_p == 1.0 and rollout.top_k == -1, "rollout.top_p/top_k",
            (rollout.top_p, rollout.top_k), f"rollout.backend={backend} samples from the distribution the trainer "
            "computes, which no filter cuts: set rollout.top_p=1.0 rollout.top_k=-1, or use rollout.backend=hf")
    problems += need(not config.algorithm.dynamic_sampling_rounds, "algorithm.dynamic_sampling_rounds",
            config.algorithm.dynamic_sampling_rounds,
            f"rollout.backend={backend} needs each rank's π_old pass to read the rows it generated, as it generated "
            "them, and dynamic sampling assembles a step's batch from several generations: set it to 0")
    problems += need(rollout.dtype == config.model.dtype, "rollout.dtype", rollout.dtype.value,
            f"rollout.backend={backend} computes with the actor's module, in model.dtype ({config.model.dtype.value}): "
            "set rollout.dtype=auto (or the same dtype)")
    return problems


def check_precision(config: HybridFlowConfig) -> list[str]:
    """model.master_dtype: float32, or the (resolved) model.dtype itself for pure 16-bit training."""
    model = config.model.dtype
    return need(config.model.master_dtype in (Dtype.float32, model), "model.master_dtype",
                config.model.master_dtype.value, f"float32, or model.dtype ({model.value}) itself for pure 16-bit "
                "training")


def lora_sync(config: HybridFlowConfig) -> tuple[str, str]:
    """How a LoRA actor's weights reach the rollout each sync: ("adapter" | "folded", why), or
    ("", "") without LoRA. The one place this is decided (weight_sync.lora;
    hybridflow/resharding/adapter.py)."""
    if not config.actor.lora.rank:
        return "", ""
    if config.weight_sync.lora == "folded":
        return "folded", "weight_sync.lora=folded"
    unserved = adapter_unserved(config)
    if unserved:
        return "folded", unserved
    return "adapter", f"weight_sync.lora={config.weight_sync.lora}: vLLM serves the rank-{config.actor.lora.rank} adapter"


def adapter_unserved(config: HybridFlowConfig) -> str:
    """Why vLLM cannot serve this run's LoRA as an adapter ("" when it can)."""
    lora, d = config.actor.lora, config.trainer.max_staleness
    if not rollout_engine(config.rollout.backend).serves_adapters:
        return f"rollout.backend={config.rollout.backend} serves no LoRA adapter (it generates with a copy of the whole model)"
    if schedule_class(d).stages_weights:
        return f"trainer.max_staleness={d} stages pushes while the engine generates, which the adapter sync does not"
    modules = [m for m in lora.target_modules if m in UNSERVED_MODULES]
    if modules:
        return f"actor.lora.target_modules has {modules}, which vLLM's LoRA does not serve here"
    if lora.rank > VLLM_LORA_RANKS[-1]:
        return f"actor.lora.rank={lora.rank} is above vLLM's largest adapter rank ({VLLM_LORA_RANKS[-1]})"
    return ""


def check_rollout_layout(config: HybridFlowConfig, plan: Plan) -> list[str]:
    """Every placement x tensor-parallel combination that cannot run, refused with what would."""
    problems: list[str] = []
    rollout = config.rollout
    heads, kv_heads = model_heads(config.model)
    tp, ranks = plan.rollout_tp, plan.devices_of("rollout")
    for key, value, allowed in rollout_layout_problems(
            tp, ranks, plan.pool_of("rollout").name, heads, kv_heads, engine=rollout_engine(rollout.backend),
            colocated=plan.rollout_colocated, actor_pool=plan.pool_of("actor").name):
        problems += need(False, key, value, allowed)
    # several engines of TP > 1 in one pool are vLLM's data parallel: their steps run in lockstep, and agent
    # rollouts call the engine a different number of times on each
    problems += need(not ((rollout.agent or rollout.environment) and 1 < tp < ranks), "rollout.tensor_parallel_size", tp,
            f"with rollout.agent, 1 (one engine per rank) or {ranks} (one engine across the pool): "
            f"{ranks // tp} engines of TP {tp} step in lockstep, and agent turns differ from engine to engine")
    return problems


def check_tiny_model_context(config: HybridFlowConfig) -> list[str]:
    """The tiny model built from model.tiny (model.path unset) holds max_position_embeddings
    tokens; the engine is asked for a prompt's and a response's worth. Checked here, before Ray
    starts: the engine would refuse it only after every worker has started."""
    problems: list[str] = []
    spec = recipe_spec(config.recipe.name)
    if config.model.path is not None or not (spec.reads_key("data.max_prompt_tokens")
                                             and spec.reads_key("rollout.max_response_tokens")):
        return problems
    prompt, response = config.data.max_prompt_tokens, config.rollout.max_response_tokens
    tokens, have = prompt + response, config.model.tiny.max_position_embeddings
    problems += need(tokens <= have, "data.max_prompt_tokens", prompt,
            f"with rollout.max_response_tokens={response} that is {tokens} tokens, more than the tiny model holds "
            f"(model.tiny.max_position_embeddings={have}): lower data.max_prompt_tokens to at most {have - response}, "
            "or raise model.tiny.max_position_embeddings")
    return problems


def check_sequence_parallel(config: HybridFlowConfig, plan: Plan) -> list[str]:
    """Each role's sequence_parallel_size (docs/long_sequences.md; the actor's and the reference's
    actor.sequence_parallel_size, critic.sequence_parallel_size, teacher.sequence_parallel_size): it divides the
    role's ranks into groups of consecutive ranks, and its model's attention and key/value heads over a group
    (the all-to-all hands each rank heads / SP of them); it splits packed rows only (the padded path stays at
    1 in this release). A size set for a role the run does not start is refused."""
    spec = recipe_spec(config.recipe.name)
    critic_runs = config.algorithm.use_critic and spec.reads_key("critic")
    problems = need(critic_runs or config.critic.sequence_parallel_size == 1, "critic.sequence_parallel_size",
                    config.critic.sequence_parallel_size, "no critic runs (algorithm.use_critic=false, or "
                    f"recipe={config.recipe.name} trains none): set it to 1")
    problems += need(config.teacher_role_runs or config.teacher.sequence_parallel_size == 1,
                     "teacher.sequence_parallel_size", config.teacher.sequence_parallel_size,
                     "no teacher runs (teacher.path is null, or the recipe reads none): set it to 1")
    roles = [("actor", "actor.sequence_parallel_size", config.actor.sequence_parallel_size, "the model",
              model_heads(config.model))]
    if config.reference_role_runs and spec.reference:  # the actor's starting model, split as the actor's
        roles.append(("reference", "actor.sequence_parallel_size", config.actor.sequence_parallel_size,
                      "the model", model_heads(config.model)))
    if critic_runs:
        roles.append(("critic", "critic.sequence_parallel_size", config.critic.sequence_parallel_size, "the model",
                      model_heads(config.model)))
    for role, path in config.teacher.paths.items() if config.teacher_role_runs else ():
        facts = ModelFacts.from_dir(path)  # None: a stage's teacher not written yet, checked when it loads
        roles.append((role, "teacher.sequence_parallel_size", config.teacher.sequence_parallel_size,
                      f"the teacher model {path}", (facts.heads, facts.kv_heads) if facts else (0, 0)))
    for role, key, sp, model, heads in roles:
        if sp > 1:
            problems += _sequence_parallel_problems(config, key, sp, f"the {role} pool", plan.devices_of(role),
                                                    model, heads)
    return list(dict.fromkeys(problems))  # the reference's problems repeat the actor's on a shared pool


def _sequence_parallel_problems(config: HybridFlowConfig, key: str, sp: int, pool: str, ranks: int, model: str,
                                heads: tuple[int, int]) -> list[str]:
    """One role's `key`=`sp` over its `ranks` and its model's (attention, key/value) `heads` ((0, 0): unknown)."""
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    problems = need(ranks % sp == 0, key, sp,
                    f"{pool} has {ranks} rank(s), which groups of {sp} do not divide ({ranks} % {sp} = "
                    f"{ranks % sp}); fix: one of {divisors}, or a pool of a multiple of {sp} ranks")
    heads, kv_heads = heads
    if heads and (heads % sp or kv_heads % sp):
        common = [d for d in range(1, min(heads, kv_heads) + 1) if heads % d == 0 and kv_heads % d == 0]
        problems += need(False, key, sp,
                         f"{model} has {heads} attention heads and {kv_heads} key/value heads ({heads} % {sp} = "
                         f"{heads % sp}, {kv_heads} % {sp} = {kv_heads % sp}), and each rank of a group attends with "
                         f"1/{sp} of both; fix: a size that divides both: one of {common}")
    problems += need(config.model.pack_sequences is not False, "model.pack_sequences", config.model.pack_sequences,
                     f"{key}={sp} splits packed rows; the padded path runs at {key}=1 only: set "
                     "model.pack_sequences=null or true")
    return problems


def check_step_split(config: HybridFlowConfig, plan: Plan) -> list[str]:
    """The step's samples (and a pretraining step's sequences) divide over the actor's data-parallel groups
    (its ranks, or its sequence-parallel groups: each group's ranks take the same rows), and a mini-batch is
    a whole number of rows per group."""
    problems: list[str] = []
    sp = config.actor.sequence_parallel_size
    world = plan.devices_of("actor") // sp
    ranks = "actor ranks" if sp == 1 else f"actor data-parallel groups (sequence-parallel groups of {sp} ranks)"
    samples = config.trainer.prompts_per_step * config.rollout.samples_per_prompt
    problems += need(samples % world == 0, "trainer.prompts_per_step", config.trainer.prompts_per_step,
            f"prompts_per_step x rollout.samples_per_prompt ({samples}) must divide evenly over the "
            f"{world} {ranks}")
    mini = config.actor.samples_per_mini_batch
    problems += need(mini == 0 or (samples % mini == 0 and mini % world == 0), "actor.samples_per_mini_batch", mini,
            f"must divide the step's {samples} samples and be a multiple of the {world} {ranks}")
    problems += need(not recipe_spec(config.recipe.name).packs_sequences or config.pretrain.sequences_per_step % world == 0,
            "pretrain.sequences_per_step", config.pretrain.sequences_per_step,
            f"must divide evenly over the {world} {ranks}")
    return problems


def check_hooks(config: HybridFlowConfig) -> list[str]:
    """Step hooks by their own rules; the reference model's hooks only where a reference runs."""
    problems: list[str] = []
    t, spec = config.trainer, recipe_spec(config.recipe.name)
    try:
        check_step_hooks(config)
    except ValueError as exc:  # the step hooks' own rules raise theirs
        return [str(exc)]
    reference_hooks = [h.name for h in t.training_hooks if h.name not in STEP_HOOKS]
    problems += need(not reference_hooks or config.needs_reference, "trainer.training_hooks", reference_hooks,
            "the hooks update the reference model, which runs only with algorithm.kl_penalty_coef > 0 or "
            "actor.kl_loss_coef > 0 (recipe=dpo: with a dpo.loss tied to the reference and dpo.reference_free=false)")
    problems += need(not (spec.step_hooks and not spec.reference) or not reference_hooks, "trainer.training_hooks",
            reference_hooks, f"recipe={config.recipe.name} has no reference model; its hooks are the step hooks "
            f"{STEP_HOOKS.names()}")
    problems += need(not reference_hooks or not config.actor.lora.rank, "trainer.training_hooks", reference_hooks,
            "with LoRA the reference is the actor with its adapter disabled; it has no weights of its own to set")
    return problems


def check_algorithm_needs(config: HybridFlowConfig) -> list[str]:
    """What the algorithm's settings need from the rest: a critic, groups of several samples, a
    response limit the overlong shaping fits under."""
    problems: list[str] = []
    a, t, spec = config.algorithm, config.trainer, recipe_spec(config.recipe.name)
    problems += need(not t.critic_warmup_steps or a.use_critic, "trainer.critic_warmup_steps", t.critic_warmup_steps,
            "only a run with a critic (algorithm.use_critic=true) can warm one up; set it to 0")
    problems += need(not a.dynamic_sampling_rounds or config.rollout.samples_per_prompt >= 2,
            "algorithm.dynamic_sampling_rounds", a.dynamic_sampling_rounds,
            f"dynamic sampling keeps groups whose samples' rewards differ; with rollout.samples_per_prompt="
            f"{config.rollout.samples_per_prompt} every group is one sample: raise it to >= 2, or set this to 0")
    problems += need(not a.dynamic_sampling_rounds or not [h for h in t.training_hooks if h.name == "spike_recovery"],
            "algorithm.dynamic_sampling_rounds", a.dynamic_sampling_rounds,
            "the spike_recovery hook puts back whole steps' prompts, and dynamic sampling draws a varying "
            "number per step: use one of the two")
    per_round = a.dynamic_sampling_prompts_per_round
    problems += need(not per_round or per_round % t.prompts_per_step == 0, "algorithm.dynamic_sampling_prompts_per_round",
            per_round, f"draws whole loader batches: set a multiple of trainer.prompts_per_step ({t.prompts_per_step}), "
            f"e.g. {3 * t.prompts_per_step}, or 0")
    problems += need(a.overlong_buffer_tokens <= config.rollout.max_response_tokens, "algorithm.overlong_buffer_tokens",
            a.overlong_buffer_tokens, f"must be at most rollout.max_response_tokens "
            f"({config.rollout.max_response_tokens}): the shaping starts that many tokens before the limit")
    problems += need(not spec.needs_critic or a.use_critic, "algorithm.use_critic", a.use_critic,
            f"recipe={config.recipe.name} trains a critic: set algorithm.use_critic=true")
    problems += need(not spec.needs_teacher or config.teacher.runs, "teacher.path", config.teacher.path,
            f"recipe={config.recipe.name} distils from a teacher: set teacher.path to a Hugging Face model directory "
            "whose tokenizer is the student's (in a pipeline: the stage's teacher_stage names an earlier stage)")
    problems += need(not config.teacher_role_runs or config.teacher.reward_weight > 0 or a.use_critic is False,
            "teacher.reward_weight", config.teacher.reward_weight,
            "a critic learns the reward's values, and with teacher.reward_weight=0 no advantage reads them: "
            "set algorithm.use_critic=false, or a reward weight > 0")
    problems += need(not config.teacher_role_runs or config.teacher.objective != "topk" or
                     not schedule_class(t.max_staleness).stale,
            "teacher.objective", config.teacher.objective,
            f"topk trains on each batch as the current student's samples, and trainer.max_staleness={t.max_staleness} "
            "trains on older weights' samples with nothing to correct them: use teacher.objective=advantage (its "
            "policy loss clips against the sampler), or trainer.max_staleness=0")
    problems += need(not config.teacher_role_runs or config.teacher.student_fraction == 1.0 or not config.rollout.agent,
            "teacher.student_fraction", config.teacher.student_fraction,
            "a data answer is one model turn, and agent trajectories (rollout.agent) interleave the model's turns "
            "with the environment's, masked from the loss: keep teacher.student_fraction=1 with an agent")
    return problems


def check_schedule(config: HybridFlowConfig) -> list[str]:
    """What the schedule trainer.max_staleness chooses needs of the config (hybridflow/rollout_schedules.py,
    docs/async.md): overlapping generation with training, staged pushes, no weight reloads."""
    d, rollout = config.trainer.max_staleness, config.rollout
    schedule = schedule_class(d)
    problems = need(rollout.on_update == "finish" or schedule.stages_weights, "rollout.on_update", rollout.on_update,
                    f"weights land while requests run only when pushes are staged, with trainer.max_staleness >= 2 "
                    f"(it is {d}, the {schedule.name} schedule): use rollout.on_update=finish, or raise "
                    "trainer.max_staleness")
    problems += need(rollout.on_update == "finish" or not (rollout.agent or rollout.environment), "rollout.on_update",
                     rollout.on_update,
                     "multi-turn agent rollouts (rollout.agent) load new weights between batches only: use "
                     "rollout.on_update=finish")
    if not schedule.overlaps or problems:
        return problems
    problems += need(recipe_spec(config.recipe.name).overlaps_generation, "trainer.max_staleness", d,
                     f"only the RL recipes (grpo, ppo) generate while training, not recipe={config.recipe.name}")
    hooks = [h.name for h in config.trainer.training_hooks
             if h.name in STEP_HOOKS and STEP_HOOKS.get(h.name).reloads_weights]
    return problems + need(schedule.reloads_weights or not hooks, "trainer.training_hooks", hooks,
                           f"{' and '.join(hooks)} reload{'s' if len(hooks) == 1 else ''} the actor's weights, and at "
                           f"trainer.max_staleness={d} the batches in flight were generated by the weights thrown away "
                           "and cannot all be generated again: use them with trainer.max_staleness <= 1")


def check_overlap(config: HybridFlowConfig, plan: Plan, schedule: type[Schedule] | None = None) -> list[str]:
    """An overlapping schedule's needs of the placement (`hybridflow.planning.layout.overlap_problems`); rollout=hf
    on a pool of its own is refused by check_rollout_layout (it loads in-process)."""
    d = config.trainer.max_staleness
    overlaps = (schedule or schedule_class(d)).overlaps
    if not overlaps:
        return []
    return [problem for key, value, allowed in overlap_problems(d, overlaps, plan.rollout_colocated,
                                                                plan.pool_of("rollout").name)
            for problem in need(False, key, value, allowed)]
