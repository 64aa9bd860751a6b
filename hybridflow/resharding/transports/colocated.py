"""The colocated transport: the generation ranks are the training ranks (the same processes).

Sending: per bucket, each rank sends every peer the pieces of its FSDP2 shard that the peer's
generation slice needs and it lacks, in one `all_to_all_single` over the training group
(`exchange`), and hands the full-shape tensors with its own generation slice filled to the receiver
of its own process, lazily, one bucket at a time inside one update session of the engine. Which
pieces move and how the tensors are assembled is the sender's (`WeightSender.local_slices`); this
module moves the bytes. Bytes received per rank are exactly the layout minimum: zero for
column-parallel tensors when the generation TP size equals the FSDP group, the missing quarter of
each row-parallel tensor at TP 2, the missing half of each replicated one, half of everything at
TP 1. A LoRA model is folded first (the fold needs whole A and B), so its sync gathers whole
tensors: correct, not at the layout minimum.

Receiving: the tensors are already in the process (`Transport.receive_bucket`'s default), handed to
the engine the actor met in its process (`send`'s `engine`: the host introduced the two when it built
them, hybridflow/controller/context.py `introduce`), whose weights `WeightSync` woke first
(`wakes_for_sync`). It cannot stage (the engine and the trainer are the same processes). Around
generation, the training state steps aside for vLLM's KV cache, in one order (`HANDOVER`; no-ops on
the CPU).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from hybridflow.resharding.layout import fsdp_box
from hybridflow.resharding.transports.base import Transport, register_transport
from hybridflow.resharding.transports.flat import TransferError
from hybridflow.resharding.verify import WeightSyncError


@register_transport
class Colocated(Transport):
    name = "colocated"
    wakes_for_sync = ("weights",)  # not the KV cache: the actor's training state is still on the device

    @classmethod
    def serves(cls, colocated: bool, device: str) -> bool:
        return colocated

    # ---- controller side ------------------------------------------------------------------
    def held(self, shapes: dict, world: int) -> list:
        return [{n: fsdp_box(s, world, r) for n, s in shapes.items()} for r in range(world)]

    def sync_calls(self, actor, rollout) -> list:
        return [actor.send_weights.remote()]

    def per_rank(self, results: list) -> list[dict]:
        return results[0]

    def metrics(self, per_rank: list[dict]) -> dict[str, float]:
        out = {"weight_sync/exchange_s": max(r["exchange_seconds"] for r in per_rank)}
        if all("device_peak_bytes" in r for r in per_rank):  # GPUs: the sync phase's peak (send)
            out["memory/device_peak_sync_gib"] = max(r["device_peak_bytes"] for r in per_rank) / 2 ** 30
        return out

    # The device hand-over of one colocated step (GPUs), in this order, the one sequence of it:
    #   [train] -> wake vLLM's weights only -> sync (and the checksums) -> offload the training state
    #   (gradients freed) -> wake vLLM's KV cache -> [the engine's half of the sync's probe] -> generate
    #   -> vLLM sleeps (weights to the host, KV cache freed) -> reload the training state -> [the actor's
    #   half of the probe] -> [train]; the engine's state (workers/rollout/__init__.py) refuses a
    #   generation, a probe among them, while its KV cache sleeps (WeightSync._probe_or_defer)
    # so the device never holds the training state and vLLM's KV cache at once: the sync's peak is
    # the training state plus vLLM's weights, generation's vLLM's weights and KV cache alone
    # (`wakes_for_sync` above, which WeightSync wakes before `sync_calls`; `generating` here).
    HANDOVER = ("offload", "engine_wake", "generate", "engine_sleep", "reload")

    @contextmanager
    def generating(self, actor, rollout) -> Iterator[None]:
        """On GPUs the actor's training state goes to host memory, then vLLM wakes what still sleeps
        (its KV cache; its weights too when no sync woke them this step), generates, sleeps, and the
        training state comes back. No-ops on the CPU. Each phase that moved something is timed
        (`timing/<phase>_s`) and, on GPUs, its device memory peak read from the actor's process
        (`memory/device_peak_<phase>_gib`, the engine shares it): `handover_seconds`."""
        self.handover = {}
        on_device = self._phase("offload", actor.offload, actor)  # False on the CPU: nothing moves, nothing is read
        self._phase("engine_wake", lambda: rollout.wake_up(["weights", "kv_cache"]), actor, on_device)
        yield
        self._phase("generate", lambda: False, actor, on_device)  # generation's own peak, read after it
        self._phase("engine_sleep", rollout.sleep, actor, on_device)
        self._phase("reload", actor.reload, actor, on_device)

    def rest(self, rollout) -> bool:
        """The engine sleeps (its KV cache freed, its weights to the host or, at rollout.sleep_level 2,
        discarded: the next sync loads them whole) while the actor trains; False where it has nothing to free
        (vLLM on the CPU)."""
        return any(rollout.sleep())

    def _phase(self, phase: str, call, actor, read_peak: bool = False) -> bool:
        """Run one phase; time it if it moved something, and read its device peak (the next phase's
        starts then) if it moved something or `read_peak`. Returns whether it moved something."""
        start = time.perf_counter()
        result = call()
        moved = any(result if isinstance(result, list) else [result])
        if moved:
            self.handover[f"timing/{phase}_s"] = time.perf_counter() - start
        if moved or read_peak:
            peaks = [p for p in actor.device_peak_bytes() if p is not None]
            if peaks:
                self.handover[f"memory/device_peak_{phase}_gib"] = max(peaks) / 2 ** 30
        return moved

    # ---- sending route ------------------------------------------------------------------------
    def check_plan(self, plan, world: int) -> None:
        if len(plan.needs) != world:
            raise WeightSyncError(f"colocated weight sync: {len(plan.needs)} generation ranks for {world} "
                                  "training ranks; they must be the same processes")

    def send(self, sender, link, stats: dict, engine) -> None:
        """This rank's slices, bucket by bucket, to `engine`, the rollout engine of this process (it checks
        its state around the load); a WeightSyncError naming the placement fix when the actor met none."""
        from hybridflow.controller.memory import phase_peak_bytes

        if engine is None:
            raise WeightSyncError(
                "colocated weight sync: no rollout engine was built in the actor's process for it to meet; map "
                "placement.roles.actor and placement.roles.rollout to the same pool, or give the rollout a pool of "
                "its own (placement=disaggregated)")
        buckets = sender.local_slices(self.exchange, stats)  # lazily, one bucket at a time
        phase_peak_bytes()  # GPUs: what came before (the update) is its own phase
        loaded = engine.load_colocated(buckets, self)
        stats["load_seconds"] = loaded["load_seconds"]
        peak = phase_peak_bytes()  # the sync phase: the training state and vLLM's weights on the device
        if peak is not None:
            stats["device_peak_bytes"] = peak

    @staticmethod
    def exchange(flat_send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], what: str) -> torch.Tensor:
        """One `all_to_all_single` over the training group (the default one): `send_sizes[r]` elements
        of `flat_send` to rank r, `recv_sizes[r]` from it, laid out by source rank."""
        received = torch.empty(sum(recv_sizes), dtype=flat_send.dtype, device=flat_send.device)
        if len(send_sizes) > 1:
            try:
                dist.all_to_all_single(received, flat_send, recv_sizes, send_sizes)
            except Exception as exc:
                raise TransferError(f"{what}: the exchange between training ranks failed: {exc}") from exc
        return received
