"""The broadcast transport's logic over gloo in real processes (hybridflow/resharding/transports/broadcast.py):
the same code runs over NCCL on GPUs. One sender and four generation ranks laid out as two engines of
TP 2: two layouts, each receiving only its own boxes, both layouts served at once."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from hybridflow.resharding.layout import Box, layouts
from hybridflow.resharding.sender import WeightSender
from hybridflow.resharding.transports.base import BucketUpdate, RouteInit
from hybridflow.resharding.transports.broadcast import Broadcast
from tests.unit.test_transports import _Only

SHAPES = {"a": [8, 4], "b": [6], "c": [4, 4]}
BUCKETS = [["a", "b"], ["c"]]
HALVES = [{"a": ((0, 4), (0, 4)), "b": ((0, 6),), "c": ((0, 2), (0, 4))},  # TP rank 0: the first rows
          {"a": ((4, 8), (0, 4)), "b": ((0, 6),), "c": ((2, 4), (0, 4))}]  # TP rank 1: the rest; b replicated
NEEDS = [HALVES[0], HALVES[1], HALVES[0], HALVES[1]]  # two engines of TP 2
DELAY_S = 1.5  # layout 0's ranks wait this long before their first bucket, layout 1's before their second


def weights() -> dict[str, torch.Tensor]:
    return {n: torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) + i * 100
            for i, (n, s) in enumerate(SHAPES.items())}


def plan(port: int) -> SimpleNamespace:
    return SimpleNamespace(master_addr="127.0.0.1", master_port=port, timeout_s=60.0, needs=NEEDS, buckets=BUCKETS,
                           shapes=SHAPES, dtype="float32")


def _run(rank: int, port: int, out_dir: str) -> None:
    route = Broadcast()
    if rank == 0:  # the training side: one rank, whole tensors, the real sender's parcels
        sender = WeightSender.__new__(WeightSender)  # its layout fields, without a model
        sender.rank, sender.dtype, sender.buckets = 0, torch.float32, BUCKETS
        sender.needs = [{n: Box.of(r) for n, r in need.items()} for need in NEEDS]
        w = weights()
        sender.whole_buckets = lambda: ((i, [(n, w[n]) for n in names]) for i, names in enumerate(BUCKETS))
        link = route.connect(plan(port), 0)
        start = time.perf_counter()
        route.send(_Only(sender, "parcels"), link, {}, None)  # what travels (no engine in-process), and no sender field
        Path(out_dir, "sender.json").write_text(json.dumps({"seconds": time.perf_counter() - start}))
        return
    me = rank - 1
    info = RouteInit(route=route, **route.receiving_init(plan(port), me))
    engine = SimpleNamespace(link=route.open_receiving(info), received_bytes=0)
    got = {}
    for update in route.receiving_updates(plan(port), me):
        if update["bucket"] == info.group:
            time.sleep(DELAY_S)
        got.update(route.receive_bucket(engine, BucketUpdate(**update)))
    Path(out_dir, f"{me}.json").write_text(json.dumps({
        "received_bytes": engine.received_bytes, "group": info.group, "group_rank": info.rank,
        "boxes": {n: got[n][Box.of(NEEDS[me][n]).slices()].tolist() for n in got}}))


def test_each_layout_gets_only_its_boxes_and_the_layouts_are_served_at_once(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_run, args=(port, str(tmp_path)), nprocs=5, join=True, start_method="spawn")
    assert layouts(NEEDS) == [[0, 2], [1, 3]]
    w = weights()
    for me in range(4):
        out = json.loads((tmp_path / f"{me}.json").read_text())
        assert (out["group"], out["group_rank"]) == (me % 2, me // 2 + 1)
        for name, box in NEEDS[me].items():
            assert torch.equal(torch.tensor(out["boxes"][name]), w[name][Box.of(box).slices()]), (me, name)
        # the layout minimum: half of a and c, all of b, float32
        assert out["received_bytes"] == (16 + 6 + 8) * 4
    # both layouts served at once, the next bucket posted before the last is received: layout 0 is ready
    # for bucket 0 and layout 1 for bucket 1 only after DELAY_S, so the sync takes about DELAY_S. A sender
    # that served one layout after the other would reach layout 1's bucket 0 at DELAY_S and its bucket 1
    # at 2 x DELAY_S (the bound is that, not a speed: the buckets are bytes, the rest is the ranks' sleeps)
    seconds = json.loads((tmp_path / "sender.json").read_text())["seconds"]
    assert DELAY_S * 0.9 <= seconds < 2 * DELAY_S, seconds
