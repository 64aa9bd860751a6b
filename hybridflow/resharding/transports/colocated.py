"""The colocated transport: the generation ranks are the training ranks (the same processes).

Sending: per bucket, each rank sends every peer the pieces of its FSDP2 shard that the peer's
generation slice needs and it lacks, in one `all_to_all_single` over the training group, then
assembles full-shape tensors with only its own generation slice filled (its own shard's part
copied, the rest received) and hands them to the receiver of its own process, lazily, one
bucket at a time inside one vLLM update session. Bytes received per rank are exactly the layout
minimum: zero for column-parallel tensors when the generation TP size equals the FSDP group, the
missing quarter of each row-parallel tensor at TP 2, the missing half of each replicated one,
half of everything at TP 1. A LoRA model is folded first (the fold needs whole A and B), so its
sync gathers whole tensors: correct, not at the layout minimum.

Receiving: the tensors are already in the process (`Transport.receive_bucket`'s default). It
cannot stage (the engine and the trainer are the same processes). Around generation, the
training state steps aside for vLLM's KV cache, in one order (`HANDOVER`; no-ops on the CPU).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from hybridflow.resharding import faults
from hybridflow.resharding.layout import Box, fsdp_box, numel
from hybridflow.resharding.transports.base import Transport, register_transport
from hybridflow.resharding.transports.flat import TransferError
from hybridflow.resharding.verify import WeightSyncError


@register_transport
class Colocated(Transport):
    name = "colocated"

    @classmethod
    def serves(cls, colocated: bool, device: str) -> bool:
        return colocated

    # ---- controller side ------------------------------------------------------------------
    def held(self, shapes: dict, world: int) -> list:
        return [{n: fsdp_box(s, world, r) for n, s in shapes.items()} for r in range(world)]

    def sync_calls(self, actor, rollout) -> list:
        rollout.wake_up(["weights"])  # not the KV cache: the actor's training state is still on the device
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
    # (`sync_calls` above, `generating` here).
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
    def check_plan(self, sender) -> None:
        if len(sender.needs) != sender.world:
            raise WeightSyncError(f"colocated weight sync: {len(sender.needs)} generation ranks for {sender.world} "
                                  "training ranks; they must be the same processes")

    def send(self, sender, stats: dict, group_name: str) -> None:
        from hybridflow.resharding.receiver import local_receiver

        if sender.gathers:
            buckets = _counted(sender, stats)
        else:
            buckets = (_exchange(sender, index, names, local, stats)
                       for index, names, local in sender.shard_buckets())
        from hybridflow.controller.memory import phase_peak_bytes

        phase_peak_bytes()  # GPUs: what came before (the update) is its own phase
        receiver = local_receiver(group_name)
        engine = receiver.engine_state  # the engine serving it checks its state around the load
        loaded = receiver.load(buckets, route=self) if engine is None else engine.load_colocated(buckets, self)
        stats["load_seconds"] = loaded["load_seconds"]
        peak = phase_peak_bytes()  # the sync phase: the training state and vLLM's weights on the device
        if peak is not None:
            stats["device_peak_bytes"] = peak


def _counted(sender, stats: dict):
    """Whole tensors (a LoRA fold): what each rank lacked of them counts as received."""
    size = torch.empty((), dtype=sender.dtype).element_size()
    for _, bucket in sender.whole_buckets():
        for name, _ in bucket:
            whole = numel(sender.shapes[name])
            stats["received_bytes"] += (whole - sender.held[sender.rank][name].numel) * size if sender.world > 1 else 0
        yield bucket


def _exchange(sender, index: int, names: list[str], local: dict, stats: dict) -> list:
    """One bucket: send each peer what it lacks of its slice, receive what this rank lacks."""
    start = time.perf_counter()
    me, pieces = sender.rank, sender.pieces[index]
    send = [[] for _ in range(sender.world)]
    recv_sizes = [0] * sender.world
    for p in pieces:
        if p.src == me and p.dst != me:
            send[p.dst].append(local[p.name][p.box.relative_to(sender.held[me][p.name]).slices()].reshape(-1))
        elif p.dst == me and p.src != me:
            recv_sizes[p.src] += p.box.numel
    send_sizes = [sum(t.numel() for t in parts) for parts in send]
    device = next(iter(local.values())).device  # the shards' device: NCCL exchanges GPU buffers
    flat_send = torch.cat([t for parts in send for t in parts]) if any(send_sizes) else \
        torch.empty(0, dtype=sender.dtype, device=device)
    received = torch.empty(sum(recv_sizes), dtype=sender.dtype, device=device)
    if sender.world > 1:
        try:
            dist.all_to_all_single(received, flat_send, recv_sizes, send_sizes)
        except Exception as exc:
            raise TransferError(f"weight sync bucket {index + 1}/{len(sender.buckets)}: the exchange between "
                                f"training ranks failed: {exc}") from exc
    faults.apply_to_bucket(index, received)
    stats["received_bytes"] += received.numel() * received.element_size()
    stats["exchange_seconds"] += time.perf_counter() - start
    start = time.perf_counter()
    out = _assemble(sender, names, pieces, local, received, recv_sizes)
    stats["assemble_seconds"] += time.perf_counter() - start
    return out


def _assemble(sender, names: list[str], pieces: list, local: dict, received: torch.Tensor,
              recv_sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    """Full-shape tensors with this rank's generation slice filled: its own part from its shard,
    the rest from `received` (laid out by source rank, in piece order)."""
    me = sender.rank
    offsets = [sum(recv_sizes[:s]) for s in range(sender.world)]
    out = []
    for name in names:
        need, held = sender.needs[me][name], sender.held[me][name]
        if need == held == Box.whole(sender.shapes[name]):
            out.append((name, local[name]))  # a single rank: its shard is the whole tensor
            continue
        full = torch.empty(sender.shapes[name], dtype=sender.dtype, device=received.device)  # only the box is written
        for p in (p for p in pieces if p.name == name and p.dst == me):
            if p.src == me:
                full[p.box.slices()].copy_(local[name][p.box.relative_to(held).slices()])
            else:
                n = p.box.numel
                full[p.box.slices()].copy_(received[offsets[p.src]:offsets[p.src] + n].view(p.box.shape))
                offsets[p.src] += n
        out.append((name, full))
    return out
