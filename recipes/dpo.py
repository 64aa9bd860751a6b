"""Direct preference optimisation: the actor trained offline on (prompt, chosen, rejected) pairs.

Each step draws `trainer.prompts_per_step` pairs, takes the reference's log-probs of both responses
of each (the starting model: the reference role, or with LoRA the actor with its adapter disabled;
none for the reference-free SimPO or `dpo.reference_free`, whose reference log-ratio is 0) and
takes one optimizer step on the `dpo.loss` of `PREFERENCE_LOSSES` (hybridflow/algos/preference.py),
with `dpo.beta` or the loss's own default. The data is TRL's preference formats
(hybridflow/data/preference.py), or the synthetic task with its right answer chosen and a near miss
rejected. Metrics carry TRL's names (`rewards/chosen`, `rewards/margins`, `logps/chosen`, ...).

Reference log-probs are computed once per pair and reused (`ReferenceScores`; TRL's
`precompute_ref_log_probs`, `dpo.reuse_reference_log_probs`), and computed again after a reference
hook (`trainer.training_hooks`: `reference_ema`, TRL's `sync_ref_model`; `reference_reset`) changes
the reference. One departure from TRL: TRL computes them for the whole dataset before the first
step; here a pair is scored the first time it is drawn, so the first epoch costs what it costs
without reuse, the run starts at once, and a reference change costs nothing until pairs are drawn.

Every `trainer.val_every_steps` the held-out pairs are scored: the loss and TRL's metrics, and
`val/preference_accuracy`, the share of pairs whose chosen response the policy itself rates above
the rejected one (at step 0, the starting model's). No rollout: nothing is generated. Step hooks
run around each update, as in SFT.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from hybridflow.output import console
from hybridflow.algos.preference import LENGTH_NORMALISED, compute_preference_loss
from hybridflow.batch import Batch
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.controller import WorkerGroup
from hybridflow.data.eos import check_eos_trained
from hybridflow.data.preference import encode_pairs
from hybridflow.run.launch import prepare_preference_data
from hybridflow.run.lifecycle import start_run
from hybridflow.run.stage import Stage
from hybridflow.run.runner import StageTimer, run_training_hooks, validation_due
from recipes.roles import actor_role, reference_role


def run(stage: Stage, run_dir: Path) -> dict:
    config = stage.config
    def roles(model_dir: Path, tokenizer) -> dict:
        # log-probs of given responses: no sampling temperature applies
        actor = actor_role(config, model_dir)
        specs = {"actor": dataclasses.replace(actor, kwargs={**actor.kwargs, "temperature": 1.0})}
        if config.reference_role_runs:
            specs["reference"] = reference_role(config, model_dir)
        return specs

    session = start_run(stage, run_dir, roles, data=prepare_preference_data)  # pairs checked before Ray
    data, actor, dpo, t = session.data, session.groups["actor"], config.dpo, config.trainer
    console.say(dpo.beta_line())
    per_token = dpo.loss in LENGTH_NORMALISED
    encode = partial(encode_pairs, tokenizer=session.tokenizer, max_prompt_tokens=config.data.max_prompt_tokens,
                     max_response_tokens=config.rollout.max_response_tokens, truncation=config.data.prompt_truncation,
                     max_length=dpo.max_length, truncation_mode=dpo.truncation_mode)
    reference = ReferenceScores(partial(reference_log_probs, config, session.groups, per_token=per_token),
                                reuse=dpo.reuse_reference_log_probs and config.needs_reference)
    console.say(reference_line(config))
    val_encoded = encode(data.val, where="the held-out pairs")
    val_pairs = val_encoded.union(reference.of(data.val, val_encoded))
    training = session.training(["actor"], data.train, t.prompts_per_step)
    loader, logger, hooks, step = training.loader, training.logger, training.hooks, training.step
    if step == 0 and t.val_every_steps:
        logger.log(0, held_out_metrics(actor, val_pairs, config))  # the starting model's

    while step < t.total_steps:
        step += 1
        timer = StageTimer()
        metrics = hooks.before_update(step, actor)
        with timer("update"):
            rows = loader.next_rows()
            pairs = encode(rows, where=f"the pairs of step {step}")
            if dpo.truncation_mode != "keep_start":  # keep_start cuts a long response's end, EOS with it
                for column in ("chosen", "rejected"):
                    check_eos_trained(pairs[f"{column}_ids"], pairs[f"{column}_mask"], session.tokenizer.eos_token_id,
                                      f"DPO step {step}, the {column} responses")
            with timer("reference"):
                scored_before = reference.scored_pairs
                pairs = pairs.union(reference.of(rows, pairs))
                if config.needs_reference:
                    metrics["dpo/reference_pairs_scored"] = reference.scored_pairs - scored_before
            metrics.update(actor.train_preference(pairs, loss=dpo.loss, beta=dpo.beta_in_use,
                                                  label_smoothing=dpo.label_smoothing,
                                                  simpo_gamma=dpo.simpo_gamma)[0])
        with timer("hooks"):
            metrics.update(hooks.after_update(step, metrics, actor))
            changed = run_training_hooks(config, step, actor, session.groups.get("reference"))
            metrics.update(changed)
            if changed.get("hooks/applied"):  # a new reference: its log-probs of every pair are stale
                reference.invalidate(f"step {step}")
                val_pairs = val_encoded.union(reference.of(data.val, val_encoded))
        if validation_due(config, step):
            with timer("validate"):
                metrics.update(held_out_metrics(actor, val_pairs, config))
        metrics.update(timer.seconds)
        logger.log(step, metrics)
        if training.checkpointer.due(step):
            training.checkpointer.save(step, {"loader": loader.state_dict(), "metrics": metrics})

    return session.finish(training, step)


def reference_line(config: HybridFlowConfig) -> str:
    """The console's line on where the reference log-probs come from and whether they are reused."""
    dpo = config.dpo
    if not config.needs_reference:
        why = "dpo.reference_free=true" if dpo.reference_free else f"dpo.loss={dpo.loss} is reference-free"
        return f"hybridflow: no reference model ({why}): the reference log-ratio is taken as 0"
    if dpo.reuse_reference_log_probs:
        return ("hybridflow: reference log-probs of each pair are computed once, the first time it is drawn, and "
                "reused (dpo.reuse_reference_log_probs=true, TRL's precompute_ref_log_probs); a reference hook "
                "that changes the reference has them computed again")
    return "hybridflow: reference log-probs are computed every step (dpo.reuse_reference_log_probs=false)"


