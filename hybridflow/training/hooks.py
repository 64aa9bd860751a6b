"""Step hooks: components a training loop calls around each actor update, named in
`trainer.training_hooks` like the reference-model hooks of `hybridflow.merge.hooks`.

    trainer.training_hooks=[{name: spike_recovery, params: {last: 4}}]

One registry, `STEP_HOOKS`, one signature: a class built as `cls(config, run_dir, loader)` from
its typed `Config` dataclass (the entry's `params`, checked before Ray starts), with
`before_update(step, actor) -> dict` and `after_update(step, metrics, actor) -> dict`; both
return metrics to log; `loader` is the recipe's `PromptLoader`, for a hook that changes which
data comes next (spike_recovery's `data: reshuffle`). The names share `trainer.training_hooks`
with the reference hooks (`reference_ema`, `reference_reset`), which replace the reference
model's weights in RL recipes; a name may be registered in only one of the two.

Every training recipe (`RecipeSpec.step_hooks`: pretrain, sft, and the RL family grpo / ppo)
runs them through one object, `StepHooks`: `before_update` just before the actor update,
`after_update` with the update's metrics (`actor/loss`, `actor/grad_norm`: workers/actor.py
reports both from `train_sft` and `update_policy`; the RL recipes add the step's training reward
`reward/score`) right after it. In an RL recipe the step's
weight sync comes after `after_update`, so weights a hook loaded into the actor (spike_recovery's
merge) are what the rollout engine generates the next step with: `WeightSync.sync` reads the
actor's parameters afresh at every call (the sender keeps the module, never a copy of its
tensors, and `load_weights` copies into the same parameters), and its log-prob probe checks that
the engine then computes with them. The reference hooks run after the step hooks, so a
`reference_ema` also follows the recovered weights.

- `spike_recovery` (the fourth claim of "Model Merging in Pre-training", arXiv 2505.12082):
  when the loss or the gradient norm is far above its running statistics, or (RL) the training
  reward far below them (`detect_spike`, `detect_drop`: pure functions), the actor's weights are
  replaced by the SMA of the last N checkpoints saved before the spike (written by
  `merge_checkpoints`, the same code as `hybridflow-merge`, into RUN_DIR/spike_recovery/step_<N>/
  with its provenance), the optimizer state is kept or, by explicit choice, reset, and training
  goes on with the next batch. The offending batch, and those since the newest merged checkpoint,
  are skipped (`data: skip`, the default), or their rows go back into the loader to be drawn
  again later in a new random order (`data: reshuffle`, `PromptLoader.requeue`). What it watches
  is by recipe unless `watch` says: the loss in pretrain / sft, the gradient norm and the reward
  in grpo / ppo (`WATCH_BY_DEFAULT`).
- `lr_burst`: multiplies the learning rate for a few steps: the paper's stress test, a
  divergence made on purpose to check a recovery against.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hybridflow.data.loader import PromptLoader
from hybridflow.registry import Registry

if TYPE_CHECKING:
    from hybridflow.config.schema import HybridFlowConfig

STEP_HOOKS: Registry[type] = Registry(
    "step hook", "a class with a dataclass `Config`, built as cls(config, run_dir, loader), with "
    "before_update(step, actor) -> dict and after_update(step, metrics, actor) -> dict")


# ------------------------------------------------------------------------ the detector (pure)


def detect_spike(history: list[float], value: float, *, sigmas: float, min_ratio: float) -> bool:
    """Whether `value` is a spike against `history` (the recent values, all healthy).

    A spike is far above the history in both senses: more than `sigmas` standard deviations
    above its mean, and more than `min_ratio` times its mean. The first alone fires on a
    flat, quiet history at a tiny wobble; the second alone misses a spike in a noisy one.
    A non-finite value is always a spike; an empty history never has one.
        history [2.0, 2.2, 1.8, 2.0], mean 2.0, std (population) sqrt(0.02) = 0.1414
        value 3.5, sigmas 6, min_ratio 1.5: 3.5 > 2.0 + 6 * 0.1414 = 2.85 and 3.5 > 3.0 -> spike
        value 2.9: above 2.85 but not above 3.0 -> no spike
    """
    if not math.isfinite(value):
        return True
    if not history:
        return False
    mean, std = _mean_std(history)
    return value > mean + sigmas * std and value > min_ratio * mean


def detect_drop(history: list[float], value: float, *, sigmas: float, min_ratio: float) -> bool:
    """Whether `value` is a collapse against `history`: more than `sigmas` standard deviations
    below its mean, and below its mean divided by `min_ratio` (a reward that falls; rewards here
    are >= 0). A non-finite value is always one; an empty history never has one.
        history [0.5, 0.4, 0.4, 0.5], mean 0.45, std (population) 0.05
        value 0.008, sigmas 6, min_ratio 1.5: 0.008 < 0.45 - 6 * 0.05 = 0.15 and < 0.3 -> collapse
        value 0.2: below 0.3 but not below 0.15 -> none
    """
    if not math.isfinite(value):
        return True
    if not history:
        return False
    mean, std = _mean_std(history)
    return value < mean - sigmas * std and value < mean / min_ratio


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


class SpikeDetector:
    """Running windows of the watched signals; an anomalous value stays out of them, so that one
    spike does not widen the statistics the next one is judged by. Names in `falls` are anomalous
    when they drop (`detect_drop`: the reward), the others when they rise (`detect_spike`)."""

    def __init__(self, window: int, warmup: int, sigmas: float, min_ratio: float, falls: tuple = ()) -> None:
        self.window, self.warmup, self.sigmas, self.min_ratio = window, warmup, sigmas, min_ratio
        self.falls = set(falls)
        self.history: dict[str, deque] = {}

    def observe(self, values: dict[str, float]) -> list[str]:
        """The names among `values` that spike (none until each has `warmup` healthy values)."""
        spiking = []
        for name, value in values.items():
            history = self.history.setdefault(name, deque(maxlen=self.window))
            ready = len(history) >= self.warmup
            test = detect_drop if name in self.falls else detect_spike
            if ready and test(list(history), value, sigmas=self.sigmas, min_ratio=self.min_ratio):
                spiking.append(name)
            elif math.isfinite(value):
                history.append(value)
        return spiking


# ------------------------------------------------------------------------------ spike recovery

LOSS_KEY, GRAD_NORM_KEY, REWARD_KEY = "actor/loss", "actor/grad_norm", "reward/score"
WATCHED = {"loss": LOSS_KEY, "grad_norm": GRAD_NORM_KEY, "reward": REWARD_KEY}  # reward: a fall
# spike_recovery's `watch: null`: the RL recipes pass the step's reward/score with the update's metrics
WATCH_BY_DEFAULT = {"supervised": ("loss",), "rl": ("grad_norm", "reward")}


@dataclass
class SpikeRecoveryConfig:
    last: int = 4  # merge the newest `last` checkpoints saved before the spike (SMA)
    window: int = 20  # running statistics over the last `window` healthy steps
    warmup: int = 10  # no detection until this many healthy steps are in the window
    sigmas: float = 6.0
    min_ratio: float = 1.5  # ... and this many times the window's mean
    # Which signals can fire it: loss, grad_norm, reward (a fall of reward/score). null: by recipe,
    # WATCH_BY_DEFAULT. Supervised recipes watch the loss only: the tiny model's gradient norm has lone
    # 10x outliers on healthy runs (clipped, harmless; tests/e2e/test_pretrain.py saw one). RL recipes
    # watch the gradient norm and the reward: a diverged policy samples no correct answer, so its
    # advantages, loss and gradient all go to 0 (docs/recipes.md), and the policy loss is centred near 0.
    watch: Optional[tuple] = None
    optimizer: str = "keep"  # keep: Adam's moments stay; reset: cleared (moments rebuilt from the next step)
    # skip: the batches since the newest merged checkpoint are lost; reshuffle: their rows are drawn again later
    data: str = "skip"
    max_recoveries: int = 3  # more spikes than this stop the run: the cause is not transient

    def __post_init__(self) -> None:
        key = "trainer.training_hooks[spike_recovery].params"
        _check(self.last >= 1, f"{key}.last", self.last, "must be >= 1")
        _check(self.window >= 2 and 2 <= self.warmup <= self.window, f"{key}.window/warmup",
               (self.window, self.warmup), "need 2 <= warmup <= window")
        _check(self.sigmas > 0 and self.min_ratio >= 1, f"{key}.sigmas/min_ratio", (self.sigmas, self.min_ratio),
               "need sigmas > 0 and min_ratio >= 1")
        if self.watch is not None:  # null: by recipe (WATCH_BY_DEFAULT)
            self.watch = tuple(self.watch)
            _check(bool(self.watch) and set(self.watch) <= set(WATCHED), f"{key}.watch", list(self.watch),
                   f"a non-empty subset of {list(WATCHED)}, or null (by recipe)")
        _check(self.optimizer in ("keep", "reset"), f"{key}.optimizer", self.optimizer, "one of ['keep', 'reset']")
        _check(self.data in ("skip", "reshuffle"), f"{key}.data", self.data, "one of ['skip', 'reshuffle']")
        _check(self.max_recoveries >= 1, f"{key}.max_recoveries", self.max_recoveries, "must be >= 1")


@STEP_HOOKS.register("spike_recovery")
class SpikeRecovery:
    """Roll the actor back to the SMA of the checkpoints saved before a spike (or a reward collapse)."""

    reloads_weights = True  # it may load other weights into the actor (a new policy version)
    reloaded_at: int | None = None  # the last step whose after_update loaded other weights into the actor

    Config = SpikeRecoveryConfig

    def __init__(self, config: SpikeRecoveryConfig, run_dir: Path, loader: PromptLoader) -> None:
        self.config, self.run_dir, self.loader = config, Path(run_dir), loader
        self.detector = SpikeDetector(config.window, config.warmup, config.sigmas, config.min_ratio, falls=("reward",))
        self.recoveries = 0

    def before_update(self, step: int, actor) -> dict[str, float]:
        return {}

    def after_update(self, step: int, metrics: dict[str, float], actor) -> dict[str, float]:
        watch = self.config.watch or WATCH_BY_DEFAULT["rl" if REWARD_KEY in metrics else "supervised"]
        spiking = self.detector.observe({name: metrics[WATCHED[name]] for name in watch})
        if not spiking:
            return {"spike_recovery/fired": 0.0, "spike_recovery/total": float(self.recoveries)}
        if self.recoveries >= self.config.max_recoveries:
            raise RuntimeError(
                f"spike_recovery: {', '.join(spiking)} spiked at step {step} after {self.recoveries} recoveries "
                f"(max_recoveries={self.config.max_recoveries}); the cause is not transient: lower the lr "
                "(actor.optim.lr) or raise max_recoveries")
        merged, steps = self.recover(step, actor)
        self.recoveries += 1
        self.reloaded_at = step
        # the draws of steps steps[-1] + 1 .. step trained weights that are now gone
        # (batches drawn ahead for later steps, in flight in an asynchronous run, stay drawn: their
        # prompts are generated again with the recovered weights)
        requeued = self.loader.requeue(step - steps[-1], through_step=step) if self.config.data == "reshuffle" else 0
        print(f"spike_recovery: {', '.join(spiking)} spiked at step {step} (loss {metrics[LOSS_KEY]:.4g}, grad norm "
              f"{metrics[GRAD_NORM_KEY]:.4g}); the actor now holds the SMA of the checkpoints of steps {steps} "
              f"({merged}), optimizer state {'reset' if self.config.optimizer == 'reset' else 'kept'}, the data of "
              f"steps {steps[-1] + 1}-{step} {f'requeued ({requeued} rows)' if requeued else 'skipped'}", flush=True)
        return {"spike_recovery/fired": 1.0, "spike_recovery/total": float(self.recoveries),
                "spike_recovery/merged_from_step": float(steps[0]), "spike_recovery/merged_to_step": float(steps[-1]),
                "spike_recovery/requeued_rows": float(requeued)}

    def recover(self, step: int, actor) -> tuple[Path, list[int]]:
        """Merge, then load into every actor rank; returns the merged directory and its steps."""
        from safetensors.torch import load_file

        from hybridflow.merge.api import merge_checkpoints

        steps, inputs = checkpoints_before(self.run_dir, step, self.config.last)
        output = self.run_dir / "spike_recovery" / f"step_{step:08d}"
        merge_checkpoints(inputs, output, "sma", overwrite=True)
        weights = {}
        for shard in sorted(output.glob("*.safetensors")):
            weights.update(load_file(shard))
        actor.load_weights(weights, reset_optimizer=self.config.optimizer == "reset")
        return output, steps


def checkpoints_before(run_dir: Path, step: int, last: int) -> tuple[list[int], list[Path]]:
    """(steps, hf/ directories) of the newest `last` complete checkpoints whose weights a healthy
    loss has vouched for: saved before step - 1. (The loss logged at `step` is that of the weights
    saved at step - 1, so a spike seen at `step` may already be in them.)"""
    from hybridflow.checkpoint import CheckpointManager

    usable = [(s, p / "hf") for s, p in CheckpointManager(run_dir).all_complete()
              if s < step - 1 and (p / "hf" / "config.json").is_file()]
    if len(usable) < last:
        raise RuntimeError(
            f"spike_recovery at step {step}: {len(usable)} checkpoint(s) with hf/ weights were saved before step "
            f"{step - 1} (steps {[s for s, _ in usable]}), {last} are needed; save more often "
            "(trainer.save_every_steps), keep more of them (trainer.keep_last_weights) or lower params.last")
    chosen = usable[-last:]
    return [s for s, _ in chosen], [p for _, p in chosen]


# -------------------------------------------------------------------------------- LR burst


@dataclass
class LrBurstConfig:
    at_step: int = 1  # the first step whose update uses the multiplied lr
    factor: float = 10.0
    steps: int = 1

    def __post_init__(self) -> None:
        key = "trainer.training_hooks[lr_burst].params"
        _check(self.at_step >= 1 and self.steps >= 1, f"{key}.at_step/steps", (self.at_step, self.steps),
               "both must be >= 1")
        _check(self.factor > 0, f"{key}.factor", self.factor, "must be > 0")


@STEP_HOOKS.register("lr_burst")
class LrBurst:
    """The updates of steps at_step .. at_step + steps - 1 use `factor` times the scheduled lr."""

    reloads_weights = False
    reloaded_at: int | None = None  # never loads weights

    Config = LrBurstConfig

    def __init__(self, config: LrBurstConfig, run_dir: Path, loader: PromptLoader) -> None:
        self.config = config

    def before_update(self, step: int, actor) -> dict[str, float]:
        c = self.config
        if not c.at_step <= step < c.at_step + c.steps:
            return {}
        actor.scale_lr(c.factor)
        return {"lr_burst/factor": c.factor}

    def after_update(self, step: int, metrics: dict[str, float], actor) -> dict[str, float]:
        return {}


# -------------------------------------------------------------------------- building, checks


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config {key}={value!r} is invalid: {allowed}")


def _plain(params: Any) -> dict:
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return dict(params)
    return OmegaConf.to_container(params, resolve=True) if OmegaConf.is_config(params) else dict(params)


def hook_config(name: str, params: Any):
    """The typed config of step hook `name` from its params; unknown keys name the known ones."""
    cls = STEP_HOOKS.get(name)
    params = _plain(params)
    known = [f.name for f in fields(cls.Config)]
    unknown = sorted(set(params) - set(known))
    _check(not unknown, f"trainer.training_hooks[{name}].params", params,
           f"unknown key(s) {unknown}; {name} takes {known}")
    return cls.Config(**params)


class StepHooks:
    """The run's step hooks, in config order, called like one: the recipes' single place to run them.

        metrics.update(hooks.before_update(step, actor))
        metrics.update(actor.train_sft(batch)[0])  # or update_policy
        metrics.update(hooks.after_update(step, metrics, actor))
    """

    def __init__(self, hooks: list) -> None:
        self.hooks = hooks

    @classmethod
    def build(cls, hooks: list, run_dir: Path, loader: PromptLoader) -> "StepHooks":
        """The step hooks among `trainer.training_hooks` (the reference hooks are left to
        `hybridflow.run.runner.run_training_hooks`); `loader` must remember `batches_to_remember` draws."""
        return cls([STEP_HOOKS.get(h.name)(hook_config(h.name, h.params), run_dir, loader)
                    for h in hooks if h.name in STEP_HOOKS])

    def before_update(self, step: int, actor) -> dict[str, float]:
        out: dict[str, float] = {}
        for hook in self.hooks:
            out.update(hook.before_update(step, actor))
        return out

    def reloaded_weights(self, step: int) -> bool:
        """Whether a hook loaded other weights into the actor at `step` (a new policy version)."""
        return any(hook.reloaded_at == step for hook in self.hooks)

    def after_update(self, step: int, metrics: dict[str, float], actor) -> dict[str, float]:
        """`metrics`: the update's (`actor/loss`, `actor/grad_norm`; in the RL recipes also the
        step's `reward/score`)."""
        out: dict[str, float] = {}
        for hook in self.hooks:
            out.update(hook.after_update(step, metrics, actor))
        return out


