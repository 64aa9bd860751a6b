"""Environments from the hubs, learning and timed against HybridFlow's own path (issue 85, its last done-when).

Two tasks on the tiny model (random init, character tokenizer), GRPO in one process (`placement=local`,
real vLLM), each side once per seed, hub then own (so over two seeds: hub, own, hub, own):

- `verifiers`: tests/e2e/fixtures/verifiers_arith.py (additions "3+4=", rubric correct + 0.5 * brevity)
  played by verifiers' own harness through the rollout engine's OpenAI-compatible endpoint
  (`rollout.environment=verifiers:...`), against the same prompts as data rows and the same rubric as a
  `reward.fn` (`sum_score` below): HybridFlow's own single-turn path.
- `openenv`: tests/e2e/fixtures/openenv_counting.py's Counting served by openenv-core on loopback
  (`rollout.agent=[openenv:...:Counting]`), against `Counting` below, the same task written for
  HybridFlow's own agent protocol (`rollout.agent=[bench/hub_environments.py:Counting]`).

Held-out reward: `val/reward_mean` (greedy, the run's validation rows) of the hub run at its last step,
and at the start from `recipe=evaluate` on the same seed's untrained tiny model (the tiny model is built
from the seed, so it is the model GRPO starts from). Seconds per step: the median `timing/step_s` of
steps 2.. of each run; overhead = hub / own - 1 (per seed, and on the medians over seeds).

    PYTHONPATH=. .venv/bin/python bench/hub_environments.py --tasks verifiers --seeds 0   # one task, one seed
    PYTHONPATH=. .venv/bin/python bench/hub_environments.py --report-only   # the table from the JSON
    PYTHONPATH=. .venv/bin/python bench/hub_environments.py --dry-run --out /tmp/hub.json   # 2 steps a side, 1 timed, no evaluate
    PYTHONPATH=. .venv/bin/python bench/hub_environments.py --tasks verifiers --model ~/.cache/hybridflow/models/SmolLM2-135M-Instruct.Q4_1

`--model DIR` runs a task on a Hugging Face model directory instead of the tiny model (float32 on both
sides, chat prompts up to 96 tokens): where a step is seconds of the model's, what the adapter adds per
episode is measured against a real step. Its runs are keyed `<task>@<directory name>_seed<seed>`.

Each invocation adds its runs to --out (keyed by task and seed) and rewrites the table in
docs/results/learning.md (not with --dry-run, which writes only --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "e2e" / "fixtures"
DOC = ROOT / "docs" / "results" / "learning.md"
BEGIN, END = "<!-- hub_environments:begin -->", "<!-- hub_environments:end -->"
VERIFIERS_ENV = FIXTURES / "verifiers_arith.py"
VERIFIERS_ARGS = '{agent: {harness: {id: "null"}}}'  # verifiers' plain chat loop
OPENENV_ENV = FIXTURES / "openenv_counting.py"
STOP = "[" + ",".join("abcdefghijklmnopqrstuvwxyz0123456789") + "]"  # a turn ends at its first letter or digit
COMMON = ["placement=local", "recipe=grpo", "trainer.export_hf=false", "rollout.backend=vllm",
          "trainer.max_steps_without_signal=null", "logger.backends=[jsonl]"]


# ---- HybridFlow's own side of each task ------------------------------------------------------------
def sum_score(response: str, ground_truth: str, **_) -> dict:
    """verifiers_arith.py's rubric as a reward function: correct (weight 1) + brevity (weight 0.5) on the
    reply stripped, as verifiers reads `trace.last_reply`."""
    reply = response.strip()
    correct, brevity = float(reply == ground_truth), 1.0 / (1.0 + len(reply))
    return {"score": correct + 0.5 * brevity, "correct": correct, "brevity": brevity}


class Counting:
    """openenv_counting.py's Counting in HybridFlow's own environment protocol (docs/agents.md): the
    same observations ("go:", then "=<digits>;"), the same step reward (the turn's share of digits) and
    the same end (after `turns` steps)."""

    stop = tuple("abcdefghijklmnopqrstuvwxyz0123456789")  # as rollout.openenv.stop for the served one

    def reset(self, turns: int = 2, **_) -> str:
        self.turns, self.steps = int(turns), 0
        return "go:"

    def step(self, response: str) -> tuple[str, float, bool]:
        self.steps += 1
        digits = sum(c.isdigit() for c in response)
        return f"={digits};", digits / max(1, len(response)), self.steps >= self.turns


# ---- the runs ---------------------------------------------------------------------------------------
def verifiers_rows(work: Path) -> tuple[Path, Path, Path, Path]:
    """The taskset's rows as verifiers_env writes them (hub side), and the same prompts with the answer
    as `ground_truth` and no task column (own side)."""
    sys.path.insert(0, str(ROOT))
    from hybridflow.agents.hubs.verifiers_env import main

    hub = work / "verifiers_rows"
    if not (hub / "train.jsonl").exists():
        main([str(VERIFIERS_ENV), str(hub), "--args", '{"agent": {"harness": {"id": "null"}}}', "--val-rows", "8"])
    own = work / "own_rows"
    own.mkdir(exist_ok=True)
    for split in ("train", "val"):
        rows = [json.loads(line) for line in (hub / f"{split}.jsonl").read_text().splitlines()]
        (own / f"{split}.jsonl").write_text("".join(
            json.dumps({"prompt": r["prompt"], "ground_truth": r["verifiers_task"]["answer"], "data_source": "own"})
            + "\n" for r in rows))
    return hub / "train.jsonl", hub / "val.jsonl", own / "train.jsonl", own / "val.jsonl"


def model_args(model: str | None) -> list[str]:
    """The model keys: the tiny model built from the seed (None), or a model directory in float32."""
    if model is None:
        return []
    return ["model=local_hf", f"model.path={Path(model).expanduser()}", "model.dtype=float32", "rollout.dtype=float32"]


def task_args(task: str, side: str, work: Path, dry_run: bool = False, model: str | None = None) -> list[str]:
    """The data, rollout and reward keys of `task` on `side` (hub | own): what evaluate takes too."""
    val_prompts = 2 if dry_run else {"verifiers": 8, "openenv": 16}[task]
    if task == "verifiers":
        hub_train, hub_val, own_train, own_val = verifiers_rows(work)
        train, val = (hub_train, hub_val) if side == "hub" else (own_train, own_val)
        prompt_tokens = 32 if model is None else 96  # a real model's chat template adds its system prompt
        args = ["data=files", f"data.train_path={train}", f"data.val_path={val}", f"data.max_prompt_tokens={prompt_tokens}",
                "rollout.max_response_tokens=16", f"trainer.val_prompts={val_prompts}"]
        if side == "hub":
            return args + [f"rollout.environment=verifiers:{VERIFIERS_ENV}",
                           f"+rollout.environment_args={VERIFIERS_ARGS}", "reward.fn=environment"]
        return args + [f"reward.fn={ROOT / 'bench' / 'hub_environments.py'}:sum_score"]
    agent = f"openenv:{OPENENV_ENV}:Counting" if side == "hub" else f"{ROOT / 'bench' / 'hub_environments.py'}:Counting"
    stop = [f"rollout.openenv.stop={STOP}"] if side == "hub" else []
    return ["data.synthetic.train_rows=200", "data.synthetic.val_rows=16", f"trainer.val_prompts={val_prompts}",
            "rollout.max_response_tokens=24", "rollout.max_turns=2", f"rollout.agent=[{agent}]", *stop,
            f"reward.fn={FIXTURES / 'agent_reward.py'}:score"]


def shape(task: str, dry_run: bool) -> tuple[int, int]:
    """(prompts per step, samples per prompt) of `task`'s GRPO runs."""
    return (1, 2) if dry_run else {"verifiers": (2, 4), "openenv": (4, 4)}[task]


def train_args(task: str, steps: int, val_every: int, dry_run: bool = False) -> list[str]:
    """The GRPO keys, the same on both sides of a task."""
    prompts, samples = shape(task, dry_run)
    return [f"trainer.prompts_per_step={prompts}", f"rollout.samples_per_prompt={samples}",
            f"actor.samples_per_micro_batch={prompts * samples}", f"trainer.total_steps={steps}",
            f"trainer.val_every_steps={val_every}", "actor.optim.lr=1e-3"]


def hybridflow(args: list[str], work: Path, name: str) -> list[dict]:
    """`hybridflow *args` as a process of its own (started with HYBRIDFLOW_WORKER_PYTHON where that is set, as a
    run's Ray workers are: the tests' warm interpreter, tests/warm_workers.py); the run's metrics rows."""
    from hybridflow.controller.runtime import WORKER_PYTHON_ENV

    python = os.environ.get(WORKER_PYTHON_ENV)
    keys = [*args, f"logger.output_root={work}", f"logger.run_name={name}"]
    command = [*([python] if python else []), str(Path(sys.executable).parent / "hybridflow"), *keys]
    print(name + ": " + " ".join(keys), flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def last(values: dict):
    """The value at the last step of a {step: value} dict (its keys are strings once read from JSON)."""
    return values[max(values, key=int)]


def summary(rows: list[dict]) -> dict:
    steps = [r["timing/step_s"] for r in rows if "timing/step_s" in r][1:]  # the first step warms up
    return {"step_s": steps, "median_step_s": statistics.median(steps),
            "val_reward": {r["step"]: r["val/reward_mean"] for r in rows if "val/reward_mean" in r},
            "train_reward": [r["reward/score"] for r in rows if "reward/score" in r],
            "turns_mean": statistics.mean(r["agent/turns_mean"] for r in rows if "agent/turns_mean" in r)
            if any("agent/turns_mean" in r for r in rows) else 1.0}


def chat_program_start_s(repeats: int = 3) -> float:
    """Median wall seconds of a fresh interpreter importing what verifiers' chat program imports (the
    `null` harness runs it as a subprocess per episode, before its first request)."""
    imports = "import openai, httpx, tenacity, certifi, anyio, mcp"
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", imports], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(task: str, seed: int, steps: int, val_every: int, work: Path, dry_run: bool,
            model: str | None = None) -> dict:
    """Start held-out reward (evaluate, hub side; not in a dry run: a process of its own, CI's time), then
    the hub run, then the own run."""
    keys = model_args(model)
    result = {"start_val_reward": None}
    if not dry_run:
        start = hybridflow(["placement=local", "recipe=evaluate", "recipe.eval_samples=1", "logger.backends=[jsonl]",
                            f"seed={seed}", *keys, *task_args(task, "hub", work, dry_run, model)], work,
                           f"{task}_seed{seed}_start")
        result["start_val_reward"] = start[-1]["val/reward_mean"]
    for side in ("hub", "own"):
        rows = hybridflow([*COMMON, f"seed={seed}", *keys, *task_args(task, side, work, dry_run, model),
                           *train_args(task, steps, val_every, dry_run)],
                          work, f"{task}_seed{seed}_{side}")
        result[side] = summary(rows)
    hub = result["hub"]
    result["end_val_reward"] = last(hub["val_reward"])
    result["margin"] = None if dry_run else result["end_val_reward"] - result["start_val_reward"]
    result["overhead"] = hub["median_step_s"] / result["own"]["median_step_s"] - 1
    if task == "verifiers":  # where the hub's time goes: one harness subprocess per episode
        episodes = shape(task, dry_run)[0] * shape(task, dry_run)[1]
        result["episodes_per_step"] = episodes
        result["extra_s_per_episode"] = (hub["median_step_s"] - result["own"]["median_step_s"]) / episodes
        result["chat_program_start_s"] = chat_program_start_s(1 if dry_run else 3)
    return result


# ---- the report ------------------------------------------------------------------------------------
def table(report: dict) -> str:
    lines = ["| task | seed | steps | held-out reward start | end | margin | own end | s/step own | s/step hub | "
             "overhead |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, r in sorted(report["runs"].items()):
        task, seed = key.rsplit("_seed", 1)
        own_end = last(r["own"]["val_reward"])
        start, margin = ("-", "-") if r["start_val_reward"] is None else (f"{r['start_val_reward']:.3f}",
                                                                           f"{r['margin']:+.3f}")
        lines.append(f"| {task} | {seed} | {r['steps']} | {start} | {r['end_val_reward']:.3f} | "
                     f"{margin} | {own_end:.3f} | {r['own']['median_step_s']:.3f} | "
                     f"{r['hub']['median_step_s']:.3f} | {100 * r['overhead']:+.0f}% |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=["verifiers", "openenv"], choices=["verifiers", "openenv"])
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 (--dry-run: 0)")
    p.add_argument("--steps", type=int, default=None, help="default: verifiers 12, openenv 30")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "hub_environments.json"))
    p.add_argument("--dry-run", action="store_true", help="2 steps a side, nothing written but --out")
    p.add_argument("--report-only", action="store_true", help="rewrite the doc's table from --out")
    p.add_argument("--model", default=None, help="a model directory (default: the tiny model built from the seed)")
    args = p.parse_args()
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() and not args.dry_run else {"runs": {}}
    if not args.report_only:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in args.seeds or ([0] if args.dry_run else [0, 1]):
                for task in args.tasks:
                    steps = 2 if args.dry_run else args.steps or {"verifiers": 12, "openenv": 30}[task]
                    val_every = steps if args.dry_run else steps // 2
                    result = measure(task, seed, steps, val_every, Path(tmp), args.dry_run, args.model)
                    label = task if args.model is None else f"{task}@{Path(args.model).name}"
                    report["runs"][f"{label}_seed{seed}"] = {"steps": steps, "date": time.strftime("%Y-%m-%d"), **result}
                    print(f"{task} seed {seed}: held-out {result['start_val_reward']} -> "
                          f"{result['end_val_reward']:.3f}, s/step own {result['own']['median_step_s']:.3f} hub "
                          f"{result['hub']['median_step_s']:.3f} ({100 * result['overhead']:+.0f}%)", flush=True)
    report["dry_run"] = args.dry_run
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    if not args.dry_run:
        sys.path.insert(0, str(ROOT))
        from bench.doc_markers import write_between

        write_between(DOC, BEGIN, END, table(report))


if __name__ == "__main__":
    main()
