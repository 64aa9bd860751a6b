"""PMA ("Model Merging in Pre-training", arXiv 2505.12082) at small scale: the study in docs/results/pma.md.

    export PYTHONPATH=.
    flock /tmp/hybridflow-heavy.lock .venv/bin/python bench/pma_study.py constant   # ~12 min
    flock /tmp/hybridflow-heavy.lock .venv/bin/python bench/pma_study.py sft --schedule cosine    # ~12 min
    flock /tmp/hybridflow-heavy.lock .venv/bin/python bench/pma_study.py sft --schedule constant  # ~12 min
    flock /tmp/hybridflow-heavy.lock .venv/bin/python bench/pma_study.py sft --schedule cosine --trajectory  # 1 min
    flock /tmp/hybridflow-heavy.lock .venv/bin/python bench/pma_study.py pmainit    # after constant
    flock /tmp/hybridflow-heavy.lock .venv/bin/python bench/pma_study.py pmainit_grpo  # after sft --schedule constant
    for s in 0 1 2; do  # ~9 min a seed
      flock /tmp/hybridflow-heavy.lock .venv/bin/python bench/pma_study.py pmainit_grpo --grpo-steps 250 --seeds $s
    done
    flock /tmp/hybridflow-heavy.lock .venv/bin/python bench/pma_study.py spike      # ~6 min
    .venv/bin/python bench/pma_study.py report    # tables (printed), bench/results/pma.png, pma_spike.png, pma_grpo*.png
    # the same on stand-in runs of the tiny model, in seconds (train nothing; write only under --work):
    .venv/bin/python bench/pma_study.py constant --dry-run --seeds 0 --work /tmp/pma_dry [--out dry.json]
    .venv/bin/python bench/pma_study.py report --dry-run --work /tmp/pma_dry   # its plots in /tmp/pma_dry/docs

Every training run is a real recipe (`hybridflow.cli.run`, in this process: Ray starts once) in
runs/pma_study/<name>; a finished run (its DONE file) is reused. Checkpoints are saved often and
kept; merges are made afterwards in memory with `merge_state_dicts` (the code behind
`hybridflow-merge` and the stage hooks) and scored here with plain transformers on the CPU:
held-out loss, and for SFT also greedy exact-match accuracy. Results go to
runs/pma_study/<experiment>.json; `report` reads them.

constant: recipe=pretrain at a constant lr (3e-3 after 20 warmup steps) for T=400 steps, a
  checkpoint every 4 steps; and a fork of the same run (same seeds: identical until step 320,
  checked) that decays linearly to 0 over its last 80 steps (WSD). Last checkpoint vs SMA / EMA
  (alpha 0.2) / WMA of the last N in {3, 6, 10} taken every V in {4, 8, 16} steps, vs the fork.
sft: the default pipeline's SFT stage (800 steps of a 1500-step cosine, 128 prompts a step,
  a checkpoint every 25 steps), or the same at a constant lr: last vs merges, loss and accuracy.
pmainit_grpo: the default pipeline's GRPO stage (its first 60 of 250 steps, or with
  --grpo-steps 250 all of it) from the constant-lr SFT run's last checkpoint vs from the SMA of
  its last 4 checkpoints every 25 steps (the pipeline's pma_sma), same seeds: first steps' policy
  loss / approx KL / reward, gradient-norm spikes, held-out accuracy every 10 (25) steps.
spike: the constant run of seed 0 with the lr multiplied by 100 for the update of step 200,
  without and with the spike_recovery hook.

--dry-run: each run's command composed and checked as `hybridflow` checks it (the config must hold
  every override the study gives), then a stand-in run in its place (`StandIn`: the recipe's
  metrics.jsonl keys, checkpoints of the tiny model at its smallest shape); the merges are then
  made and scored as above on the smallest held-out sets, and the results, tables and plots
  written under --work (runs/, docs/). `--seeds` chooses every experiment's seeds there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "pma_study"
DOCS = ROOT / "bench" / "results"
SEEDS = (0, 1, 2)
METHODS = {"sma": {}, "ema": {"alpha": 0.2}, "wma": {}}
NS = (3, 6, 10)

PRETRAIN = ["recipe=pretrain", "trainer.total_steps=400", "actor.optim.lr=3e-3", "actor.optim.warmup_steps=20",
            "trainer.val_every_steps=20", "pretrain.val_sequences=256", "trainer.keep_last_checkpoints=1",
            "trainer.keep_last_weights=null", "trainer.export_hf=true"]
T, EVERY, DECAY = 400, 4, 80
SFT = ["recipe=sft", "placement.pools.global.devices_per_node=1", "placement.pools.global.cpus_per_device=2",
       "data.synthetic.train_rows=7700", "data.synthetic.val_rows=500", "trainer.val_prompts=500",
       "trainer.total_steps=800", "trainer.prompts_per_step=128", "actor.samples_per_micro_batch=128",
       "actor.optim.lr=3.0e-3", "actor.optim.schedule_steps=1500", "trainer.save_every_steps=25",
       "trainer.val_every_steps=0", "trainer.keep_last_checkpoints=1", "trainer.keep_last_weights=null"]
SFT_T, SFT_EVERY = 800, 25
# The default pipeline's GRPO stage (conf/recipe/pipeline.yaml: common and stage overrides) on its
# 250-step cosine: its first 60 steps validated every 10 (`pmainit_grpo`), or all of it validated
# every 25 (`pmainit_grpo --grpo-steps 250`).
GRPO_STEPS = {60: 10, 250: 25}  # steps run: validation interval


def grpo_overrides(steps: int) -> list[str]:
    return ["recipe=grpo", "placement.pools.global.devices_per_node=1", "placement.pools.global.cpus_per_device=2",
            "data.synthetic.train_rows=7700", "data.synthetic.val_rows=500", "trainer.val_prompts=500",
            f"trainer.total_steps={steps}", f"trainer.val_every_steps={GRPO_STEPS[steps]}",
            "trainer.prompts_per_step=64", "rollout.samples_per_prompt=8", "actor.samples_per_micro_batch=512",
            "actor.samples_per_mini_batch=128", "actor.clip_ratio_high=0.28", "actor.optim.lr=1.0e-4",
            "actor.optim.warmup_steps=10", "actor.optim.lr_schedule=cosine", "actor.optim.schedule_steps=250",
            "trainer.save_every_steps=0", "trainer.export_hf=false"]


def grpo_suffix(steps: int) -> str:
    """Run and result names: the 60-step runs keep their first names."""
    return "" if steps == 60 else f"-t{steps}"


SPIKE_RATIO = 3.0  # a gradient-norm spike: above this many times the run's median
# A dry run (`dry_run`) sets these: stand-in runs instead of training, and the smallest held-out sets to
# score on (two pretraining sequences, two SFT prompts); the real study leaves them as they are.
STAND_IN: StandIn | None = None
SCORED_SHAPE: list[str] = []


# ------------------------------------------------------------------------------ running


def train(overrides: list[str], name: str) -> Path:
    """Run a recipe into runs/pma_study/<name> unless a finished run is there (a dry run: `StandIn`)."""
    overrides = [*overrides, f"logger.output_root={RUNS}", f"logger.run_name={name}", "logger.backends=[jsonl]"]
    run_dir = RUNS / name
    if STAND_IN is not None:
        return STAND_IN.run(overrides, run_dir)
    from hybridflow.cli import run
    from hybridflow.config import compose

    if (run_dir / "DONE").is_file():
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    config = compose(overrides)
    start = time.perf_counter()
    run(config)
    (run_dir / "DONE").write_text(f"{time.perf_counter() - start:.1f}\n")
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def hf(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}" / "hf"


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def merged(run_dir: Path, steps: list[int], method: str) -> dict[str, torch.Tensor]:
    from hybridflow.merge.api import merge_state_dicts

    return merge_state_dicts([read_weights(hf(run_dir, s)) for s in steps], method, **METHODS[method])


def window(end: int, every: int, n: int, first_saved: int) -> list[int] | None:
    """Steps end - (n-1)*every, ..., end (oldest first), or None if some were never saved."""
    steps = [end - every * k for k in range(n - 1, -1, -1)]
    return steps if steps[0] >= first_saved else None


# ---------------------------------------------------------------------------- scoring


class Scorer:
    """Held-out loss (and for a task, greedy exact-match accuracy) of weights in one model."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def load(self, weights: dict[str, torch.Tensor]) -> "Scorer":
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        self.model.tie_weights()
        return self

    @torch.no_grad()
    def loss(self, batch) -> float:
        """Mean per-token NLL of the response tokens (every token for a pretraining sequence)."""
        from hybridflow.training.sequences import response_log_probs

        total, tokens = 0.0, 0
        for micro in batch.split(128):
            log_probs, _ = response_log_probs(self.model, micro)
            mask = micro["response_mask"]
            total += float(-(log_probs * mask).sum())
            tokens += int(mask.sum())
        return total / tokens

    @torch.no_grad()
    def accuracy(self, prompts, answers: list[str], max_new_tokens: int = 8) -> float:
        ids, mask = prompts["prompt_ids"], prompts["prompt_mask"].long()
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id)
        texts = self.tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        return sum(t.strip() == a for t, a in zip(texts, answers)) / len(answers)


