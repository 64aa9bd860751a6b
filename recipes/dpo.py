"""Direct preference optimisation: the actor trained offline on (prompt, chosen, rejected) pairs.

Each step draws `trainer.prompts_per_step` pairs, scores both responses of each with the reference
(the starting model: the reference role, or with LoRA the actor with its adapter disabled; none for
the reference-free SimPO) and takes one optimizer step on the `dpo.loss` of `PREFERENCE_LOSSES`
(hybridflow/algos/preference.py). The data is TRL's preference format (hybridflow/data/preference.py),
or the synthetic task with its right answer chosen and a near miss rejected. Every
`trainer.val_every_steps` the held-out pairs are scored: the loss and implicit rewards TRL reports,
and `val/preference_accuracy`, the share of pairs whose chosen response the policy itself rates
above the rejected one (at step 0, the starting model's). No rollout: nothing is generated.
Step hooks (`trainer.training_hooks`) run around each update, as in SFT.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import torch

from hybridflow.algos.preference import LENGTH_NORMALISED, compute_preference_loss
from hybridflow.batch import Batch
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.controller import WorkerGroup
from hybridflow.data.preference import encode_pairs
from hybridflow.launch import prepare_preference_data
from hybridflow.lifecycle import start_run
from hybridflow.runner import StageTimer, validation_due
from recipes.roles import actor_role, reference_role


def run(config: HybridFlowConfig, run_dir: Path) -> dict:
    def roles(model_dir: Path, tokenizer) -> dict:
        # log-probs of given responses: no sampling temperature applies
        actor = actor_role(config, model_dir)
        specs = {"actor": dataclasses.replace(actor, kwargs={**actor.kwargs, "temperature": 1.0})}
        if config.reference_role_runs:
            specs["reference"] = reference_role(config, model_dir)
        return specs

    session = start_run(config, run_dir, roles, data=prepare_preference_data)  # pairs checked before Ray
    data, actor, dpo, t = session.data, session.groups["actor"], config.dpo, config.trainer
    per_token = dpo.loss in LENGTH_NORMALISED
    encode = partial(encode_pairs, tokenizer=session.tokenizer, max_prompt_tokens=config.data.max_prompt_tokens,
                     max_response_tokens=config.rollout.max_response_tokens, truncation=config.data.prompt_truncation)
    score_reference = partial(reference_log_probs, config, session.groups, per_token=per_token)
    val_pairs = encode(data.val, where="the held-out pairs")
    val_pairs = val_pairs.union(score_reference(val_pairs))  # the reference never changes: scored once
    training = session.training(["actor"], data.train, t.prompts_per_step)
    loader, logger, hooks, step = training.loader, training.logger, training.hooks, training.step
    if step == 0 and t.val_every_steps:
        logger.log(0, held_out_metrics(actor, val_pairs, config))  # the starting model's

    while step < t.total_steps:
        step += 1
        timer = StageTimer()
        metrics = hooks.before_update(step, actor)
        with timer("update"):
            pairs = encode(loader.next_rows(), where=f"the pairs of step {step}")
            with timer("reference"):
                pairs = pairs.union(score_reference(pairs))
            metrics.update(actor.train_preference(pairs, loss=dpo.loss, beta=dpo.beta,
                                                  label_smoothing=dpo.label_smoothing,
                                                  simpo_gamma=dpo.simpo_gamma)[0])
        with timer("hooks"):
            metrics.update(hooks.after_update(step, metrics, actor))
        if validation_due(config, step):
            with timer("validate"):
                metrics.update(held_out_metrics(actor, val_pairs, config))
        metrics.update(timer.seconds)
        logger.log(step, metrics)
        if training.checkpointer.due(step):
            training.checkpointer.save(step, {"loader": loader.state_dict(), "metrics": metrics})

    return session.finish(training, step)


def reference_log_probs(config: HybridFlowConfig, groups: dict[str, WorkerGroup], pairs: Batch,
                        per_token: bool) -> Batch:
    """`ref_chosen_log_probs` / `ref_rejected_log_probs` of `pairs`: the reference role's, the
    LoRA actor's with its adapter disabled, or zeros for a reference-free loss (which ignores them)."""
    if not config.needs_reference:
        zeros = torch.zeros(len(pairs))
        return Batch(tensors={"ref_chosen_log_probs": zeros, "ref_rejected_log_probs": zeros.clone()})
    if config.reference_role_runs:
        return groups["reference"].compute_ref_pair_log_probs(pairs, per_token=per_token)
    return groups["actor"].compute_ref_pair_log_probs(pairs, per_token=per_token)


def held_out_metrics(actor: WorkerGroup, val_pairs: Batch, config: HybridFlowConfig) -> dict[str, float]:
    """The held-out pairs under the current policy: `val/preference_accuracy` (the policy rates the
    chosen response above the rejected one), and the loss and implicit rewards of `dpo.loss`."""
    dpo = config.dpo
    scored = actor.compute_pair_log_probs(val_pairs, per_token=dpo.loss in LENGTH_NORMALISED)
    chosen, rejected = scored["chosen_log_probs"], scored["rejected_log_probs"]
    _, stats = compute_preference_loss(dpo.loss, chosen_log_probs=chosen, rejected_log_probs=rejected,
                                       ref_chosen_log_probs=val_pairs["ref_chosen_log_probs"],
                                       ref_rejected_log_probs=val_pairs["ref_rejected_log_probs"], beta=dpo.beta,
                                       label_smoothing=dpo.label_smoothing, simpo_gamma=dpo.simpo_gamma)
    metrics = {f"val/{k}": float(v) for k, v in stats.items()}
    metrics["val/preference_accuracy"] = float((chosen > rejected).float().mean())
    return metrics
