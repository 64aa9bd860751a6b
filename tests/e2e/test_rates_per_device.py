"""placement=auto on a device the planner has no rates for (a simulated identity): the first run
ranks with borrowed rates, says so, and saves what it measured as the device's rates; the second
run plans with them, whose factors make the prediction for the first run's plan what that run
measured, stage by stage (hybridflow/planning/device_rates.py). The second run's planning is all it
decides before anything starts (`hybridflow.run.stage.prepare_stage`), so it is called here in
the test's process, as the command calls it, instead of a second whole run (CI's time,
tests/budget.py). How close that prediction comes to the second run's own steps is a measurement,
not a test (timings on two shared cores drift): docs/placement.md "Rates per device". Its runs start
their own Ray: joined to the tests' head (tests/ray_head.py) they would plan that cluster, not this
machine's device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.planning.cost import STAGES, Rates
from tests.e2e import cli_in_one_process

GRPO = ["recipe=grpo", "placement=auto", "trainer.total_steps=5", "trainer.prompts_per_step=8",
        "rollout.samples_per_prompt=8", "rollout.max_response_tokens=32", "trainer.val_every_steps=0",
        "trainer.save_every_steps=0", "trainer.export_hf=false"]


def _run(tmp_path: Path, name: str, env: dict) -> tuple[str, dict]:
    done = cli_in_one_process.run([*GRPO, f"logger.output_root={tmp_path}", f"logger.run_name={name}"], env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr, json.loads((tmp_path / name / "plan.json").read_text())


def _plan_second(tmp_path: Path, name: str) -> tuple[str, dict]:
    """What the second run does before anything starts: the same config, its stage prepared (`prepare_stage`)."""
    from hybridflow.config import compose
    from hybridflow.run.stage import prepare_stage

    run_dir = tmp_path / name
    run_dir.mkdir()
    stage = prepare_stage(compose([*GRPO, f"logger.output_root={tmp_path}", f"logger.run_name={name}"]))
    stage.save(run_dir)
    return stage.said[0], json.loads((run_dir / "plan.json").read_text())


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
@pytest.mark.budget(60)  # one whole 5-step GRPO run of the `hybridflow` command
def test_the_second_run_on_an_unknown_device_predicts_what_the_first_measured(tmp_path, monkeypatch):
    identity = {"HYBRIDFLOW_DEVICE_IDENTITY": "Simulated CPU for rates", "HYBRIDFLOW_RATES_CACHE": str(tmp_path / "rates")}
    first_out, first = _run(tmp_path, "first", identity)
    assert first["rates_choice"]["provenance"] == "borrowed"
    chose = first_out.split("placement=auto chose")[1].split("\n")[0]
    assert "ranked with rates BORROWED from another device" in chose and "predicted" not in chose
    assert "this device had no rates; saved the rates this run measured as its own" in first_out
    assert len(list((tmp_path / "rates").glob("*.json"))) == 1
    for key, value in identity.items():
        monkeypatch.setenv(key, value)
    second_out, second = _plan_second(tmp_path, "second")
    assert second["rates_choice"]["provenance"] == "cached" and "with rates this device's, first measured" in second_out
    # the rates the second run planned with carry, per stage, the first run's measured / predicted seconds:
    # applied to the first run's plan they predict what it measured
    scale = dict(Rates.from_dict(second["rates"]).stage_scale)
    measured, predicted = first["measured"]["stages"], first["prediction"]["stages"]
    fitted = [stage for stage in STAGES if measured[stage] > 0 and predicted[stage] > 0]
    assert {"generate", "update"} <= set(fitted)
    for stage in fitted:
        assert scale[stage] == pytest.approx(measured[stage] / predicted[stage], rel=1e-6), stage
