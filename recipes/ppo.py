"""The PPO family: PPO with a critic, and the critic-free estimators (GRPO, Dr. GRPO, RLOO,
REINFORCE++, ReMax) — one loop, the algorithm chosen by config.

Per step: generate n samples per prompt -> reward -> old and reference log-probs -> values
-> advantages -> critic update -> actor update -> weight sync. Stages that do not depend on
each other are issued together (non-blocking), so on different pools they run at the same
time. An on-policy run with one update per step uses the sampler's log-probs as the old
log-probs instead of a second forward pass; the update reports how far they are from the
actor's own (`rollout/log_prob_diff`). Step hooks (`trainer.training_hooks`,
hybridflow/training/hooks.py, e.g. spike_recovery) run around the actor update, before the
reference hooks and the weight sync: weights a hook loads into the actor are synced to the
rollout at the end of the same step, so the next step generates with them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from hybridflow.algos import apply_kl_penalty, build_kl_controller, compute_advantages, masked_mean
from hybridflow.algos.rewards import place_sequence_rewards
from hybridflow.batch import Batch
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.controller import RoleSpec
from hybridflow.data.loader import PromptLoader
from hybridflow.data.prompts import encode_prompts
from hybridflow.faults import inject_faults
from hybridflow.launch import build_weight_sync, prepare_data, prepare_model, spawn_roles, start_ray, vllm_env
from hybridflow.rewards import reward_metrics
from hybridflow.runner import (
    Checkpointer,
    StageTimer,
    response_stats,
    run_training_hooks,
    sample_seeds,
    validate,
    validation_due,
)
from hybridflow.tracking import MetricsLogger
from hybridflow.training.hooks import StepHooks, batches_to_remember
from hybridflow.training.sequences import loss_mask
from recipes.roles import actor_role, critic_role, reference_role, reward_role, rollout_role


def run(config: HybridFlowConfig, run_dir: Path) -> dict:
    model_dir = prepare_model(config, run_dir)
    data = prepare_data(config, run_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=config.model.trust_remote_code)
    start_ray(config)
    groups = spawn_roles(config, build_roles(config, model_dir, tokenizer), env_vars=vllm_env(config))
    actor, rollout, reward = groups["actor"], groups["rollout"], groups["reward"]
    reference, critic = groups.get("reference"), groups.get("critic")
    for future in [g.start.remote() for name, g in groups.items() if name != "rollout"] + [rollout.start_engine.remote()]:
        future.get()

    trainable = {"actor": actor, **({"critic": critic} if critic else {})}
    checkpointer = Checkpointer(config, run_dir, model_dir, trainable)
    t = config.trainer
    loader = PromptLoader(data.train, t.prompts_per_step, seed=config.seed,
                          remember_batches=batches_to_remember(t.training_hooks, t.save_every_steps))
    kl_ctl = build_kl_controller(config.algorithm.kl_controller, **kl_controller_args(config))
    state = checkpointer.resume() or {}
    step = int(state.get("step", 0))
    if state:
        loader.load_state_dict(state["loader"])
        kl_ctl.coef = float(state["kl_coef"])
    weight_sync = build_weight_sync(config, actor, rollout)
    weight_sync.setup()
    weight_sync.sync(step)
    logger = MetricsLogger(run_dir, config.logger, total_steps=config.trainer.total_steps)
    hooks = StepHooks.build(t.training_hooks, run_dir, loader)
    n = config.rollout.samples_per_prompt
    on_policy = config.trainer.use_sampler_log_probs and config.actor.epochs_per_step == 1 and \
        config.actor.samples_per_mini_batch in (0, config.trainer.prompts_per_step * n)

    while step < config.trainer.total_steps:
        step += 1
        inject_faults(config, step, groups, run_dir)  # trainer.fault_injection: off unless configured
        timer = StageTimer()
        with timer("generate"), weight_sync.generating():  # GPU, colocated: the devices change hands
            prompts = encode_prompts(loader.next_rows(), tokenizer, config.data.max_prompt_tokens)
            prompts.tensors["group_ids"] = torch.arange(len(prompts))
            greedy = rollout.generate(prompts, greedy=True) if needs_greedy_baseline(config) else None  # ReMax
            prompts = prompts.repeat_interleave(n)
            prompts.tensors["sample_seed"] = sample_seeds(config.seed, step, len(prompts))
            samples = rollout.generate(prompts)
        with timer("score"):  # independent: on separate pools these run at the same time
            pending = [reward.compute_rewards.remote(text_only(samples))]
            baseline = reward.compute_rewards.remote(text_only(greedy)) if greedy is not None else None
            if not on_policy:
                pending.append(actor.compute_log_probs.remote(samples))
            if reference is not None:
                pending.append(reference.compute_ref_log_probs.remote(samples))
            elif config.actor.lora.rank and needs_reference(config):
                pending.append(actor.compute_ref_log_probs.remote(samples))
            if critic is not None:
                pending.append(critic.compute_values.remote(samples))
            for future in pending:
                samples = samples.union(future.get())
            if baseline is not None:  # each prompt's greedy reward, beside each of its n samples
                samples.tensors["baseline_rewards"] = baseline.get()["sequence_rewards"].repeat_interleave(n)
        if on_policy:
            samples.tensors["old_log_probs"] = samples["sampler_log_probs"]
        with timer("advantages"):
            samples, algo_metrics = add_advantages(samples, config, kl_ctl.coef)
            kl_ctl.update(algo_metrics.get("kl/penalty_mean", 0.0), n_steps=len(samples))
        actor_learns = step > config.trainer.critic_warmup_steps
        with timer("update"):
            critic_update = critic.update_critic.remote(samples) if critic is not None else None
            hook_metrics = hooks.before_update(step, actor) if actor_learns else {}
            actor_metrics = actor.update_policy(samples)[0] if actor_learns else {}
            critic_metrics = critic_update.get()[0] if critic_update is not None else {}
            if actor_learns:  # step hooks first: a reference EMA then follows weights they loaded
                hook_metrics.update(hooks.after_update(step, {**reward_metrics(samples), **actor_metrics}, actor))
                hook_metrics.update(run_training_hooks(config, step, actor, reference))
        with timer("weight_sync"):
            sync_metrics = weight_sync.sync(step) if actor_learns else {}

        metrics = {**reward_metrics(samples), **algo_metrics, **actor_metrics, **critic_metrics, **hook_metrics,
                   **sync_metrics, **response_stats(samples), **timer.seconds, "kl/coef": kl_ctl.coef}
        metrics["perf/tokens_per_s"] = metrics["response/tokens"] / metrics["timing/generate_s"]
        if on_policy and actor_learns:  # the update's first forward pass is the actor's log-prob of the sampled tokens
            metrics["rollout/log_prob_diff"] = actor_metrics["actor/log_prob_diff_from_old"]
        elif not on_policy:
            metrics["rollout/log_prob_diff"] = float(masked_mean(
                (samples["old_log_probs"] - samples["sampler_log_probs"]).abs(), loss_mask(samples)))
        if validation_due(config, step):
            with weight_sync.generating():
                metrics.update(validate(config, rollout, reward, data.val, tokenizer, step))
        logger.log(step, metrics)
        if checkpointer.due(step):
            checkpointer.save(step, {"loader": loader.state_dict(), "kl_coef": kl_ctl.coef, "metrics": metrics})

    final_model = checkpointer.export_final(run_dir) if config.trainer.export_hf else None
    logger.close()
    return {"final_model": final_model, "steps": step}


def needs_reference(config: HybridFlowConfig) -> bool:
    return config.algorithm.kl_penalty_coef > 0 or config.actor.kl_loss_coef > 0


def needs_greedy_baseline(config: HybridFlowConfig) -> bool:
    """ReMax's baseline is the reward of one greedy response per prompt."""
    return config.algorithm.advantage_estimator == "remax"


