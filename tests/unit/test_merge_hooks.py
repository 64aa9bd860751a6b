"""Stage hooks (PMA-init between pipeline stages) and training hooks (reference model refresh),
each against a hand-worked example, and the errors of the hook runner."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridflow.merge import STAGE_HOOKS, HookConfig, MergeError, run_stage_hook, run_training_hook
from hybridflow.merge.hooks import reference_ema, reference_reset

STEPS = (10, 20, 30, 40, 50, 60)  # complete; step 70 is incomplete (no COMPLETE marker)


def checkpoint_state(step):
    """`w` is the step everywhere (hand-worked averages); `r` random; `n` an integer counter."""
    g = torch.Generator().manual_seed(step)
    return {"model.w": torch.full((2, 3), float(step)), "model.r": torch.randn(4, generator=g),
            "model.n": torch.tensor([step])}


def write_hf(path, state, step):
    path.mkdir(parents=True)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "toy", "step": step}))
    (path / "tokenizer.json").write_text("{}")


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "sft"
    for step in STEPS + (70,):
        step_dir = run / "checkpoints" / f"step_{step:08d}"
        write_hf(step_dir / "hf", checkpoint_state(step), step)
        if step != 70:
            (step_dir / "COMPLETE").write_text("{}\n")
    return run


def load(path):
    return load_file(path / "model.safetensors")


# ---------------------------------------------------------------------------- stage hooks


def test_pma_sma_averages_the_last_n_complete_checkpoints(run_dir, tmp_path):
    out = run_stage_hook(HookConfig("pma_sma", {"last": 3}), run_dir, tmp_path / "init")
    assert out == tmp_path / "init"
    merged = load(out)
    # the last 3 complete checkpoints are steps 40, 50, 60 (70 is incomplete): (40 + 50 + 60) / 3 = 50
    torch.testing.assert_close(merged["model.w"], torch.full((2, 3), 50.0), rtol=0, atol=1e-5)  # 1/3 in fp32
    want_r = sum(checkpoint_state(s)["model.r"] for s in (40, 50, 60)) / 3
    torch.testing.assert_close(merged["model.r"], want_r, rtol=0, atol=1e-6)
    assert torch.equal(merged["model.n"], torch.tensor([60]))  # integers: copied from the newest
    assert json.loads((out / "config.json").read_text())["step"] == 60
    provenance = json.loads((out / "merge_provenance.json").read_text())
    assert provenance["method"] == "sma" and [i["step"] for i in provenance["inputs"]] == [40, 50, 60]


def test_pma_ema_and_wma_hand_worked(run_dir, tmp_path):
    # EMA, alpha 0.5, from the oldest: m = 40; m = .5 * 50 + .5 * 40 = 45; m = .5 * 60 + .5 * 45 = 52.5
    ema = run_stage_hook(HookConfig("pma_ema", {"last": 3, "alpha": 0.5}), run_dir, tmp_path / "ema")
    assert torch.equal(load(ema)["model.w"], torch.full((2, 3), 52.5))
    # WMA: (1 * 40 + 2 * 50 + 3 * 60) / (1 + 2 + 3) = 320 / 6
    wma = run_stage_hook(HookConfig("pma_wma", {"last": 3}), run_dir, tmp_path / "wma")
    torch.testing.assert_close(load(wma)["model.w"], torch.full((2, 3), 320 / 6), rtol=0, atol=1e-5)
    # dtype and overwrite reach merge_checkpoints
    again = run_stage_hook(HookConfig("pma_wma", {"last": 3, "dtype": "bfloat16", "overwrite": True}), run_dir,
                           tmp_path / "wma")
    assert load(again)["model.w"].dtype == torch.bfloat16


def test_last_checkpoint_and_final_model(run_dir, tmp_path):
    newest = run_dir / "checkpoints" / "step_00000060" / "hf"
    assert run_stage_hook(HookConfig("last_checkpoint"), run_dir, tmp_path / "unused") == newest
    assert not (tmp_path / "unused").exists()  # it writes nothing
    with pytest.raises(MergeError, match=r"final_model does not exist: .* use the stage hook last_checkpoint"):
        run_stage_hook(HookConfig("final_model"), run_dir, tmp_path / "unused")
    write_hf(run_dir / "final_model", checkpoint_state(99), 99)
    assert run_stage_hook(HookConfig("final_model"), run_dir, tmp_path / "unused") == run_dir / "final_model"


def test_pipeline_start_is_the_first_stages_model_path_or_the_tiny_model_it_built(tmp_path):
    """A pipeline's stage directories as the runner writes them (00-teacher/, 01-student/): the hook reads
    the first stage's saved model.path, or its base_model/ where it built the tiny model; an incomplete
    first stage is refused with the fix."""
    run = tmp_path / "pipe"
    first, previous = run / "00-teacher", run / "01-student"
    previous.mkdir(parents=True)
    first.mkdir()
    (first / "config.json").write_text(json.dumps({"model": {"path": None}}))
    with pytest.raises(MergeError, match=r"base_model: the pipeline's first stage \(00-teacher\) started from no model"
                                         r".* rerun the pipeline under a new logger.run_name"):
        run_stage_hook(HookConfig("pipeline_start"), previous, tmp_path / "unused")
    write_hf(first / "base_model", checkpoint_state(0), 0)
    assert run_stage_hook(HookConfig("pipeline_start"), previous, tmp_path / "unused") == first / "base_model"
    write_hf(tmp_path / "given", checkpoint_state(1), 1)
    (first / "config.json").write_text(json.dumps({"model": {"path": str(tmp_path / "given")}}))
    assert run_stage_hook(HookConfig("pipeline_start"), previous, tmp_path / "unused") == tmp_path / "given"
    assert not (tmp_path / "unused").exists()  # it writes nothing


def test_last_checkpoint_without_hf_export_points_to_pma_sma(run_dir, tmp_path):
    step_dir = run_dir / "checkpoints" / "step_00000080"
    (step_dir / "actor").mkdir(parents=True)
    (step_dir / "COMPLETE").touch()
    with pytest.raises(MergeError, match=r"step_00000080 has no hf/ export, only actor/; use the stage hook pma_sma "
                                         r"with last: 1"):
        run_stage_hook(HookConfig("last_checkpoint"), run_dir, tmp_path / "unused")


@pytest.mark.parametrize("config, error, message", [
    (HookConfig("pma_sma", {"last": 7}), MergeError,
     r"6 complete checkpoints \(step_00000010, .*, step_00000060\) but 7 were asked for; incomplete \(no COMPLETE "
     r"file\): step_00000070"),
    (HookConfig("pma_avg", {"last": 3}), KeyError,
     r"unknown stage hook 'pma_avg'; registered: final_model, last_checkpoint, pipeline_start, pma_ema, pma_sma, "
     r"pma_wma"),
    (HookConfig("pma_sma", {"lst": 3}), MergeError,
     r"stage hook 'pma_sma': unknown params \['lst'\]; missing params \['last'\]; it takes last \(required\), "
     r"dtype \(default None\), overwrite \(default False\)"),
    (HookConfig("pma_ema", {"last": 3}), MergeError, r"missing params \['alpha'\]"),
    (HookConfig("pma_ema", {"last": 3, "alpha": 1.5}), MergeError, r"alpha=1.5: must be a number in \(0, 1\]"),
    (HookConfig("pma_sma", {"last": "3"}), MergeError, r"last='3': must be a whole number of at least 1"),
    (HookConfig("pma_sma", {"last": 3, "output_dir": "x"}), MergeError,
     r"params \['output_dir'\] are passed by the runner"),
    (HookConfig("last_checkpoint", {"last": 1}), MergeError, r"unknown params \['last'\]; it takes no params"),
])
def test_stage_hook_errors_name_the_fix(run_dir, tmp_path, config, error, message):
    with pytest.raises(error, match=message):
        run_stage_hook(config, run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_user_stage_hook_from_a_file_and_its_result_is_checked(run_dir, tmp_path):
    hook_file = tmp_path / "my_hooks.py"
    hook_file.write_text(
        "from pathlib import Path\n"
        "def newest_of(*, previous_run_dir, output_dir, which):\n"
        "    return previous_run_dir / 'checkpoints' / f'step_{which:08d}' / 'hf'\n")
    config = HookConfig(f"{hook_file}:newest_of", {"which": 20})
    assert run_stage_hook(config, run_dir, tmp_path / "out") == run_dir / "checkpoints" / "step_00000020" / "hf"
    with pytest.raises(MergeError, match=r"returned .*step_00000099.*, which is not a model directory"):
        run_stage_hook(HookConfig(f"{hook_file}:newest_of", {"which": 99}), run_dir, tmp_path / "out")
    (tmp_path / "other.py").write_text("def no_output(*, previous_run_dir):\n    return previous_run_dir\n")
    with pytest.raises(MergeError, match=r"it does not accept \['output_dir'\]; a stage hook must have the signature "
                                         r"hook\(\*, previous_run_dir: Path, output_dir: Path, \*\*params\)"):
        run_stage_hook(HookConfig(f"{tmp_path / 'other.py'}:no_output"), run_dir, tmp_path / "out")
    assert "pma_sma" in STAGE_HOOKS.names()


def test_hook_config_is_a_hydra_structured_config(run_dir, tmp_path):
    from omegaconf import OmegaConf

    assert HookConfig() == HookConfig("pma_sma", {})
    config = OmegaConf.merge(OmegaConf.structured(HookConfig), {"name": "pma_ema", "params": {"last": 2, "alpha": 0.5}})
    out = run_stage_hook(config, run_dir, tmp_path / "init")  # params arrive as a DictConfig
    # .5 * 60 + .5 * 50 = 55
    assert torch.equal(load(out)["model.w"], torch.full((2, 3), 55.0))


# ------------------------------------------------------------------------- training hooks


def states():
    actor = {"w": torch.tensor([1.0, 2.0]), "count": torch.tensor([7])}
    reference = {"w": torch.tensor([3.0, 6.0]), "count": torch.tensor([0])}
    return actor, reference


def test_reference_ema_every_k_steps_hand_worked():
    actor, reference = states()
    kwargs = dict(actor_state=actor, reference_state=reference, every_steps=2, alpha=0.25)
    assert reference_ema(step=0, **kwargs) is None and reference_ema(step=3, **kwargs) is None
    new = reference_ema(step=4, **kwargs)
    # .25 * [1, 2] + .75 * [3, 6] = [2.5, 5.0]; the integer counter is the actor's
    assert torch.equal(new["w"], torch.tensor([2.5, 5.0])) and torch.equal(new["count"], torch.tensor([7]))
    assert torch.equal(reference["w"], torch.tensor([3.0, 6.0]))  # inputs untouched, output not aliased
    assert new["count"].data_ptr() != actor["count"].data_ptr()
    config = HookConfig("reference_ema", {"every_steps": 2, "alpha": 0.25})
    assert torch.equal(run_training_hook(config, step=2, actor_state=actor, reference_state=reference)["w"], new["w"])


def test_reference_ema_keeps_bfloat16():
    actor = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}
    reference = {"w": torch.tensor([3.0, 6.0], dtype=torch.bfloat16)}
    new = reference_ema(step=1, actor_state=actor, reference_state=reference, every_steps=1, alpha=0.5)
    assert new["w"].dtype == torch.bfloat16 and torch.equal(new["w"].float(), torch.tensor([2.0, 4.0]))


def test_reference_reset_copies_the_actor_every_k_steps():
    embed = torch.randn(5, 3)
    actor = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "b": torch.randn(3, dtype=torch.bfloat16)}
    reference = {k: torch.zeros_like(v) for k, v in actor.items()}
    kwargs = dict(actor_state=actor, reference_state=reference, every_steps=3)
    assert reference_reset(step=4, **kwargs) is None
    new = reference_reset(step=6, **kwargs)
    assert all(torch.equal(new[k], actor[k]) and new[k].dtype == actor[k].dtype for k in actor)
    assert all(new[k].data_ptr() != actor[k].data_ptr() for k in actor)  # a copy: the actor keeps training
    assert new["lm_head.weight"] is new["model.embed_tokens.weight"]  # tied stays tied
    with pytest.raises(MergeError, match=r"key 'b' has shape \[4\]"):
        reference_reset(step=3, actor_state=actor, reference_state={**reference, "b": torch.zeros(4)}, every_steps=3)


@pytest.mark.parametrize("config, error, message", [
    (HookConfig("reference_ema", {"every_steps": 2}), MergeError, r"missing params \['alpha'\]"),
    (HookConfig("reference_reset", {"every_steps": 0}), MergeError, "every_steps=0: must be a whole number"),
    (HookConfig("reference_reset", {"every_steps": 2, "alpha": 0.1}), MergeError,
     r"training hook 'reference_reset': unknown params \['alpha'\]; it takes every_steps \(required\)"),
    (HookConfig("reference_avg", {}), KeyError, "registered: reference_ema, reference_reset"),
])
def test_training_hook_errors_name_the_fix(config, error, message):
    actor, reference = states()
    with pytest.raises(error, match=message):
        run_training_hook(config, step=2, actor_state=actor, reference_state=reference)


def test_user_training_hook_result_is_checked(tmp_path):
    hook_file = tmp_path / "bad_hook.py"
    hook_file.write_text("def drop_w(*, step, actor_state, reference_state):\n"
                         "    return {'count': actor_state['count']}\n")
    actor, reference = states()
    with pytest.raises(MergeError, match=r"missing key 'w'"):
        run_training_hook(HookConfig(f"{hook_file}:drop_w"), step=1, actor_state=actor, reference_state=reference)