# ------------------------------------------------------------------------ experiments


def constant_lr() -> None:
    from hybridflow.config import compose
    from hybridflow.data.corpus import build_corpus, sequence_batch

    results = {}
    for seed in SEEDS:
        seeds = [f"seed={seed}", f"model.tiny.seed={seed}"]
        const = train([*PRETRAIN, *seeds, "actor.optim.lr_schedule=constant", f"trainer.save_every_steps={EVERY}"],
                      f"const-s{seed}")
        fork = train([*PRETRAIN, *seeds, "actor.optim.lr_schedule=wsd", f"actor.optim.decay_steps={DECAY}",
                      "trainer.save_every_steps=0"], f"wsd-s{seed}")
        shared = [(a["actor/loss"], b["actor/loss"]) for a, b in zip(metrics(const), metrics(fork))
                  if a["step"] <= T - DECAY]
        scorer = Scorer(const / "base_model")
        corpus = build_corpus(compose([*PRETRAIN, *seeds, *SCORED_SHAPE]).pretrain, scorer.tokenizer)
        val = sequence_batch(corpus.val, corpus.start_token_id)
        row = {"fork_max_loss_diff_before_decay": max(abs(a - b) for a, b in shared),
               "last": scorer.load(read_weights(hf(const, T))).loss(val),
               "annealed": scorer.load(read_weights(fork / "final_model")).loss(val),
               "seconds": {d.name: float((d / "DONE").read_text()) for d in (const, fork)}}
        for every in (4, 8, 16):
            for n in NS:
                for method in METHODS:
                    row[f"{method}/N{n}/V{every}"] = scorer.load(merged(const, window(T, every, n, EVERY), method)).loss(val)
        row["curve"] = {end: {"last": scorer.load(read_weights(hf(const, end))).loss(val),
                              "sma6x8": scorer.load(merged(const, window(end, 8, 6, EVERY), "sma")).loss(val)}
                        for end in range(60, T + 1, 20)}
        row["fork_curve"] = {m["step"]: m["val/loss"] for m in metrics(fork) if "val/loss" in m}
        results[seed] = row
        print(f"seed {seed}: last {row['last']:.4f} annealed {row['annealed']:.4f} "
              f"sma N6 V8 {row['sma/N6/V8']:.4f}", flush=True)
    _save("constant", results)


