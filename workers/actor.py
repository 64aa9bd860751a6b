"""The actor: a Hugging Face causal LM under FSDP2 over its group's ranks.

Computes response log-probs and entropy, and trains: the policy update, supervised fine-tuning steps
(the SFT recipe reuses the actor) and preference steps, each an objective
(hybridflow.training.objectives: `PolicyObjective`, `SFTObjective`, `PreferenceObjective`) run by the
trained roles' one loop (hybridflow.training.loop: mini-batches, gradient accumulation, the float16 loss
scale's retry, clipping, the lr schedule, the reduction over ranks). What it does with its weights
besides training is composed from the framework, each registered method here or in a mixin delegating
so that the controller calls it on the worker by name: the sending end of the weight sync and the
rollout engine it meets in its process (`hybridflow.resharding.source`), the moves of its training state off and back onto a GPU
shared with the rollout engine (`hybridflow.training.memory_moves`), the reference as the model with its
LoRA adapter off (`hybridflow.training.adapter_reference`), and the whole model read, replaced
(`hybridflow.training.state`) or exported (`hybridflow.training.whole_model`).
"""

from __future__ import annotations

import time

import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import ActorConfig
from hybridflow.controller import Dispatch, WorkerContext, register
from hybridflow.resharding.source import WeightSendingMixin, WeightSource
from hybridflow.training import memory_moves, whole_model
from hybridflow.training.exact_layout import OfferedModule, layout_log_probs
from hybridflow.training.fsdp import (
    build_optimizer,
    fp32_output_head,
    load_model,
    shard_model,
)
from hybridflow.training.adapter_reference import AdapterReferenceMixin
from hybridflow.training.loop import TrainingLoopMixin
from hybridflow.training.loss_scale import LossScale
from hybridflow.training.objectives import OBJECTIVES, Objective, PolicyObjective, PreferenceObjective, SFTObjective
from hybridflow.training.packing import choose_packing
from hybridflow.training.resolution import MovedFraction, precision_stats
from hybridflow.training.shared_prompts import choose_sharing
from hybridflow.training.state import TrainingStateMixin
from hybridflow.training.sequences import log_probs_and_entropy, pair_log_probs
from hybridflow.training.ulysses import split_sequences


