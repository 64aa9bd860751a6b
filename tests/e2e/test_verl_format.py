"""A verl-format data set and a verl reward file train with GRPO through the `hybridflow` command,
unchanged: chat-message prompts (rendered with the tokenizer's chat template), the answer nested in
`reward_model.ground_truth`, `extra_info` / `ability` / `data_source` columns, verl's
`compute_score(data_source, solution_str, ground_truth, extra_info)`, and verl's KL names.

The run is verbose (`logger.verbose=true`), and what a verbose run prints is read on it too
(hybridflow/output/console.py: the library output on the console, no logs directory): one start of the
stack for both (each start is a minute of CI's time on a 2-core CPU, tests/budget.py). A quiet
run's console is read on tests/e2e/test_rl_recipes.py's uninterrupted run."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_rl_recipes import ONE_RANK

pytestmark = pytest.mark.usefixtures("shared_ray_head")  # its runs join one Ray head (tests/ray_head.py)

VENV_BIN = Path(sys.executable).parent
# A reward file as verl users write it (verl/utils/reward_score style), not adapted to HybridFlow.
VERL_REWARD = '''
import re


def compute_score(data_source, solution_str, ground_truth, extra_info):
    """1.0 when the last number in the solution equals the ground truth."""
    assert data_source.startswith("arith") and extra_info["split"] in ("train", "test")
    numbers = re.findall(r"-?\\d+", solution_str)
    return 1.0 if numbers and numbers[-1] == ground_truth else 0.0
'''


def verl_rows(count: int, split: str, seed: int) -> list[dict]:
    """Rows in verl's parquet layout (as verl's examples/data_preprocess/gsm8k.py writes them)."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        rows.append({"data_source": "arith/add", "ability": "math",
                     "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": split, "index": index}})
    return rows


@pytest.fixture(scope="module")
def verl_inputs(tmp_path_factory) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("verl")
    pq.write_table(pa.Table.from_pylist(verl_rows(64, "train", seed=0)), root / "train.parquet")
    pq.write_table(pa.Table.from_pylist(verl_rows(8, "test", seed=1)), root / "test.parquet")
    (root / "reward.py").write_text(VERL_REWARD)
    return {"train": root / "train.parquet", "val": root / "test.parquet", "reward": root / "reward.py",
            "root": root}


@pytest.fixture(scope="module")
def verl_run(verl_inputs) -> subprocess.CompletedProcess:
    """Three GRPO steps on the verl files, verbose; its run directory is `verl_inputs['root'] / 'verl'`."""
    inputs = verl_inputs
    cmd = [str(VENV_BIN / "hybridflow"), "recipe=grpo", "data=files", f"data.train_path={inputs['train']}",
           f"data.val_path={inputs['val']}", f"reward.fn={inputs['reward']}:compute_score",
           "algorithm.kl_penalty_coef=0.01", "algorithm.kl_penalty_estimator=kl",
           "actor.kl_loss_coef=0.01", "actor.kl_loss_estimator=low_var_kl",
           "trainer.total_steps=3", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4",
           "rollout.max_response_tokens=4", "data.max_prompt_tokens=32", "trainer.val_prompts=8",
           "actor.samples_per_micro_batch=8", "trainer.export_hf=false", "logger.verbose=true",
           ONE_RANK,
           f"logger.output_root={inputs['root']}", "logger.run_name=verl"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_grpo_trains_three_steps_on_verl_data_with_a_verl_reward_file(verl_inputs, verl_run):
    rows = [json.loads(line) for line in (verl_inputs["root"] / "verl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward/score", "reward/compute_score/score", "kl/penalty_mean", "kl_loss", "response/length_mean"):
        assert key in rows[0], f"{key} missing from the step metrics"
    assert rows[-1]["kl_loss"] > 0  # low_var_kl (k3) once the actor has moved from the reference
    assert 0.0 <= rows[-1]["val/accuracy"] <= 1.0


@pytest.mark.slow  # a dead worker named with its last output: tests/e2e/test_rl_recipes.py's rank-kill test
def test_verbose_shows_the_library_output(verl_inputs, verl_run):
    assert "Initializing a V1 LLM engine" in verl_run.stdout + verl_run.stderr
    assert not (verl_inputs["root"] / "verl" / "logs" / "grpo").exists()