def batches_to_remember(hooks: list, save_every_steps: int, drawn_ahead: int = 0) -> int:
    """The draws the recipe's `PromptLoader` must remember (`remember_batches`) for the step hooks.
    spike_recovery with `data: reshuffle` puts back the draws since the newest checkpoint it merges,
    the newest saved before step - 1: at most save_every_steps + 1 of them, behind the
    `drawn_ahead` draws of batches in flight (trainer.max_staleness)."""
    reshuffles = any(h.name in STEP_HOOKS and getattr(hook_config(h.name, h.params), "data", None) == "reshuffle"
                     for h in hooks)
    return save_every_steps + 1 + drawn_ahead if reshuffles else 0


def check_step_hooks(config: "HybridFlowConfig") -> None:
    """Before Ray starts: each step hook's params, that the recipe runs step hooks, and that
    spike_recovery will find its checkpoints and can load their weights into the actor."""
    if not any(hook.name in STEP_HOOKS for hook in config.trainer.training_hooks):
        return  # nothing to check (the merge hooks' registry, imported below, imports DCP)
    from hybridflow.merge.hooks import TRAINING_HOOKS

    from hybridflow.config.recipes import RECIPE_SPECS, recipe_spec

    t, recipe, spec = config.trainer, config.recipe.name, recipe_spec(config.recipe.name)
    with_step_hooks = [n for n in RECIPE_SPECS.names() if RECIPE_SPECS.get(n).step_hooks]
    with_reward = [n for n in RECIPE_SPECS.names() if RECIPE_SPECS.get(n).rl_reward]
    for hook in t.training_hooks:
        if hook.name not in STEP_HOOKS:
            continue
        _check(hook.name not in TRAINING_HOOKS, "trainer.training_hooks", hook.name,
               "is registered both as a step hook and as a reference hook; rename one")
        _check(spec.step_hooks, "trainer.training_hooks", hook.name,
               f"step hooks run around the actor update of the recipes {with_step_hooks}, not in "
               f"recipe={recipe}: put the hook in the overrides of a training stage (a pipeline's stages[].overrides) "
               "or drop it")
        typed = hook_config(hook.name, hook.params)
        if isinstance(typed, SpikeRecoveryConfig):
            _check(t.save_every_steps > 0, "trainer.save_every_steps", t.save_every_steps,
                   "spike_recovery merges the checkpoints saved before a spike: save some (e.g. 10)")
            kept = None if t.keep_last_weights is None or t.keep_last_checkpoints is None else \
                max(t.keep_last_weights, t.keep_last_checkpoints)
            _check(kept is None or kept >= typed.last + 1, "trainer.keep_last_weights", t.keep_last_weights,
                   f"spike_recovery reads the weights of {typed.last} checkpoints saved before the newest one: "
                   f"keep at least {typed.last + 1} (or null: all)")
            _check("reward" not in (typed.watch or ()) or spec.rl_reward,
                   "trainer.training_hooks[spike_recovery].params.watch", list(typed.watch or ()),
                   f"recipe={recipe} has no training reward: watch [loss] or [grad_norm] (reward is for "
                   f"{with_reward})")
            _check(not config.actor.lora.rank, "actor.lora.rank", config.actor.lora.rank,
                   "spike_recovery loads merged full weights (LoRA folded) into the actor, which a LoRA actor cannot "
                   "take: set actor.lora.rank=0 or drop the hook")
