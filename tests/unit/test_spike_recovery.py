"""The spike detector against hand-worked examples, the spike_recovery hook against a fake actor
(which checkpoints it merges, what it loads, when it gives up), the step-hook config checks in
every training recipe, and `StepHooks`, the one runner the recipes call."""

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hybridflow.config import ConfigError, compose
from hybridflow.data.loader import PromptLoader
from hybridflow.run.runner import run_training_hooks
from hybridflow.training.hooks import (LrBurst, LrBurstConfig, SpikeDetector, SpikeRecovery, SpikeRecoveryConfig,
                                       StepHooks, batches_to_remember, checkpoints_before, detect_drop,
                                       detect_spike)


def test_detect_spike_by_hand():
    # mean 2.0; population std sqrt((0 + 0.04 + 0.04 + 0) / 4) = 0.1414; 2.0 + 6 * 0.1414 = 2.849
    history = [2.0, 2.2, 1.8, 2.0]
    assert detect_spike(history, 3.5, sigmas=6, min_ratio=1.5)  # > 2.849 and > 3.0
    assert not detect_spike(history, 2.9, sigmas=6, min_ratio=1.5)  # > 2.849 but not > 3.0
    assert not detect_spike([2.0, 2.0], 2.5, sigmas=6, min_ratio=1.5)  # std 0, but 2.5 < 3.0
    # a noisy history: mean 2, std 1; 3.5 > 1.5 * 2 but not > 2 + 6 * 1
    assert not detect_spike([1.0, 3.0, 1.0, 3.0], 3.5, sigmas=6, min_ratio=1.5)
    assert detect_spike(history, math.nan, sigmas=6, min_ratio=1.5)
    assert not detect_spike([], 100.0, sigmas=6, min_ratio=1.5)


def test_detect_drop_by_hand():
    # mean 0.45; population std sqrt((4 * 0.0025) / 4) = 0.05; 0.45 - 6 * 0.05 = 0.15; 0.45 / 1.5 = 0.3
    history = [0.5, 0.4, 0.4, 0.5]
    assert detect_drop(history, 0.008, sigmas=6, min_ratio=1.5)  # < 0.15 and < 0.3
    assert not detect_drop(history, 0.2, sigmas=6, min_ratio=1.5)  # < 0.3 but not < 0.15
    assert not detect_drop(history, 0.9, sigmas=6, min_ratio=1.5)  # a rise is no collapse
    assert detect_drop(history, math.nan, sigmas=6, min_ratio=1.5)
    assert not detect_drop([], 0.0, sigmas=6, min_ratio=1.5)


def test_detect_drop_matches_torch_statistics():
    rng = random.Random(1)
    for _ in range(200):
        history = [rng.uniform(0.2, 1.0) for _ in range(rng.randint(1, 30))]
        value = rng.uniform(0, 1)
        t = torch.tensor(history, dtype=torch.float64)
        expected = value < float(t.mean()) - 2 * float(t.std(unbiased=False)) and value < float(t.mean()) / 1.2
        assert detect_drop(history, value, sigmas=2, min_ratio=1.2) == expected


def slow_detect(history, value, sigmas, min_ratio):
    n = len(history)
    mean = sum(history) / n
    var = sum((h - mean) ** 2 for h in history) / n
    return value > mean + sigmas * var**0.5 and value > min_ratio * mean


def test_detect_spike_matches_torch_statistics():
    rng = random.Random(0)
    for _ in range(200):
        history = [rng.uniform(0.5, 4.0) for _ in range(rng.randint(1, 30))]
        value = rng.uniform(0, 10)
        t = torch.tensor(history, dtype=torch.float64)
        expected = value > float(t.mean()) + 2 * float(t.std(unbiased=False)) and value > 1.2 * float(t.mean())
        assert detect_spike(history, value, sigmas=2, min_ratio=1.2) == expected == \
            slow_detect(history, value, 2, 1.2)


