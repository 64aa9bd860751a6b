"""The weight-transport protocol (`Transport`), its registry and the choice among the registered
transports; the package's docstring (hybridflow/resharding/transports/__init__.py) says what each
method is for. A transport module imports this, subclasses `Transport` and registers it."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from hybridflow.resharding.verify import WeightSyncError
from hybridflow.registry import Registry


@dataclass
class RouteInit:
    """What a generation rank opens its end of a route with (`Transport.receiving_init`'s fields and the
    route itself); an engine's receiving side passes it to `open_receiving` (vLLM's transfer engine
    takes it as its init info)."""

    route: Any = None  # the transport whose receiving end this opens
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    rank: int = 1  # this rank in the route's group (the sender is 0)
    world_size: int = 2
    timeout_s: float = 120.0
    group: int = 0  # which of the route's groups this rank joins (the broadcast transport's layout)


@dataclass
class BucketUpdate:
    """One bucket for `route` (a transport) to turn into [(checkpoint name, full-shape tensor)]:
    `weights` handed over in this process, or `names`/`shapes`/`boxes`/`dtype` for the route to
    receive (`Transport.receiving_updates`' fields); vLLM's transfer engine takes it as its update info."""

    route: Any = None
    bucket: int = 0
    weights: Any = None  # iterable of (checkpoint name, full-shape tensor) (colocated)
    names: list = field(default_factory=list)
    shapes: list = field(default_factory=list)
    boxes: list = field(default_factory=list)  # per name: the ranges this rank receives
    dtype: str = "float32"


class Transport:
    """The protocol; a transport module subclasses it and overrides what differs."""

    name = ""
    gathers_whole = False  # training ranks build whole tensors (FSDP all-gathers) before sending
    supports_staging = False  # can receive into host memory while the engine generates (max_staleness >= 2)
    preference = 0  # among the transports that serve a placement, the highest is chosen
    # the engine parts (of "weights", "kv_cache") a sync loads into, which `WeightSync` wakes before `sync_calls`
    # (a route that loads into the engine in the actor's processes: its weights, while the training state is on the device)
    wakes_for_sync: tuple[str, ...] = ()
    device = "cpu"  # the plan's device ("cpu" or "cuda"), set by `build_transport`: both ends read it

    @classmethod
    def serves(cls, colocated: bool, device: str) -> bool:
        """Whether this transport can carry the weights for a placement: the rollout in the
        actor's processes (`colocated`) or on a pool of its own, on `device` ("cpu" or "cuda")."""
        return False

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
        """The group calls of one sync, issued together (the parts of `wakes_for_sync` already awake)."""
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

    def rest(self, rollout) -> bool:
        """Before training that no generation comes between (a recipe whose engine is first used later):
        the engine frees what it holds where it shares the actor's devices; returns whether it did. The
        next sync or generation wakes it (`WeightSync.sync_calls`, `generating`)."""
        return False

    handover: dict[str, float] = {}  # the last `generating`'s timed steps (a transport that has some sets its own)

    def handover_seconds(self) -> dict[str, float]:
        """`timing/<step>_s` of each device memory step of the last `generating` that moved something
        (offload, reload, engine sleep and wake-up); {} when none did."""
        return dict(self.handover)

    # ---- sending route (in WeightSender, every actor process) ---------------------------------
    def check_plan(self, plan, world: int) -> None:
        """Refuse a `SyncPlan` this route cannot carry between `world` training ranks and the plan's
        generation ranks (`plan.needs`, one per generation rank)."""

    def connect(self, plan, rank: int):
        """Open training rank `rank`'s end of the route; returns the link the sender keeps for it and
        hands back to `send`."""
        return None

    def send(self, sender, link, stats: dict, engine) -> None:
        """Move one sync's buckets, taken from `sender` in the shape the route needs — per bucket
        one flat parcel per layout of the generation ranks on training rank 0
        (`sender.parcels()`), or this rank's own generation slice, the missing pieces moved by a
        collective the transport passes (`sender.local_slices(exchange, stats)`) — over `link`
        (what `connect` returned), or in this process to `engine`: the rollout engine the actor met
        in its process (a `receiver.ColocatedReceiver`; None when it met none); add to `stats` what
        this rank measured."""
        raise NotImplementedError

    # ---- receiving route (in the rollout worker, and in the engine's receiving side: vLLM's worker) ---
    def receiving_init(self, plan, rank: int) -> dict:
        """The fields of generation rank `rank`'s `RouteInit`."""
        raise self._no_route()

    def receiving_updates(self, plan, rank: int) -> list[dict]:
        """Per bucket, what generation rank `rank` receives (`BucketUpdate` fields)."""
        raise self._no_route()

    def update_bytes(self, update: dict) -> int:
        """Bytes one of `receiving_updates` carries to its rank."""
        raise self._no_route()

    def _no_route(self) -> WeightSyncError:
        return WeightSyncError(f"the {self.name} transport hands weights over in the actor's processes; it has no "
                               "route to a rollout on a pool of its own")

    def open_receiving(self, info: RouteInit):
        """In the engine's receiving side: open this rank's end of the route; returns the link the
        engine keeps for it."""
        return None

    def receive_bucket(self, engine, info: BucketUpdate) -> list:
        """In the engine's receiving side: one bucket's [(checkpoint name, full-shape tensor)] for
        `info`; `engine` holds the route's `link` and counts `received_bytes`. By default the tensors
        were handed over in this process."""
        if info.weights is None:
            raise WeightSyncError(f"the {self.name} transport was given bucket {info.bucket} without its tensors")
        return info.weights

    def stage_bucket(self, engine, info: BucketUpdate) -> list:
        """In the engine's receiving side, while it may be generating: receive one bucket into host memory."""
        raise WeightSyncError(f"a staged weight push needs a transport that receives while the engine generates; "
                              f"this run's transport is {self.name} (put the rollout on a pool of its own)")

    def __repr__(self) -> str:
        return self.name


TRANSPORTS: Registry[type[Transport]] = Registry("weight transport", "a Transport subclass with a `name`")


# Add a transport class to the registry `build_transport` chooses from (usable as a decorator).
register_transport = TRANSPORTS.add_class


def transport_class(colocated: bool, device: str = "cpu") -> type[Transport]:
    """The transport a placement needs: of the registered ones that serve it (the rollout in the
    actor's processes or on a pool of its own, on `device`), the one of highest preference."""
    found = [cls for cls in TRANSPORTS.values() if cls.serves(colocated, device)]
    if not found:
        where = "in the actor's processes" if colocated else "on a pool of its own"
        raise WeightSyncError(f"no registered weight transport ({TRANSPORTS.names()}) serves a rollout {where} on "
                              f"{device}")
    return max(found, key=lambda cls: cls.preference)


def build_transport(colocated: bool, device: str = "cpu", name: str | None = None) -> Transport:
    """An instance of `transport_class(colocated, device)` (or of the transport registered as `name`),
    for `device`."""
    transport = (TRANSPORTS.get(name) if name else transport_class(colocated, device))()
    transport.device = device
    return transport
