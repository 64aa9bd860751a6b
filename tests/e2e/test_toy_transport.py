"""A third transport, added by this file alone: registered, chosen by `build_transport`, and run
end to end between a real FSDP2 actor and a real vLLM engine on pools of their own.

`Files` moves each generation rank's boxes of a bucket as one file in a directory both pools
can see: training rank 0 packs and writes them (atomically), the rollout rank waits for its
file, reads it and deletes it. It implements every part of the protocol a transport owns
(hybridflow/resharding/transports/__init__.py): controller side, sending route, receiving route
and a declared `supports_staging = False`, with nothing changed outside this file.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.config.schema import ActorConfig, HybridFlowConfig, OptimConfig, RolloutConfig, WeightSyncConfig
from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, spawn_workers
from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.prompts import encode_prompts
from hybridflow.resharding import WeightSyncError
from hybridflow.resharding.layout import Box
from hybridflow.resharding.sync import WeightSync
from hybridflow.resharding.transports import TRANSPORTS, Transport, build_transport, register_transport
from hybridflow.resharding.transports.flat import unpack
from recipes.roles import actor_role
from hybridflow.run.stage import prepare_stage
from workers.rollout.vllm_rollout import VLLMRollout

VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


class Files(Transport):
    name = "toy-files"
    gathers_whole = True
    preference = 10  # above broadcast's: once registered, it carries every disaggregated sync on CPUs

    def __init__(self) -> None:
        self.directory = ""

    @classmethod
    def serves(cls, colocated: bool, device: str) -> bool:
        return not colocated and device == "cpu"

    # ---- controller side
    def rendezvous(self, actor) -> tuple[str, int]:
        self.directory = tempfile.mkdtemp(prefix="hybridflow-toy-transport-")  # travels in the plan
        return "", 0

    def setup_calls(self, actor, rollout, plan) -> list:
        return [actor.setup_weight_sender.remote(plan), rollout.join_weight_sync.remote(plan)]

    def sync_calls(self, actor, rollout) -> list:
        return [actor.send_weights.remote(), rollout.receive_weights.remote()]

    def per_rank(self, results: list) -> list[dict]:
        return results[1]

    # ---- sending route
    def connect(self, plan, rank: int):
        return {"syncs": 0}

    def send(self, sender, link, stats: dict, engine) -> None:
        link["syncs"] += 1
        for parcels in sender.parcels():  # training rank 0: one per layout of the generation ranks
            for parcel in parcels:
                for dst in parcel.ranks:
                    path = self._path(link["syncs"], parcel.index, dst)
                    torch.save(parcel.flat, path + ".tmp")
                    os.replace(path + ".tmp", path)

    # ---- receiving route
    def receiving_init(self, plan, rank: int) -> dict:
        return {"rank": rank, "timeout_s": plan.timeout_s}

    def receiving_updates(self, plan, rank: int) -> list[dict]:
        need = plan.needs[rank]
        return [{"bucket": i, "names": names, "shapes": [plan.shapes[n] for n in names],
                 "boxes": [need[n] for n in names], "dtype": plan.dtype, "route": self}
                for i, names in enumerate(plan.buckets)]

    def update_bytes(self, update: dict) -> int:
        size = torch.empty((), dtype=getattr(torch, update["dtype"])).element_size()
        return sum(Box.of(b).numel for b in update["boxes"]) * size

    def open_receiving(self, info):
        return {"rank": info.rank, "timeout_s": info.timeout_s, "syncs": 0}

    def receive_bucket(self, engine, info) -> list:
        link = engine.link
        if info.bucket == 0:
            link["syncs"] += 1
        path = self._path(link["syncs"], info.bucket, link["rank"])
        deadline = time.monotonic() + link["timeout_s"]
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"toy-files: {path} did not arrive within {link['timeout_s']} s")
            time.sleep(0.01)
        flat = torch.load(path)
        os.remove(path)
        engine.received_bytes += flat.numel() * flat.element_size()
        boxes = [Box.of(b) for b in info.boxes]
        return unpack(flat, info.names, info.shapes, boxes, getattr(torch, info.dtype))

    def _path(self, sync: int, bucket: int, rank: int) -> str:
        return os.path.join(self.directory, f"sync{sync}-bucket{bucket}-rank{rank}.pt")


@pytest.fixture
def files_registered():
    register_transport(Files)
    yield
    TRANSPORTS.remove(Files.name)


@pytest.mark.slow  # an actor and a vLLM engine on pools of their own, about 20 s
def test_a_transport_added_by_one_file_is_chosen_and_carries_the_weights(ray_local, tiny_model_dir,
                                                                         files_registered):
    transport = build_transport(colocated=False, device="cpu")
    assert isinstance(transport, Files)  # chosen through the registry, by preference
    assert build_transport(colocated=False, device="cuda").name == "broadcast"  # it does not serve GPUs
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = RoleSpec(VLLMRollout, dict(
        model_path=str(tiny_model_dir), rollout=RolloutConfig(max_response_tokens=6), max_prompt_tokens=8,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, verifiable_weights=True))
    actor = actor_role(prepare_stage(HybridFlowConfig(actor=ActorConfig(optim=OptimConfig(lr=1e-3), samples_per_micro_batch=4))).config,
                       tiny_model_dir)
    groups = spawn_workers(ResourcePool(PoolSpec("toy-train", devices_per_node=1)), {"actor": actor},
                           env_vars=VLLM_ENV)
    groups.update(spawn_workers(ResourcePool(PoolSpec("toy-gen", devices_per_node=1)), {"rollout": rollout},
                                env_vars=VLLM_ENV))
    try:
        for future in [groups["actor"].start.remote(), groups["rollout"].start.remote()]:
            future.get()
        sync = WeightSync(groups["actor"], groups["rollout"],
                          WeightSyncConfig(bucket_mb=0.25, timeout_s=60.0, checksum_every_steps=1), transport,
                          "float32")
        setup = sync.setup()
        assert setup["weight_sync/buckets"] > 1
        prompts = encode_prompts(make_arithmetic_rows(8, ArithmeticSpec(), seed=0), tok, 8)
        samples = groups["rollout"].generate(prompts)
        samples = samples.union(groups["actor"].compute_log_probs(samples))
        samples.tensors["advantages"] = torch.ones_like(samples["old_log_probs"])
        groups["actor"].update_policy(samples)  # the rollout's weights are now one step behind

        metrics = sync.sync(step=1, version=1)
        # every vLLM tensor compared exactly with the actor's, and the log-probs agree
        assert metrics["weight_sync/verified_tensors"] > 0 and metrics["weight_sync/probe_log_prob_gap"] < 1e-3
        assert metrics["weight_sync/bytes_received_per_rank"] == metrics["weight_sync/min_bytes_per_rank"] > 0
        assert os.listdir(transport.directory) == []  # every file read and removed
        with pytest.raises(WeightSyncError, match="toy-files"):  # it declared no staging
            sync.stage(step=2, version=1)
    finally:
        for group in {id(g.pool): g for g in groups.values()}.values():
            group.shutdown()
