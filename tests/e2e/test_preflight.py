"""Bad inputs are refused before anything starts: one `hybridflow` command per row of the table,
each exiting with status 2, naming the file or key, the row, the column, the value's type, creating no
run directory (so no model was built) and never starting Ray. How long a refusal takes is a speed
claim: bench/refusal_seconds.py measures it (docs/results/performance.md "Refusals"), no test times it.

The table's commands run through the entry point one after another in one process
(tests/e2e/cli_in_one_process.py: the same code path, without a fresh interpreter's imports per
command); the last test runs the `hybridflow` command itself, in a process of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

VENV_BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["trainer.prompts_per_step=4", "trainer.val_prompts=4", "data.max_prompt_tokens=32"]


def rows(count: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "ground_truth": str(i + 1), "data_source": "a"} for i in range(count)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir) -> Path:
    """Every bad input of the table, written once: data files, model directories, reward files."""
    from hybridflow.data import write_rows

    root = tmp_path_factory.mktemp("bad_inputs")
    write_rows(rows(40), root / "good.parquet")
    write_rows(rows(8), root / "eight.parquet")
    write_rows([{"prompt": i, "ground_truth": "1"} for i in range(40)], root / "numbers.parquet")
    gaps = rows(40)
    gaps[2]["ground_truth"] = gaps[5]["ground_truth"] = None
    write_rows(gaps, root / "gaps.jsonl")
    write_rows([{"prompt": [{"role": "user", "text": "1+1="}], "ground_truth": "2"}] * 8, root / "bad_chat.parquet")
    write_rows([{"prompt": [{"role": "user", "content": f"{i}+1="}], "ground_truth": str(i + 1)} for i in range(8)],
               root / "chat.parquet")
    write_rows([{"question": "1+1=", "ground_truth": "2"}] * 8, root / "no_prompt.jsonl")
    long_answer = rows(40)
    long_answer[3]["ground_truth"] = "123456789012"  # 12 characters + EOS: 13 tokens
    write_rows(long_answer, root / "long_answer.jsonl")
    past_sample = rows(1010)  # over-long prompts after the first 1,000 rows, which the check samples
    past_sample[1003]["prompt"] = past_sample[1007]["prompt"] = "1+" * 30 + "1="
    write_rows(past_sample, root / "long_after_1000.parquet")
    (root / "broken.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": \n')
    (root / "empty.jsonl").write_text("")
    (root / "needs_answer.py").write_text("def score(response, answer):\n    return float(response == answer)\n")
    (root / "syntax_error.py").write_text("def score(response:\n    return 1.0\n")
    (root / "positional.py").write_text("def score(response, /):\n    return 1.0\n")
    for name, breaks in MODEL_BREAKS.items():
        shutil.copytree(tiny_model_dir, root / name)
        breaks(root / name)
    return root


MODEL_BREAKS: dict[str, Callable[[Path], None]] = {
    "no_weights": lambda d: (d / "model.safetensors").unlink(),
    "no_tokenizer": lambda d: (d / "tokenizer.json").unlink(),
    "bad_config": lambda d: (d / "config.json").write_text('{"model_type": "qwen2",'),
    "truncated_weights": lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 4),
    "no_chat_template": lambda d: (d / "chat_template.jinja").unlink(),
}


def files(train: str, val: str = "good.parquet") -> Callable[[Path], list[str]]:
    return lambda root: ["recipe=grpo", "data=files", f"data.train_path={root / train}",
                         f"data.val_path={root / val}", *SMALL]


def model(name: str, *extra: str) -> Callable[[Path], list[str]]:
    return lambda root: ["recipe=grpo", f"model.path={root / name}", *SMALL, *extra]


def reward(file: str) -> Callable[[Path], list[str]]:
    return lambda root: [*files("good.parquet")(root), f"reward.fn={root / file}:score"]


# id -> (overrides, the names the error must contain; "{root}" is the inputs folder)
CASES = {
    "prompt holds numbers": (files("numbers.parquet"), [
        "{root}/numbers.parquet (data.train_path)", "column 'prompt'", "row(s) 0, 1, 2, 3, 4 and 35 more",
        "holds int 0", "fix: write the prompt as text"]),
    "fewer rows than one step": (lambda root: [*files("eight.parquet")(root), "trainer.prompts_per_step=16"], [
        "{root}/eight.parquet (data.train_path) has 8 rows, fewer than trainer.prompts_per_step=16"]),
    "fewer validation rows than val_prompts": (lambda root: [*files("good.parquet", "eight.parquet")(root),
                                                             "trainer.val_prompts=20"], [
        "{root}/eight.parquet (data.val_path) has 8 rows, fewer than trainer.val_prompts=20",
        "lower trainer.val_prompts to at most 8"]),
    "ground truth missing in some rows": (files("gaps.jsonl"), [
        "{root}/gaps.jsonl (data.train_path)", "column 'ground_truth', row(s) 2, 5: no value (row 2: null)",
        "reward function 'exact_match' (reward.fn) requires the argument 'ground_truth'"]),
    "chat message without content": (files("bad_chat.parquet"), [
        "{root}/bad_chat.parquet (data.train_path)", "column 'prompt', row(s) 0, 1, 2, 3, 4 and 3 more",
        "has no text content"]),
    "no prompt column": (files("no_prompt.jsonl"), [
        "{root}/no_prompt.jsonl (data.train_path): no column 'prompt' (columns: ['question', 'ground_truth'])"]),
    "broken JSON line": (files("broken.jsonl"), ["{root}/broken.jsonl:2: not valid JSON"]),
    "empty file": (files("empty.jsonl"), ["{root}/empty.jsonl (data.train_path) has no rows"]),
    "missing data file": (files("nowhere.parquet"), ["data file {root}/nowhere.parquet does not exist"]),
    "prompt longer than max_prompt_tokens": (lambda root: [
        "recipe=grpo", "data=files", f"data.train_path={root / 'good.parquet'}",
        f"data.val_path={root / 'good.parquet'}",
        "trainer.prompts_per_step=4", "trainer.val_prompts=4", "data.max_prompt_tokens=3"], [
        "{root}/good.parquet (data.train_path), column 'prompt', row(s) 0, 1, 2, 3, 4 and 35 more: row 0 has 4 tokens, "
        "more than data.max_prompt_tokens=3; fix: raise data.max_prompt_tokens to 5"]),
    "model without weights": (model("no_weights"), ["model.path='{root}/no_weights'", "no weights"]),
    "model without tokenizer": (model("no_tokenizer"), ["model.path='{root}/no_tokenizer'", "no tokenizer files"]),
    "model config not JSON": (model("bad_config"), ["{root}/bad_config/config.json (model.path): not valid JSON"]),
    "truncated weights": (model("truncated_weights"), [
        "{root}/truncated_weights/model.safetensors (model.path)", "not a complete safetensors file"]),
    "chat prompts, no chat template": (lambda root: [*model("no_chat_template")(root), "data=files",
                                                     f"data.train_path={root / 'chat.parquet'}",
                                                     f"data.val_path={root / 'chat.parquet'}"], [
        "{root}/chat.parquet (data.train_path), column 'prompt', row 0: a list of chat messages",
        "model.path='{root}/no_chat_template' has no chat template"]),
    "reward argument the data lacks": (reward("needs_answer.py"), [
        "{root}/good.parquet (data.train_path): no column 'answer'", "'{root}/needs_answer.py:score' (reward.fn)"]),
    "reward file does not parse": (reward("syntax_error.py"), [
        "cannot load reward function reward.fn='{root}/syntax_error.py:score': SyntaxError"]),
    "reward with positional-only parameters": (reward("positional.py"), [
        "'{root}/positional.py:score' (reward.fn) has positional-only parameters ['response']"]),
    "SFT answer longer than max_response_tokens": (lambda root: [
        *files("long_answer.jsonl")(root), "recipe=sft", "rollout.max_response_tokens=8"], [
        "{root}/long_answer.jsonl (data.train_path), column 'ground_truth', row(s) 3: the SFT target of row 3 needs "
        "13 tokens with EOS, more than rollout.max_response_tokens=8; fix: raise rollout.max_response_tokens to 13"]),
    "config: unknown prompt truncation": (lambda root: ["recipe=grpo", "data.prompt_truncation=right"], [
        "data.prompt_truncation='right'", "one of ['error', 'left', 'filter']"]),
    "config: validation larger than the synthetic set": (lambda root: ["recipe=sft", "trainer.val_prompts=300"], [
        "trainer.val_prompts=300 is more than data.synthetic.val_rows=200"]),
    "pipeline whose first stage has no weights": (lambda root: [f"model.path={root / 'no_weights'}"], [
        "pipeline.stages[0] (sft): model.path='{root}/no_weights'", "no weights"]),
    # Ray itself retries a dead head for ever (a stale RAY_ADDRESS after `ray stop` waited past two minutes)
    "ray.address where no Ray head answers": (lambda root: ["recipe=grpo", "ray.address=127.0.0.1:9"], [
        "ray.address='127.0.0.1:9': no Ray head answers at 127.0.0.1:9", "ray start --head"]),
}


@pytest.fixture(scope="module")
def refusals(inputs, tmp_path_factory) -> tuple[Path, dict]:
    """Every case of the table run through the entry point (see the module docstring), each with an
    output root of its own: (the folder holding the output roots, results by case)."""
    roots = tmp_path_factory.mktemp("refusal_runs")
    argvs = {case: [*overrides(inputs), f"logger.output_root={roots / str(i)}"]
             for i, (case, (overrides, _)) in enumerate(CASES.items())}
    done = subprocess.run([sys.executable, "-m", "tests.e2e.cli_in_one_process", json.dumps(argvs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return roots, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_before_anything_starts(inputs, refusals, case):
    roots, results = refusals
    _, names = CASES[case]
    result = results[case]
    assert result["returncode"] == 2, result["stdout"][-3000:] + result["stderr"][-3000:]
    for name in names:
        assert name.format(root=inputs) in result["stderr"], f"{name!r} not in:\n{result['stderr']}"
    output_root = roots / str(list(CASES).index(case))
    assert not output_root.exists() and "run directory" not in result["stdout"]  # nothing was started
    assert not result["ray_started"]


def test_long_prompt_after_the_sampled_rows_is_refused_before_ray_starts(inputs, tmp_path):
    """The check reads the first 1,000 rows; every row's prompt is measured as the data is loaded,
    still before Ray starts: the run stops with status 2 naming the rows, and no worker ran."""
    output_root = tmp_path / "runs"
    cmd = [str(VENV_BIN / "hybridflow"), *files("long_after_1000.parquet")(inputs), f"logger.output_root={output_root}",
           "logger.run_name=long"]
    ray_tmp = tmp_path / "ray_tmp"  # where a Ray started by this command would write its session
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_TMPDIR": str(ray_tmp)})
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert not ray_tmp.exists(), "Ray was started"
    assert "checked the first 1000 of 1010 rows" in result.stdout
    assert (f"data file {inputs / 'long_after_1000.parquet'} (data.train_path), column 'prompt', row(s) 1003, 1007: "
            "row 1003 has 62 tokens, more than data.max_prompt_tokens=32") in result.stderr, result.stderr
    assert "data.prompt_truncation=left" in result.stderr
    logs = output_root / "long" / "logs"
    assert not (output_root / "long" / "metrics.jsonl").exists()
    assert not [p for p in logs.iterdir() if p.is_dir()], "a worker process was started"  # logs/<stage>/ per worker


def test_a_worker_python_this_node_cannot_run_stops_the_run_before_ray_starts(tmp_path):
    """A HYBRIDFLOW_WORKER_PYTHON the driver's node cannot run (Ray's py_executable for every worker) stops
    the run naming the variable, before Ray starts: otherwise each worker waits out Ray's registration."""
    ray_tmp = tmp_path / "ray_tmp"  # where a Ray started by this command would write its session
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(ray_tmp), HYBRIDFLOW_WORKER_PYTHON=str(tmp_path / "no-such-python"))
    result = subprocess.run([str(VENV_BIN / "hybridflow"), "recipe=grpo", "trainer.total_steps=1",
                             f"logger.output_root={tmp_path / 'runs'}", "logger.run_name=bad_python"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode != 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "HYBRIDFLOW_WORKER_PYTHON=" in result.stdout + result.stderr
    assert "is not an executable on this node" in result.stdout + result.stderr
    assert not ray_tmp.exists(), "Ray was started"
