"""What a run prints (hybridflow/console.py): a few lines and one progress line per stage on the
console; everything vLLM, Ray, transformers and torch print under <run_dir>/logs/; errors whole. A
short run's console is read on tests/e2e/test_rl_recipes.py's uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_rl_recipes import ONE_RANK

pytestmark = pytest.mark.usefixtures("shared_ray_head")  # its runs join one Ray head (tests/ray_head.py)

VENV_BIN = Path(sys.executable).parent
SMALL = ["recipe=grpo", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_response_tokens=4",
         "trainer.val_prompts=8", "data.synthetic.train_rows=200", "data.synthetic.val_rows=16",
         "actor.samples_per_micro_batch=8", ONE_RANK]


def hybridflow(args: list[str], output_root: Path, run_name: str) -> subprocess.CompletedProcess:
    """The command's output as written: bytes decoded without universal newlines, so a progress
    line's carriage returns stay carriage returns and only real lines end in "\n"."""
    cmd = [str(VENV_BIN / "hybridflow"), *SMALL, *args, f"logger.output_root={output_root}",
           f"logger.run_name={run_name}"]
    result = subprocess.run(cmd, capture_output=True, timeout=600)
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


@pytest.mark.slow  # ~20 s; a dead worker named with its last output: tests/e2e/test_rl_recipes.py's rank-kill test
def test_verbose_shows_the_library_output(tmp_path):
    verbose = hybridflow(["trainer.total_steps=1", "logger.verbose=true"], tmp_path, "verbose")
    assert verbose.returncode == 0, verbose.stdout[-4000:] + verbose.stderr[-4000:]
    assert "Initializing a V1 LLM engine" in verbose.stdout + verbose.stderr
    assert not (tmp_path / "verbose" / "logs" / "grpo").exists()
