"""The PPO family: PPO with a critic, and the critic-free estimators (GRPO, Dr. GRPO, RLOO,
REINFORCE++, ReMax) — one loop, the algorithm chosen by config.

Per step, each stage a named call: generate n samples per prompt (`rollouts.next`, the
schedule of hybridflow/rollout_schedules.py) -> `score` (reward, old and reference log-probs,
values) -> `add_advantages` -> `update` (critic, then actor with its step hooks) -> weight sync
(`rollouts.updated`) -> `step_metrics`. Stages that do not depend on each other are issued
together (non-blocking), so on different pools they run at the same time. With
`trainer.max_staleness=1` the same calls run one-step-off: the next batch generates on the
rollout pool while this one trains (docs/async.md).

The update clips against π_old: the sampler's log-probs when the run is on-policy with one
update per step (no second forward pass; the update reports how far they are from the actor's
own, `rollout/log_prob_diff`) or with `trainer.old_log_probs=sampler`, else the actor's
recomputed `old_log_probs` (hybridflow/batch_keys.py names every key). Every step reports the
rollout–training mismatch of the batch it trains (`rollout_mismatch/*`, hybridflow.algos.mismatch:
`old_log_probs` against the sampler's, or, clipping against the sampler, the update's first
mini-batch before its optimizer step), and a rollout correction preset (algorithm.rollout_correction,
hybridflow.algos.rollout_correction) weighs the update's tokens when π_old is recomputed. Step hooks
(`trainer.training_hooks`, hybridflow/training/hooks.py, e.g. spike_recovery) run around the
actor update, before the reference hooks and the weight sync: weights a hook loads into the
actor are synced to the rollout at the end of the same step, so the next step generates with
them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.algos import apply_kl_penalty, build_kl_controller, compute_advantages, masked_mean, masked_var
from hybridflow.algos.mismatch import mismatch_metrics
from hybridflow.algos.rollout_correction import rollout_correction, token_band
from hybridflow.algos.rewards import informative_groups, overlong_penalty, place_sequence_rewards
from hybridflow.batch import Batch, from_json, to_json
from hybridflow.batch_keys import clips_against_sampler, proximal_key, require
from hybridflow.output import console
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.controller import RoleSpec
from hybridflow.data.loader import PromptLoader
from hybridflow.data.prompts import encode_prompts
from hybridflow.run.faults import inject_faults
from hybridflow.controller.memory import pool_memory_metrics
from hybridflow.run.lifecycle import start_run
from hybridflow.run.stage import Stage
from hybridflow.rewards import reward_metrics
from hybridflow.rewards.composer import EXTRA_PREFIX
from hybridflow.rollout_schedules import Pending, build_schedule, schedule_class
from hybridflow.run.runner import (
    StageTimer,
    response_stats,
    run_training_hooks,
    sample_seeds,
    target_reached,
    validate,
    validation_due,
)
from hybridflow.training.guards import StepGuards
from hybridflow.training.hooks import StepHooks
from hybridflow.training.sequences import balanced_over_ranks, loss_mask
from recipes.distillation import TeacherScores, add_distillation, students, with_data_answers
from recipes.roles import actor_role, critic_role, reference_role, reward_role, rollout_role, teacher_role


def run(stage: Stage, run_dir: Path) -> dict:
    config = stage.config
    session = start_run(stage, run_dir, lambda model_dir, tokenizer: build_roles(config, model_dir, tokenizer))
    groups, tokenizer, data = session.groups, session.tokenizer, session.data
    t = config.trainer
    training = session.training([role for role in ("actor", "critic") if role in groups], data.train,
                                t.prompts_per_step, drawn_ahead=t.max_staleness)
    loader, logger, weight_sync, state, step = (training.loader, training.logger, training.weight_sync,
                                                training.state, training.step)
    kl_ctl = build_kl_controller(config.algorithm.kl_controller, **kl_controller_args(config))
    if state:
        kl_ctl.coef = float(state["kl_coef"])
    r = Step(config, groups, tokenizer, loader, training.hooks)
    rollouts = build_schedule(Batches(r), weight_sync, t.max_staleness, last_step=t.total_steps)
    rollouts.start(step, **state.get("rollouts", {}))
    guards = StepGuards.from_config(config, session.model_dir)  # parity, no signal, broken environments, stalls

    while step < t.total_steps:
        step += 1
        inject_faults(config, step, groups, run_dir)  # trainer.fault_injection: off unless configured
        timer = StageTimer()
        with timer("generate"), weight_sync.generating():  # GPU, colocated: the devices change hands
            (samples, greedy), trained_version, queue_metrics = rollouts.next(step)
        queue_metrics.update(weight_sync.handover_seconds())  # inside timing/generate_s
        if config.teacher_role_runs and config.teacher.student_fraction < 1:  # GKD's mixture: some data answers
            samples = with_data_answers(r, samples, step)
        with timer("score"):  # independent: on separate pools these run at the same time
            samples = score(r, samples, greedy)
        with timer("advantages"):
            samples, algo_metrics = add_advantages(samples, config, kl_ctl.coef, r.proximal)
            kl_ctl.update(algo_metrics.get("kl/penalty_mean", 0.0), n_steps=len(samples))
        actor_learns = step > t.critic_warmup_steps
        with timer("update"):
            update_metrics = update(r, step, balanced(r, samples), actor_learns)
        sync_metrics = rollouts.updated(step, learned=actor_learns,  # with the step's timing/weight_sync_s
                                        reloaded=r.hooks.reloaded_weights(step))
        metrics = step_metrics(r, samples, trained_version, rollouts.stale, actor_learns, {
            **algo_metrics, **update_metrics, **sync_metrics, **queue_metrics, **timer.seconds, "kl/coef": kl_ctl.coef,
            "timing/step_s": timer.elapsed_s()})  # generate to weight sync, before validation
        if validation_due(config, step):
            metrics.update(rollouts.drain(step))  # validate the newest weights (depth 0: pushed already)
            with weight_sync.generating():
                metrics.update(validate(config, r.rollout, r.reward, data.val, tokenizer, step))
        metrics.update(pool_memory_metrics(groups))  # each pool's peak since the last step's read
        guards.observe(metrics)
        logger.log(step, metrics)
        logger.log_prompts(step, samples["prompt_index"][::r.n].tolist())  # trained_prompts.jsonl
        guards.check(step, samples, metrics)
        if training.checkpointer.due(step):
            rollouts.drain(step)
            training.checkpointer.save(step, {"loader": loader.state_dict(), "kl_coef": kl_ctl.coef,
                                              "metrics": metrics, "rollouts": rollouts.state()})
        if target_reached(config, step, metrics):  # after a validation: nothing in flight (drained)
            break

    return session.finish(training, step)


class Step:
    """What the stages of a step read: the config, the role groups, the data, the hooks, and
    which log-probs the update clips against (`proximal`, hybridflow.batch_keys)."""

    def __init__(self, config: HybridFlowConfig, groups: dict, tokenizer, loader: PromptLoader,
                 hooks: StepHooks) -> None:
        self.config, self.tokenizer, self.loader, self.hooks = config, tokenizer, loader, hooks
        self.actor, self.rollout, self.reward = groups["actor"], groups["rollout"], groups["reward"]
        self.reference, self.critic = groups.get("reference"), groups.get("critic")
        self.teachers = {role: group for role, group in groups.items() if role.split(".", 1)[0] == "teacher"}
        self.teacher = next(iter(self.teachers.values()), None)  # one of them: whether a teacher scores at all
        self.n = config.rollout.samples_per_prompt
        self.clip_against_sampler = clips_against_sampler(config)
        self.proximal = proximal_key(self.clip_against_sampler)
        self.weighted = applied_correction(config, self.proximal) != "none"
        a = config.algorithm
        self.mismatch_band = token_band(a.rollout_correction, a.rollout_correction_cap, a.rollout_correction_low,
                                        a.rollout_correction_high)


def applied_correction(config: HybridFlowConfig, proximal: str) -> str:
    """The rollout correction preset the step's update applies (hybridflow.algos.rollout_correction):
    none when the update clips against the sampler (π_old is μ itself); with algorithm.rollout_correction
    =auto, token_tis on a stale run's batches (trainer.max_staleness > 0), none on a synchronous one;
    else the preset chosen, on every batch."""
    preset = config.algorithm.rollout_correction
    if proximal != "old_log_probs":
        return "none"
    if preset == "auto":
        return "token_tis" if schedule_class(config.trainer.max_staleness).stale else "none"
    return preset


class Batches:
    """The schedule's generator (hybridflow.rollout_schedules.Generator): a step's batch is its prompts'
    samples (and ReMax's greedy responses)."""

    def __init__(self, r: Step) -> None:
        self.r = r

    def launch(self, step: int, version: int, staged: bool) -> Pending:
        """Draw the step's prompts and submit their generation (and ReMax's greedy pass) to the
        rollout, without waiting; per-sample seeds depend only on the step."""
        return submit_generation(self.r, step, draw_prompts(self.r, step), version, staged)

    def relaunch(self, pending: Pending, version: int) -> Pending:
        prompts, staged = pending.source
        return submit_generation(self.r, pending.step, prompts, version, staged)

    def version_of(self, result: tuple) -> int:
        return int(result[0]["behavior_version"].min())

    def encode(self, result: tuple) -> list:
        return [None if b is None else to_json(b) for b in result]

    def decode(self, saved: list) -> tuple:
        return tuple(None if b is None else from_json(b) for b in saved)


def draw_prompts(r: Step, step: int) -> Batch:
    """The next `trainer.prompts_per_step` rows drawn for `step` (with dynamic sampling, the round's
    algorithm.dynamic_sampling_prompts_per_round: several loader batches), encoded, one group id per prompt."""
    a = r.config.algorithm
    per_round = a.dynamic_sampling_prompts_per_round if a.dynamic_sampling_rounds else 0
    batches = max(1, per_round // r.config.trainer.prompts_per_step)
    rows, indices = [], []
    for _ in range(batches):
        rows += r.loader.next_rows(step)
        indices += r.loader.last_picked
    prompts = encode_prompts(rows, r.tokenizer, r.config.data.max_prompt_tokens,
                             truncation=r.config.data.prompt_truncation)
    prompts.tensors["group_ids"] = torch.arange(len(prompts))
    prompts.tensors["prompt_index"] = torch.tensor(indices, dtype=torch.long)  # (B,) rows of the training data
    return prompts


def samples_of(r: Step, prompts: Batch, step: int, round_: int = 0) -> Batch:
    """Each prompt `rollout.samples_per_prompt` times, with per-sample seeds that depend only on the
    step and (dynamic sampling's extra rounds) the round: round k continues where round k-1's end."""
    samples = prompts.repeat_interleave(r.n)
    samples.tensors["sample_seed"] = sample_seeds(r.config.seed, step, len(samples)) + len(samples) * round_
    return samples


def submit_generation(r: Step, step: int, prompts: Batch, version: int, staged: bool) -> Pending:
    """`version`: the policy version the rollout holds, or (`staged`) the oldest it may generate
    with, loading staged weights first and waiting for them if needed; the rollout stamps each
    sample with the version it used (`behavior_version`)."""
    staged_args = {"min_version": version, "weights_timeout_s": r.config.weight_sync.timeout_s} if staged else {}
    greedy = r.rollout.generate.remote(prompts, greedy=True, **staged_args) if needs_greedy_baseline(r.config) else None
    samples = r.rollout.generate.remote(samples_of(r, prompts, step), **staged_args)

    def collect() -> tuple[Batch, Batch | None]:
        greedy_out = greedy.get() if greedy is not None else None  # ReMax's baseline
        if r.config.algorithm.dynamic_sampling_rounds:
            return refill_groups(r, step, len(prompts), samples.get(), staged_args), greedy_out
        return samples.get(), greedy_out

    return Pending(step, version, collect, source=(prompts, staged))


def refill_groups(r: Step, step: int, groups: int, samples: Batch, staged_args: dict) -> Batch:
    """DAPO's dynamic sampling: `samples` scored, the groups whose algorithm.dynamic_sampling_metric all
    agrees dropped, and more prompts drawn and generated (with the same policy-version bound as the
    step's batch, so the staleness bound holds) until `groups` informative groups are in hand or
    algorithm.dynamic_sampling_rounds extra rounds are spent. Still short: an error saying the numbers
    (dynamic_sampling_on_limit=raise, as verl), or topped up with groups that agree (top_up), so the step
    trains on a full batch. The batch keeps its rewards (`score` does not ask again) and says what
    happened in `dynamic_sampling/*` (Batch.meta)."""
    a = r.config.algorithm
    scored = add_rewards(r, samples, r.reward.compute_rewards.remote(text_only(samples)).get())
    (kept, dropped), rounds = _split_groups(scored, a.dynamic_sampling_metric), 0
    while len(kept) < groups and rounds < a.dynamic_sampling_rounds:
        rounds += 1
        more = r.rollout.generate.remote(samples_of(r, draw_prompts(r, step), step, rounds), **staged_args).get()
        more = add_rewards(r, more, r.reward.compute_rewards.remote(text_only(more)).get())
        new_kept, new_dropped = _split_groups(more, a.dynamic_sampling_metric)
        kept, dropped = kept + new_kept, dropped + new_dropped
    generated = len(kept) + len(dropped)
    if len(kept) < groups and a.dynamic_sampling_on_limit == "raise":
        raise RuntimeError(
            f"dynamic sampling at step {step}: {len(kept)} of the {groups} groups a step trains (trainer."
            f"prompts_per_step) differ in their {a.dynamic_sampling_metric} after {rounds} extra rounds "
            f"(algorithm.dynamic_sampling_rounds={a.dynamic_sampling_rounds}): {generated} groups generated, "
            f"{len(dropped)} all alike. Fix: raise algorithm.dynamic_sampling_rounds or algorithm.dynamic_sampling_"
            f"prompts_per_round, use data the model solves sometimes but not always, or set algorithm.dynamic_"
            f"sampling_on_limit=top_up to train on groups that agree")
    informative = min(len(kept), groups)
    chosen = (kept + dropped)[:groups]
    batch = Batch.concat(_same_columns(chosen))
    batch.tensors["group_ids"] = torch.arange(groups).repeat_interleave(r.n)  # one id per group again
    batch.meta.update({"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/informative_groups": float(informative),
                       "dynamic_sampling/generated_groups": float(generated),
                       "dynamic_sampling/kept_groups": float(len(kept)),
                       "dynamic_sampling/dropped_groups": float(len(dropped)),
                       "dynamic_sampling/short_groups": float(groups - informative)})
    return batch


def _same_columns(groups: list[Batch]) -> list[Batch]:
    """`groups` with the reward columns some lack added (an extra a function returned only for other
    rows: NaN, as the reward role fills it; a fallback cause: False), so that they concatenate."""
    keys = {k for g in groups for k in g.tensors}
    out = []
    for g in groups:
        missing = keys - set(g.tensors)
        filled = {k: torch.full((len(g),), float("nan")) if k.startswith("reward_extra/") else torch.zeros(len(g), dtype=torch.bool)
                  for k in missing if k.startswith(("reward_extra/", "reward_fallback"))}
        out.append(g.union(Batch(filled)) if filled else g)
    return out


def _split_groups(samples: Batch, metric: str) -> tuple[list[Batch], list[Batch]]:
    """(informative groups, groups whose `metric` all agrees), each group a Batch of its samples."""
    ids = samples["group_ids"]
    informative = set(informative_groups(filter_values(samples, metric), ids).tolist())
    kept, dropped = [], []
    for g in dict.fromkeys(ids.tolist()):
        group = samples.index(torch.nonzero(ids == g)[:, 0])
        (kept if g in informative else dropped).append(group)
    return kept, dropped


def filter_values(samples: Batch, metric: str) -> torch.Tensor:
    """(B,) what dynamic sampling compares within a group (algorithm.dynamic_sampling_metric): the
    reward's `accuracy` extra (a sample scored with the fallback, NaN there, counts as -1), the reward
    role's total before the overlong shaping, or the shaped reward the advantages see."""
    if metric == "shaped_reward":
        return samples["sequence_rewards"]
    if metric == "reward":
        penalty = samples.tensors.get(EXTRA_PREFIX + "overlong_penalty")
        return samples["sequence_rewards"] - (penalty if penalty is not None else 0.0)
    keys = [k for k in samples.tensors if k == EXTRA_PREFIX + "accuracy"] or \
        [k for k in samples.tensors if k.startswith(EXTRA_PREFIX) and k.endswith("/accuracy")]
    if len(keys) != 1:
        found = "no reward function returns one" if not keys else f"several do ({', '.join(keys)})"
        raise ValueError(f"algorithm.dynamic_sampling_metric=accuracy keeps the groups whose samples' `accuracy` "
                         f"differs, and {found}; fix: return {{'score': ..., 'accuracy': ...}} from one reward "
                         f"function, or set algorithm.dynamic_sampling_metric=reward (the total reward)")
    return samples[keys[0]].nan_to_num(nan=-1.0)


def add_rewards(r: Step, samples: Batch, rewards: Batch) -> Batch:
    """`samples` with the reward role's `rewards`, and DAPO's overlong shaping when
    algorithm.overlong_buffer_tokens > 0: `sequence_rewards` lowered by `overlong_penalty`, which is
    also kept as `reward_extra/overlong_penalty` (the metric `reward/overlong_penalty`)."""
    samples = samples.union(rewards)
    a = r.config.algorithm
    if a.overlong_buffer_tokens:
        penalty = overlong_penalty(samples["response_mask"].sum(dim=1), r.config.rollout.max_response_tokens,
                                   a.overlong_buffer_tokens, a.overlong_penalty)
        samples.tensors["sequence_rewards"] = samples["sequence_rewards"] + penalty
        samples.tensors[EXTRA_PREFIX + "overlong_penalty"] = penalty  # the metric reward/overlong_penalty
    return samples


def score(r: Step, samples: Batch, greedy: Batch | None) -> Batch:
    """Rewards, π_old (unless the update clips against the sampler), reference log-probs, values and
    the teacher's log-probs (distillation), issued together."""
    config = r.config
    rewards = None if "sequence_rewards" in samples else r.reward.compute_rewards.remote(text_only(samples))  # dynamic sampling scored it
    pending = []
    baseline = r.reward.compute_rewards.remote(text_only(greedy)) if greedy is not None else None
    if not r.clip_against_sampler:
        pending.append(r.actor.compute_log_probs.remote(samples))
    if r.reference is not None:
        pending.append(r.reference.compute_ref_log_probs.remote(samples))
    elif config.actor.lora.rank and config.needs_reference:  # the actor with its adapter disabled
        pending.append(r.actor.compute_ref_log_probs.remote(samples))
    if r.critic is not None:
        pending.append(r.critic.compute_values.remote(samples))
    if r.teachers:
        pending.append(TeacherScores(r, samples))
    if rewards is not None:
        samples = add_rewards(r, samples, rewards.get())
    for future in pending:
        samples = samples.union(future.get())
    if baseline is not None:  # each prompt's greedy reward, beside each of its n samples
        samples.tensors["baseline_rewards"] = baseline.get()["sequence_rewards"].repeat_interleave(r.n)
    return samples


def balanced(r: Step, samples: Batch) -> Batch:
    """The samples reordered so each of the actor's data-parallel ranks trains about as many tokens
    (trainer.balance_batch); advantages go by group id, not position, so nothing else changes."""
    ranks = r.actor.world_size // r.actor.replica_size
    return balanced_over_ranks(samples, ranks) if r.config.trainer.balance_batch and ranks > 1 else samples


def update(r: Step, step: int, samples: Batch, actor_learns: bool) -> dict[str, float]:
    """Critic and actor updates (the critic's issued first, so on its own pool it trains
    meanwhile), with the step hooks around the actor's."""
    critic_update = r.critic.update_critic.remote(samples) if r.critic is not None else None
    hook_metrics = r.hooks.before_update(step, r.actor) if actor_learns else {}
    actor_metrics = {}
    if actor_learns and r.teacher is not None and r.config.teacher.objective == "topk":  # a supervised step
        actor_metrics = r.actor.train_objective(samples, "distill_topk", {
            "beta": r.config.teacher.beta, "temperature": r.config.rollout.temperature})[0]
    elif actor_learns:
        require(samples, [r.proximal, "advantages", *(["ref_log_probs"] if r.config.actor.kl_loss_coef else []),
                          *(["behavior_weights"] if r.weighted else [])], "actor.update_policy")
        actor_metrics = r.actor.update_policy(samples, old_log_probs_key=r.proximal, weighted=r.weighted,
                                              mismatch_band=r.mismatch_band)[0]
    critic_metrics = critic_update.get()[0] if critic_update is not None else {}
    if actor_learns:  # step hooks first: a reference EMA then follows weights they loaded
        hook_metrics.update(r.hooks.after_update(step, {**reward_metrics(students(samples)), **actor_metrics}, r.actor))
        hook_metrics.update(run_training_hooks(r.config, step, r.actor, r.reference))
    return {**actor_metrics, **critic_metrics, **hook_metrics}


def step_metrics(r: Step, samples: Batch, trained_version: int, stale: bool, actor_learns: bool,
                 stage_metrics: dict[str, float]) -> dict[str, float]:
    """The step's row of metrics.jsonl: rewards, the stages', responses, throughput, how far the
    sampler's log-probs are from the actor's at the same version, and (async) staleness: the
    version the batch trained on minus each sample's `behavior_version`."""
    sampled = students(samples)  # not the data answers a distillation mixed in
    metrics = {**reward_metrics(sampled), **stage_metrics, **response_stats(sampled),
               **{k: v for k, v in samples.meta.items()  # each forward pass's own; dynamic sampling's counts
                  if k.startswith(("timing/", "dynamic_sampling/", "distill/"))}}
    metrics["perf/tokens_per_s"] = metrics["response/tokens"] / metrics["timing/generate_s"]
    staleness = trained_version - samples["behavior_version"]  # (B,)
    before_update = metrics.pop("log_prob_diff_before_update", None)  # the actor's, not a metric of its own
    if r.clip_against_sampler and actor_learns and not staleness.any() and before_update is not None:
        # the update's first mini-batch, before its optimizer step: later ones see moved weights
        metrics["rollout/log_prob_diff"] = before_update
    elif not r.clip_against_sampler and not staleness.any():
        metrics["rollout/log_prob_diff"] = float(masked_mean(
            (samples["old_log_probs"] - samples["sampler_log_probs"]).abs(), loss_mask(samples)))
    if not r.clip_against_sampler:  # π_old recomputed: on every batch; else the update measured it (rollout_mismatch/*)
        mismatch = mismatch_metrics(
            trainer_log_probs=samples["old_log_probs"], sampler_log_probs=samples["sampler_log_probs"],
            response_mask=loss_mask(samples), band_low=r.mismatch_band[0], band_high=r.mismatch_band[1])
        metrics.update({f"rollout_mismatch/{k}": v for k, v in mismatch.items()})
    warn_mismatch(r.config, metrics)
    if "weights_wait_s" in samples:  # staged pushes: how long the rollout waited for the weights it needed
        metrics["async/rollout_weights_wait_s"] = float(samples["weights_wait_s"].max())
    if "token_versions" in samples:  # rollout.on_update=recompute: versions a sample's tokens span
        versions, mask = samples["token_versions"], samples["response_mask"]
        newest = versions.masked_fill(~mask, -1).max(dim=1).values
        metrics["async/version_span_max"] = float((newest - samples["behavior_version"]).clamp(min=0).max())
    if stale:
        metrics.update({"async/staleness_mean": float(staleness.float().mean()),
                        "async/staleness_max": float(staleness.max()),
                        "async/behavior_version_min": float(samples["behavior_version"].min()),
                        "async/trained_version": float(trained_version)})
    return metrics


def warn_mismatch(config: HybridFlowConfig, metrics: dict[str, float]) -> None:
    """A console line when the step's per-token KL(sampler ‖ trainer) passes algorithm.mismatch_warn_kl."""
    threshold, kl = config.algorithm.mismatch_warn_kl, metrics.get("rollout_mismatch/k3_kl")
    if threshold is not None and kl is not None and kl > threshold:
        console.say(f"hybridflow: the sampler's log-probs are off the trainer's: KL {kl:.3g} per token (k3) > "
                    f"algorithm.mismatch_warn_kl={threshold:g}; "
                    f"{metrics['rollout_mismatch/outside_band_fraction']:.2%} of the tokens outside the ratio band, "
                    f"largest |log-ratio| {metrics['rollout_mismatch/abs_diff_max']:.3g} (docs/algorithms.md "
                    f"\"Rollout correction\")")


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
    if "reference" in config.model_roles:
        roles["reference"] = reference_role(config, model_dir)
    if "critic" in config.model_roles:
        roles["critic"] = critic_role(config, model_dir)
    if "teacher" in config.model_roles:
        roles.update({role: teacher_role(config, path) for role, path in config.teacher.paths.items()})
    return roles


def kl_controller_args(config: HybridFlowConfig) -> dict:
    a = config.algorithm
    if a.kl_controller == "adaptive":
        return {"init_coef": a.kl_penalty_coef, "target_kl": a.kl_target, "horizon": a.kl_horizon}
    return {"coef": a.kl_penalty_coef}


def add_advantages(samples: Batch, config: HybridFlowConfig, kl_coef: float, proximal: str = "old_log_probs"
                   ) -> tuple[Batch, dict[str, float]]:
    """Token rewards (sequence reward on the last token, minus the KL penalty), then the
    configured advantage estimator, weighed by teacher.reward_weight and joined by the teacher's
    distillation signal when a teacher scores (`add_distillation`). Adds `token_rewards`, `advantages`,
    `returns`, and when the
    update clips against the actor's `old_log_probs` and a rollout correction applies
    (`applied_correction`) `behavior_weights`, with the correction's statistics (`rollout_correction/*`).

    Reads `sequence_rewards`, `loss_mask` (the sampled tokens: tool output gets no reward or
    advantage, and the estimators skip over it), `group_ids`, the `proximal` log-probs and
    `ref_log_probs` (when a reference runs), `values` (with a critic) and `baseline_rewards`
    (ReMax: the greedy response's reward per sample, (B,)); hybridflow.batch_keys says who
    writes each."""
    a, mask = config.algorithm, loss_mask(samples)
    token_rewards = place_sequence_rewards(samples["sequence_rewards"], mask)
    baseline_token_rewards = None
    if needs_greedy_baseline(config):  # summed over the row by the estimator: any one column carries it
        baseline_token_rewards = torch.zeros_like(token_rewards)
        baseline_token_rewards[:, 0] = samples["baseline_rewards"].float()
    metrics: dict[str, float] = {}
    if config.needs_reference:
        token_rewards, kl_stats = apply_kl_penalty(
            token_rewards=token_rewards, log_probs=samples[proximal], ref_log_probs=samples["ref_log_probs"],
            response_mask=mask, kl_coef=kl_coef if a.kl_penalty_coef > 0 else 0.0, estimator=a.kl_penalty_estimator)
        metrics["kl/penalty_mean"] = kl_stats["kl_per_sequence"]
        metrics["kl/token_mean"] = kl_stats["kl"]
    advantages, returns, stats = compute_advantages(
        a.advantage_estimator, token_rewards=token_rewards, response_mask=mask,
        values=samples["values"] if a.use_critic else None, group_ids=samples["group_ids"],
        baseline_token_rewards=baseline_token_rewards, gamma=a.gamma, lam=a.lam)
    if "teacher_log_probs" in samples:  # the advantage statistics then describe the advantages trained
        advantages = add_distillation(samples, config, advantages, mask, proximal, metrics)
        stats = {**stats, "advantage_mean": float(masked_mean(advantages, mask)),
                 "advantage_std": float(masked_var(advantages, mask).sqrt())}
    added = {"token_rewards": token_rewards, "advantages": advantages, "returns": returns}
    preset = applied_correction(config, proximal)
    if preset != "none":
        added["behavior_weights"], correction_stats = rollout_correction(
            preset, old_log_probs=samples["old_log_probs"], sampler_log_probs=samples["sampler_log_probs"],
            response_mask=mask, cap=a.rollout_correction_cap, low=a.rollout_correction_low,
            high=a.rollout_correction_high)
        metrics.update({f"rollout_correction/{k}": v for k, v in correction_stats.items()})
    samples = samples.union(Batch(added))
    metrics.update({f"advantages/{k}": v for k, v in stats.items()})
    return samples, metrics
