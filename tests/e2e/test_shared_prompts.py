"""Shared prompts in a GRPO run (hybridflow/training/shared_prompts.py): the tiny model's short run in one
process (placement=local, the hf engine), `model.share_prompts` null (the default: shared) against
false. The actor's update computes fewer tokens (`perf/computed_tokens`) and learns the same: the same
samples and rewards, the same loss and gradient norm within float32 rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e import cli_in_one_process

TINY = ["recipe=grpo", "rollout.backend=hf", "trainer.total_steps=2", "trainer.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "rollout.max_response_tokens=4", "trainer.val_every_steps=0",
        "trainer.save_every_steps=0", "trainer.export_hf=false", "data.synthetic.train_rows=200",
        "data.synthetic.val_rows=16", "trainer.val_prompts=8", "actor.samples_per_micro_batch=8", "critic.samples_per_micro_batch=8"]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_grpo_run_with_shared_prompts_computes_fewer_tokens_and_learns_the_same(tmp_path):
    reward = Path(__file__).parent / "fixtures" / "varied_reward.py"  # a score that varies within every group
    runs = {}
    for name, setting in (("shared", "null"), ("unshared", "false")):
        args = [*TINY, f"reward.fn={reward}:score", f"model.share_prompts={setting}"]
        done = cli_in_one_process.without_ray(args, tmp_path, name)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        runs[name] = _rows(tmp_path / name)
    shared, unshared = runs["shared"], runs["unshared"]
    assert [r["step"] for r in shared] == [r["step"] for r in unshared] == [1, 2]
    for a, b in zip(shared, unshared):
        assert a["perf/computed_tokens"] < b["perf/computed_tokens"], (a, b)
        assert a["perf/sharing_saved_tokens"] == b["perf/computed_tokens"] - a["perf/computed_tokens"] > 0
        assert b["perf/sharing_saved_tokens"] == 0
        assert a["perf/padding_saved_tokens"] == b["perf/padding_saved_tokens"]
        for key in ("actor/loss", "actor/grad_norm", "actor/entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert shared[0]["reward/score"] == unshared[0]["reward/score"]  # the same weights sampled the same answers
