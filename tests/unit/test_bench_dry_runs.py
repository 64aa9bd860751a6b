"""Bench scripts' dry runs: each runs its real code path at the smallest shape, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(script: str, out: Path, timeout_s: int = 300) -> dict:
    """`bench/<script> --dry-run --out <out>` run to the end; its JSON report."""
    done = subprocess.run([sys.executable, f"bench/{script}", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_sft_step_bench_times_the_actor_and_the_plain_loop(tmp_path):
    report = _dry_run("sft_step.py", tmp_path / "sft_step.json")
    assert report["actor_sft_step_s"] > 0 and report["plain_loop_step_s"] > 0
    assert report["ratio"] == report["actor_sft_step_s"] / report["plain_loop_step_s"]
    assert report["last_loss"] < report["first_loss"]  # both sides train: the actor's loss falls
    assert report["cpu"] and report["rows_per_step"] == 8
    assert report["save_every"] == 1 and report["actor_sft_step_s_after_first_save"] > 0  # timed after a checkpoint
    assert report["actor_after_over_before_first_save"] > 0


def test_the_packed_sequences_bench_times_both_paths_and_compares_their_log_probs(tmp_path):
    report = _dry_run("packed_sequences.py", tmp_path / "packed.json")
    assert report["padded_update_s"] > 0 and report["packed_update_s"] > 0
    assert report["speedup_update_s"] == report["padded_update_s"] / report["packed_update_s"]
    assert report["real_token_fraction"] < 1 and report["max_log_prob_gap"] < 1e-4  # float32: the same log-probs


def test_the_optimizer_step_bench_times_the_actors_fused_adamw_beside_its_cpu_default(tmp_path):
    """bench/optimizer_step.py --dry-run: the actor's optimizer (build_optimizer) with optim.fused=true is PyTorch's
    fused AdamW on the CPU and with optim.fused null (the default) is not, timed over the same parameters and
    gradients, both moving the weights alike."""
    report = _dry_run("optimizer_step.py", tmp_path / "optimizer.json")
    assert report["dry_run"] and report["fused_is_fused"] and not report["default_is_fused"]
    assert report["fused_step_s"] > 0 and report["ratio"] == report["fused_step_s"] / report["default_step_s"]
    assert report["largest_move"] > 1e-3 and report["largest_gap"] < 1e-6  # the same update, to float32's rounding


def test_the_gpu_check_runs_on_the_cpu_without_ray_or_vllm(tmp_path):
    """bench/gpu_check.py's every part at the tiny shapes on the CPU, with Ray and vLLM unimportable (the lent
    GPU machines have neither): each in order, each passing, its results in the output folder as JSON and a
    log (no weights); the parts listed with their expected seconds within the 8-minute budget."""
    out = tmp_path / "out"
    code = ("import runpy, sys; sys.modules['ray'] = sys.modules['vllm'] = None; "
            f"sys.argv = ['gpu_check.py', '--dry-run', '--out', {str(out)!r}]; "
            "runpy.run_path('bench/gpu_check.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]  # never weights
    report = json.loads((out / "gpu_check.json").read_text())
    parts = ["grpo_hf_level2", "resume", "pipeline", "level1_and_exact", "grpo_0.5b", "engine_checks", "handover_0.5b",
             "speed_0.5b"]
    assert list(report["parts"]) == parts and sum(p["expected_s"] for p in report["parts"].values()) <= 8 * 60
    assert report["passed"] == parts, {p: report[p].get("error") or report[p].get("skipped") for p in parts}
    level2 = report["grpo_hf_level2"]  # every sync's weights checked tensor by tensor after a level-2 sleep
    assert [s["step"] for s in level2["steps"]] == [1, 2, 3]
    assert all(s["weight_sync/verified_tensors"] > 0 for s in level2["steps"])
    assert [s["step"] for s in report["resume"]["steps"]] == [4]  # resumed from step 3's checkpoint
    assert report["pipeline"]["stages"]["01-grpo"]["final_accuracy"] is not None
    phases = report["grpo_0.5b"]["phases"]  # the hf engine's phases of the GPU memory model
    assert list(phases) == ["training", "start", "weight sync", "generation"]
    assert any(k.startswith("hf engine KV cache") for k in phases["generation"]["terms_gib"])
    engine = report["engine_checks"]
    assert engine["training"]["first_param_changed"] and engine["reference_and_critic"]["critic_values_changed"]
    assert engine["offload"]["log_probs_equal_after_reload"]
    assert [s["tensors_mismatched"] for s in engine["sync"]] == [[]] * 4
    attention = engine["packed_attention"]  # the packed kernel against a dense block-diagonal mask
    assert attention["kernel"] == "padded layout"  # no flash kernel on the CPU; bfloat16 tolerances (the dry run's dtype)
    assert attention["max_output_gap"] < 0.02 * attention["output_scale"] and attention["max_grad_gap"] < 0.02 * attention["grad_scale"]
    handover = report["handover_0.5b"]["handover"]  # the transport's own sequence with the stand-in engine
    assert list(handover["phases"]) == ["training", "start", "weight sync", "generation"]
    # the engine's share of the 80 GiB, and the process's CUDA context (an estimate, memory_budget.CUDA_CONTEXT_BYTES)
    assert handover["phases"]["start"]["floor_gib"] == handover["phases"]["generation"]["floor_gib"] == 0.4 * 80 + 0.5
    speed = report["speed_0.5b"]["speed"]
    for side in ("ours", "ours_packed", "plain"):
        assert speed[side]["log_prob_pass_s"] > 0 and speed[side]["update_s"] > 0
    assert (speed["ours"]["packed_sequences"], speed["ours_packed"]["packed_sequences"]) == (False, True)
    assert speed["packed_vs_padded_mean_log_prob_gap"] < 0.02  # bfloat16's rounding, not other tokens
    assert speed["ratio_update_s"] == speed["ours"]["update_s"] / speed["plain"]["update_s"]


def test_the_pipeline_seeds_bench_composes_every_seeds_command(tmp_path):
    """bench/pipeline_seeds.py --dry-run: each seed's command composed and checked as `hybridflow`
    checks it, the seed reaching every stage (its table from a finished run: tests/e2e/test_pipeline.py),
    and `--kernels avx2` reaching torch: its CPU kernels limited to AVX2 on whatever CPU this is."""
    done = subprocess.run([sys.executable, "bench/pipeline_seeds.py", "--dry-run", "--seeds", "0", "3", "--kernels", "avx2",
                           "--root", str(tmp_path), "stages.sft.trainer.total_steps=7"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "kernels: avx2 (torch: AVX2)"
    assert [line.split(":")[0] for line in lines[1:]] == ["seed 0", "seed 3"]
    assert "seed=3 model.tiny.seed=3" in lines[2] and "(2 stages: sft, grpo)" in lines[2]


def test_the_dpo_bench_builds_trl_format_pairs_and_a_command_hybridflow_accepts(tmp_path):
    """bench/dpo_vs_trl.py --dry-run: the preference files in TRL's conversational form (the right
    number chosen, a near miss rejected), the pairs in the loader's order for TRL, and HybridFlow's
    command composed and checked (recipe=dpo with a reference)."""
    done = subprocess.run([sys.executable, "bench/dpo_vs_trl.py", "--dry-run", "--work", str(tmp_path),
                           "--out", str(tmp_path / "dry.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "dry.json").read_text())
    assert report["recipe"] == "dpo" and report["needs_reference"]
    assert report["train_pairs"] == 64 and report["ordered_pairs"] == 2 * 16  # 2 steps of 16 pairs
    pair = report["first_pair"]
    assert pair["prompt"][0]["role"] == "user" and pair["chosen"][0]["role"] == pair["rejected"][0]["role"] == "assistant"
    chosen, rejected = pair["chosen"][0]["content"], pair["rejected"][0]["content"]
    assert chosen != rejected and len(chosen) == len(rejected)


def test_the_lora_adapter_sync_bench_composes_both_modes_commands():
    """bench/lora_adapter_sync.py --dry-run: each mode's command composed and checked, nothing run. Its
    reading of a finished run (`summarize`) runs on tests/e2e/test_lora.py's TP-2 adapter run (a
    whole-stack start of its own here was CI's time, tests/budget.py)."""
    done = subprocess.run([sys.executable, "bench/lora_adapter_sync.py", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("adapter:", "folded:"))]
    assert [line.split(":")[0] for line in lines] == ["adapter", "folded"]
    assert "weight_sync.lora=adapter" in lines[0] and "weight_sync.lora=folded" in lines[1]


