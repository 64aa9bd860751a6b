"""The transport registry: which transport `build_transport` chooses, and what a route that a
transport lacks says."""

from __future__ import annotations

import pytest

from hybridflow.resharding import WeightSyncError
from hybridflow.resharding.transports import TRANSPORTS, Colocated, Broadcast, Transport, build_transport, register_transport


def test_the_placement_chooses_the_builtin_transport_on_either_device():
    for device in ("cpu", "cuda"):
        assert isinstance(build_transport(colocated=True, device=device), Colocated)
        built = build_transport(colocated=False, device=device)
        assert isinstance(built, Broadcast) and built.device == device  # gloo on the CPU, NCCL on GPUs
    assert TRANSPORTS.get("colocated") is Colocated and TRANSPORTS.get("broadcast") is Broadcast


class _Preferred(Transport):
    name = "preferred-on-cuda"
    preference = 5

    @classmethod
    def serves(cls, colocated: bool, device: str) -> bool:
        return not colocated and device == "cuda"


def test_a_registered_transport_of_higher_preference_wins_only_where_it_serves():
    register_transport(_Preferred)
    try:
        assert isinstance(build_transport(colocated=False, device="cuda"), _Preferred)
        assert isinstance(build_transport(colocated=False, device="cpu"), Broadcast)
        assert isinstance(build_transport(colocated=True, device="cuda"), Colocated)
    finally:
        TRANSPORTS.remove(_Preferred.name)


def test_no_transport_serving_the_placement_is_a_named_error():
    broadcast = TRANSPORTS.remove(Broadcast.name)
    try:
        with pytest.raises(WeightSyncError, match=r"no registered weight transport \(\['colocated'\]\) serves a "
                                                  "rollout on a pool of its own on cpu"):
            build_transport(colocated=False, device="cpu")
    finally:
        register_transport(broadcast)


def test_a_transport_without_a_cross_pool_route_or_staging_says_so():
    with pytest.raises(WeightSyncError, match="colocated transport .* no route to a rollout on a pool of its own"):
        Colocated().receiving_updates(plan=None, rank=0)
    with pytest.raises(WeightSyncError, match="this run's transport is colocated"):
        Colocated().stage_bucket(engine=None, info=None)
    assert Broadcast.supports_staging and not Colocated.supports_staging
    with pytest.raises(ValueError, match="needs a `name`"):
        register_transport(type("Nameless", (Transport,), {}))


def test_a_transport_name_is_registered_once():
    with pytest.raises(KeyError, match="weight transport 'broadcast' is already registered"):
        register_transport(type("AnotherBroadcast", (Broadcast,), {}))


class _Only:
    """The sender as a transport may see it: the named methods, and no field (the layouts, the pieces, the
    shards stay the sender's)."""

    def __init__(self, sender, *methods: str) -> None:
        self._sender, self._methods = sender, methods

    def __getattr__(self, name: str):
        if name not in self._methods:
            raise AssertionError(f"the transport read the sender's {name!r}")
        return getattr(self._sender, name)


class _Engine:
    """The rollout engine of the actor's process as the colocated transport sees it: a `ColocatedReceiver`."""

    def __init__(self, receiver) -> None:
        self.receiver, self.loads = receiver, 0

    def load_colocated(self, buckets, route):
        self.loads += 1
        return self.receiver.load(buckets, route=route)


def _one_rank_sender():
    import torch

    from hybridflow.resharding.receiver import ModuleReceiver
    from hybridflow.resharding.sender import SyncPlan, WeightSender

    torch.manual_seed(0)
    trained, engine = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
    receiver = ModuleReceiver(engine, pad_token_id=0)
    shapes = {n: list(p.shape) for n, p in trained.named_parameters()}
    plan = SyncPlan(Colocated(), "float32", 2 ** 20, 10.0, needs=[receiver.needed_boxes(shapes)],
                    buckets=[list(shapes)], shapes=shapes)
    return trained, WeightSender(trained, plan, rank=0, world_size=1), _Engine(receiver)


def test_the_colocated_transport_moves_the_senders_local_slices_and_reads_no_sender_field():
    """One training rank: the sender's own generation slice (the whole tensors) reaches the engine the sender is
    handed (the one the actor met in its process) through `Colocated.send`, which is handed `local_slices` alone."""
    import torch

    trained, sender, engine = _one_rank_sender()
    stats = {"received_bytes": 0, "exchange_seconds": 0.0, "assemble_seconds": 0.0}
    Colocated().send(_Only(sender, "local_slices"), None, stats, engine)
    assert engine.loads == 1
    for name, param in engine.receiver.model.named_parameters():
        assert torch.equal(param, dict(trained.named_parameters())[name]), name
    assert stats["received_bytes"] == 0  # one rank holds its whole slice: nothing moved between ranks


def test_a_colocated_sync_from_an_actor_that_met_no_engine_names_the_placement_fix():
    _, sender, _ = _one_rank_sender()
    with pytest.raises(WeightSyncError, match=r"no rollout engine was built in the actor's process .* map "
                                              r"placement.roles.actor and placement.roles.rollout to the same pool"):
        sender.send(engine=None)


def test_the_colocated_transport_asks_the_sync_to_wake_the_engines_weights_alone():
    """The wake-up is the sync's order (hybridflow/resharding/sync.py `WeightSync.sync_calls`), declared by the
    transport: the weights, not the KV cache, which waits for the training state to leave the device."""
    assert Colocated.wakes_for_sync == ("weights",) and Broadcast.wakes_for_sync == ()
