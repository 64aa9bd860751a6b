"""The sleep level (rollout.sleep_level; workers/rollout/__init__.py): at 2 a sleep discards the engine's
weights, so nothing may generate, probe or check them before a whole load, and the buffers no sync
rewrites must come back as they were at start. Shown on the real `hf` engine on the CPU (it discards
its weights at level 2 on any device), then the config's choice and its refusal."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import RolloutConfig
from hybridflow.controller import WorkerContext
from workers.rollout import EngineStateError
from workers.rollout.hf_rollout import HFRollout


def _engine(tiny_model_dir, level: int, cls=HFRollout) -> HFRollout:
    engine = cls(WorkerContext(rank=0, device="cpu", group_name=f"sleep-level-{level}-{cls.__name__}"),
                 str(tiny_model_dir), RolloutConfig(max_response_tokens=6, sleep_level=level), max_prompt_tokens=8,
                 eos_token_id=-1, pad_token_id=0)
    engine.start()
    return engine


def _prompts() -> Batch:
    return Batch(tensors={"prompt_ids": torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]]),
                          "prompt_mask": torch.tensor([[False, True, True, True], [True] * 4])})


def _reload(engine, weights: dict) -> None:
    """What the colocated transport's send does: every weight through the engine's receiving end."""
    engine.load_colocated([list(weights.items())], route=None)


def test_a_level_2_sleep_discards_the_weights_and_a_whole_load_brings_back_the_same_model(tiny_model_dir):
    engine = _engine(tiny_model_dir, 2)
    before = engine.generate(_prompts(), greedy=True)
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    buffers = {n: b.clone() for n, b in engine.model.named_buffers()}
    assert buffers, "the tiny model has rotary buffers: the check below would be empty"

    assert engine.sleep() is True
    assert all(p.numel() == 0 for p in engine.model.parameters())  # freed, on the CPU too
    engine.wake_up()
    assert engine.weights_discarded() is True
    for call in (lambda: engine.generate(_prompts(), greedy=True), lambda: engine.probe_log_probs([[1, 2]], 2),
                 lambda: engine.verify_weights([{}])):
        with pytest.raises(EngineStateError, match="level-2 sleep discarded them"):
            call()

    _reload(engine, weights)
    assert engine.weights_discarded() is False
    for name, b in engine.model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    after = engine.generate(_prompts(), greedy=True)
    assert torch.equal(after["response_ids"], before["response_ids"])
    assert torch.equal(after["sampler_log_probs"], before["sampler_log_probs"])


def test_a_level_1_sleep_on_the_cpu_frees_nothing_and_keeps_generating(tiny_model_dir):
    engine = _engine(tiny_model_dir, 1)
    assert engine.sleep() is False and engine.weights_discarded() is False
    assert len(engine.generate(_prompts(), greedy=True)) == 2


class _ForgetsBuffers(HFRollout):
    """An engine whose wake-up does not put its buffers back (the bug that made another project's
    rollouts compute with wrong rotary caches after a level-2 sleep)."""

    def restore(self, parts):
        super().restore(parts)
        for b in self.model.buffers():
            b.data = torch.zeros_like(b)


def test_buffers_not_restored_after_a_level_2_sleep_are_found_at_the_load_naming_them(tiny_model_dir):
    engine = _engine(tiny_model_dir, 2, _ForgetsBuffers)
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.sleep()
    engine.wake_up()
    with pytest.raises(EngineStateError, match=r"buffer\(s\) no weight sync rewrites differ.*inv_freq"):
        _reload(engine, weights)
    with pytest.raises(EngineStateError, match="level-2 sleep discarded them"):  # still refused
        engine.generate(_prompts(), greedy=True)


def test_the_config_chooses_level_2_unless_an_adapter_sync_keeps_the_base_weights(tiny_model_dir):
    from hybridflow.run.pipeline_stages import compose_command

    folded = compose_command(["recipe=grpo", f"model.path={tiny_model_dir}"])
    assert folded.rollout.sleep_level == 2
    lora = ["recipe=grpo", f"model.path={tiny_model_dir}", "actor.lora.rank=4", "weight_sync.lora=adapter"]
    assert compose_command(lora).rollout.sleep_level == 1
    with pytest.raises(Exception, match=r"rollout.sleep_level=2 is invalid.*adapter sync.*rollout.sleep_level=1"):
        compose_command([*lora, "rollout.sleep_level=2"])



@contextmanager
def _level_2_sync(tiny_model_dir):
    """The real actor and the hf engine fused in one process (the colocated path), the engine sleeping at level 2
    (its weights discarded), with weight_sync.checksum_every_steps=0 and no probe: nothing but the reload's own
    check compares the weights. Yields the WeightSync, the rollout group and the engine's parameter count."""
    from hybridflow.resharding.sync import WeightSync
    from hybridflow.resharding.transports import build_transport
    from tests.unit.test_engine_meets_actor import fused_stage

    with fused_stage(tiny_model_dir, "rollout.backend=hf", "rollout.sleep_level=2",
                     "weight_sync.checksum_every_steps=0", "weight_sync.check=none") as (config, groups):
        engine = groups["actor"].hosts[0].worker_host.workers["rollout"]
        sync = WeightSync(groups["actor"], groups["rollout"], config.weight_sync, build_transport(colocated=True),
                          "float32")
        sync.setup()
        assert groups["rollout"].sleep() == [True] and groups["rollout"].weights_discarded() == [True]
        yield sync, groups, engine


@pytest.mark.parametrize("where", ["sync", "reload"])
def test_a_weight_a_level_2_reload_wrote_wrong_is_named(tiny_model_dir, where):
    """Issue 83 item 6: the load after a level-2 sleep writes `model.norm.weight` wrong (the planted fault,
    hybridflow/resharding/faults.py `garble_after_level_2_wake`), at a sync or at the reload before a generation
    that follows no sync (a validation's, `WeightSync.generating`): the WeightSyncError names the weight, though
    no checksum was configured."""
    from hybridflow.resharding import faults
    from hybridflow.resharding.verify import WeightSyncError

    with _level_2_sync(tiny_model_dir) as (sync, groups, _):
        if where == "reload":
            sync.sync(step=1, version=1)
            groups["rollout"].wake_up()
            groups["rollout"].sleep()  # a validation generated and slept: the next generation follows no sync
        faults.garble_after_level_2_wake("model.norm.weight")
        with pytest.raises(WeightSyncError, match=r"model\.norm\.weight"):
            if where == "sync":
                sync.sync(step=1, version=1)
            else:
                with sync.generating():
                    pass


def test_every_weight_is_verified_after_a_level_2_sync_and_reload(tiny_model_dir):
    """Unplanted, the sync and the reload after a level-2 sleep each compare every weight with the actor's."""
    with _level_2_sync(tiny_model_dir) as (sync, groups, engine):
        every = len(list(engine.model.parameters()))
        metrics = sync.sync(step=1, version=1)
        assert metrics["weight_sync/verified_tensors"] == every and metrics["weight_sync/reload_checksum_s"] > 0
        groups["rollout"].wake_up()
        groups["rollout"].sleep()
        trained = groups["actor"].full_state_dict()
        with sync.generating():  # the engine holds the actor's weights while it generates
            assert all(torch.equal(p, trained[n]) for n, p in engine.model.named_parameters())
        reload = sync.handover_seconds()
        assert reload["weight_sync/verified_tensors"] == every and reload["weight_sync/reload_checksum_s"] > 0