def sft(schedule: str, trajectory_only: bool = False) -> None:
    from hybridflow.config import compose
    from hybridflow.data.answers import encode_answers
    from hybridflow.data.prompts import encode_prompts
    from hybridflow.run.launch import prepare_data

    results = {}
    for seed in SEEDS:
        overrides = [*SFT, f"seed={seed}", f"model.tiny.seed={seed}", f"actor.optim.lr_schedule={schedule}"]
        run_dir = train(overrides, f"sft-{schedule}-s{seed}")
        config = compose([*overrides, *SCORED_SHAPE])
        scorer = Scorer(run_dir / "base_model")
        rows = prepare_data(config, run_dir, scorer.tokenizer).val
        prompts = encode_prompts(rows, scorer.tokenizer, config.data.max_prompt_tokens)
        answers = [r["ground_truth"] for r in rows]
        batch = prompts.union(encode_answers(answers, scorer.tokenizer, config.rollout.max_response_tokens))

        def score(weights):
            scorer.load(weights)
            return {"loss": scorer.loss(batch), "accuracy": scorer.accuracy(prompts, answers)}

        if trajectory_only:  # each checkpoint of the last 250 steps on its own: how fast is it still moving?
            results[seed] = {s: score(read_weights(hf(run_dir, s))) for s in window(SFT_T, 25, 11, SFT_EVERY)}
            continue
        row = {"last": score(read_weights(hf(run_dir, SFT_T))), "recipe_val_accuracy": metrics(run_dir)[-1].get(
            "val/accuracy"), "seconds": float((run_dir / "DONE").read_text())}
        for every in (25, 50, 100):
            for n in NS:
                steps = window(SFT_T, every, n, SFT_EVERY)
                if steps is None:
                    continue
                for method in METHODS:
                    row[f"{method}/N{n}/V{every}"] = score(merged(run_dir, steps, method))
        row["sma/N4/V25"] = score(merged(run_dir, window(SFT_T, 25, 4, SFT_EVERY), "sma"))  # the pipeline's merge
        results[seed] = row
        print(f"seed {seed}: last {row['last']} sma N4 V25 {row['sma/N4/V25']}", flush=True)
    _save(f"sft_{schedule}{'_trajectory' if trajectory_only else ''}", results)


