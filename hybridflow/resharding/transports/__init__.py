"""How weights travel from the actor group to the rollout group: one module per transport.

`WeightSync` (sync.py) plans the buckets, runs the checks and reports metrics; `WeightSender`
(sender.py) produces the buckets in every actor process; the rollout's receiver (the protocol in
receiver.py; vLLM's `VLLMReceiver`, workers/rollout/vllm/receiver.py) and our vLLM
transfer engine (transfer.py) load what arrives. Everything that depends on *how*
the bytes move lives in one module here, both ends of it:

- controller side: opening the route (`rendezvous`, `setup_calls`), the engine parts a sync loads
  into (`wakes_for_sync`, which `WeightSync` wakes first), the calls one sync makes
  (`sync_calls`), which rank's statistics count (`per_rank`, `metrics`), what the training
  ranks already hold (`held`, for the layout minimum) and the device memory steps around
  generation (`generating`);
- sending route, inside `WeightSender` in every actor process: whether whole tensors are
  gathered (`gathers_whole`), plan checks (`check_plan`), opening this rank's end (`connect`,
  which returns the link the sender keeps for it) and moving one sync's buckets (`send`), taken
  from the sender in the shape the route needs (`WeightSender.parcels` or `local_slices`), over the
  link or to the engine of the actor's own process, which the sender hands it: which part of which
  tensor goes where is the sender's; a transport only moves bytes;
- receiving route, in the rollout worker and the engine's receiving side (for vLLM, inside its
  worker): the updates a generation rank will receive (`receiving_updates`, `receiving_init`: the
  fields of the route's own `BucketUpdate` and `RouteInit`, which vLLM's transfer engine takes as
  its update and init info), opening its end (`open_receiving`), turning one update into tensors
  (`receive_bucket`), and staging — receiving into host memory while the engine generates — where
  `supports_staging` says it can (`stage_bucket`).

A transport object is built once on the controller (`build_transport`, through the
`TRANSPORTS` registry) and travels to the actor ranks inside the `SyncPlan` and to vLLM's
worker inside each update, so it holds only plain values; what a route opens (a process
group) is kept by the sender or the engine as its `link`, never by the transport.

Two are registered: `colocated.py` (the rollout in the actor's processes) and `broadcast.py` (a pool
of its own: each bucket broadcast once per layout of the generation ranks, over gloo on CPUs and NCCL
on GPUs). Another is one more module: it subclasses `Transport`, says where it `serves` and with
what `preference`, and `register_transport` adds it (tests/e2e/test_toy_transport.py adds one that
moves files). Nothing else changes.
"""

from hybridflow.resharding.transports.base import (  # noqa: F401 - the package's names
    TRANSPORTS, Transport, build_transport, register_transport, transport_class)
# the built-in transports register themselves on import (they subclass `Transport`)
from hybridflow.resharding.transports.colocated import Colocated
from hybridflow.resharding.transports.broadcast import Broadcast

__all__ = ["TRANSPORTS", "Broadcast", "Colocated", "Transport", "build_transport", "register_transport",
           "transport_class"]