def test_detector_warms_up_and_keeps_spikes_out_of_its_window():
    detector = SpikeDetector(window=4, warmup=3, sigmas=3, min_ratio=1.5)
    assert detector.observe({"loss": 100.0}) == []  # no history yet: taken as healthy
    detector = SpikeDetector(window=4, warmup=3, sigmas=3, min_ratio=1.5)
    for value in (2.0, 2.1, 1.9):
        assert detector.observe({"loss": value}) == []
    assert detector.observe({"loss": 9.0}) == ["loss"]
    assert detector.observe({"loss": 9.0}) == ["loss"]  # the first 9.0 did not enter the window
    assert list(detector.history["loss"]) == [2.0, 2.1, 1.9]
    detector = SpikeDetector(window=4, warmup=3, sigmas=3, min_ratio=1.5, falls=("reward",))
    for loss, reward in ((2.0, 0.40), (2.1, 0.45), (1.9, 0.42)):
        assert detector.observe({"loss": loss, "reward": reward}) == []
    assert detector.observe({"loss": 0.0, "reward": 0.0}) == ["reward"]  # a loss at 0 is no spike
    assert detector.observe({"loss": 9.0, "reward": 0.9}) == ["loss"]  # a reward rise is no collapse


class FakeActor:
    def __init__(self):
        self.loaded = None

    def load_weights(self, weights, reset_optimizer=False):
        self.loaded = (weights, reset_optimizer)

    def scale_lr(self, factor):
        self.scaled = factor


def write_checkpoints(run_dir, steps):
    for step in steps:
        hf = run_dir / "checkpoints" / f"step_{step:08d}" / "hf"
        hf.mkdir(parents=True)
        save_file({"w": torch.full((2,), float(step))}, hf / "model.safetensors", metadata={"format": "pt"})
        (hf / "config.json").write_text(json.dumps({"model_type": "toy"}))
        (hf.parent / "COMPLETE").write_text("{}\n")


def test_checkpoints_before_skips_the_one_the_spike_may_be_in(tmp_path):
    write_checkpoints(tmp_path, (2, 4, 6, 8))
    steps, paths = checkpoints_before(tmp_path, 9, 2)  # 8 holds the weights whose loss step 9 logged
    assert steps == [4, 6] and paths[-1] == tmp_path / "checkpoints" / "step_00000006" / "hf"
    with pytest.raises(RuntimeError, match="save more often"):
        checkpoints_before(tmp_path, 9, 4)


def test_spike_recovery_loads_the_sma_and_counts(tmp_path):
    write_checkpoints(tmp_path, (2, 4, 6, 8))
    hook = SpikeRecovery(SpikeRecoveryConfig(last=3, window=4, warmup=3, optimizer="reset", max_recoveries=1),
                         tmp_path, PromptLoader(list(range(8)), 2, seed=0))
    actor = FakeActor()
    for step, loss in enumerate((2.0, 2.1, 1.9), start=6):
        out = hook.after_update(step, {"actor/loss": loss, "actor/grad_norm": 1.0}, actor)
        assert out == {"spike_recovery/fired": 0.0, "spike_recovery/total": 0.0}
    out = hook.after_update(9, {"actor/loss": 20.0, "actor/grad_norm": 1.0}, actor)
    assert out["spike_recovery/fired"] == 1.0 and out["spike_recovery/merged_to_step"] == 6
    assert out["spike_recovery/requeued_rows"] == 0.0  # data: skip (the default)
    weights, reset = actor.loaded
    assert weights["w"].tolist() == [4.0, 4.0] and reset  # (2 + 4 + 6) / 3
    assert (tmp_path / "spike_recovery" / "step_00000009" / "merge_provenance.json").is_file()
    with pytest.raises(RuntimeError, match="max_recoveries=1"):
        hook.after_update(10, {"actor/loss": 20.0, "actor/grad_norm": 1.0}, actor)