def pma_init() -> None:
    """The next stage (SFT on the arithmetic task, constant lr 1e-3, 150 steps) from the constant-lr
    pretraining run's last checkpoint vs from the SMA of its last 6 checkpoints taken every 8 steps."""
    from hybridflow.merge.api import merge_checkpoints

    stage = ["recipe=sft", "placement.pools.global.devices_per_node=1", "placement.pools.global.cpus_per_device=2",
             "data.synthetic.train_rows=7700", "data.synthetic.val_rows=500", "trainer.val_prompts=500",
             "trainer.total_steps=150", "trainer.prompts_per_step=128", "actor.samples_per_micro_batch=128",
             "actor.optim.lr=1e-3", "actor.optim.warmup_steps=0", "actor.optim.lr_schedule=constant",
             "trainer.val_every_steps=25", "trainer.save_every_steps=0", "trainer.export_hf=false"]
    results = {}
    for seed in SEEDS:
        const = RUNS / f"const-s{seed}"
        start = {"last": hf(const, T), "sma6x8": RUNS / f"init-sma6x8-s{seed}"}
        if not start["sma6x8"].is_dir():
            merge_checkpoints([hf(const, s) for s in window(T, 8, 6, EVERY)], start["sma6x8"], "sma")
        results[seed] = {}
        for name, model in start.items():
            rows = metrics(train([*stage, f"seed={seed}", f"model.path={model}"], f"init-{name}-sft-s{seed}"))
            norms = [r["actor/grad_norm"] for r in rows]
            results[seed][name] = {"first_loss": rows[0]["actor/loss"], "loss": [r["actor/loss"] for r in rows],
                                   "max_grad_norm_first_20": max(norms[:20]), "grad_norm": norms,
                                   "val": {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}}
    _save("pma_init", results)


def pma_init_grpo(steps: int, seeds: tuple[int, ...] = SEEDS) -> None:
    """`steps` of GRPO from the constant-lr SFT run's last checkpoint vs from the SMA of its last 4
    (every 25 steps). Only `seeds` are trained now (one seed of the 250-step stage is ~9 min);
    the results are written once every seed's runs are done."""
    from hybridflow.merge.api import merge_checkpoints

    results = {}
    for seed in SEEDS:
        done = all((RUNS / f"grpo-{name}-s{seed}{grpo_suffix(steps)}" / "DONE").is_file() for name in ("last", "sma4x25"))
        if seed not in seeds and not done:
            print(f"seed {seed} not run yet: `bench/pma_study.py pmainit_grpo --grpo-steps {steps} --seeds {seed}`")
            continue
        sft_dir = RUNS / f"sft-constant-s{seed}"
        if not (sft_dir / "DONE").is_file():
            raise SystemExit(f"{sft_dir} is missing: run `bench/pma_study.py sft --schedule constant` first")
        start = {"last": hf(sft_dir, SFT_T), "sma4x25": RUNS / f"grpo-init-sma4x25-s{seed}"}
        if not start["sma4x25"].is_dir():
            merge_checkpoints([hf(sft_dir, s) for s in window(SFT_T, 25, 4, SFT_EVERY)], start["sma4x25"], "sma")
        results[seed] = {}
        for name, model in start.items():
            run_dir = train([*grpo_overrides(steps), f"seed={seed}", f"model.path={model}"],
                            f"grpo-{name}-s{seed}{grpo_suffix(steps)}")
            results[seed][name] = grpo_summary(metrics(run_dir), float((run_dir / "DONE").read_text()))
            print(f"seed {seed} {name}: {({k: v for k, v in results[seed][name].items() if not isinstance(v, list)})}",
                  flush=True)
    if len(results) == len(SEEDS):
        _save(f"pma_init_grpo{grpo_suffix(steps)}".replace("-", "_"), results)


def grpo_summary(rows: list[dict], seconds: float) -> dict:
    """The first 5 steps' policy loss, approx KL (k3, update vs sampling policy) and training reward;
    gradient-norm spikes (before clipping); the held-out accuracy curve."""
    norms = [r["actor/grad_norm"] for r in rows]
    median = statistics.median(norms)

    def first(key: str) -> float:
        return statistics.mean(r[key] for r in rows[:5])

    return {"loss_first_5": first("actor/loss"), "approx_kl_first_5": first("approx_kl"),
            "reward_first_5": first("reward/score"), "max_grad_norm": max(norms),
            "max_grad_norm_first_20": max(norms[:20]), "median_grad_norm": median,
            "grad_norm_spikes": sum(n > SPIKE_RATIO * median for n in norms),
            "loss": [r["actor/loss"] for r in rows], "approx_kl": [r["approx_kl"] for r in rows],
            "grad_norm": norms, "val": {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r},
            "seconds": seconds}