def text_only(samples: Batch) -> Batch:
    """What the reward role reads: the prompt, response and data columns, no tensors."""
    return samples.select(list(samples.objects))


def build_roles(config: HybridFlowConfig, model_dir: Path, tokenizer) -> dict[str, RoleSpec]:
    roles = {
        "actor": actor_role(config, model_dir),
        "rollout": rollout_role(config, model_dir, tokenizer),
        "reward": reward_role(config),
    }
    if needs_reference(config) and not config.actor.lora.rank:
        roles["reference"] = reference_role(config, model_dir)
    if config.algorithm.use_critic:
        roles["critic"] = critic_role(config, model_dir)
    return roles


def kl_controller_args(config: HybridFlowConfig) -> dict:
    a = config.algorithm
    if a.kl_controller == "adaptive":
        return {"init_coef": a.kl_penalty_coef, "target_kl": a.kl_target, "horizon": a.kl_horizon}
    return {"coef": a.kl_penalty_coef}


def add_advantages(samples: Batch, config: HybridFlowConfig, kl_coef: float) -> tuple[Batch, dict[str, float]]:
    """Token rewards (sequence reward on the last token, minus the KL penalty), then the
    configured advantage estimator. Adds `token_rewards`, `advantages`, `returns`.

    Reads `sequence_rewards`, `loss_mask` (the sampled tokens: tool output gets no reward or
    advantage, and the estimators skip over it), `group_ids`, `old_log_probs` and `ref_log_probs`
    (when a reference ran), `values` (with a critic) and `baseline_rewards` (ReMax: the greedy
    response's reward per sample, (B,))."""
    a, mask = config.algorithm, loss_mask(samples)
    token_rewards = place_sequence_rewards(samples["sequence_rewards"], mask)
    baseline_token_rewards = None
    if "baseline_rewards" in samples:  # summed over the row by the estimator: any one column carries it
        baseline_token_rewards = torch.zeros_like(token_rewards)
        baseline_token_rewards[:, 0] = samples["baseline_rewards"].float()
    metrics: dict[str, float] = {}
    if "ref_log_probs" in samples:
        token_rewards, kl_stats = apply_kl_penalty(
            token_rewards=token_rewards, log_probs=samples["old_log_probs"], ref_log_probs=samples["ref_log_probs"],
            response_mask=mask, kl_coef=kl_coef if a.kl_penalty_coef > 0 else 0.0, estimator=a.kl_penalty_estimator)
        metrics["kl/penalty_mean"] = kl_stats["kl_per_sequence"]
        metrics["kl/token_mean"] = kl_stats["kl"]
    advantages, returns, stats = compute_advantages(
        a.advantage_estimator, token_rewards=token_rewards, response_mask=mask, values=samples.tensors.get("values"),
        group_ids=samples["group_ids"], baseline_token_rewards=baseline_token_rewards, gamma=a.gamma, lam=a.lam)
    samples = samples.union(Batch({"token_rewards": token_rewards, "advantages": advantages, "returns": returns}))
    metrics.update({f"advantages/{k}": v for k, v in stats.items()})
    return samples, metrics