def test_the_refusal_bench_times_a_refused_command_that_never_started_ray(tmp_path):
    report = _dry_run("refusal_seconds.py", tmp_path / "refusal.json")
    (case,) = report["cases"].values()
    assert len(case["seconds"]) == 1 and case["median_s"] > 0
    assert "row(s) 2: no value" in case["error"]  # the refusal's own message, read from its stderr


def test_the_placement_validation_bench_ranks_each_workloads_plans_and_composes_their_commands(tmp_path):
    """bench/placement_validation.py without calibrating or running: each workload's plans ranked with
    the rates this machine has, the top three, the median and the slowest chosen, each one's command
    composed as the bench runs it, and the device the results belong to recorded."""
    report = _dry_run("placement_validation.py", tmp_path / "validation.json")
    assert set(report) == {"gen", "update"}
    for name, result in report.items():
        assert result["dry_run"] and result["device"] and result["rates"]["provenance"], name
        ranks = [run["rank"] for run in result["runs"]]
        assert ranks == sorted(set(ranks)) and ranks[0] == 1 and ranks[-1] == result["candidates"], ranks
        assert len(ranks) == min(5, result["candidates"])
        for run in result["runs"]:
            assert run["predicted"]["step"] > 0 and run["composed_total_steps"] == 6, run


