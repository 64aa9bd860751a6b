"""docs/config.md is the schema's reference, up to date; every key has a meaning; every metric
name the code writes is in docs/recipes.md's metrics table."""

from __future__ import annotations

import re
from pathlib import Path

from hybridflow.config.reference import render, rows

ROOT = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_generated_from_the_schema():
    assert (ROOT / "docs" / "config.md").read_text() == render(), (
        "docs/config.md is out of date: PYTHONPATH=. .venv/bin/python -m hybridflow.config.reference > docs/config.md")


def test_every_key_has_a_type_default_and_meaning():
    table = rows()
    keys = {r.key for r in table}
    assert {"actor.lora.rank", "model.trust_remote_code", "actor.entropy_coef", "rollout.top_p", "rollout.enforce_eager",
            "rollout.dtype", "trainer.use_sampler_log_probs", "critic.value_clip_range", "placement.collective_timeout_s",
            "ray.address", "data.synthetic.train_rows", "model.tiny.hidden_size", "algorithm.gamma",
            "algorithm.lam"} <= keys
    assert [r.key for r in table if not r.meaning] == []


def test_every_metric_the_code_writes_is_in_the_metrics_table():
    doc = (ROOT / "docs" / "recipes.md").read_text()
    table = doc[doc.index("## Metrics"):]
    table = table[:table.index("\n## ")]
    documented = set(re.findall(r"`([a-z_]+/[a-z_@<>/]+)`", table))
    prefixes = {d.split("<")[0] for d in documented if "<" in d}
    written = set()
    for path in [*(ROOT / "recipes").glob("*.py"), *(ROOT / "hybridflow").rglob("*.py"), *(ROOT / "workers").rglob("*.py")]:
        text = path.read_text()
        written |= set(re.findall(r"\"((?:actor|critic|kl|reward|response|rollout|weight_sync|perf|val|advantages|hooks|"
                                  r"spike_recovery|lr_burst|agent|trainer|demo|time)/[a-z_]+)\"", text))
    assert len(written) > 30  # the scan finds the metric names
    missing = sorted(m for m in written if m not in documented and not any(m.startswith(p) for p in prefixes))
    assert missing == [], f"metrics written but not in docs/recipes.md's table: {missing}"
