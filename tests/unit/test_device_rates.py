"""Rates per device (hybridflow/planning/device_rates.py): the planner names the device its rates
describe, uses the rates cached for this device before built-in ones, marks another device's rates
as borrowed (never a prediction for this one), and the running fit saves what a run measured."""

from __future__ import annotations

import json

import pytest

from hybridflow.planning import device_rates as dr
from hybridflow.planning.cost import Rates
from hybridflow.planning.profiles import CPU_XEON_2CORE
from hybridflow.precision import SPEED_CPU_FLAGS

XEON = dr.DeviceIdentity("cpu", "Intel(R) Xeon(R) Processor", ("avx2", "avx512f", "avx512_bf16", "amx_bf16"), 2)
EPYC = dr.DeviceIdentity("cpu", "AMD EPYC", ("avx2",), 2)
STAGES = {"generate": 0.5, "score": 0.1, "update": 0.2, "transition": 0.2}


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(dr.CACHE_VAR, str(tmp_path))
    return tmp_path


def test_a_device_is_named_by_its_model_instruction_sets_and_cores(monkeypatch):
    assert EPYC.key == "cpu-amd-epyc-avx2-2c" and XEON.describe().startswith("Intel(R) Xeon(R) Processor (2 cores")
    here = dr.this_device("cpu")
    assert here.kind == "cpu" and here.size >= 1 and set(here.features) <= set(SPEED_CPU_FLAGS)
    monkeypatch.setenv(dr.IDENTITY_VAR, "Simulated CPU")
    assert dr.this_device("cpu").name == "Simulated CPU"


def test_the_rates_are_this_devices_cached_then_built_in_else_borrowed(cache):
    assert dr.choose_rates(None, "cpu", XEON).provenance == "built-in"
    borrowed = dr.choose_rates(None, "cpu", EPYC)
    assert borrowed.borrowed and borrowed.rates == CPU_XEON_2CORE
    assert borrowed.note.startswith("BORROWED from another device") and "none for AMD EPYC (2 cores; avx2)" in borrowed.note
    mine = Rates(**{**CPU_XEON_2CORE.to_dict(), "decode_step_s": 0.01, "source": "mine"})
    path = dr.save_cached(EPYC, mine, "calibrated")
    assert path == cache / "cpu-amd-epyc-avx2-2c.json" and not list(cache.glob("*.partial"))
    cached = dr.choose_rates(None, "cpu", EPYC)
    assert cached.provenance == "cached" and cached.rates == mine
    assert cached.note.startswith("this device's, calibrated 0.0 h ago")
    (cache / "cpu-amd-epyc-avx2-2c.json").write_text("{not json")  # damaged: as good as none
    assert dr.choose_rates(None, "cpu", EPYC).borrowed


def test_the_a100_h100_and_h200_have_built_in_rates_and_another_gpu_borrows(cache):
    """GPUs as torch names them; the H200's memory bandwidth above the H100's, their matrix rate the same."""
    from hybridflow.planning.profiles import A100_80GB, H100_80GB, H200_141GB, PROFILES

    for name, size, rates in (("NVIDIA H100 80GB HBM3", 79, H100_80GB), ("NVIDIA H200", 140, H200_141GB),
                              ("NVIDIA A100-SXM4-80GB", 79, A100_80GB)):
        choice = dr.choose_rates(None, "cuda", dr.DeviceIdentity("cuda", name, (), size))
        assert (choice.provenance, choice.rates) == ("built-in", rates), name
    assert H200_141GB.decode_bytes_per_s > H100_80GB.decode_bytes_per_s > A100_80GB.decode_bytes_per_s
    assert H200_141GB.train_flops_per_s == H100_80GB.train_flops_per_s > A100_80GB.train_flops_per_s
    assert dr.choose_rates(None, "cuda", dr.DeviceIdentity("cuda", "NVIDIA A100-PCIE-40GB", (), 39)).borrowed
    assert dr.choose_rates(None, "cuda", dr.DeviceIdentity("cuda", "NVIDIA L4", (), 22)).borrowed
    assert {"a100-80gb", "h100-80gb", "h200-141gb"} <= set(PROFILES)


def test_the_fit_scales_each_stage_toward_what_was_measured():
    measured = {"generate": 1.0, "score": 0.1, "update": 0.8, "transition": 0.0}
    full = dr.refit(CPU_XEON_2CORE, STAGES, measured, 1.0)
    assert dict(full.stage_scale) == pytest.approx({"generate": 2.0, "score": 1.0, "update": 4.0})
    half = dr.refit(full, STAGES, measured, 0.5)  # from the same prediction again: half the log-distance more
    assert dict(half.stage_scale)["generate"] == pytest.approx(2.0 * 2 ** 0.5)
    assert Rates.from_json(json.dumps(full.to_dict())) == full


def _plan(provenance: str, device=EPYC, rates=CPU_XEON_2CORE) -> dict:
    import dataclasses

    return {"rates": rates.to_dict(), "rates_choice": {"provenance": provenance, "note": "",
                                                       "device": dataclasses.asdict(device), "device_key": device.key}}


def test_a_run_on_borrowed_rates_saves_what_it_measured_as_this_devices(cache):
    measured = {"generate": 1.0, "score": 0.2, "update": 0.4, "transition": 0.4, "step": 2.0}
    line = dr.update_from_measured(_plan("borrowed"), {**STAGES, "step": 1.0}, measured)
    assert "this device had no rates; saved the rates this run measured as its own" in line
    saved = dr.choose_rates(None, "cpu", EPYC)
    assert saved.provenance == "cached" and "first measured" in saved.note
    assert dict(saved.rates.stage_scale) == pytest.approx({s: 2.0 for s in STAGES})


def test_a_cached_device_is_refitted_only_past_a_quarter_off(cache):
    near = {**{s: v * 1.2 for s, v in STAGES.items()}, "step": 1.2}
    assert dr.update_from_measured(_plan("cached"), {**STAGES, "step": 1.0}, near) is None  # 20%: kept
    far = {**{s: v * 2 for s, v in STAGES.items()}, "step": 2.0}
    line = dr.update_from_measured(_plan("cached"), {**STAGES, "step": 1.0}, far)
    assert line.startswith("hybridflow: the measured step was -50% off the prediction (more than 25%)")
    assert dict(dr.read_cached(EPYC)[0].stage_scale)["generate"] == pytest.approx(2 ** 0.5)  # halfway, in log space
    assert dr.update_from_measured(_plan("file"), {**STAGES, "step": 1.0}, far) is None  # the user's file is theirs


def test_the_plan_command_marks_borrowed_seconds(cache, monkeypatch, capsys):
    from hybridflow.run.pipeline_stages import compose_command
    from hybridflow.planning.cli import main

    monkeypatch.setenv(dr.IDENTITY_VAR, "Simulated CPU")
    assert main(["--top", "2", "recipe=grpo"], compose_command) == 0
    out = capsys.readouterr().out
    assert "rates: BORROWED from another device" in out and "s/step*" in out
    assert "the ranking below is by another device's seconds (borrowed rates): not a prediction for this one" in out
    dr.save_cached(dr.this_device("cpu"), CPU_XEON_2CORE, "calibrated")
    assert main(["--top", "2", "recipe=grpo"], compose_command) == 0
    out = capsys.readouterr().out
    assert "rates: this device's, calibrated 0.0 h ago" in out and "s/step*" not in out