class ActorWorker(TrainingStateMixin, TrainingLoopMixin, AdapterReferenceMixin, WeightSendingMixin):
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
        with this module (rollout.backend=exact), which `offered_module` offers it, and π_old is computed in the
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
        self.colocated_engine = None  # the rollout engine of this process, met at build (`meet`), if any
        self.model = self.optimizer = self.scheduler = None
        self.weights = None  # this rank's end of the weight path (hybridflow.resharding.source), built by start
        self.updates = 0

    # ---- set-up ---------------------------------------------------------------------------

    def offered_module(self) -> OfferedModule:
        """What the exact engine of this process generates with (rollout.backend=exact): this module and
        the rows of one π_old forward."""
        if not self.exact_rollout:
            raise RuntimeError("rollout.backend=exact generates with the actor's module, and this actor was built "
                               "without exact_rollout=True, so its π_old pass is not computed in the engine's layout: "
                               "build the actor with recipes/roles.py actor_role, which sets it for the exact engine")
        if self.model is None:
            raise RuntimeError("the exact engine asked for the actor's module before the actor started: call the "
                               "actor's start first")
        return OfferedModule(self.model, self.cfg.samples_per_micro_batch)

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> dict:
        torch.manual_seed(self.seed)
        model = load_model(self.model_path, self.master_dtype, lora=self.cfg.lora,
                           gradient_checkpointing=self.cfg.gradient_checkpointing,
                           trust_remote_code=self.trust_remote_code, keep_dropout=self.keep_dropout,
                           on_meta=self.ctx.world_size > 1 and self.ctx.rank != 0)
        packed = choose_packing(model, self.pack_sequences)
        shared = choose_sharing(model, self.share_prompts, packed)
        split_sequences(model, packed, self.cfg.sequence_parallel_size, self.ctx, self.pack_sequences)
        self.model = shard_model(model, self.ctx.device, compute_dtype=self.dtype)
        if self.cfg.fp32_lm_head:
            fp32_output_head(self.model)
        self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg.optim, self.total_steps)
        self.weights = WeightSource(self.model, self.ctx.rank, self.ctx.world_size)
        if not self.cfg.lora.rank:  # a LoRA run's engine gets the folded weights, not the adapter's
            self._moved = MovedFraction([p for p in self.model.parameters() if p.requires_grad],
                                        {"master": getattr(torch, self.master_dtype), "actor": getattr(torch, self.dtype),
                                         "engine": getattr(torch, self.engine_dtype)})
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

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def compute_pair_log_probs(self, pairs: Batch, per_token: bool = False) -> Batch:
        """`chosen_log_probs` and `rejected_log_probs` (B,) of a pair batch under the current policy:
        each response's summed log-probability, or its mean per token with `per_token`."""
        return pair_log_probs(self.model, pairs.to(self.ctx.device), self.cfg.samples_per_micro_batch,
                              self.cfg.tokens_per_micro_batch, per_token)

    # ---- training: each an objective (hybridflow.training.objectives), one loop (training.loop) -----

    @register(Dispatch.DP_SPLIT)
    def update_policy(self, batch: Batch, old_log_probs_key: str = "old_log_probs", weighted: bool = False,
                      mismatch_band: tuple[float, float] | None = None) -> dict:
        """One step's policy update (`PolicyObjective`: the columns it needs, `rollout_mismatch/*` against the
        sampler with a `mismatch_band`), the proximal log-probs from `old_log_probs_key`, times
        `behavior_weights` when `weighted`. Returns metrics averaged over ranks."""
        start = time.perf_counter()
        stats = self._train(batch, PolicyObjective(self.cfg, self.temperature, old_log_probs_key, weighted, mismatch_band))
        stats["timing/actor_update_s"] = time.perf_counter() - start
        return stats

    @register(Dispatch.DP_SPLIT)
    def train_sft(self, batch: Batch) -> dict:
        """One supervised step: cross-entropy on response (answer) tokens only (`SFTObjective`)."""
        return self._train(batch, SFTObjective())

    @register(Dispatch.DP_SPLIT)
    def train_preference(self, pairs: Batch, loss: str, beta: float, label_smoothing: float = 0.0,
                         simpo_gamma: float = 0.5) -> dict:
        """One optimizer step of the `PREFERENCE_LOSSES` loss `loss` over every pair of a pair batch with its
        reference log-probs (`PreferenceObjective`). Returns `actor/loss`, `actor/grad_norm`, `actor/lr` and
        the loss's statistics under TRL's names (`rewards/chosen`, `rewards/margins`, `logps/chosen`, ...)."""
        start = time.perf_counter()
        stats = self._train(pairs, PreferenceObjective(loss, beta, label_smoothing, simpo_gamma))
        stats["timing/actor_update_s"] = time.perf_counter() - start
        return stats

    @register(Dispatch.DP_SPLIT)
    def train_objective(self, batch: Batch, name: str, params: dict) -> dict:
        """One update of the registered objective `name` (hybridflow.training.objectives `OBJECTIVES`) built
        from `params`: a new objective needs its file and its entry, no method here."""
        start = time.perf_counter()
        stats = self._train(batch, OBJECTIVES.get(name)(**params))
        stats["timing/actor_update_s"] = time.perf_counter() - start
        return stats

    def _train(self, batch: Batch, objective: Objective) -> dict:
        """The trained roles' one loop (`run_objective`, hybridflow.training.loop) under the actor's names,
        with `precision/*`: the share of the weights the step moved in each watched dtype, and float16's
        loss scale (hybridflow.training.resolution)."""
        if self._moved is not None:
            self._moved.before()
        stats = self.run_objective(batch, objective, "actor")
        return {**stats, **precision_stats(self._moved, self.loss_scale)}

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

    # ---- checkpoints (save, load, the whole model read or replaced: TrainingStateMixin) -----------------

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, directory: str, tokenizer_source_dir: str) -> str | None:
        """Collective: rank 0 writes the actor (LoRA folded) as a Hugging Face model directory in the
        compute dtype (`model.dtype`: what the model was loaded and is served in), not the master's;
        or, with actor.lora.save_adapter_only, its LoRA adapter as a peft adapter directory."""
        return whole_model.export_hf(directory, model=self.model, tokenizer_source_dir=tokenizer_source_dir,
                                     base_model_dir=self.model_path, rank=self.ctx.rank, dtype=self.dtype,
                                     adapter_only=bool(self.cfg.lora.rank and self.cfg.lora.save_adapter_only))
