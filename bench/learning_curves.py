"""Plot held-out accuracy curves from runs' own metrics.jsonl files.

    .venv/bin/python bench/learning_curves.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...] [--start ACC]

Each RUN_DIR is a recipe's run directory; its `val/accuracy` entries are printed as a table
and plotted against wall-clock minutes since the run's step loop started (`time/elapsed_s`,
validation included). A label starting with "sft" goes on the left panel, the others (RL runs)
on the right. `--start ACC` draws the RL runs' starting accuracy as a dashed line.
No dry run of its own: tests/unit/test_bench_dry_runs_studies.py runs it on run directories
written in the recipes' format.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, minutes since the step loop started, val/accuracy) for each validation of the run."""
    points = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "val/accuracy" in row:
            points.append((row["step"], row["time/elapsed_s"] / 60, row["val/accuracy"]))
    return points


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args = sys.argv[2:]
    start = None
    if "--start" in args:
        at = args.index("--start")
        start = float(args[at + 1])
        del args[at:at + 2]
    out, runs = Path(sys.argv[1]), [a.split("=", 1) for a in args]
    fig, (sft_ax, rl_ax) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for label, run_dir in runs:
        points = curve(Path(run_dir))
        ax = sft_ax if label.startswith("sft") else rl_ax
        ax.plot([p[1] for p in points], [p[2] for p in points], marker="o", markersize=3, label=label)
        print(f"{label}: " + ", ".join(f"step {s} ({m:.1f} min): {a:.3f}" for s, m, a in points))
    if start is not None:
        rl_ax.axhline(start, color="grey", linestyle="--", label=f"SFT start ({start:.3f})")
    sft_ax.set_title("SFT")
    rl_ax.set_title("RL from the SFT model")
    for ax in (sft_ax, rl_ax):
        ax.set_xlabel("minutes (wall clock, validation included)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    sft_ax.set_ylabel("held-out exact-match accuracy (greedy)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main()
