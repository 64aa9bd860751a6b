"""The reward role: scores generated samples with the configured functions and reward model.

Each rank scores its share of the batch (data-parallel). A rank reads the objects `prompt`,
`response` and every other object column of the batch as the row a reward function sees.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, WorkerContext, register
from hybridflow.rewards import RewardConfig, build_reward


class RewardWorker:
    def __init__(self, ctx: WorkerContext, reward: RewardConfig) -> None:
        self.ctx, self.cfg = ctx, reward
        self.composer = None

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> float:
        """Load the reward functions (and the reward model onto this rank's device); returns seconds."""
        start = time.perf_counter()
        self.composer = build_reward(self.cfg, device=self.ctx.device)
        return time.perf_counter() - start

    @register(Dispatch.DP_SPLIT)
    def compute_rewards(self, batch: Batch) -> Batch:
        """Scores per sample.

        In: objects `prompt`, `response` and any data columns (`ground_truth`, ...).
        Out: `sequence_rewards` (B,) float32 (the weighted total), `reward_extra/<name>` (B,)
        float32 per extra and per-source score (NaN where a sample lacks it),
        `reward_fallback` (B,) bool and `reward_fallback/<cause>` (B,) bool.
        Metrics: `hybridflow.rewards.reward_metrics(out)` on the driver.
        """
        if self.composer is None:
            raise RuntimeError("RewardWorker.compute_rewards called before start()")
        missing = [k for k in ("prompt", "response") if k not in batch.objects]
        if missing:
            raise KeyError(f"RewardWorker.compute_rewards: the batch has no object(s) {missing}; "
                           f"it has objects {list(batch.objects)}")
        rows = [{k: v[i] for k, v in batch.objects.items()} for i in range(len(batch))]
        # DP_SPLIT hands rank r the r-th of equal chunks, so this is the sample's index in the whole batch.
        try:
            result, failure = self.composer.score(rows, first_index=self.ctx.rank * len(batch)), None
        except Exception as exc:  # raised after the gather below, which every rank must join
            result, failure = None, exc
        names = self._extra_names_of_all_ranks(None if failure else sorted(result.extras))
        if failure is not None:
            raise failure
        # names None: another rank failed, and its error is the one the controller raises; this rank's
        # own result goes back unused
        return Batch(result.tensors(names if names is not None else sorted(result.extras)))

    def _extra_names_of_all_ranks(self, names: list[str] | None) -> list[str] | None:
        """The union of extra names over ranks: the controller concatenates the ranks' Batches,
        which must then have the same keys, but extras depend on the data each rank scored. None
        when a rank failed (`names` None there): every rank still joins the gather, so the ranks
        that scored never wait for one that raised."""
        if self.ctx.world_size == 1 or not dist.is_initialized():
            return names
        gathered: list = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, names)
        if any(rank_names is None for rank_names in gathered):
            return None
        return sorted({name for rank_names in gathered for name in rank_names})
