"""Adding a rollout engine is one file plus its capability entry, and the colocated weight path reaches it with
no registry of live objects: `ToyEngine`, defined here, outside the package (a `RolloutEngineBase` with a
`ModuleReceiver`), and `TOY`, its entry, named by `rollout.backend`, are built with the real actor on the tiny
model into one process (hybridflow/controller/local.py `spawn_local`). The host introduces the two
(hybridflow/controller/context.py `introduce`), and `WeightSync`'s colocated sync loads the actor's weights
into the toy: it wakes the toy's weights first, then every tensor's checksum is compared. Dropping the stage's
workers frees both."""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.config.engines import RolloutEngine
from hybridflow.controller import Dispatch, register
from hybridflow.resharding.receiver import ModuleReceiver
from workers.rollout import RolloutEngineBase

TOY = RolloutEngine("toy-meets-actor", "tests.unit.test_engine_meets_actor:ToyEngine")  # in the actor's processes


class ToyEngine(RolloutEngineBase):
    """Holds a copy of the model with every weight zeroed, so that each one it computes with came through the
    sync; its sleep frees nothing but counts, so a load while its weights sleep is refused as on a GPU."""

    def __init__(self, ctx, model_path: str, rollout, max_prompt_tokens: int, eos_token_id: int, pad_token_id: int,
                 verifiable_weights: bool = False, trust_remote_code: bool = False) -> None:
        self.ctx, self.model_path, self.pad_token_id = ctx, model_path, pad_token_id
        self.model = None

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> float:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        for param in self.model.parameters():
            param.data.zero_()
        self.serve_weights(ModuleReceiver(self.model, self.pad_token_id))
        return 0.0

    def release(self) -> bool:
        return True

    @register(Dispatch.DP_SPLIT)
    def generate(self, prompts: Batch, greedy: bool = False) -> Batch:
        raise AssertionError("the weight sync does not generate")


@contextmanager
def fused_stage(model_dir, *overrides: str):
    """The actor and a rollout engine (`overrides` choose it), one worker group each, built into one process as
    a colocated run fuses them, started; yields the stage's config and the groups, shut down after."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from hybridflow.config import compose
    from hybridflow.controller.local import spawn_local
    from hybridflow.run.stage import prepare_stage
    from recipes.roles import actor_role, rollout_role

    made = not dist.is_initialized()
    config = prepare_stage(compose(["recipe=grpo", "placement=local", "model.dtype=float32", "rollout.dtype=float32",
                                    *overrides])).config
    tok = AutoTokenizer.from_pretrained(model_dir)
    groups = spawn_local("one:actor+rollout", "cpu", {"actor": actor_role(config, model_dir),
                                                      "rollout": rollout_role(config, model_dir, tok)})
    groups["actor"].start()
    groups["rollout"].start()
    try:
        yield config, groups
    finally:
        groups["actor"].shutdown()
        if made and dist.is_initialized():  # the run's group lives as long as its process; this test's goes on
            dist.destroy_process_group()


@pytest.fixture
def fused(tiny_model_dir):
    """The actor and the toy engine; the stage's config (weight_sync.checksum_every_steps=1: every tensor
    compared at each sync)."""
    with fused_stage(tiny_model_dir, "rollout.backend=tests.unit.test_engine_meets_actor:TOY",
                     "weight_sync.checksum_every_steps=1", "weight_sync.check=none") as stage:
        yield stage


def test_a_toy_engine_from_outside_the_package_gets_the_actors_weights_through_the_meeting(fused):
    from hybridflow.resharding.sync import WeightSync
    from hybridflow.resharding.transports import build_transport

    config, groups = fused
    workers = groups["actor"].hosts[0].worker_host.workers
    actor, engine = workers["actor"], workers["rollout"]
    assert actor.colocated_engine is engine  # the host introduced them: no name, no registry
    sync = WeightSync(groups["actor"], groups["rollout"], config.weight_sync, build_transport(colocated=True),
                      "float32")
    sync.setup()
    assert groups["rollout"].sleep() == [True]  # its weights asleep: the colocated load would be refused
    metrics = sync.sync(step=1, version=1)
    assert groups["rollout"].awake_parts() == [["weights"]]  # the sync woke them, the KV cache still sleeps
    assert metrics["weight_sync/verified_tensors"] == len(list(engine.model.parameters()))  # every one, exactly
    trained = groups["actor"].full_state_dict()
    assert all(torch.equal(param, trained[name]) for name, param in engine.model.named_parameters())
    assert engine.receiver.version == 1


def test_dropping_the_stages_workers_frees_the_engine_and_the_actor_that_met(fused):
    _, groups = fused
    host = groups["actor"].hosts[0].worker_host
    engine, actor = weakref.ref(host.workers["rollout"]), weakref.ref(host.workers["actor"])
    groups["actor"].shutdown()  # the one-process host's teardown, as between two stages of a pipeline
    gc.collect()
    assert host.workers == {} and engine() is None and actor() is None
