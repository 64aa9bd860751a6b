"""What the bench scripts' dry runs share: a composed `hybridflow` command checked against what the
bench sets, so a bench whose overrides stop reaching the config (a key renamed, a placement file
changed) fails its dry run instead of measuring something else; and a stand-in run's metrics.jsonl
for their readers of finished runs."""

from __future__ import annotations

import json
from pathlib import Path


def write_metrics(run_dir: Path, rows: list[dict]) -> Path:
    """`rows` (one per step) as a run writes them: one JSON object a line in run_dir/metrics.jsonl."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def carried(config, override: str) -> bool:
    """Whether the composed `config` holds what `override` sets: `placement=<file>` by whether its plan
    puts the rollout on a pool of its own, a dotted `key=value` by the key's value."""
    from hybridflow.planning.auto import decide_plan

    key, text = override.split("=", 1)
    if key == "placement":
        return decide_plan(config).plan.rollout_colocated == (text != "disaggregated")
    value = config
    for part in key.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    value = getattr(value, "value", value)  # an Enum's
    if isinstance(value, bool):
        return text == str(value).lower()
    return float(text) == value if isinstance(value, (int, float)) else str(value) == text


def check_composed(overrides: list[str], wanted: dict) -> None:
    """`overrides` composed and checked as `hybridflow` checks them; SystemExit unless the config
    carries each dotted key of `wanted` with its value."""
    from functools import reduce

    from hybridflow.run.pipeline_stages import compose_command

    config = compose_command(overrides)
    got = {key: reduce(getattr, key.split("."), config) for key in wanted}
    got = {key: getattr(value, "value", value) for key, value in got.items()}  # an enum's value
    wrong = [f"{key}={got[key]!r}, not {value!r}" for key, value in wanted.items() if got[key] != value]
    if wrong:
        raise SystemExit(f"HybridFlow's composed config does not carry what the bench sets: {'; '.join(wrong)} "
                         f"(overrides: {' '.join(overrides)})")