def spike() -> None:
    seeds = ["seed=0", "model.tiny.seed=0"]
    common = [*PRETRAIN, *seeds, "actor.optim.lr_schedule=constant", f"trainer.save_every_steps={EVERY}",
              "trainer.val_every_steps=10"]
    burst = "{name: lr_burst, params: {at_step: 200, factor: 100}}"
    recovery = "{name: spike_recovery, params: {last: 4}}"
    runs = {"healthy": train([*common], "spike-healthy"),
            "unrecovered": train([*common, f"trainer.training_hooks=[{burst}]"], "spike-unrecovered"),
            "recovered": train([*common, f"trainer.training_hooks=[{burst},{recovery}]"], "spike-recovered")}
    results = {name: {"val": {m["step"]: m["val/loss"] for m in metrics(d) if "val/loss" in m},
                      "train": {m["step"]: m["actor/loss"] for m in metrics(d)},
                      "fired": [m["step"] for m in metrics(d) if m.get("spike_recovery/fired")],
                      "seconds": float((d / "DONE").read_text())} for name, d in runs.items()}
    _save("spike", results)


def _save(name: str, results: dict) -> None:
    RUNS.mkdir(parents=True, exist_ok=True)
    (RUNS / f"{name}.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {RUNS / f'{name}.json'}", flush=True)


# ----------------------------------------------------------------------------- dry run


DRY_SCORED_SHAPE = ["pretrain.val_sequences=2", "pretrain.generated.train_documents=8",
                    "pretrain.generated.val_documents=4", "pretrain.generated.world_entities=4",
                    "pretrain.sequences_per_step=1", "data.synthetic.train_rows=8", "data.synthetic.val_rows=2",
                    "trainer.val_prompts=2"]
STAND_IN_MODEL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)  # the tiny model's smallest shape: a merge or a score in milliseconds


class StandIn:
    """A dry run's `train`: the run's command composed and checked as `hybridflow` checks it, printed,
    and a stand-in run written where the run would be, in the layout the recipe writes: metrics.jsonl
    (through the recipes' logger) with the keys this study reads, a checkpoint's hf/ every
    trainer.save_every_steps, base_model/, final_model/ and DONE, every model one tiny model at its
    smallest shape. A command is checked even where a finished stand-in is reused."""

    def __init__(self, work: Path) -> None:
        from hybridflow.builders import build_tiny_model
        from hybridflow.config.schema import TinyModelConfig

        self.model = build_tiny_model(work / "stand_in_model", TinyModelConfig(**STAND_IN_MODEL))
        self.commands: dict[str, list[str]] = {}

    def run(self, overrides: list[str], run_dir: Path) -> Path:
        from hybridflow.run.pipeline_stages import compose_command

        config = compose_command(overrides)
        missing = not_carried(config, overrides)
        if missing:
            raise SystemExit(f"{run_dir.name}: the composed config does not hold {missing}; a preset or a rule "
                             "overrides what the study sets")
        print(f"{run_dir.name}: hybridflow {' '.join(overrides)}", flush=True)
        self.commands[run_dir.name] = overrides
        if not (run_dir / "DONE").is_file():
            self.write(config, run_dir)
        return run_dir

    def write(self, config, run_dir: Path) -> None:
        from hybridflow.output.tracking import MetricsLogger, save_config

        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        save_config(config, run_dir)
        trainer = config.trainer
        logger = MetricsLogger(run_dir, config.logger, total_steps=trainer.total_steps)
        for step in range(1, trainer.total_steps + 1):
            logger.log(step, stand_in_metrics(config, step))
            if trainer.save_every_steps and step % trainer.save_every_steps == 0:
                hf(run_dir, step).parent.mkdir(parents=True)
                hf(run_dir, step).symlink_to(self.model)
        logger.close()
        for name in ("base_model", "final_model") if trainer.export_hf else ("base_model",):
            (run_dir / name).symlink_to(self.model)
        (run_dir / "DONE").write_text("0.0\n")


def stand_in_metrics(config, step: int) -> dict[str, float]:
    """A step's metrics under the keys its recipe logs them (recipes/pretrain.py, sft.py, ppo.py;
    hybridflow/training/hooks.py) and this study reads, the values made up: a falling loss, a rising
    reward and accuracy, a gradient-norm spike every 50 steps; held-out numbers when the run validates."""
    from hybridflow.run.runner import validation_due
    from hybridflow.training.hooks import GRAD_NORM_KEY, LOSS_KEY, REWARD_KEY

    recipe, progress = config.recipe.name, step / config.trainer.total_steps
    metrics = {LOSS_KEY: 3.0 - progress, GRAD_NORM_KEY: 5.0 if step % 50 == 0 else 1.0}
    if recipe == "grpo":
        metrics.update({REWARD_KEY: progress, "approx_kl": 1e-3 * progress})
    if any(hook.name == "spike_recovery" for hook in config.trainer.training_hooks):
        metrics["spike_recovery/fired"] = 0.0
    if validation_due(config, step):
        metrics.update({"val/loss": 3.0 - progress} if recipe == "pretrain" else {"val/accuracy": progress})
    return metrics


