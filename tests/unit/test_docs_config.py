"""docs/config.md is the schema's reference, up to date; every key has a meaning; docs/recipes.md's
metrics table lists exactly the metric names the code writes.

`written_metrics` (tests/metric_names.py) reads the syntax trees (never the text) of recipes/,
hybridflow/ and workers/ and returns every name the code can write into a metrics row. The rule:

- Namespaced names (`ns/...`): every string or f-string used as a key where a dict is built (a
  key of a dict display or comprehension, a subscript assignment target `out["x/y"] = ...`,
  `d.setdefault("x/y", ...)`) whose text starts with a literal lower-case namespace and `/` and
  holds no space. Keys that are not metrics fail that shape: batch columns built from a constant
  (`f"{FALLBACK_KEY}/{cause}"`, `EXTRA_PREFIX + name`: the namespace is not literal), label
  text. A dict display whose values are all string literals is a table of names (the console's
  short labels), not a row. Reads (`metrics["x/y"]` as a value) are not writes; a keyword
  (`dict(x=...)`, `.update(x=...)`) cannot hold a `/`.
- Formatted parts: a `{k}` that is the key of a loop or comprehension over a dict
  (`{f"critic/{k}": v for k, v in totals.items()}`) becomes each key that dict can hold, followed
  through assignments, subscript stores, `.update` and `.setdefault`, what the functions called
  return (`a, stats = f(...)`: f's returned tuple at that position) and registries
  (`REG.get(name)(...)`: every function registered in REG); so `critic/{k}` is
  `critic/value_loss`, ..., `critic/grad_norm`. A `{p}` that is a parameter becomes the string
  literals its callers pass and its default (`agent_metrics(..., prefix="val/agent/")`). A part
  the scan cannot follow stays a placeholder named for the loop's key or the expression
  (`memory/<name>_peak_gib`, `timing/<stage>_s`). The order of statements is not followed: a
  name assigned twice in one function holds the keys of both dicts (more names, never fewer).
- Bare names (no `/`): the stats dict a function of hybridflow/algos returns (STYLE.md 2: the
  value plus a dict of stats), where a caller outside hybridflow/algos passes it on with its keys
  unchanged: returns it (followed up through the callers), merges it (`.update`, `**`,
  `dict()`), copies it key by key (the actor's loop adds each of `PolicyObjective.loss`'s stats into
  its mini-batch's), or hands it to a call or a caller the scan cannot follow: `policy_loss`, ...,
  `kl_loss`. Stats a caller
  prefixes (`advantages/`, `critic/`, `async/`), only reads (`kl_stats["kl"]`, written as
  `kl/token_mean`) or drops (`bonus, _ = entropy_bonus(...)`) are not names of their own.

The table (`metrics_table`): the backticked names in the first cell of each row. A concrete name
the code writes must be one of them, or a placeholder row's name with one of the identifiers
that row lists in backticks put in its placeholder (`timing/<stage>_s` lists `generate`, ...); a
name written with a placeholder needs a row of the same shape (`memory/<pool>_peak_gib`). The
other way, each name in the table must be written: of the same shape as a written name, or
matched by a written placeholder (`reward/<extra>`, whose extras are the reward functions' own
keys, writes `reward/accuracy`), or matching a written name.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.config.reference import render, rows
from tests.metric_names import metrics_table, repo_metrics, repo_sources, undocumented, unwritten, written_metrics

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


# ---- the metrics table ------------------------------------------------------------------------------


def test_every_metric_the_code_writes_is_in_the_metrics_table():
    written = repo_metrics()
    assert {"actor/loss", "critic/value_loss", "critic/grad_norm", "advantages/baseline_mean", "rollout_mismatch/k3_kl",
            "async/staleness_mean", "timing/overlap_fraction", "agent/turns_mean", "val/agent/turns_mean", "kl_loss",
            "policy_loss", "memory/<name>_peak_gib", "timing/<stage>_s"} <= set(written)
    assert not {"kl", "kl_per_sequence", "entropy", "value_loss", "score_mean", "is_weight_mean"} & set(written)
    missing = undocumented(written, metrics_table((ROOT / "docs" / "recipes.md").read_text()))
    assert missing == [], f"metrics written but not in docs/recipes.md's metrics table: {missing}"


def test_every_name_in_the_metrics_table_is_written_by_the_code():
    table = metrics_table((ROOT / "docs" / "recipes.md").read_text())
    assert {"reward/<name>/score", "policy_loss", "critic/value_loss", "timing/<stage>_s"} <= set(table)
    assert unwritten(repo_metrics(), table) == [], "names in docs/recipes.md's metrics table that nothing writes"


PLANTED_MATH = '''
def planted_loss():
    return 0.0, {"planted_bare": 1.0}


def planted_stats():
    return 0.0, {"planted_stat": 2.0}
'''

PLANTED = '''
from hybridflow.algos.planted import planted_loss, planted_stats

LABELS = {"planted/label": "a table of names, not a row"}


def step_row(seen):
    row = {"planted/display": 3.0}
    row["planted/subscript"] = seen["planted/read"]
    row.update({f"critic/{k}": v for k, v in {"planted_prefixed": 4.0}.items()})
    _, prefixed = planted_stats()
    row.update({f"advantages/{k}": v for k, v in prefixed.items()})
    loss, stats = planted_loss()
    return row, stats
'''


def test_a_metric_the_table_lacks_is_reported():
    """Each way of writing a name, planted among the real sources, is found and reported; the
    label, the read and the stats written with a prefix are not names of their own."""
    written = written_metrics({**repo_sources(), "hybridflow/algos/planted.py": PLANTED_MATH,
                               "recipes/planted.py": PLANTED})
    planted = {"planted/display": "recipes/planted.py:8", "planted/subscript": "recipes/planted.py:9",
               "critic/planted_prefixed": "recipes/planted.py:10", "advantages/planted_stat": "recipes/planted.py:12",
               "planted_bare": "recipes/planted.py:13"}
    assert written == {**repo_metrics(), **planted}
    table = metrics_table((ROOT / "docs" / "recipes.md").read_text())
    assert undocumented(written, table) == [f"{n} ({w})" for n, w in sorted(planted.items())]


def test_a_table_row_nothing_writes_is_reported():
    doc = (ROOT / "docs" / "recipes.md").read_text()
    at = doc.index("| `reward/score`")
    planted = doc[:at] + "| `critic/planted_loss`, `planted/<x>_s` | ppo | nothing writes these |\n" + doc[at:]
    assert unwritten(repo_metrics(), metrics_table(planted)) == ["critic/planted_loss", "planted/<x>_s"]
