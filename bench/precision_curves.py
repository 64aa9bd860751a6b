"""Plot reward per step of GRPO runs (bench/precision_curves.sh) and print a table.

    .venv/bin/python bench/precision_curves.py OUT.png RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a GRPO run directory (its metrics.jsonl); the table gives the reward's mean over
the first and the last 5 steps. No dry run of its own: tests/unit/test_bench_dry_runs_studies.py
composes the driver's three commands and runs this on run directories in their format.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]]
    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        r = rows(run)
        steps = [x["step"] for x in r]
        ax.plot(steps, [x["reward/score"] for x in r], marker="o", markersize=3, label=run.name)
        gap_ax.semilogy(steps, [max(x["rollout/log_prob_diff"], 1e-9) for x in r], label=run.name)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        first, last = r[:5], r[-5:]
        print(f"{run.name}: reward steps {first[0]['step']}-{first[-1]['step']} "
              f"{mean([x['reward/score'] for x in first]):.3f}, steps {last[0]['step']}-{last[-1]['step']} "
              f"{mean([x['reward/score'] for x in last]):.3f}; rollout/log_prob_diff step {r[0]['step']} "
              f"{r[0]['rollout/log_prob_diff']:.2g}, median {sorted(x['rollout/log_prob_diff'] for x in r)[len(r) // 2]:.2g}; "
              f"probe gap max {max(x.get('weight_sync/probe_log_prob_gap', 0) for x in r):.2g}")
    ax.set(xlabel="step", ylabel="reward/score (share of digits)", title="GRPO on the tiny model")
    gap_ax.set(xlabel="step", ylabel="rollout/log_prob_diff", title="sampler vs actor")
    ax.legend()
    gap_ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