def test_reshuffle_puts_back_the_rows_drawn_since_the_newest_merged_checkpoint(tmp_path):
    write_checkpoints(tmp_path, (2, 4, 6, 8))
    config = SpikeRecoveryConfig(last=3, window=4, warmup=3, data="reshuffle")
    loader = PromptLoader(list(range(40)), 2, seed=0, remember_batches=5)
    hook = SpikeRecovery(config, tmp_path, loader)
    drawn = {step: loader.next_rows() for step in range(1, 10)}  # one draw a step; step 9's spikes
    for step, loss in enumerate((2.0, 2.1, 1.9), start=6):
        hook.after_update(step, {"actor/loss": loss, "actor/grad_norm": 1.0}, FakeActor())
    out = hook.after_update(9, {"actor/loss": 20.0, "actor/grad_norm": 1.0}, FakeActor())
    # merged: steps 2, 4, 6; the draws of steps 7, 8, 9 trained weights that are gone: 3 x 2 rows back
    assert out["spike_recovery/merged_to_step"] == 6 and out["spike_recovery/requeued_rows"] == 6
    back = sorted(drawn[7] + drawn[8] + drawn[9])
    assert sorted(i for i in loader.queue if i in back) == back
    assert [rows for _, rows in loader.recent] == [[drawn[s][0], drawn[s][1]] for s in (5, 6)]


def test_reshuffle_one_step_off_keeps_the_batch_drawn_ahead(tmp_path):
    """trainer.max_staleness=1: step 10's prompts were drawn (and are generating) when step 9's
    update spikes. The draws of steps 7-9 go back; step 10's stay drawn (the rollout queue
    generates them again with the recovered weights), so no row is trained twice or lost."""
    write_checkpoints(tmp_path, (2, 4, 6, 8))
    config = SpikeRecoveryConfig(last=3, window=4, warmup=3, data="reshuffle")
    loader = PromptLoader(list(range(40)), 2, seed=0, remember_batches=batches_to_remember(
        compose(["recipe=grpo", "trainer.save_every_steps=2",
                 "trainer.training_hooks=[{name: spike_recovery, params: {data: reshuffle}}]"]).trainer.training_hooks,
        save_every_steps=2, drawn_ahead=1))
    hook = SpikeRecovery(config, tmp_path, loader)
    drawn = {step: loader.next_rows(step) for step in range(1, 11)}  # one step ahead of training
    for step, loss in enumerate((2.0, 2.1, 1.9), start=6):
        hook.after_update(step, {"actor/loss": loss, "actor/grad_norm": 1.0}, FakeActor())
    out = hook.after_update(9, {"actor/loss": 20.0, "actor/grad_norm": 1.0}, FakeActor())
    assert out["spike_recovery/requeued_rows"] == 6
    back = sorted(drawn[7] + drawn[8] + drawn[9])
    assert sorted(loader.queue) == sorted(set(range(40)) - {r for s in range(1, 11) for r in drawn[s]} | set(back))
    assert loader.recent[-1] == (10, drawn[10])  # in flight: still drawn, and remembered


def test_batches_to_remember():
    def hooks(data):
        return compose(["recipe=sft", "trainer.save_every_steps=5",
                        f"trainer.training_hooks=[{{name: spike_recovery, params: {{data: {data}}}}}]"]).trainer
    assert batches_to_remember(hooks("reshuffle").training_hooks, 5) == 6  # newest merged: at most 6 steps back
    assert batches_to_remember(hooks("skip").training_hooks, 5) == 0
    assert batches_to_remember(hooks("reshuffle").training_hooks, 5, drawn_ahead=1) == 7  # one-step-off


