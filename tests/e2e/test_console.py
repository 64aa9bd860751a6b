"""What a run prints (hybridflow/console.py): a few lines and one progress line per stage on the
console; everything vLLM, Ray, transformers and torch print under <run_dir>/logs/; errors whole."""

from __future__ import annotations

import pytest
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
SMALL = ["recipe=grpo", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_response_tokens=4",
         "trainer.val_prompts=8", "data.synthetic.train_rows=200", "data.synthetic.val_rows=16",
         "actor.samples_per_micro_batch=8"]


def hybridflow(args: list[str], output_root: Path, run_name: str) -> subprocess.CompletedProcess:
    """The command's output as written: bytes decoded without universal newlines, so a progress
    line's carriage returns stay carriage returns and only real lines end in "\n"."""
    cmd = [str(VENV_BIN / "hybridflow"), *SMALL, *args, f"logger.output_root={output_root}",
           f"logger.run_name={run_name}"]
    result = subprocess.run(cmd, capture_output=True, timeout=600)
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


def test_a_short_run_prints_a_few_lines_and_keeps_the_library_output_in_its_logs(tmp_path):
    result = hybridflow(["trainer.total_steps=3", "trainer.val_every_steps=2"], tmp_path, "quiet")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # run directory (start, end), validation at steps 2 and 3, the progress line, the summary
    assert result.stdout.count("\n") <= 8, result.stdout
    assert result.stderr == "", result.stderr
    last_draw = result.stdout.split("\n")[-4].split("\r")[-1]  # the progress line as it was left
    assert last_draw.startswith("grpo 3/3 [") and "reward=" in last_draw and "tok/s=" in last_draw, last_draw
    assert "grpo step 2/3: held-out accuracy" in result.stdout
    assert "grpo: 3 steps in" in result.stdout
    logs = tmp_path / "quiet" / "logs"
    assert "Started a local Ray instance" in (logs / "driver.log").read_text()
    for rank in (0, 1):
        worker = (logs / "grpo" / f"global-rank{rank}.log").read_text()
        assert "Initializing a V1 LLM engine" in worker  # vLLM's start-up, from inside the worker process
        # the weight syncs' reloads: the rotary cache and the tied lm_head receive nothing by design
        assert "Failed to load weights" not in worker


@pytest.mark.slow  # ~20 s; a dead worker named with its last output: the default run's rank-kill test
def test_verbose_shows_the_library_output(tmp_path):
    verbose = hybridflow(["trainer.total_steps=1", "logger.verbose=true"], tmp_path, "verbose")
    assert verbose.returncode == 0, verbose.stdout[-4000:] + verbose.stderr[-4000:]
    assert "Initializing a V1 LLM engine" in verbose.stdout + verbose.stderr
    assert not (tmp_path / "verbose" / "logs" / "grpo").exists()
