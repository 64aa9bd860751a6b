"""Pieces every training recipe uses around its step loop: stage timing, validation,
checkpoint save / resume, and the final export. Nothing here knows an algorithm.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from hybridflow.output import console
from hybridflow.agents.hubs.openenv_server import serve
from hybridflow.batch import Batch
from hybridflow.checkpoint import (CheckpointCorrupt, CheckpointManager, capture_rng_state, config_hash,
                                  restore_rng_state)
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.controller import WorkerGroup, deadlines
from hybridflow.data.prompts import encode_prompts
from hybridflow.rewards import reward_metrics
from hybridflow.rewards.composer import EXTRA_PREFIX, SCORE_KEY


class StageTimer:
    """`with timer("generate"): ...` records `timing/generate_s`, and bounds every worker-group
    wait inside by the stage's deadline (hybridflow.controller.deadlines)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()

    def elapsed_s(self) -> float:
        """Seconds since the timer was made (the step's wall time so far)."""
        return time.perf_counter() - self.started

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with deadlines.stage(stage):
                yield
        finally:
            self.seconds[f"timing/{stage}_s"] = time.perf_counter() - start


def response_stats(samples: Batch) -> dict[str, float]:
    """Response lengths (every response token, tool output included), and an agent rollout's
    turns, tool errors and truncations (hybridflow.agents.agent_metrics)."""
    from hybridflow.agents import agent_metrics

    lengths = samples["response_mask"].sum(dim=1).float()
    return {"response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/tokens": float(lengths.sum()), **agent_metrics(samples)}


def target_reached(config: HybridFlowConfig, step: int, metrics: dict[str, float]) -> bool:
    """Whether the step's validation reached trainer.stop_at_val_accuracy (said on the console): the run
    ends after this step, its final model this step's."""
    target, accuracy = config.trainer.stop_at_val_accuracy, metrics.get("val/accuracy")
    if target is None or accuracy is None or accuracy < target:
        return False
    console.say(f"hybridflow: held-out accuracy {accuracy:.3f} at step {step} reached trainer.stop_at_val_accuracy="
                f"{target:g}; the run ends here, its final model this step's")
    return True


def validation_due(config: HybridFlowConfig, step: int) -> bool:
    """Validate every `trainer.val_every_steps` steps (0: never) and always after the last step."""
    every = config.trainer.val_every_steps
    return bool(every) and step % every == 0 or step == config.trainer.total_steps


def validate(config: HybridFlowConfig, rollout: WorkerGroup, reward: WorkerGroup, rows: list[dict], tokenizer,
             step: int) -> dict[str, float]:
    """Greedy generation on the validation prompts; `val/accuracy` is the reward's `accuracy`
    extra when it reports one, else the mean reward."""
    from hybridflow.agents import agent_metrics

    rows = rows[: config.trainer.val_prompts]
    prompts = encode_prompts(rows, tokenizer, config.data.max_prompt_tokens, source="validation data",
                             truncation=config.data.prompt_truncation)
    samples = rollout.generate(prompts, greedy=True)
    rewards = reward.compute_rewards(samples.select(list(samples.objects)))
    scored = reward_metrics(rewards)
    accuracy = scored.get("reward/accuracy", scored["reward/score"])
    metrics = {"val/accuracy": accuracy, "val/reward_mean": scored["reward/score"],
               "val/response_length_mean": float(samples["response_mask"].sum(1).float().mean()),
               **agent_metrics(samples, prefix="val/agent/"),
               **accuracy_by_source(rewards, [row.get("data_source") for row in rows])}
    return metrics  # shown on the console by the MetricsLogger that logs it


def accuracy_by_source(rewards: Batch, sources: list) -> dict[str, float]:
    """`val/accuracy/<data_source>` for each data source among the rows, when there are several
    (e.g. `val/accuracy/arithmetic/add/2d`): the reward's `accuracy` extra, else the score."""
    names = sorted({s for s in sources if s is not None})
    if len(names) < 2:
        return {}
    per_sample = rewards.tensors.get(EXTRA_PREFIX + "accuracy", rewards[SCORE_KEY]).float()  # (B,)
    out = {}
    for name in names:
        rows = torch.tensor([s == name for s in sources])
        values = per_sample[rows]
        out[f"val/accuracy/{name}"] = float(values[~torch.isnan(values)].mean())
    return out