def test_spike_recovery_fires_on_a_reward_collapse(tmp_path):
    # GRPO after a wrecked update: the reward collapses while loss and grad norm go to 0 (docs/recipes.md)
    write_checkpoints(tmp_path, (2, 4, 6, 8))
    hook = SpikeRecovery(SpikeRecoveryConfig(last=2, window=4, warmup=3, watch=("grad_norm", "reward")), tmp_path,
                         PromptLoader(list(range(8)), 2, seed=0))
    actor = FakeActor()
    for step, reward in enumerate((0.51, 0.41, 0.42, 0.44), start=5):
        out = hook.after_update(step, {"actor/loss": 0.0, "actor/grad_norm": 1.2, "reward/score": reward}, actor)
        assert out["spike_recovery/fired"] == 0.0
    out = hook.after_update(9, {"actor/loss": 0.0, "actor/grad_norm": 0.27, "reward/score": 0.008}, actor)
    assert out["spike_recovery/fired"] == 1.0 and actor.loaded[0]["w"].tolist() == [5.0, 5.0]  # (4 + 6) / 2


def test_spike_recovery_watches_by_recipe_when_watch_is_null(tmp_path):
    # watch left null: an RL step (its metrics carry reward/score) watches the reward, a supervised one the loss
    write_checkpoints(tmp_path, (2, 4, 6, 8))
    rl = SpikeRecovery(SpikeRecoveryConfig(last=2, window=4, warmup=3), tmp_path, PromptLoader(list(range(8)), 2, 0))
    supervised = SpikeRecovery(SpikeRecoveryConfig(last=2, window=4, warmup=3), tmp_path,
                               PromptLoader(list(range(8)), 2, 0))
    actor = FakeActor()
    for step, value in enumerate((0.51, 0.41, 0.42, 0.44), start=5):
        assert rl.after_update(step, {"actor/loss": 0.0, "actor/grad_norm": 1.2, "reward/score": value},
                               actor)["spike_recovery/fired"] == 0.0
        assert supervised.after_update(step, {"actor/loss": value, "actor/grad_norm": 1.2},
                                       actor)["spike_recovery/fired"] == 0.0
    # a reward collapse fires the RL hook; the same fall of the loss is no spike for the supervised one
    assert rl.after_update(9, {"actor/loss": 0.0, "actor/grad_norm": 0.27, "reward/score": 0.008},
                           actor)["spike_recovery/fired"] == 1.0
    assert supervised.after_update(9, {"actor/loss": 0.008, "actor/grad_norm": 0.27},
                                   actor)["spike_recovery/fired"] == 0.0
    assert supervised.after_update(10, {"actor/loss": 9.0, "actor/grad_norm": 1.2},
                                   actor)["spike_recovery/fired"] == 1.0


def test_lr_burst_scales_only_its_steps():
    hook, actor = LrBurst(LrBurstConfig(at_step=3, factor=50.0, steps=2), None, None), FakeActor()
    assert hook.before_update(2, actor) == {} and not hasattr(actor, "scaled")
    assert hook.before_update(4, actor) == {"lr_burst/factor": 50.0} and actor.scaled == 50.0
    assert hook.before_update(5, actor) == {}


@pytest.mark.parametrize("overrides, message", [
    (["trainer.training_hooks=[{name: spike_recovery, params: {lst: 3}}]"], "unknown key"),
    (["trainer.training_hooks=[{name: spike_recovery, params: {optimizer: restore}}]"], "keep"),
    (["trainer.training_hooks=[{name: spike_recovery, params: {watch: [los]}}]"], "grad_norm"),
    (["recipe=sft", "trainer.save_every_steps=5", "trainer.training_hooks=[{name: spike_recovery, params: "
      "{watch: [reward]}}]"], r"recipe=sft has no training reward: watch \[loss\]"),
    (["trainer.training_hooks=[{name: spike_recovery, params: {last: 20}}]"], "keep at least 21"),
    (["trainer.training_hooks=[{name: spike_recovery}]", "trainer.save_every_steps=0"], "save some"),
    (["trainer.training_hooks=[{name: lr_burst, params: {factor: 0}}]"], "factor"),
    (["trainer.training_hooks=[{name: spike_recovery, params: {data: shuffle}}]"], r"data='shuffle'.*'reshuffle'"),
    (["trainer.training_hooks=[{name: reference_ema, params: {every_steps: 1, alpha: 0.1}}]",
      "algorithm.kl_penalty_coef=0.1"], "no reference model"),
    (["recipe=demo", "trainer.training_hooks=[{name: lr_burst}]"], r"not in recipe=demo: put the hook"),
    (["recipe=grpo", "actor.lora.rank=8", "trainer.save_every_steps=5",
      "trainer.training_hooks=[{name: spike_recovery}]"], r"actor.lora.rank=8 .*set actor.lora.rank=0"),
    (["recipe=sft", "algorithm.kl_penalty_coef=0.1",
      "trainer.training_hooks=[{name: reference_reset, params: {every_steps: 2}}]"], "recipe=sft has no reference"),
    (["actor.optim.decay_steps=0"], "decay_steps"),
])
def test_config_errors_name_the_key_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(["recipe=pretrain", *overrides])


