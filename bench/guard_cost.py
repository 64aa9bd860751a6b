"""What the silent-failure guards cost a GRPO step (issue 87; docs/reliability.md "Runs that train silently wrong").

Times, on a batch of the default GRPO step's shape (16 prompts x 8 samples, 8 response tokens), each
per-step call the guards add to the driver: the no-signal guard (`SignalGuard.observe`/`enforce`, and the
reward's spread `reward/score_std` it reads), the environment-failure guard (`EnvFailureGuard.check` and
the agent metrics it reads, on an agent batch), the record of the trained prompts (one line of
trained_prompts.jsonl), the SFT batch's EOS check, and the truncated-sampling refusal (once, at
compose). Then runs the default `recipe=grpo` on the tiny model in one process for `--steps` steps and
reports the guards' seconds per step against the median `timing/step_s`.

    PYTHONPATH=. .venv/bin/python bench/guard_cost.py --out bench/results/guard_cost.json
    PYTHONPATH=. .venv/bin/python bench/guard_cost.py --dry-run --out /tmp/guard_cost.json   # no run, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS, SAMPLES, RESPONSE_TOKENS = 16, 8, 8


def seconds(fn, repeats: int) -> float:
    """The median wall seconds of `fn()` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def guard_seconds(repeats: int, work: Path) -> dict[str, float]:
    from hybridflow.agents.failures import EnvFailureGuard
    from hybridflow.agents.trajectory import agent_metrics
    from hybridflow.batch import Batch
    from hybridflow.config import compose
    from hybridflow.data.eos import check_eos_trained
    from hybridflow.rewards import reward_metrics
    from hybridflow.output.tracking import MetricsLogger
    from hybridflow.training.signal import SignalGuard

    batch = PROMPTS * SAMPLES
    scores = torch.rand(batch)
    response_ids = torch.randint(3, 100, (batch, RESPONSE_TOKENS))
    response_ids[:, -1] = 2
    mask = torch.ones(batch, RESPONSE_TOKENS, dtype=torch.bool)
    agent = Batch(tensors={"agent_turns": torch.full((batch,), 2.0), "agent_tool_errors": torch.zeros(batch),
                           "agent_truncated": torch.zeros(batch), "agent_env_steps": torch.full((batch,), 2.0),
                           "agent_env_failures": torch.zeros(batch), "response_mask": mask, "loss_mask": mask},
                  objects={"agent_failure": [""] * batch})
    signal, environments = SignalGuard(5, "reward.fn=exact_match"), EnvFailureGuard(0.1)
    logger = MetricsLogger(work, ["jsonl"])
    index = list(range(PROMPTS))

    def no_signal():
        metrics = reward_metrics({"sequence_rewards": scores}) | {"advantages/zero_std_fraction": 0.25}
        signal.observe(metrics)
        signal.enforce(metrics)

    def env_failures():
        environments.check(1, agent, agent_metrics(agent))

    return {"no_signal_s": seconds(no_signal, repeats), "env_failures_s": seconds(env_failures, repeats),
            "trained_prompts_s": seconds(lambda: logger.log_prompts(1, index), repeats),
            "sft_eos_s": seconds(lambda: check_eos_trained(response_ids, mask, 2, "bench"), repeats),
            "truncated_sampling_at_compose_s": seconds(lambda: compose(["recipe=grpo"]), max(1, repeats // 100))}


def step_seconds(steps: int, work: Path) -> list[float]:
    """`timing/step_s` of each step of the default GRPO recipe on the tiny model, one process."""
    command = [str(Path(sys.executable).parent / "hybridflow"), "recipe=grpo", "placement=local",
               f"trainer.total_steps={steps}", "trainer.val_every_steps=0", "trainer.export_hf=false",
               f"logger.output_root={work}", "logger.run_name=grpo", "logger.backends=[jsonl]"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    rows = [json.loads(line) for line in (work / "grpo" / "metrics.jsonl").read_text().splitlines()]
    return [row["timing/step_s"] for row in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=1000)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "guard_cost.json"))
    p.add_argument("--dry-run", action="store_true", help="time the guards 3 times each; run no step")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        guards = guard_seconds(3 if args.dry_run else args.repeats, work)
        report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "guards_s": guards,
                  "shape": f"{PROMPTS} prompts x {SAMPLES} samples x {RESPONSE_TOKENS} tokens", "dry_run": args.dry_run}
        per_step = sum(v for k, v in guards.items() if not k.endswith("_at_compose_s"))
        report["guards_per_step_s"] = per_step
        if not args.dry_run:
            steps = step_seconds(args.steps, work)[1:]  # the first step warms up
            report["step_s"], report["median_step_s"] = steps, statistics.median(steps)
            report["share_of_step"] = per_step / report["median_step_s"]
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