class Checkpointer:
    """Saves every role's training state plus the actor as a Hugging Face model, atomically,
    and resumes from the newest complete checkpoint that holds its full state and passes its
    checksums (older ones, weights-only snapshots, serve the merge; see docs/checkpoints.md).

    A resume may run on another number of ranks than the save (placement is not in the config
    hash): each role's state is resharded on load, and the log says which RNG states were
    restored, dropped or derived."""

    def __init__(self, config: HybridFlowConfig, run_dir: Path, model_dir: Path,
                 trainable: dict[str, WorkerGroup]) -> None:
        self.config, self.model_dir, self.trainable = config, model_dir, trainable
        trainer = config.trainer
        lora = config.actor.lora
        self.manager = CheckpointManager(run_dir, keep_last=trainer.keep_last_checkpoints,
                                         keep_weights=trainer.keep_last_weights,
                                         required=("hf/adapter_config.json",) if lora.rank and lora.save_adapter_only
                                         else ("hf/config.json",))
        self.config_hash = config_hash({k: v for k, v in _plain(config).items()
                                        if k in ("model", "data", "algorithm", "actor", "critic", "seed")})

    def due(self, step: int) -> bool:
        every = self.config.trainer.save_every_steps
        return bool(every) and step % every == 0

    def save(self, step: int, state: dict) -> Path:
        tmp = self.manager.begin(step)
        try:
            for role, group in self.trainable.items():
                group.save_checkpoint(str(tmp / role))
            self.trainable["actor"].export_hf(str(tmp / "hf"), str(self.model_dir))
            state = {**state, "step": step, "driver_rng": capture_rng_state(), "config_hash": self.config_hash}
            return self.manager.commit(tmp, step, state)
        except BaseException:
            self.manager.abort(tmp)
            raise

    def resume(self) -> dict | None:
        """Load the newest sound checkpoint into every role; returns its trainer state."""
        if not self.config.trainer.resume:
            return None
        self.manager.clean_stale()
        found = self._newest_sound()
        if found is None:
            print("hybridflow: trainer.resume=true but no complete checkpoint yet; starting fresh", flush=True)
            return None
        step, path = found
        state = self.manager.load_trainer_state(path, config_hash=self.config_hash)
        for role, group in self.trainable.items():
            notes = group.load_checkpoint(str(path / role))  # per rank: what another rank count changed
            if notes and notes[0]:
                print(f"hybridflow: {role} {notes[0]}", flush=True)
        self.manager.discard_after(step)
        restore_rng_state(state["driver_rng"])
        print(f"hybridflow: resumed from {path} (step {step})", flush=True)
        return state

    def _newest_sound(self) -> tuple[int, Path] | None:
        """The newest full-state checkpoint whose files match their checksums. A corrupt one is
        moved aside (`corrupt-step_<N>-*`) and the one before it tried, or, with
        trainer.on_corrupt_checkpoint=stop, the run stops naming the file."""
        candidates = self.manager.resumable()
        for step, path in reversed(candidates):
            start = time.perf_counter()
            try:
                checked = self.manager.verify(path)
            except CheckpointCorrupt as error:
                if self.config.trainer.on_corrupt_checkpoint == "stop":
                    raise CheckpointCorrupt(f"{error}. Stopping (trainer.on_corrupt_checkpoint=stop); set "
                                            "trainer.on_corrupt_checkpoint=previous to resume from the checkpoint "
                                            "before it, or delete the corrupt checkpoint") from None
                aside = self.manager.quarantine(path)
                print(f"hybridflow: {error}; moved it to {aside} and trying the checkpoint before it", flush=True)
                continue
            print(f"hybridflow: checksums of {path.name} verified ({checked / 2**20:.1f} MiB in "
                  f"{time.perf_counter() - start:.2f} s)", flush=True)
            return step, path
        if candidates:
            raise CheckpointCorrupt(f"{self.manager.root}: every checkpoint with a full training state is corrupt "
                                    "(moved aside as corrupt-step_*); start without resume (trainer.resume=false)")
        return None

    def export_final(self, run_dir: Path) -> str:
        final = run_dir / "final_model"
        if final.exists():
            import shutil

            shutil.rmtree(final)
        self.trainable["actor"].export_hf(str(final), str(self.model_dir))
        return str(final)


def _plain(value):
    from hybridflow.output.tracking import _jsonable

    return _jsonable(value)


def sample_seeds(seed: int, step: int, count: int) -> torch.Tensor:
    """Per-sample sampling seeds (B,): generation at a step depends only on weights, seed and step,
    so a resumed run draws exactly what the uninterrupted run drew."""
    return (seed * 1_000_003 + step * 10_007 + torch.arange(count)).long()


