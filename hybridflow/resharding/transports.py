"""How weights travel from the actor group to the rollout group: one class per transport.

`WeightSync` (sync.py) plans the buckets, runs the checks, counts policy versions and reports
metrics; everything that depends on *how* the bytes move lives in a `Transport`:

- controller side: opening the route (`rendezvous`, `setup_calls`), the calls one sync makes
  (`sync_calls`), which rank's statistics count (`per_rank`, `metrics`), what the training
  ranks already hold (`held`, for the layout minimum) and the device memory steps around
  generation (`generating`);
- training side, inside `WeightSender` (sender.py), in every actor process: whether whole
  tensors are gathered (`gathers_whole`), plan checks (`check_plan`), opening its end of the
  route (`connect`) and moving one sync's buckets (`send`).

A transport object is built once on the controller (`build_transport`) and travels to the
actor ranks inside the `SyncPlan`, so it holds only plain values.

Two exist:
- `Colocated`: the generation ranks are the training ranks (same processes); buckets are
  exchanged over the training group and handed to this process's receiver.
- `Gloo`: the rollout has a pool of its own; training rank 0 sends each rollout rank its
  boxes over a gloo group spanning both pools (transport.py).

An NCCL transport for GPU pools goes here as a third class: `connect` / the rollout's `join`
would build a group beside the default one (vLLM's `StatelessProcessGroup` and
`PyNcclCommunicator`, as its `NCCLWeightTransferEngine` does), `send` would broadcast
device buffers bucket by bucket, and `build_transport` would choose it for a disaggregated
run on CUDA. Nothing else changes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class Transport:
    """The protocol; a subclass overrides what differs."""

    name = ""
    gathers_whole = False  # training ranks build whole tensors (FSDP all-gathers) before sending

    # ---- controller side ------------------------------------------------------------------
    def rendezvous(self, actor) -> tuple[str, int]:
        """Where the route's processes meet (an address on training rank 0's host), if anywhere."""
        return "", 0

    def setup_calls(self, actor, rollout, plan) -> list:
        """The group calls that open the route, issued together."""
        return [actor.setup_weight_sender.remote(plan)]

    def held(self, shapes: dict, world: int) -> list | None:
        """Per generation rank, the box of each tensor it holds before the sync (None: nothing)."""
        return None

    def sync_calls(self, actor, rollout) -> list:
        """The group calls of one sync, issued together."""
        raise NotImplementedError

    def per_rank(self, results: list) -> list[dict]:
        """Per generation rank, the statistics of one sync, from `sync_calls`' results."""
        raise NotImplementedError

    def metrics(self, per_rank: list[dict]) -> dict[str, float]:
        """Metrics only this transport has."""
        return {}

    @contextmanager
    def generating(self, actor, rollout) -> Iterator[None]:
        """Around generation: device memory steps, if the pools share devices."""
        yield

    # ---- training side (in WeightSender) -------------------------------------------------------
    def check_plan(self, sender) -> None:
        pass

    def connect(self, sender) -> None:
        pass

    def send(self, sender, stats: dict, group_name: str) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class Colocated(Transport):
    name = "colocated"

    def held(self, shapes: dict, world: int) -> list:
        from hybridflow.resharding.layout import fsdp_box

        return [{n: fsdp_box(s, world, r) for n, s in shapes.items()} for r in range(world)]

    def sync_calls(self, actor, rollout) -> list:
        rollout.wake_up()
        return [actor.send_weights.remote()]

    def per_rank(self, results: list) -> list[dict]:
        return results[0]

    def metrics(self, per_rank: list[dict]) -> dict[str, float]:
        return {"weight_sync/exchange_s": max(r["exchange_seconds"] for r in per_rank)}

    @contextmanager
    def generating(self, actor, rollout) -> Iterator[None]:
        """On GPUs the actor's training state goes to host memory while vLLM generates, then vLLM
        releases its KV cache and the training state comes back (the next sync wakes vLLM up).
        No-ops on the CPU."""
        rollout.wake_up()  # a step without a sync (critic warm-up) left it asleep
        actor.offload()
        yield
        rollout.sleep()
        actor.reload()

    def check_plan(self, sender) -> None:
        from hybridflow.resharding.verify import WeightSyncError

        if len(sender.needs) != sender.world:
            raise WeightSyncError(f"colocated weight sync: {len(sender.needs)} generation ranks for {sender.world} "
                                  "training ranks; they must be the same processes")

    def send(self, sender, stats: dict, group_name: str) -> None:
        from hybridflow.resharding.receiver import local_receiver

        loaded = local_receiver(group_name).load(sender.colocated_buckets(stats))
        stats["load_seconds"] = loaded["load_seconds"]


class Gloo(Transport):
    name = "gloo"
    gathers_whole = True

    def rendezvous(self, actor) -> tuple[str, int]:
        import ray

        return tuple(ray.get(actor.hosts[0].rendezvous_address.remote()))

    def setup_calls(self, actor, rollout, plan) -> list:
        return [actor.setup_weight_sender.remote(plan), rollout.join_weight_sync.remote(plan)]

    def sync_calls(self, actor, rollout) -> list:
        return [actor.send_weights.remote(), rollout.receive_weights.remote()]

    def per_rank(self, results: list) -> list[dict]:
        return results[1]  # the rollout ranks' own statistics

    def connect(self, sender) -> None:
        """Training rank 0 opens the transfer group (rollout ranks join from their side)."""
        from hybridflow.resharding.transport import join_group

        if sender.rank == 0:
            sender.group = join_group(sender.plan.master_addr, sender.plan.master_port, 0, 1 + len(sender.needs),
                                      sender.plan.timeout_s)

    def send(self, sender, stats: dict, group_name: str) -> None:
        sender.send_gloo()


TRANSPORTS: dict[str, type[Transport]] = {cls.name: cls for cls in (Colocated, Gloo)}


def build_transport(rollout_colocated: bool) -> Transport:
    """The transport a placement needs: the rollout in the actor's processes, or on a pool of its own."""
    return Colocated() if rollout_colocated else Gloo()