def test_the_paper_placement_bench_prints_one_case_of_its_table():
    """bench/paper_placement.py --dry-run: 13B on 16 simulated A100s through the same table as the whole run,
    the planner's family beside the paper's (colocate for both)."""
    done = subprocess.run([sys.executable, "bench/paper_placement.py", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 13B")]
    assert len(rows) == 1 and rows[0].split("|")[3:5] == [" colocate ", " colocate "], done.stdout
    assert "agrees with the paper in 1 of 1 published cases" in done.stdout


# Run only inside TRL's own virtual environment (bench/trl_env.sh), which the tests do not build: their
# command lines are composed by the dry runs of the benches that start them.
RUN_BY_ANOTHER_BENCH = {"trl_grpo_steps.py": "grpo_vs_trl.py, real_learning_vs_trl.py",
                        "trl_dpo_steps.py": "dpo_vs_trl.py", "trl_distill_steps.py": "distill_vs_trl.py"}


def scripts_without_a_dry_run(bench_dir: Path, tests: list[Path]) -> list[str]:
    """The bench scripts (files with a `__main__` block) that no dry-run test names (`bench/<script>`, or
    `"<script>"` given to `_dry_run`), less RUN_BY_ANOTHER_BENCH."""
    named = "".join(t.read_text() for t in tests)
    return sorted(p.name for p in bench_dir.glob("*.py") if 'if __name__ == "__main__":' in p.read_text()
                  and p.name not in RUN_BY_ANOTHER_BENCH and f"bench/{p.name}" not in named and f'"{p.name}"' not in named)


def dry_run_tests() -> list[Path]:
    return sorted((ROOT / "tests" / "unit").glob("test_bench_*.py"))


def test_every_bench_script_has_a_dry_run_that_a_test_runs(tmp_path):
    """A bench whose results docs quote cannot rot unseen: every script in bench/ with a `__main__` is named
    by a test in tests/unit/test_bench_*.py (the dry runs above); a script added without one is caught."""
    assert scripts_without_a_dry_run(ROOT / "bench", dry_run_tests()) == []
    for name in RUN_BY_ANOTHER_BENCH:
        assert (ROOT / "bench" / name).exists(), name  # an exception for a script that is gone is stale
    planted, script = tmp_path / "bench", "planted_" + "bench.py"  # a name no test file spells out
    planted.mkdir()
    (planted / script).write_text('if __name__ == "__main__":\n    print(1)\n')
    (planted / "helper.py").write_text("X = 1\n")  # a module, not a script
    assert scripts_without_a_dry_run(planted, dry_run_tests()) == [script]


def test_the_guard_cost_bench_times_each_guard(tmp_path):
    report = _dry_run("guard_cost.py", tmp_path / "guards.json")
    assert set(report["guards_s"]) == {"no_signal_s", "env_failures_s", "trained_prompts_s", "sft_eos_s",
                                       "truncated_sampling_at_compose_s"}
    assert all(v > 0 for v in report["guards_s"].values()) and report["guards_per_step_s"] > 0


@pytest.mark.slow  # four hybridflow processes with vLLM (~100 s alone on 2 cores, 300 s beside the other worker)
@pytest.mark.timeout(960)  # past pyproject.toml's 600 s
def test_the_hub_environments_bench_times_each_task_on_both_sides_and_reads_its_held_out_reward(tmp_path):
    """bench/hub_environments.py --dry-run: each task (a verifiers taskset, an OpenEnv server) through its
    hub adapter and through HybridFlow's own path, 2 steps a side, the held-out reward at the end, the
    overhead from the steps after the first; no doc written (and no recipe=evaluate run for the start)."""
    report = _dry_run("hub_environments.py", tmp_path / "hub.json", timeout_s=900)
    assert report["dry_run"] and set(report["runs"]) == {"verifiers_seed0", "openenv_seed0"}
    for name, run in report["runs"].items():
        assert run["start_val_reward"] is None and 0 <= run["end_val_reward"], name
        for side in ("hub", "own"):
            assert len(run[side]["step_s"]) == 1 and run[side]["median_step_s"] > 0, (name, side)
        assert run["overhead"] == run["hub"]["median_step_s"] / run["own"]["median_step_s"] - 1
    assert report["runs"]["openenv_seed0"]["hub"]["turns_mean"] >= 1