def run_training_hooks(config: HybridFlowConfig, step: int, actor: WorkerGroup, reference: WorkerGroup | None
                       ) -> dict[str, float]:
    """Apply the reference hooks of `trainer.training_hooks` after the actor update of `step` (e.g.
    reference <- EMA of the actor); the step hooks among them run through
    `hybridflow.training.hooks.StepHooks`. Full weights pass through the driver, so hooks are
    meant for every K steps."""
    from hybridflow.training.hooks import STEP_HOOKS

    reference_hooks = [h for h in config.trainer.training_hooks if h.name not in STEP_HOOKS]
    if not reference_hooks:
        return {}  # the merge tools (and DCP) are imported only for a run that has reference hooks
    from hybridflow.merge.hooks import run_training_hook

    applied = 0.0
    for hook in reference_hooks:
        every = hook.params.get("every_steps")  # hook params are free-form by design
        if every and step % int(every):
            continue
        if reference is None:
            raise RuntimeError(f"training hook {hook.name!r} needs the reference role")
        new_state = run_training_hook(hook, step=step,
                                      actor_state=actor.full_state_dict(), reference_state=reference.full_state_dict())
        if new_state is not None:
            reference.load_state_from(new_state)
            applied += 1
    return {"hooks/applied": applied} if reference_hooks else {}


def run_stage(recipe, stage, run_dir: Path) -> dict:
    """Run one recipe in `run_dir` (a run, or one stage of a pipeline) on its `stage` (hybridflow.run.stage.Stage,
    decided before anything starts: its resolved config and its plan, saved here as plan.json), under its
    own deadlines (`trainer.stage_timeout_s`, `trainer.default_stage_timeout_s`) and restarts
    (`trainer.max_restarts`): a restart resumes it from its own last complete checkpoint. An OpenEnv
    environment's server (rollout.agent=openenv:...) is started before it and stopped after it
    (hybridflow.agents.hubs.openenv_server.serve)."""
    from hybridflow.output.tracking import save_config

    for line in stage.said:
        console.say(line)
    stage.save(run_dir)
    save_config(stage.config, run_dir)  # as the run uses it
    trainer = stage.config.trainer
    deadlines.configure(dict(trainer.stage_timeout_s), trainer.default_stage_timeout_s)
    with serve(stage.config, run_dir) as config:  # rollout.agent=openenv:...: its server, for the stage's length
        return run_with_restarts(recipe, dataclasses.replace(stage, config=config), run_dir)


def run_with_restarts(recipe, stage, run_dir: Path) -> dict:
    """Run `recipe`; when a worker dies or raises, or a stage overruns its deadline, report it,
    tear the worker groups down and resume from the last complete checkpoint, at most
    `trainer.max_restarts` times. Each restart is a line in run_dir/restarts.jsonl, and every
    metrics row after it carries `trainer/restarts`."""
    import json

    from hybridflow.run import cluster
    from hybridflow.controller import WorkerError, WorkerGroupBroken
    from hybridflow.run.launch import release_all
    from hybridflow.resharding import WeightSyncError
    from hybridflow.output.tracking import last_logged_step

    cluster.use_run_dir(run_dir)
    config, restarts = stage.config, 0
    while True:
        try:
            return recipe(stage, run_dir)
        except (WorkerError, WorkerGroupBroken, WeightSyncError, TimeoutError) as exc:
            lost = _node_lost(exc, restarts < config.trainer.max_restarts)
            if restarts >= config.trainer.max_restarts:
                raise
            restarts += 1
            step = last_logged_step(run_dir) + 1
            console.end_progress_lines()
            if lost is not None:
                exc = lost
            print(f"hybridflow: step {step}: {type(exc).__name__}: {str(exc).splitlines()[0]}\n"
                  f"hybridflow: restart {restarts} of "
                  f"{config.trainer.max_restarts} (trainer.max_restarts): tearing the worker groups down and resuming "
                  "from the last complete checkpoint", flush=True)
            with (run_dir / "restarts.jsonl").open("a") as f:
                f.write(json.dumps({"restart": restarts, "step": step, "error": type(exc).__name__, "message": str(exc)[:2000],
                                    "time": time.time()}) + "\n")
            release_all()
            cluster.wait_until_plan_fits(stage.plan, config.placement.node_wait_s)
            config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, resume=True))
            stage = dataclasses.replace(stage, config=config)


def _node_lost(error: BaseException, will_restart: bool):
    """A `NodeLostError` naming the planned nodes that left the cluster and the pools and ranks they
    hosted, when that is what `error` came from (None otherwise); raised at once when no restart
    is left, so the run's last word names the node rather than a rank's dead process."""
    from hybridflow.run.cluster import NodeLostError, lost_nodes

    described = lost_nodes(error)
    if described is None:
        return None
    lost = NodeLostError(f"{described}. The first error it caused: {str(error).splitlines()[0].rstrip(':')}")
    console.end_progress_lines()
    if not will_restart:
        raise lost from error
    return lost