@pytest.mark.parametrize("recipe", ["sft", "grpo", "ppo"])
def test_every_training_recipe_takes_step_hooks(recipe):
    watch = "[reward, grad_norm]" if recipe != "sft" else "[grad_norm]"
    hooks = f"[{{name: lr_burst, params: {{at_step: 3}}}}, {{name: spike_recovery, params: {{last: 2, watch: {watch}}}}}]"
    overrides = [f"recipe={recipe}", "trainer.save_every_steps=5", f"trainer.training_hooks={hooks}"]
    config = compose(overrides + (["algorithm.use_critic=true"] if recipe == "ppo" else []))
    built = StepHooks.build(config.trainer.training_hooks, Path("unused"), PromptLoader(list(range(8)), 2, seed=0))
    assert [type(h) for h in built.hooks] == [LrBurst, SpikeRecovery]
    # the RL recipes' reference-hook runner leaves step hooks alone (no reference role needed, no metric)
    assert run_training_hooks(config, 5, actor=None, reference=None) == {}


class Recorder:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def before_update(self, step, actor):
        self.calls.append((self.name, "before", step))
        return {f"{self.name}/before": float(step)}

    def after_update(self, step, metrics, actor):
        self.calls.append((self.name, "after", step, metrics["actor/loss"]))
        return {f"{self.name}/after": 1.0}


def test_step_hooks_run_in_config_order_and_merge_their_metrics():
    calls = []
    hooks = StepHooks([Recorder("a", calls), Recorder("b", calls)])
    assert hooks.before_update(7, actor=None) == {"a/before": 7.0, "b/before": 7.0}
    assert hooks.after_update(7, {"actor/loss": 2.5, "actor/grad_norm": 1.0}, actor=None) == \
        {"a/after": 1.0, "b/after": 1.0}
    assert calls == [("a", "before", 7), ("b", "before", 7), ("a", "after", 7, 2.5), ("b", "after", 7, 2.5)]
    assert StepHooks([]).before_update(1, None) == {} == StepHooks([]).after_update(1, {}, None)


def test_pretrain_config_with_hooks_composes():
    config = compose(["recipe=pretrain", "trainer.training_hooks=[{name: spike_recovery, params: {last: 4}}]"])
    assert config.recipe.name == "pretrain" and config.actor.optim.lr_schedule == "wsd"


def test_a_pipeline_stage_may_pretrain_and_the_next_start_from_its_merge(tmp_path):
    from hybridflow.config.schema import StageConfig
    from hybridflow.merge.hooks import HookConfig
    from recipes.pipeline import check_stages

    config = compose(["recipe=pipeline"])
    config.pipeline.stages = [StageConfig(name="pretrain", recipe="pretrain", overrides=["trainer.total_steps=20"]),
                              StageConfig(name="sft", recipe="sft", init=HookConfig("pma_sma", {"last": 3}))]
    config.pipeline.__post_init__()
    pretrain, sft = check_stages(config, tmp_path)  # composes both stages
    assert (pretrain.recipe.name, pretrain.trainer.total_steps, pretrain.trainer.keep_last_weights) == ("pretrain", 20, 3)
    assert sft.recipe.name == "sft" and sft.model.path == str(tmp_path / "01-sft" / "init_model")  # the merge's output
