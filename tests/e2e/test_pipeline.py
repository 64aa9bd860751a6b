"""The multi-stage pipeline: SFT -> PMA merge of the last SFT checkpoints -> GRPO, with its report."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from hybridflow.config import compose
from hybridflow.config.schema import StageConfig
from hybridflow.merge.hooks import HookConfig

pytestmark = pytest.mark.usefixtures("shared_ray_head")  # its runs join one Ray head (tests/ray_head.py)

ROOT = Path(__file__).resolve().parents[2]

COMMON = ["trainer.prompts_per_step=4", "rollout.max_response_tokens=4", "trainer.val_prompts=8",
          "data.synthetic.train_rows=200", "data.synthetic.val_rows=16", "actor.samples_per_micro_batch=8",
          "placement.pools.global.devices_per_node=1"]


def test_sft_merge_grpo_pipeline_runs_reports_and_skips_finished_stages(tmp_path):
    import ray

    from hybridflow.cli import run
    from hybridflow.preflight import InputError

    config = compose(["recipe=pipeline", f"logger.output_root={tmp_path}", "logger.run_name=pipe"])
    config.pipeline.common_overrides = COMMON
    config.pipeline.stages = [
        StageConfig(name="sft", recipe="sft", overrides=["trainer.total_steps=4", "trainer.save_every_steps=2"]),
        StageConfig(name="grpo", recipe="grpo", init=HookConfig("pma_sma", {"last": 2}), evaluate_init=True,
                    overrides=["trainer.total_steps=2", "rollout.samples_per_prompt=2"]),
    ]
    try:
        result = run(config)
        run_dir = tmp_path / "pipe"
        sft, grpo = (json.loads((run_dir / d / "STAGE_COMPLETE").read_text()) for d in ("00-sft", "01-grpo"))
        assert sft["final_accuracy"] is not None and grpo["final_accuracy"] is not None
        # the numbers reported are the ones measured: the merged start's evaluation, each stage's last validation
        init_eval = [json.loads(line) for line in (run_dir / "01-grpo" / "init_eval" / "metrics.jsonl").read_text().splitlines()]
        assert grpo["init_accuracy"] == init_eval[0]["val/accuracy"]
        for name, stage in (("00-sft", sft), ("01-grpo", grpo)):
            rows = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
            assert stage["final_accuracy"] == [r["val/accuracy"] for r in rows if "val/accuracy" in r][-1]
        provenance = json.loads((run_dir / "01-grpo" / "init_model" / "merge_provenance.json").read_text())
        assert provenance["method"] == "sma" and len(provenance["inputs"]) == 2
        report = (run_dir / "report.md").read_text()
        assert "the last checkpoint of stage sft" in report and (run_dir / "report.png").stat().st_size > 0
        assert f"| grpo | grpo | {grpo['init_accuracy']:.3f} | {grpo['final_accuracy']:.3f} |" in report
        assert result["final_model"].endswith("01-grpo/final_model")
        # bench/pipeline_seeds.py's row for this run: the accuracies the stages wrote, GRPO's gain over its start
        bench = runpy.run_path(str(ROOT / "bench" / "pipeline_seeds.py"))
        row = bench["summarize"](run_dir)
        assert [(s["stage"], s["final_accuracy"]) for s in row["stages"]] == [("sft", sft["final_accuracy"]),
                                                                             ("grpo", grpo["final_accuracy"])]
        assert row["last_stage_gain"] == round(grpo["final_accuracy"] - grpo["init_accuracy"], 4)
        assert row["stages"][1]["minutes"] >= 0 and "| 0 |" in bench["table"]({0: row})

        with pytest.raises(InputError, match="already holds a run"):
            run(config)  # the same run name again without trainer.resume: refused, nothing appended
        config.trainer.resume = True
        again = run(config)  # every stage is complete: nothing is re-run
        assert again["final_model"] == result["final_model"]
    finally:
        ray.shutdown()
