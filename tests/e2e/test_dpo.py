"""recipe=dpo end to end on the tiny model (the actor and the reference role in one process without
Ray: placement=local, Ray's import blocked, tests/e2e/cli_in_one_process.py `without_ray`), through
the `hybridflow` command, on preference files in TRL's format (text and conversational responses):
the held-out DPO loss falls below log 2 and the implicit rewards rank the chosen responses first; the
held-out preference accuracy equals one recomputed from the final model; the metrics carry TRL's
names; the reference log-probs of each training pair are computed once (the first epoch) and reused
after; checkpoints and the final model are written. And the pipeline SFT ->
DPO -> GRPO, each stage starting from the one before it (on Ray, joining the tests' head)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hybridflow.data import ArithmeticSpec, make_arithmetic_split
from hybridflow.data.preference import synthetic_pairs
from tests.e2e.cli_in_one_process import without_ray


def write_preference_files(root: Path, train_rows: int = 512, val_rows: int = 128) -> tuple[Path, Path]:
    """TRL-format .jsonl files from the arithmetic task: every other row's responses as chat messages."""
    train, val = make_arithmetic_split(train_rows, val_rows, ArithmeticSpec(), seed=0)
    paths = []
    for name, rows in (("train", synthetic_pairs(train, 0)), ("val", synthetic_pairs(val, 1))):
        path = root / f"{name}.jsonl"
        with open(path, "w") as f:
            for i, row in enumerate(rows):
                chosen, rejected = row["chosen"], row["rejected"]
                if i % 2:
                    chosen = [{"role": "assistant", "content": chosen}]
                    rejected = [{"role": "assistant", "content": rejected}]
                f.write(json.dumps({"prompt": row["prompt"], "chosen": chosen, "rejected": rejected}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def test_dpo_on_trl_format_files_ranks_the_chosen_responses_first(tmp_path):
    train, val = write_preference_files(tmp_path)
    result = without_ray(["recipe=dpo", f"data.train_path={train}", f"data.val_path={val}",
                          "trainer.total_steps=40", "trainer.val_every_steps=20", "trainer.prompts_per_step=32",
                          "trainer.val_prompts=128", "trainer.save_every_steps=20", "actor.optim.lr=2e-3",
                          "actor.optim.lr_schedule=constant", "actor.optim.warmup_steps=0"], tmp_path, "dpo")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = tmp_path / "dpo"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    held_out = [r for r in rows if "val/preference_loss" in r]
    assert [r["step"] for r in held_out] == [0, 20, 40]
    start, *later = held_out
    assert start["val/preference_loss"] == pytest.approx(math.log(2)) and start["val/rewards/margins"] == 0
    for r in later:  # DPO's own objective on pairs it never trained on
        assert r["val/preference_loss"] < math.log(2) - 0.02, r
        assert r["val/rewards/margins"] > 0.1 and r["val/rewards/accuracies"] > 0.5, r  # 0.29-0.33 and 0.59-0.62 here
    # the policy's own preference accuracy at step 40 is the final model's, recomputed here pair by pair
    accuracy, chosen_mean = preference_accuracy(run_dir / "final_model", val)
    assert later[-1]["val/preference_accuracy"] == pytest.approx(accuracy, abs=1.5 / 128)
    assert later[-1]["val/logps/chosen"] == pytest.approx(chosen_mean, rel=1e-4)
    trained = [r for r in rows if "actor/loss" in r]
    assert len(trained) == 40 and all({"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                                       "logps/chosen", "logps/rejected"} <= set(r) for r in trained)
    # the starting model scores the pairs, the reference role (the run's step-0 loss, log 2, says it is the
    # starting model): 512 pairs, 32 a step, the first epoch (steps 1-16) scores each pair once; not run after
    scored = [r["dpo/reference_pairs_scored"] for r in trained]
    assert scored == [32] * 16 + [0] * 24, scored
    assert "reference log-probs of each pair are computed once" in result.stdout
    assert "dpo.loss=sigmoid runs with beta=0.1 (the loss's own default" in result.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000020", "step_00000040"]
    assert (run_dir / "final_model" / "config.json").is_file()


def preference_accuracy(model_dir: Path, val_path: Path) -> tuple[float, float]:
    """(share of the held-out pairs whose chosen response `model_dir` gives the higher log-probability,
    mean chosen log-prob), computed outside the run: the model as transformers loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.config import compose
    from hybridflow.data.preference import encode_pairs
    from hybridflow.data.tokenizer import load_tokenizer
    from hybridflow.training.sequences import pair_log_probs

    config = compose(["recipe=dpo"])
    rows = [json.loads(line) for line in val_path.read_text().splitlines()]
    pairs = encode_pairs(rows, load_tokenizer(model_dir), config.data.max_prompt_tokens,
                         config.rollout.max_response_tokens)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        scored = pair_log_probs(model, pairs, rows_per_micro_batch=64)
    chosen, rejected = scored["chosen_log_probs"], scored["rejected_log_probs"]
    return float((chosen > rejected).float().mean()), float(chosen.mean())


@pytest.mark.usefixtures("shared_ray_head")  # its run joins one Ray head (tests/ray_head.py)
@pytest.mark.slow  # ~90 s: three stages, each starting the stack
def test_an_sft_dpo_grpo_pipeline_runs_end_to_end(tmp_path):
    import ray

    from hybridflow.cli import run
    from hybridflow.config import compose
    from hybridflow.config.schema import StageConfig
    from hybridflow.merge.hooks import HookConfig

    config = compose(["recipe=pipeline", f"logger.output_root={tmp_path}", "logger.run_name=pipe"])
    config.pipeline.common_overrides = ["rollout.max_response_tokens=4", "trainer.val_prompts=16",
                                        "data.synthetic.train_rows=300", "data.synthetic.val_rows=16",
                                        "actor.samples_per_micro_batch=16", "placement.pools.global.devices_per_node=1"]
    config.pipeline.stages = [
        StageConfig(name="sft", recipe="sft", overrides=["trainer.total_steps=4", "trainer.prompts_per_step=8"]),
        StageConfig(name="dpo", recipe="dpo", overrides=["trainer.total_steps=6", "trainer.prompts_per_step=16",
                                                         "trainer.save_every_steps=3", "trainer.val_every_steps=3"]),
        # evaluate_init off: the merged start's held-out evaluation is a whole-stack start of its own,
        # tested in tests/e2e/test_pipeline.py (CI's time, tests/budget.py)
        StageConfig(name="grpo", recipe="grpo", init=HookConfig("pma_sma", {"last": 2}), evaluate_init=False,
                    overrides=["trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=2"]),
    ]
    try:
        result = run(config)
    finally:
        ray.shutdown()
    run_dir = tmp_path / "pipe"
    dpo = [json.loads(line) for line in (run_dir / "01-dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in dpo if "val/preference_loss" in r] == [0, 3, 6]
    # the DPO stage started from the SFT stage's final model, and GRPO from the SMA of DPO's checkpoints
    done = json.loads((run_dir / "01-dpo" / "STAGE_COMPLETE").read_text())
    assert done["init_model"] == str(run_dir / "00-sft" / "final_model")
    provenance = json.loads((run_dir / "02-grpo" / "init_model" / "merge_provenance.json").read_text())
    assert [Path(i["path"]).relative_to(run_dir).parts[:3] for i in provenance["inputs"]] == [
        ("01-dpo", "checkpoints", "step_00000003"), ("01-dpo", "checkpoints", "step_00000006")]
    report = (run_dir / "report.md").read_text()
    assert "| dpo | dpo |  |  |" in report  # no generation in DPO: no held-out task accuracy of its own
    assert result["final_model"].endswith("02-grpo/final_model")
