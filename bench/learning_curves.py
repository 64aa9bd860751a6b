"""Plot held-out accuracy curves from runs' own metrics.jsonl files.

    .venv/bin/python bench/learning_curves.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Each RUN_DIR is a recipe's run directory; its `val/accuracy` entries are plotted against
wall-clock minutes (from the `timing/*` stage seconds) and printed as a table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, minutes since start, val/accuracy) for each validation of the run."""
    minutes, points = 0.0, []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        minutes += sum(v for k, v in row.items() if k.startswith("timing/") and k.endswith("_s")) / 60
        if "val/accuracy" in row:
            points.append((row["step"], minutes, row["val/accuracy"]))
    return points


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = Path(sys.argv[1]), [a.split("=", 1) for a in sys.argv[2:]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, run_dir in runs:
        points = curve(Path(run_dir))
        ax.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=label)
        print(f"{label}: " + ", ".join(f"step {s} ({m:.1f} min): {a:.3f}" for s, m, a in points))
    ax.set_xlabel("step")
    ax.set_ylabel("held-out exact-match accuracy (greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main()
