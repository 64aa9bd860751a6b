"""The policy-gradient objective of PPO, GRPO and their kin: the configured policy loss
(`POLICY_LOSSES`) with the entropy bonus and the KL loss to the reference when they are on
(`ActorWorker.update_policy`).

Against the sampler (`old_key="sampler_log_probs"` with a `mismatch_band`) it also measures the
rollout–training mismatch of the first mini-batch (`rollout_mismatch/*`, hybridflow.algos.mismatch):
its log-probs before the optimizer step, which are π_old's, against the sampler's, over the rows
trained (as verl's bypass mode reports its rollout-correction metrics from π_θ); maxima over ranks."""

from __future__ import annotations

import torch

from hybridflow.algos import compute_policy_loss, entropy_bonus, kl_loss, masked_mean, vanishes_at_zero_advantage
from hybridflow.algos.mismatch import MISMATCH_MAX_KEYS, mismatch_metrics
from hybridflow.batch import Batch
from hybridflow.config.schema import ActorConfig
from hybridflow.training.fsdp import all_reduce_max
from hybridflow.training.objectives.base import Objective, Split, token_split
from hybridflow.training.sequences import loss_mask, response_log_probs


class PolicyObjective(Objective):
    """`cfg`: the actor's config (the loss and its coefficients); `temperature`: the sampler's, at which
    log-probs are computed; `old_key`: the column of the proximal log-probs (`old_log_probs` or
    `sampler_log_probs`); `weighted`: multiply by `behavior_weights`. Needs response tokens, the
    proximal log-probs, `advantages`, and `ref_log_probs` when kl_loss_coef > 0 (hybridflow.batch_keys)."""

    # the gap to the proximal policy before the update moved it: the recipe's (recipes/ppo.py), no metric
    first_mini_batch = {"actor/log_prob_diff_from_old": "log_prob_diff_before_update"}

    def __init__(self, cfg: ActorConfig, temperature: float = 1.0, old_key: str = "old_log_probs",
                 weighted: bool = False, mismatch_band: tuple[float, float] | None = None) -> None:
        self.cfg, self.temperature, self.old_key, self.weighted = cfg, temperature, old_key, weighted
        self.band = mismatch_band if old_key == "sampler_log_probs" and mismatch_band else None
        self.needs = (*Objective.needs, old_key, "advantages", *(["ref_log_probs"] if cfg.kl_loss_coef else []),
                      *(["behavior_weights"] if weighted else []), *(["sampler_log_probs"] if self.band else []))
        self._mini_batches = 0
        self._kept = [] if self.band else None  # the first mini-batch's (log-probs, sampler's, mask), for the mismatch

    def split(self, model: torch.nn.Module, mini: Batch, samples_per_micro_batch: int,
              tokens_per_micro_batch: int | None) -> Split:
        self._mini_batches += 1
        return token_split(model, mini, samples_per_micro_batch, tokens_per_micro_batch, keep=self.rows_with_gradient)

    def accumulation_started(self) -> None:
        if self._kept and self._mini_batches == 1:  # a float16 retry: the first mini-batch's log-probs are taken again
            self._kept.clear()

    def loss(self, model: torch.nn.Module, micro: Batch, counts: dict[str, float]) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        log_probs, entropy = response_log_probs(model, micro, self.temperature,
                                                entropy_grad=bool(cfg.entropy_coef))  # else a metric only
        mask = loss_mask(micro)  # sampled tokens only: tool output is attended to, never trained
        loss, stats = compute_policy_loss(
            cfg.policy_loss, log_probs=log_probs, old_log_probs=micro[self.old_key],
            behavior_weights=micro["behavior_weights"] if self.weighted else None,
            advantages=micro["advantages"], response_mask=mask, clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high, dual_clip_c=cfg.dual_clip_c,
            aggregation=cfg.loss_aggregation, **counts)
        if cfg.entropy_coef:
            bonus, _ = entropy_bonus(entropy=entropy, response_mask=mask, coef=cfg.entropy_coef,
                                     aggregation=cfg.loss_aggregation, **counts)
            loss = loss - bonus
        stats["actor/entropy"] = masked_mean(entropy.detach(), mask)  # 0-dim tensors: read once per mini-batch
        stats["actor/log_prob_diff_from_old"] = masked_mean((log_probs.detach() - micro[self.old_key]).abs(), mask)
        if self._kept is not None and self._mini_batches == 1:
            self._kept.append((log_probs.detach(), micro["sampler_log_probs"], mask))
        if cfg.kl_loss_coef:
            kl, kl_stats = kl_loss(log_probs=log_probs, ref_log_probs=micro["ref_log_probs"], response_mask=mask,
                                   estimator=cfg.kl_loss_estimator, aggregation=cfg.loss_aggregation, **counts)
            loss = loss + cfg.kl_loss_coef * kl
            stats.update(kl_stats)
        return loss, stats

    def results(self) -> dict[str, float]:
        """Collective, against the sampler with a band: `rollout_mismatch/*` of the first mini-batch's
        trained rows on this rank, the maxima over ranks."""
        if self._kept is None:
            return {}
        log_probs, sampler, mask = (torch.cat(parts) for parts in zip(*self._kept))
        stats = mismatch_metrics(trainer_log_probs=log_probs, sampler_log_probs=sampler, response_mask=mask,
                                 band_low=self.band[0], band_high=self.band[1])
        return {f"rollout_mismatch/{k}": all_reduce_max(v) if k in MISMATCH_MAX_KEYS else v for k, v in stats.items()}

    def rows_with_gradient(self, mini: Batch) -> Batch:
        """Collective: the rows of a mini-batch worth a forward and backward pass.

        A sample whose every advantage is 0 (a GRPO group where all samples scored the same)
        adds nothing to the gradient of a loss that vanishes there (`ppo_clip`, `gspo`), so when
        the loss has no entropy or KL term it is left out. The loss is still normalised by the
        whole mini-batch's token and sequence counts, so the gradient is the same as with every
        row. Ranks keep the same number of rows (topped up with zero-advantage ones) so that
        FSDP's collectives match. Stats such as `actor/entropy` are then over the trained rows only."""
        cfg = self.cfg
        if not cfg.skip_zero_advantage_samples or "advantages" not in mini or \
                cfg.entropy_coef or cfg.kl_loss_coef or not vanishes_at_zero_advantage(cfg.policy_loss):
            return mini
        has_gradient = (mini["advantages"] != 0).any(dim=1)  # (B,)
        rows = max(1, int(all_reduce_max(int(has_gradient.sum()))))
        order = torch.argsort((~has_gradient).int(), stable=True)  # rows with a gradient first
        return mini.index(order[:rows])