def not_carried(config, overrides: list[str]) -> list[str]:
    """The overrides whose value the composed `config` does not hold (a config group: its name; a key
    given twice: its last value, as Hydra composes it)."""
    from enum import Enum

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    node, missing = OmegaConf.structured(config), []
    last = {o.key_or_group: o for o in OverridesParser.create().parse_overrides(overrides)}
    for override in last.values():
        held, wanted = OmegaConf.select(node, override.key_or_group), override.value()
        held = OmegaConf.to_container(held) if OmegaConf.is_config(held) else held
        if isinstance(held, dict) and isinstance(wanted, str):  # recipe=pretrain
            held = held["name"]
        if not _holds(held.value if isinstance(held, Enum) else held, wanted):
            missing.append(override.input_line)
    return missing


def _holds(held, wanted) -> bool:
    """`held` has every value `wanted` gives (a dict may hold more: the schema's defaults)."""
    if isinstance(wanted, dict):
        return isinstance(held, dict) and all(_holds(held.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(held, list) and len(held) == len(wanted) and all(map(_holds, held, wanted))
    return held == wanted


def dry_run(args) -> dict:
    """`args.experiment` on stand-in runs under `args.work` (runs/, docs/; a new temporary directory if
    none): every run's command checked, the merges made and scored, the results, tables and plots
    written there. Returns what it composed and wrote."""
    global RUNS, DOCS, SEEDS, STAND_IN, SCORED_SHAPE
    work = args.work or Path(tempfile.mkdtemp(prefix="pma_study_dry_"))
    RUNS, DOCS, SEEDS = work / "runs", work / "docs", tuple(args.seeds)
    DOCS.mkdir(parents=True, exist_ok=True)
    STAND_IN, SCORED_SHAPE = StandIn(work), DRY_SCORED_SHAPE
    run_experiment(args)
    return {"experiment": args.experiment, "work": str(work), "commands": STAND_IN.commands,
            "results": sorted(p.name for p in RUNS.glob("*.json")), "plots": sorted(p.name for p in DOCS.glob("*.png"))}


# ------------------------------------------------------------------------------ report


def _stats(values: list[float]) -> str:
    mean = statistics.mean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.4f} ± {spread:.4f}"


def report() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if (RUNS / "constant.json").is_file():
        res = json.loads((RUNS / "constant.json").read_text())
        seeds = list(res)
        print(f"## constant lr ({len(seeds)} seeds: mean ± std of held-out loss; lower is better)\n")
        print(f"last checkpoint (step {T}): {_stats([res[s]['last'] for s in seeds])}  ")
        print(f"annealed fork (WSD, decay over the last {DECAY} steps): {_stats([res[s]['annealed'] for s in seeds])}  ")
        print(f"annealed minus last, paired: {_stats([res[s]['annealed'] - res[s]['last'] for s in seeds])}  ")
        print(f"fork vs constant before the decay, max |train loss diff|: "
              f"{max(res[s]['fork_max_loss_diff_before_decay'] for s in seeds):.2e}\n")
        for key in ("sma/N6/V8", "sma/N10/V4", "wma/N6/V8", "ema/N10/V4"):
            print(f"{key} minus annealed, paired: {_stats([res[s][key] - res[s]['annealed'] for s in seeds])}  ")
        print("\nmerge minus last checkpoint (held-out loss, negative: the merge is better):\n")
        _merge_table(res, seeds, (4, 8, 16), lambda v: v, "last")
        fig, ax = plt.subplots(figsize=(7, 4))
        ends = sorted(int(e) for e in res[seeds[0]]["curve"])
        for key, label in (("last", "last checkpoint (constant lr)"), ("sma6x8", "SMA of the last 6, every 8 steps")):
            values = torch.tensor([[res[s]["curve"][str(e)][key] for e in ends] for s in seeds])
            ax.plot(ends, values.mean(0), label=label)
            ax.fill_between(ends, values.min(0).values, values.max(0).values, alpha=0.2)
        fork_steps = [int(k) for k in res[seeds[0]]["fork_curve"] if int(k) >= T - DECAY - 20]
        values = torch.tensor([[res[s]["fork_curve"][str(k)] for k in fork_steps] for s in seeds])
        ax.plot(fork_steps, values.mean(0), label="fork annealed to 0 (WSD)", linestyle="--")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.set_title(f"pretrain, tiny model, constant lr 3e-3: {len(seeds)} seeds (band: min-max)")
        ax.set_ylim(top=float(torch.tensor([res[s]["curve"][str(120)]["last"] for s in seeds]).max()))
        ax.legend()
        fig.tight_layout()
        fig.savefig(DOCS / "pma.png", dpi=100)
        plt.close(fig)
    for schedule in ("cosine", "constant"):
        path = RUNS / f"sft_{schedule}.json"
        if path.is_file():
            res = json.loads(path.read_text())
            seeds = list(res)
            print(f"\n## SFT, {schedule} lr ({len(seeds)} seeds: held-out answer loss / greedy accuracy)\n")
            print(f"last checkpoint: loss {_stats([res[s]['last']['loss'] for s in seeds])}, accuracy "
                  f"{_stats([res[s]['last']['accuracy'] for s in seeds])}; SMA of the last 4 (the pipeline's "
                  f"merge): loss {_stats([res[s]['sma/N4/V25']['loss'] for s in seeds])}, accuracy "
                  f"{_stats([res[s]['sma/N4/V25']['accuracy'] for s in seeds])}\n")
            trajectory = RUNS / f"sft_{schedule}_trajectory.json"
            if trajectory.is_file():
                traj = json.loads(trajectory.read_text())
                steps = list(traj[seeds[0]])
                print("| seed | " + " | ".join(f"step {k}" for k in steps) + " |")
                print("| --- |" + " --- |" * len(steps))
                for seed in seeds:
                    print(f"| {seed} | " + " | ".join(f"{traj[seed][k]['accuracy']:.3f}" for k in steps) + " |")
                print()
            for metric in ("loss", "accuracy"):
                print(f"{metric}, merge minus last checkpoint:\n")
                _merge_table(res, seeds, (25, 50, 100), lambda v, m=metric: v[m], "last")
    if (RUNS / "pma_init.json").is_file():
        res = json.loads((RUNS / "pma_init.json").read_text())
        seeds = list(res)
        checkpoints = sorted(int(k) for k in res[seeds[0]]["last"]["val"])
        print(f"\n## PMA-init ({len(seeds)} seeds): SFT from the last pretraining checkpoint vs from the SMA\n")
        print("| start | first-step loss | max grad norm, steps 1-20 | "
              + " | ".join(f"accuracy @{k}" for k in checkpoints) + " |")
        print("| --- | --- | --- |" + " --- |" * len(checkpoints))
        for name in ("last", "sma6x8"):
            runs = [res[s][name] for s in seeds]
            print(f"| {name} | {_stats([r['first_loss'] for r in runs])} | "
                  f"{_stats([r['max_grad_norm_first_20'] for r in runs])} | "
                  + " | ".join(_stats([r["val"][str(k)] for r in runs]) for k in checkpoints) + " |")
    for steps in GRPO_STEPS:
        name = f"pma_init_grpo{grpo_suffix(steps)}".replace("-", "_")
        if (RUNS / f"{name}.json").is_file():
            _report_grpo(json.loads((RUNS / f"{name}.json").read_text()), plt, name.replace("pma_init_", "pma_"))
    if (RUNS / "spike.json").is_file():
        res = json.loads((RUNS / "spike.json").read_text())
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, run in res.items():
            steps = sorted(int(k) for k in run["val"])
            ax.plot(steps, [run["val"][str(k)] for k in steps], label=name)
        ax.axvline(200, color="gray", linestyle=":", label="lr x100 at step 200")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.set_ylim(top=4.0)
        ax.legend()
        fig.tight_layout()
        fig.savefig(DOCS / "pma_spike.png", dpi=100)
        plt.close(fig)
        print("\n## spike (seed 0): held-out loss at steps 190, 210, 250, 300, 400; recovery fired at",
              res["recovered"]["fired"], "\n")
        print("| run | " + " | ".join(f"step {k}" for k in (190, 210, 250, 300, 400)) + " |")
        print("| --- |" + " --- |" * 5)
        for name, run in res.items():
            print(f"| {name} | " + " | ".join(f"{run['val'][str(k)]:.4f}" for k in (190, 210, 250, 300, 400)) + " |")


def _report_grpo(res: dict, plt, plot_name: str) -> None:
    seeds = list(res)
    steps = sorted(int(k) for k in res[seeds[0]]["last"]["val"])
    start = json.loads((RUNS / "sft_constant.json").read_text()) if (RUNS / "sft_constant.json").is_file() else None
    start_key = {"last": "last", "sma4x25": "sma/N4/V25"}
    print(f"\n## PMA-init into GRPO ({len(seeds)} seeds): from the last constant-lr SFT checkpoint vs the SMA of "
          "its last 4\n")
    print("| start | steps 1-5: policy loss | approx KL | reward | max grad norm | median | spikes > "
          f"{SPIKE_RATIO:g}x median | " + " | ".join(f"accuracy @{k}" for k in [0, *steps]) + " |")
    print("| --- |" + " --- |" * (7 + len(steps)))
    for name in ("last", "sma4x25"):
        runs = [res[s][name] for s in seeds]
        at_zero = _stats([start[s][start_key[name]]["accuracy"] for s in seeds]) if start else "n/a"
        print(f"| {name} | {_stats([r['loss_first_5'] for r in runs])} | {_stats([r['approx_kl_first_5'] for r in runs])}"
              f" | {_stats([r['reward_first_5'] for r in runs])} | {_stats([r['max_grad_norm'] for r in runs])} | "
              f"{_stats([r['median_grad_norm'] for r in runs])} | {sum(r['grad_norm_spikes'] for r in runs)} | "
              f"{at_zero} | " + " | ".join(_stats([r["val"][str(k)] for r in runs]) for k in steps) + " |")
    print("\nper seed, accuracy at the last step (last / sma4x25):",
          ", ".join(f"{s}: {res[s]['last']['val'][str(steps[-1])]:.3f} / {res[s]['sma4x25']['val'][str(steps[-1])]:.3f}"
                    for s in seeds))
    print("paired, sma4x25 minus last, accuracy at each validation:",
          " | ".join(f"@{k} {_stats([res[s]['sma4x25']['val'][str(k)] - res[s]['last']['val'][str(k)] for s in seeds])}"
                     for k in steps))
    print("run seconds:", {f"{s}/{n}": round(res[s][n]["seconds"]) for s in seeds for n in res[s]})
    fig, ax = plt.subplots(figsize=(7, 4))  # per seed: the seeds differ far more than the two starts
    xs = [0, *steps] if start else steps
    for color, seed in zip(("C0", "C1", "C2"), seeds):
        for name, style in (("last", "-"), ("sma4x25", "--")):
            ys = ([start[seed][start_key[name]]["accuracy"]] if start else []) + \
                [res[seed][name]["val"][str(k)] for k in steps]
            ax.plot(xs, ys, style, color=color, label=f"seed {seed}, from the {'SMA of the last 4' if name != 'last' else 'last checkpoint'}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out accuracy (greedy exact match)")
    ax.set_title("GRPO after constant-lr SFT: last checkpoint (solid) vs SMA (dashed)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(DOCS / f"{plot_name}.png", dpi=100)
    plt.close(fig)


def _merge_table(res: dict, seeds: list[str], intervals, pick, last_key: str) -> None:
    """Rows: method x N; columns: interval V. A cell: the merge's value minus the last checkpoint's,
    per seed (paired: the seeds differ more from each other than a merge from its last checkpoint),
    as mean ± std over seeds."""
    print("| method | N | " + " | ".join(f"V={v}" for v in intervals) + " |")
    print("| --- | --- |" + " --- |" * len(intervals))
    for method in METHODS:
        for n in NS:
            cells = []
            for v in intervals:
                key = f"{method}/N{n}/V{v}"
                cells.append(_stats([pick(res[s][key]) - pick(res[s][last_key]) for s in seeds])
                             if key in res[seeds[0]] else "n/a")
            print(f"| {method} | {n} | " + " | ".join(cells) + " |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=["constant", "sft", "pmainit", "pmainit_grpo", "spike", "report"])
    parser.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    parser.add_argument("--grpo-steps", type=int, choices=sorted(GRPO_STEPS), default=60,
                        help="pmainit_grpo: the stage's first 60 steps, or all 250")
    parser.add_argument("--seeds", type=int, nargs="+", choices=SEEDS, default=list(SEEDS),
                        help="pmainit_grpo: train only these seeds now; a dry run: every experiment's seeds")
    parser.add_argument("--trajectory", action="store_true", help="sft: score each of the last 11 checkpoints")
    parser.add_argument("--dry-run", action="store_true",
                        help="check each run's command and score stand-in runs under --work; train nothing")
    parser.add_argument("--work", type=Path, default=None,
                        help="a dry run's runs/ and docs/ (default: a new temporary directory)")
    parser.add_argument("--out", type=Path, default=None, help="a dry run's report (JSON): commands, results, plots")
    args = parser.parse_args()
    if not args.dry_run and (args.work or args.out):
        parser.error("--work and --out are a dry run's: add --dry-run, or leave them out")
    torch.set_num_threads(1 if args.dry_run else 2)  # a dry run's tensors are too small to share out
    if args.dry_run:
        done = dry_run(args)
        print(f"dry run: {len(done['commands'])} command(s) checked; results {done['results']}, plots "
              f"{done['plots']} under {done['work']}")
        if args.out:
            args.out.write_text(json.dumps(done, indent=1) + "\n")
        return
    run_experiment(args)


def run_experiment(args) -> None:
    if args.experiment == "constant":
        constant_lr()
    elif args.experiment == "sft":
        sft(args.schedule, args.trajectory)
    elif args.experiment == "pmainit":
        pma_init()
    elif args.experiment == "pmainit_grpo":
        pma_init_grpo(args.grpo_steps, tuple(args.seeds))
    elif args.experiment == "spike":
        spike()
    else:
        report()


if __name__ == "__main__":
    sys.exit(main())
