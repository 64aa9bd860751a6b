"""The actor: a Hugging Face causal LM under FSDP2 over its group's ranks.

Computes response log-probs and entropy, updates the policy with the configured loss over
mini-batches and micro-batches, runs supervised fine-tuning steps (the SFT recipe reuses the
actor) and preference steps. What it does with its weights besides training is composed from the
framework, each registered method here delegating so that the controller calls it on the worker by
name: the sending end of the weight sync (`hybridflow.resharding.source.WeightSource`), the moves
of its training state off and back onto a GPU shared with the rollout engine
(`hybridflow.training.memory_moves`), and the whole model read, replaced or exported
(`hybridflow.training.whole_model`).

Gradient accumulation is invariant to the micro-batch split: every micro-batch loss is
normalised by the token (or sequence) count of the whole mini-batch across all ranks, and
multiplied by the number of ranks to undo FSDP's gradient averaging, so one micro-batch or
four give the same gradients.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from hybridflow.algos import (
    aggregate_loss,
    compute_policy_loss,
    entropy_bonus,
    kl_loss,
    masked_mean,
    micro_batch_stat,
    vanishes_at_zero_advantage,
)
from hybridflow.algos.mismatch import MISMATCH_MAX_KEYS, mismatch_metrics
from hybridflow.algos.preference import LENGTH_NORMALISED, compute_preference_loss
from hybridflow.batch import Batch
from hybridflow.config.schema import ActorConfig
from hybridflow.controller import Dispatch, WorkerContext, register
from hybridflow.data.preference import pair_sequences, pair_sums
from hybridflow.resharding.source import WeightSource
from hybridflow.training import memory_moves, whole_model
from hybridflow.training.exact_layout import OfferedModule, layout_log_probs, offer
from hybridflow.training.fsdp import (
    accumulating,
    fp32_output_head,
    all_reduce_max,
    all_reduce_mean_dict,
    all_reduce_sum,
    build_optimizer,
    load_model,
    read_floats,
    shard_model,
)
from hybridflow.training.loss_scale import LossScale, clipped_step
from hybridflow.training.packing import choose_packing, runs_packed
from hybridflow.training.resolution import MovedFraction
from hybridflow.training.shared_prompts import choose_sharing, shares_prompts
from hybridflow.training.state import TrainingStateMixin
from hybridflow.training.sequences import (
    TOKEN_COUNTS,
    computed_tokens,
    log_probs_and_entropy,
    loss_mask,
    micro_batch_rows,
    mini_batches,
    pair_log_probs,
    response_log_probs,
    row_facts,
)


class ActorWorker(TrainingStateMixin):
    def __init__(self, ctx: WorkerContext, actor: ActorConfig, *, model_path: str, dtype: str, master_dtype: str,
                 keep_dropout: bool, temperature: float, total_steps: int, trust_remote_code: bool, seed: int,
                 pack_sequences: bool | None = None, share_prompts: bool | None = None,
                 exact_rollout: bool = False, engine_dtype: str | None = None) -> None:
        """`actor`: the `actor` config node; the rest come from elsewhere in the config (built by
        recipes/roles.py): `model.dtype` (compute), `model.master_dtype` (parameters and optimizer
        state), `model.keep_dropout`, `rollout.temperature` (log-probs at the sampler's temperature),
        `trainer.total_steps` (the lr schedule's span unless actor.optim.schedule_steps),
        `model.trust_remote_code`, `seed`, `model.pack_sequences` (None: packed where the model allows),
        `model.share_prompts` (None: shared where packed); `exact_rollout`: the rollout engine generates
        with this module (rollout.backend=exact), which start offers it, and π_old is computed in the
        engine's layout (hybridflow.training.exact_layout), equal to its sampler log-probs bit for bit;
        `engine_dtype`: `rollout.dtype`, the dtype whose copy of the weights the engine samples from, watched
        with `model.dtype` by `precision/moved_fraction/*` (hybridflow.training.resolution; None: the actor's)."""
        self.ctx, self.cfg = ctx, actor
        self.model_path, self.dtype, self.temperature = model_path, dtype, temperature
        self.master_dtype, self.keep_dropout = master_dtype, keep_dropout
        self.total_steps, self.trust_remote_code, self.seed = total_steps, trust_remote_code, seed
        self.pack_sequences, self.share_prompts = pack_sequences, share_prompts
        self.exact_rollout = exact_rollout
        self.engine_dtype = engine_dtype or dtype
        self.loss_scale = LossScale(dtype)  # float16: dynamic loss scaling; otherwise scale 1
        self._moved = None  # hybridflow.training.resolution.MovedFraction, built by start
        self._offered = None  # what start offers the exact engine; held here, the offer is weak
        self.model = self.optimizer = self.scheduler = None
        self.weights = None  # this rank's end of the weight path (hybridflow.resharding.source), built by start
        self.updates = 0
        self._sampled = None  # update_policy against the sampler: its first mini-batch's log-probs, for the mismatch

    # ---- set-up ---------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> dict:
        torch.manual_seed(self.seed)
        model = load_model(self.model_path, self.master_dtype, lora=self.cfg.lora,
                           gradient_checkpointing=self.cfg.gradient_checkpointing,
                           trust_remote_code=self.trust_remote_code, keep_dropout=self.keep_dropout,
                           on_meta=self.ctx.world_size > 1 and self.ctx.rank != 0)
        packed = choose_packing(model, self.pack_sequences)
        shared = choose_sharing(model, self.share_prompts, packed)
        self.model = shard_model(model, self.ctx.device, compute_dtype=self.dtype)
        if self.cfg.fp32_lm_head:
            fp32_output_head(self.model)
        self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg.optim, self.total_steps)
        self.weights = WeightSource(self.model, self.ctx.rank, self.ctx.world_size, self.ctx.group_name)
        if not self.cfg.lora.rank:  # a LoRA run's engine gets the folded weights, not the adapter's
            self._moved = MovedFraction([p for p in self.model.parameters() if p.requires_grad],
                                        {"master": getattr(torch, self.master_dtype), "actor": getattr(torch, self.dtype),
                                         "engine": getattr(torch, self.engine_dtype)})
        if self.exact_rollout:
            self._offered = OfferedModule(self.model, self.cfg.samples_per_micro_batch)
            offer(self.ctx.group_name, self._offered)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {"trainable_parameters_on_rank": trainable, "packed_sequences": packed, "shared_prompts": shared}

    # ---- inference ------------------------------------------------------------------------

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def compute_log_probs(self, batch: Batch) -> Batch:
        """`old_log_probs`, (B, R), 0 outside `loss_mask`; the pass's seconds in meta. No entropy: nothing
        reads the proximal policy's (the update reports the current policy's, `actor/entropy`). With the
        exact engine, in its layout: its rows together in its order, every response column, unpacked
        (hybridflow.training.exact_layout)."""
        start = time.perf_counter()
        if self.exact_rollout:
            out = Batch(tensors={"old_log_probs": layout_log_probs(
                self.model, batch.to(self.ctx.device), self.cfg.samples_per_micro_batch, self.temperature).cpu()})
        else:
            out = self._log_probs(batch, "old_log_probs")
        out.meta["timing/actor_forward_s"] = time.perf_counter() - start
        return out

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """Reference log-probs from the actor with its LoRA adapter disabled (LoRA runs only)."""
        if not hasattr(self.model, "disable_adapter"):
            raise RuntimeError("compute_ref_log_probs on the actor needs actor.lora.rank > 0; "
                               "without LoRA the reference role computes reference log-probs")
        start = time.perf_counter()
        with self.model.disable_adapter():
            out = self._log_probs(batch, "ref_log_probs")
        out.meta["timing/reference_forward_s"] = time.perf_counter() - start
        return out.select(["ref_log_probs"])

    def _log_probs(self, batch: Batch, key: str) -> Batch:
        log_probs, _ = log_probs_and_entropy(self.model, batch.to(self.ctx.device), self.cfg.samples_per_micro_batch,
                                             self.temperature, self.cfg.tokens_per_micro_batch, with_entropy=False)
        return Batch(tensors={key: log_probs.cpu()})

    @register(Dispatch.ONE_TO_ALL)
    @torch.no_grad()
    def probe_log_probs(self, prompts: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
        """Collective: the actor's log-prob of each of `tokens[i]` after `prompts[i]`, concatenated
        (float64), computed as one left-padded batch the way compute_log_probs reads samples (the
        weight sync's probe, hybridflow.resharding.verify, compares it with the engine's)."""
        from hybridflow.resharding.verify import probe_batch

        batch = probe_batch(prompts, tokens)
        log_probs, _ = log_probs_and_entropy(self.model, batch.to(self.ctx.device), len(batch), with_entropy=False)
        return log_probs[batch["response_mask"].to(log_probs.device)].double().cpu()

    # ---- training ---------------------------------------------------------------------------

    @register(Dispatch.DP_SPLIT)
    def update_policy(self, batch: Batch, old_log_probs_key: str = "old_log_probs", weighted: bool = False,
                      mismatch_band: tuple[float, float] | None = None) -> dict:
        """One step's policy update. Needs response tokens, the proximal log-probs (the column
        `old_log_probs_key`: the actor's `old_log_probs` or the `sampler_log_probs`), `advantages`,
        `ref_log_probs` when kl_loss_coef > 0 and, when `weighted`, `behavior_weights`
        (hybridflow.batch_keys). Returns metrics averaged over ranks.

        Clipping against the sampler with a `mismatch_band`, the rollout–training mismatch of the first
        mini-batch (`rollout_mismatch/*`, hybridflow.algos.mismatch): its log-probs before the optimizer
        step, which are π_old's, against the sampler's, over the rows trained (as verl's bypass mode
        reports its rollout-correction metrics from π_θ); maxima over ranks, the rest averaged."""
        start = time.perf_counter()
        self._sampled = [] if old_log_probs_key == "sampler_log_probs" and mismatch_band else None
        after_first = partial(self._mismatch, mismatch_band) if self._sampled is not None else None
        stats = self._train(batch, partial(self._policy_loss, old_key=old_log_probs_key, weighted=weighted),
                            after_first_mini_batch=after_first)
        stats["timing/actor_update_s"] = time.perf_counter() - start
        return stats

    def _mismatch(self, band: tuple[float, float]) -> dict[str, float]:
        """`rollout_mismatch/*` of the log-probs `_policy_loss` kept (one rank's trained rows); stops keeping."""
        log_probs, sampler, mask = (torch.cat(parts) for parts in zip(*self._sampled))
        self._sampled = None
        stats = mismatch_metrics(trainer_log_probs=log_probs, sampler_log_probs=sampler, response_mask=mask,
                                 band_low=band[0], band_high=band[1])
        return {f"rollout_mismatch/{k}": all_reduce_max(v) if k in MISMATCH_MAX_KEYS else v for k, v in stats.items()}

    @register(Dispatch.DP_SPLIT)
    def train_sft(self, batch: Batch) -> dict:
        """One supervised step: cross-entropy on response (answer) tokens only."""
        return self._train(batch, self._sft_loss, epochs=1, whole_batch=True)

    @register(Dispatch.DP_SPLIT)
    def train_preference(self, pairs: Batch, loss: str, beta: float, label_smoothing: float = 0.0,
                         simpo_gamma: float = 0.5) -> dict:
        """One preference step on a pair batch (hybridflow.data.preference): the loss `loss` of
        `PREFERENCE_LOSSES` over every pair, one optimizer step. Needs `ref_chosen_log_probs` and
        `ref_rejected_log_probs` (B,) (summed, or per token for the length-normalised losses). Returns
        `actor/loss`, `actor/grad_norm`, `actor/lr` and the loss's statistics under TRL's names
        (`rewards/chosen`, `rewards/margins`, `logps/chosen`, ...).

        Each micro-batch holds `actor.samples_per_micro_batch` sequences, i.e. half as many pairs, both
        halves of a pair in one forward pass; its loss is its pairs' share of the mean over all pairs
        on all ranks, so the gradient is the same for any micro-batch split or rank count."""
        start = time.perf_counter()
        self.model.train()
        pairs = pairs.to(self.ctx.device)
        world = self.ctx.world_size
        total_pairs = all_reduce_sum(len(pairs))
        per_token = loss in LENGTH_NORMALISED
        if self._moved is not None:
            self._moved.before()

        def accumulate() -> dict:
            self.optimizer.zero_grad(set_to_none=True)
            stats: dict = {}
            loss_total = 0.0
            for micro in accumulating(self.model, pairs.split(max(1, self.cfg.samples_per_micro_batch // 2))):
                sequences = pair_sequences(micro)
                log_probs, _ = response_log_probs(self.model, sequences, with_entropy=False)
                chosen, rejected = pair_sums(log_probs, sequences["response_mask"], per_token=per_token)
                mean_loss, micro_stats = compute_preference_loss(
                    loss, chosen_log_probs=chosen, rejected_log_probs=rejected,
                    ref_chosen_log_probs=micro["ref_chosen_log_probs"],
                    ref_rejected_log_probs=micro["ref_rejected_log_probs"],
                    beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma)
                part = mean_loss * (len(micro) / total_pairs)
                (part * (world * self.loss_scale.scale)).backward()
                loss_total = loss_total + part.detach()
                share = len(micro) / len(pairs)
                for k, v in micro_stats.items():  # means over this rank's pairs, under TRL's names (rewards/chosen, ...)
                    stats[k] = stats.get(k, 0.0) + v * share
            stats["actor/loss"] = loss_total
            read_floats(stats)  # the one wait for the device in this step
            return stats

        grad_norm = None
        while grad_norm is None:  # float16: a backward that overflowed runs again at half the loss scale
            stats = accumulate()
            grad_norm = self._clipped_step("or dpo.beta")
        self.scheduler.step()
        self.updates += 1
        loss_sum = all_reduce_sum(stats.pop("actor/loss"))  # the step's loss over all ranks
        stats = all_reduce_mean_dict(stats)
        stats.update({"actor/loss": loss_sum, "actor/grad_norm": grad_norm, "actor/lr": self.scheduler.get_last_lr()[0],
                      "timing/actor_update_s": time.perf_counter() - start, **self._precision_stats()})
        return stats

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def compute_pair_log_probs(self, pairs: Batch, per_token: bool = False) -> Batch:
        """`chosen_log_probs` and `rejected_log_probs` (B,) of a pair batch under the current policy:
        each response's summed log-probability, or its mean per token with `per_token`."""
        return pair_log_probs(self.model, pairs.to(self.ctx.device), self.cfg.samples_per_micro_batch,
                              self.cfg.tokens_per_micro_batch, per_token)

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def compute_ref_pair_log_probs(self, pairs: Batch, per_token: bool = False) -> Batch:
        """`ref_chosen_log_probs` / `ref_rejected_log_probs` from the actor with its LoRA adapter
        disabled (LoRA runs only; otherwise the reference role computes them)."""
        if not hasattr(self.model, "disable_adapter"):
            raise RuntimeError("compute_ref_pair_log_probs on the actor needs actor.lora.rank > 0; "
                               "without LoRA the reference role computes reference log-probs")
        with self.model.disable_adapter():
            return pair_log_probs(self.model, pairs.to(self.ctx.device), self.cfg.samples_per_micro_batch,
                                  self.cfg.tokens_per_micro_batch, per_token, prefix="ref_")

    def _policy_loss(self, micro: Batch, tokens: float, seqs: float, old_key: str = "old_log_probs",
                     weighted: bool = False) -> tuple[torch.Tensor, dict]:
        log_probs, entropy = response_log_probs(self.model, micro, self.temperature,
                                                entropy_grad=bool(self.cfg.entropy_coef))  # else a metric only
        mask = loss_mask(micro)  # sampled tokens only: tool output is attended to, never trained
        counts = {"global_token_count": tokens, "global_sequence_count": seqs}
        loss, stats = compute_policy_loss(
            self.cfg.policy_loss, log_probs=log_probs, old_log_probs=micro[old_key],
            behavior_weights=micro["behavior_weights"] if weighted else None,
            advantages=micro["advantages"], response_mask=mask, clip_ratio_low=self.cfg.clip_ratio_low,
            clip_ratio_high=self.cfg.clip_ratio_high, dual_clip_c=self.cfg.dual_clip_c,
            aggregation=self.cfg.loss_aggregation, **counts)
        if self.cfg.entropy_coef:
            bonus, _ = entropy_bonus(entropy=entropy, response_mask=mask, coef=self.cfg.entropy_coef,
                                     aggregation=self.cfg.loss_aggregation, **counts)
            loss = loss - bonus
        stats["actor/entropy"] = masked_mean(entropy.detach(), mask)  # 0-dim tensors: read once per mini-batch
        stats["actor/log_prob_diff_from_old"] = masked_mean((log_probs.detach() - micro[old_key]).abs(), mask)
        if self._sampled is not None:  # the first mini-batch's, for the mismatch (update_policy)
            self._sampled.append((log_probs.detach(), micro["sampler_log_probs"], mask))
        if self.cfg.kl_loss_coef:
            kl, kl_stats = kl_loss(log_probs=log_probs, ref_log_probs=micro["ref_log_probs"], response_mask=mask,
                                   estimator=self.cfg.kl_loss_estimator, aggregation=self.cfg.loss_aggregation, **counts)
            loss = loss + self.cfg.kl_loss_coef * kl
            stats.update(kl_stats)
        return loss, stats

    def _sft_loss(self, micro: Batch, tokens: float, seqs: float) -> tuple[torch.Tensor, dict]:
        log_probs, _ = response_log_probs(self.model, micro, with_entropy=False)
        nll = -log_probs
        loss = aggregate_loss(nll, loss_mask(micro), "token-mean", global_token_count=tokens)
        return loss, {}  # the mini-batch loss is reported as actor/loss

    def _train(self, batch: Batch, loss_fn, epochs: int | None = None, whole_batch: bool = False,
               after_first_mini_batch=None) -> dict:
        """`epochs` passes over `batch` in mini-batches of `actor.samples_per_mini_batch`, an optimizer step
        each; the statistics averaged over mini-batches and ranks. `after_first_mini_batch()` returns
        statistics of the first mini-batch alone, already combined over ranks."""
        self.model.train()
        batch = batch.to(self.ctx.device)
        world = self.ctx.world_size
        rows_per_mini = len(batch) if whole_batch or not self.cfg.samples_per_mini_batch else \
            self.cfg.samples_per_mini_batch // world
        generator = torch.Generator().manual_seed(self.seed * 100003 + self.updates)
        totals: dict[str, float] = {}
        computed: dict[str, float] = {}  # perf/*_tokens: summed over mini-batches and ranks, not averaged
        n_mini, first, once = 0, {}, {}
        if self._moved is not None:
            self._moved.before()
        for _ in range(epochs or self.cfg.epochs_per_step):
            for mini in mini_batches(batch, rows_per_mini, generator, shares_prompts(self.model)):
                mini_stats = self._train_mini_batch(mini, loss_fn, world)
                for k in TOKEN_COUNTS:
                    computed[k] = computed.get(k, 0) + mini_stats.pop(k)
                for k, v in mini_stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                if not first and after_first_mini_batch is not None:
                    once = after_first_mini_batch()
                first = first or mini_stats
                n_mini += 1
        self.scheduler.step()
        self.updates += 1
        stats = {k: v / n_mini for k, v in totals.items()}
        if "actor/log_prob_diff_from_old" in first:  # the first mini-batch's, before any optimizer step:
            stats["log_prob_diff_before_update"] = first["actor/log_prob_diff_from_old"]  # the recipe's, no metric
        stats["actor/lr"] = self.scheduler.get_last_lr()[0]
        reduced = all_reduce_mean_dict({**stats, **computed})
        return {**reduced, **{k: reduced[k] * world for k in computed}, **once, **self._precision_stats()}

    def _precision_stats(self) -> dict[str, float]:
        """After a step's updates: the share of the weights they moved in the master dtype, the actor's
        compute dtype and the engine's (`precision/moved_fraction/{master,actor,engine}`, over every rank's
        sample), and with float16 the loss scale and the overflows retried so far (`precision/loss_scale`,
        `precision/overflow_retries`)."""
        stats = {}
        if self._moved is not None:
            for name, (changed, sampled) in self._moved.after().items():
                stats[f"precision/moved_fraction/{name}"] = all_reduce_sum(changed) / max(1.0, all_reduce_sum(sampled))
        if self.loss_scale.enabled:
            stats["precision/loss_scale"] = self.loss_scale.scale
            stats["precision/overflow_retries"] = float(self.loss_scale.overflows)
        return stats

    def _train_mini_batch(self, mini: Batch, loss_fn, world: int) -> dict:
        mask = loss_mask(mini)
        tokens = all_reduce_sum(int(mask.sum()))
        seqs = all_reduce_sum(int(mask.any(dim=1).sum()))
        if tokens == 0:
            raise ValueError("a mini-batch has no response tokens on any rank; check rollout.max_response_tokens")
        trained = self._rows_with_gradient(mini)
        packed, share = runs_packed(self.model), shares_prompts(self.model)
        facts = row_facts(trained, share=packed and share)
        rows = micro_batch_rows(trained, self.cfg.samples_per_micro_batch, self.cfg.tokens_per_micro_batch,
                                packed, share, facts)
        grad_norm = None
        while grad_norm is None:  # float16: a backward that overflowed runs again at half the loss scale
            weighted = self._accumulate(trained, rows, loss_fn, tokens, seqs, world)
            grad_norm = self._clipped_step("or check the advantages/rewards for NaN")
        weighted.update(computed_tokens(facts, rows, packed))
        weighted["actor/trained_sample_fraction"] = len(trained) / len(mini)
        weighted["actor/loss"] = all_reduce_sum(weighted["actor/loss"])  # the mini-batch loss over all ranks
        weighted["actor/grad_norm"] = grad_norm
        return weighted

    def _accumulate(self, trained: Batch, rows: list, loss_fn, tokens: float, seqs: float, world: int) -> dict:
        """Zero the gradients, then every micro-batch's forward and backward (the loss times the loss
        scale); the micro-batches' statistics weighed by their tokens, read from the device once."""
        self.optimizer.zero_grad(set_to_none=True)
        if self._sampled:  # a float16 retry: the first mini-batch's log-probs are taken again
            self._sampled.clear()
        loss_total, weighted = 0.0, {}
        trained_tokens = loss_mask(trained).sum().clamp(min=1)
        micros = (trained.index(r) for r in rows)
        for micro in accumulating(self.model, micros):  # nothing here waits for the device (read_floats)
            loss, stats = loss_fn(micro, tokens, seqs)
            (loss * (world * self.loss_scale.scale)).backward()
            loss_total = loss_total + loss.detach()
            share = loss_mask(micro).sum() / trained_tokens
            for k, v in stats.items():  # loss parts add up, means weigh by tokens: no split changes them
                weighted[k] = weighted.get(k, 0.0) + micro_batch_stat(k, v, share, world)
        weighted["actor/loss"] = loss_total
        read_floats(weighted)  # the one wait for the device in this mini-batch's micro-batches
        return weighted

    def _clipped_step(self, fix: str) -> float | None:
        """Unscale (float16), clip, step; None when a float16 backward overflowed and must run again
        (hybridflow.training.loss_scale); a non-finite norm otherwise is refused (lower the lr, `fix`)."""
        return clipped_step(self.model, self.optimizer, self.loss_scale, self.cfg.optim.max_grad_norm,
                            f"actor update {self.updates}; lower the lr {fix}")

    def _rows_with_gradient(self, mini: Batch) -> Batch:
        """The rows of a policy mini-batch worth a forward and backward pass.

        A sample whose every advantage is 0 (a GRPO group where all samples scored the same)
        adds nothing to the gradient of a loss that vanishes there (`ppo_clip`, `gspo`), so when
        the loss has no entropy or KL term it is left out. The loss is still normalised by the
        whole mini-batch's token and sequence counts, so the gradient is the same as with every
        row. Ranks keep the same number of rows (topped up with zero-advantage ones) so that
        FSDP's collectives match.
        Stats such as `actor/entropy` are then over the trained rows only.
        """
        if not self.cfg.skip_zero_advantage_samples or "advantages" not in mini or \
                self.cfg.entropy_coef or self.cfg.kl_loss_coef or not vanishes_at_zero_advantage(self.cfg.policy_loss):
            return mini
        has_gradient = (mini["advantages"] != 0).any(dim=1)  # (B,)
        rows = max(1, int(all_reduce_max(int(has_gradient.sum()))))
        order = torch.argsort((~has_gradient).int(), stable=True)  # rows with a gradient first
        return mini.index(order[:rows])

    @register(Dispatch.ONE_TO_ALL)
    def scale_lr(self, factor: float) -> float:
        """Multiply the lr of the next update only (the scheduler sets the one after from its own
        formula): the `lr_burst` step hook's injected divergence. Returns the lr now in force."""
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
        return self.optimizer.param_groups[0]["lr"]

    # ---- device memory (hybridflow.training.memory_moves) -------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def offload(self) -> bool:
        """Move parameters and optimizer state to host memory while the colocated engine generates.
        Only on a GPU (on the CPU there is nowhere else to put them); returns whether it moved. The
        exact engine generates with the parameters themselves: they stay."""
        return memory_moves.offload(self.model, self.optimizer, self.ctx.device, keep_parameters=self.exact_rollout)

    @register(Dispatch.ONE_TO_ALL)
    def reload(self) -> bool:
        """Bring parameters and optimizer state back to the device before training."""
        return memory_moves.reload(self.model, self.optimizer, self.ctx.device, keep_parameters=self.exact_rollout)

    @register(Dispatch.ONE_TO_ALL)
    def device_peak_bytes(self) -> int | None:
        """GPUs: this process's device memory peak since the last read (one phase of the colocated
        hand-over; the engine shares the process), then reset; None on the CPU."""
        return memory_moves.device_peak_bytes(self.ctx.device)

    # ---- weights (the sending end of hybridflow.resharding.WeightSync: `self.weights`) ------------

    @register(Dispatch.RANK_ZERO)
    def weight_shapes(self) -> dict[str, list[int]]:
        """Checkpoint name -> full shape of every weight the rollout receives."""
        return self.weights.shapes()

    @register(Dispatch.ONE_TO_ALL)
    def setup_weight_sender(self, plan) -> bool:
        """Build this rank's sender from the controller's `SyncPlan` (opens the transfer group if any)."""
        self.weights.connect(plan)
        return True

    @register(Dispatch.ONE_TO_ALL)
    def send_weights(self) -> dict[str, float]:
        """Collective: move the current weights to the rollout (see hybridflow.resharding.sender)."""
        return self.weights.send()

    @register(Dispatch.RANK_ZERO)
    def lora_adapter(self, dtype: str) -> dict | None:
        """Collective: the LoRA adapter for the rollout, from rank 0 (weight_sync.lora=adapter;
        hybridflow.resharding.adapter.adapter_payload): factors in `dtype`, config, checksums."""
        return self.weights.adapter(dtype)

    @register(Dispatch.ONE_TO_ALL)
    def lora_checksums(self, dtype: str) -> dict | None:
        """Collective: rank 0's checksums of the live LoRA weights, as the adapter must hold them
        (hybridflow.resharding.adapter.live_adapter_checksums); the others None."""
        return self.weights.adapter_checksums(dtype)

    @register(Dispatch.ONE_TO_ALL)
    def weight_checksums(self) -> list[dict[str, tuple[float, float]]]:
        """Collective: per rollout rank, checksums of the part of every tensor it needs."""
        return self.weights.checksums()

    # ---- checkpoints (save/load: TrainingStateMixin; the whole model: hybridflow.training.whole_model) ----

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, directory: str, tokenizer_source_dir: str) -> str | None:
        """Collective: rank 0 writes the actor (LoRA folded) as a Hugging Face model directory in the
        compute dtype (`model.dtype`: what the model was loaded and is served in), not the master's;
        or, with actor.lora.save_adapter_only, its LoRA adapter as a peft adapter directory."""
        return whole_model.export_hf(directory, model=self.model, tokenizer_source_dir=tokenizer_source_dir,
                                     base_model_dir=self.model_path, rank=self.ctx.rank, dtype=self.dtype,
                                     adapter_only=bool(self.cfg.lora.rank and self.cfg.lora.save_adapter_only))

    @register(Dispatch.RANK_ZERO)
    def full_state_dict(self) -> dict:
        """Collective: the full (unsharded) weights on the CPU, in the compute dtype (`model.dtype`, what
        the reference holds: the reference hooks merge the two); rank 0's copy is returned."""
        return whole_model.full_state_dict(self.model, self.dtype)

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, weights: dict[str, torch.Tensor], reset_optimizer: bool = False) -> None:
        """Replace the weights with full tensors under Hugging Face names (e.g. a merge of checkpoints,
        from the `spike_recovery` step hook); `reset_optimizer` also clears Adam's moments."""
        whole_model.load_full_state_dict(self.model, weights, f"actor rank {self.ctx.rank}")
        if reset_optimizer:
            self.optimizer.state.clear()