def pair_key(row: dict) -> bytes:
    """A pair's identity for the reference cache: a digest of its prompt and both responses (what the
    reference scores), so a pair drawn again in any later epoch, at any position, finds its scores."""
    text = json.dumps([row["prompt"], row["chosen"], row["rejected"]], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).digest()


class ReferenceScores:
    """The reference's log-probs of pairs (`ref_chosen_log_probs`, `ref_rejected_log_probs`, (B,)),
    each pair's computed by `score` once and reused while the reference stays the same (`reuse`);
    `invalidate` forgets them all when it changes. Without `reuse` every call scores its pairs.
    `scored_pairs` counts the pairs scored so far (the recipe's `dpo/reference_pairs_scored`)."""

    def __init__(self, score: Callable[[Batch], Batch], reuse: bool) -> None:
        self.score, self.reuse = score, reuse
        self.cache: dict[bytes, tuple[float, float]] = {}
        self.scored_pairs = 0

    def of(self, rows: list[dict], pairs: Batch) -> Batch:
        """The reference log-probs of `pairs`, the pair batch encoded from `rows`."""
        if not self.reuse:
            self.scored_pairs += len(pairs)
            return self.score(pairs)
        keys = [pair_key(row) for row in rows]
        missing = [i for i, key in enumerate(keys) if key not in self.cache]
        if missing:
            scored = self.score(pairs.index(missing))
            self.scored_pairs += len(missing)
            for i, chosen, rejected in zip(missing, scored["ref_chosen_log_probs"].tolist(),
                                           scored["ref_rejected_log_probs"].tolist()):
                self.cache[keys[i]] = (chosen, rejected)
        values = torch.tensor([self.cache[key] for key in keys], dtype=torch.float32)  # (B, 2)
        return Batch(tensors={"ref_chosen_log_probs": values[:, 0].contiguous(),
                              "ref_rejected_log_probs": values[:, 1].contiguous()})

    def invalidate(self, when: str) -> None:
        if self.reuse and self.cache:
            console.say(f"hybridflow: the reference changed at {when}: its log-probs of the {len(self.cache)} pairs "
                        "scored so far are computed again as the pairs are drawn")
        self.cache.clear()


def reference_log_probs(config: HybridFlowConfig, groups: dict[str, WorkerGroup], pairs: Batch,
                        per_token: bool) -> Batch:
    """`ref_chosen_log_probs` / `ref_rejected_log_probs` of `pairs`: the reference role's, the
    LoRA actor's with its adapter disabled, or zeros without a reference (a reference-free loss
    ignores them; `dpo.reference_free` takes the reference log-ratio as 0, TRL's reference_free)."""
    if not config.needs_reference:
        zeros = torch.zeros(len(pairs))
        return Batch(tensors={"ref_chosen_log_probs": zeros, "ref_rejected_log_probs": zeros.clone()})
    if config.reference_role_runs:
        return groups["reference"].compute_ref_pair_log_probs(pairs, per_token=per_token)
    return groups["actor"].compute_ref_pair_log_probs(pairs, per_token=per_token)


def held_out_metrics(actor: WorkerGroup, val_pairs: Batch, config: HybridFlowConfig) -> dict[str, float]:
    """The held-out pairs under the current policy: `val/preference_accuracy` (the policy rates the
    chosen response above the rejected one), the loss of `dpo.loss` (`val/preference_loss`) and
    TRL's metrics (`val/rewards/chosen`, ..., `val/logps/rejected`; TRL's eval_rewards/chosen, ...)."""
    dpo = config.dpo
    scored = actor.compute_pair_log_probs(val_pairs, per_token=dpo.loss in LENGTH_NORMALISED)
    chosen, rejected = scored["chosen_log_probs"], scored["rejected_log_probs"]
    loss, stats = compute_preference_loss(dpo.loss, chosen_log_probs=chosen, rejected_log_probs=rejected,
                                          ref_chosen_log_probs=val_pairs["ref_chosen_log_probs"],
                                          ref_rejected_log_probs=val_pairs["ref_rejected_log_probs"],
                                          beta=dpo.beta_in_use, label_smoothing=dpo.label_smoothing,
                                          simpo_gamma=dpo.simpo_gamma)
    metrics = {f"val/{k}": float(v) for k, v in stats.items()}
    metrics["val/preference_loss"] = float(loss)
    metrics["val/preference_accuracy"] = float((chosen > rejected).float().mean())
    return metrics
