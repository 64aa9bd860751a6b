"""Every GPU command of the pages users run on GPUs (README "On GPUs", docs/cluster.md,
docs/migrating.md) fits the GPU its page names by the GPU memory model (hybridflow/checks/memory_budget.py:
training, and with a colocated engine its start, weight sync and generation), and each page shows
that arithmetic. The models the pages name are stood in for by header-only directories of their
shapes (no weights: the checks before start read headers only)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_docs_commands import ROOT, commands_in
from tests.unit.test_memory_budget import header_only_model, qwen2_shapes

# config.json fields of the models the pages name, and (head size x key/value heads, tied embeddings)
MODELS = {
    "Qwen2.5-0.5B-Instruct": ({"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                               "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                               "tie_word_embeddings": True}, 2 * 64),
    "Qwen2.5-3B-Instruct": ({"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
                             "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
                             "tie_word_embeddings": True}, 2 * 128),
    "Qwen2.5-7B-Instruct": ({"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                             "tie_word_embeddings": False}, 4 * 128),
}
MODELS["Qwen2-7B-Instruct"] = MODELS["Qwen2.5-7B-Instruct"]  # the same shapes
PAGES = {"README.md": ROOT / "README.md", "cluster.md": ROOT / "docs" / "cluster.md",
         "migrating.md": ROOT / "docs" / "migrating.md"}
STATED_GPU = re.compile(r"(\d+)\s+GB\s+GPUs")


def _on_gpus(command) -> bool:
    from hybridflow.run.pipeline_stages import compose_command

    args = [a for a in command.args if ".py:" not in a]  # a user's reward file is not needed to read the device
    return compose_command(args).placement.device.value == "cuda"


def gpu_commands() -> list:
    """The pages' `hybridflow` runs on GPUs (`placement.device=cuda`, as `recipe=grpo_gsm8k` sets) that name
    one of MODELS; the others are CPU examples."""
    out = []
    for path in PAGES.values():
        for command in commands_in(path):
            named = [a.split("/")[-1] for a in command.args if a.startswith("model.path=")]
            if named and named[0] in MODELS and _on_gpus(command):
                out.append(command)
    return out


def test_each_page_names_its_gpu_and_has_gpu_commands():
    commands = GPU_COMMANDS
    assert {c.where.split(":")[0] for c in commands} == set(PAGES), [c.where for c in commands]
    for name, path in PAGES.items():
        assert STATED_GPU.search(path.read_text()), f"{name} does not say which GPU its commands are for (N GB GPUs)"


# composed once at collection (each command composes its config: seconds, in every pytest-xdist worker)
GPU_COMMANDS = gpu_commands()


@pytest.mark.parametrize("command", GPU_COMMANDS, ids=[c.where for c in GPU_COMMANDS])
def test_every_documented_gpu_command_fits_the_gpu_its_page_names(command, tmp_path, monkeypatch, tiny_model_dir):
    from hybridflow.run.pipeline_stages import compose_command
    from hybridflow.checks.memory_budget import GIB, ModelShape, actor_pool_roles, gpu_phase_terms, memory_problems
    from hybridflow.planning.plan import Plan

    page = PAGES[command.where.split(":")[0]].read_text()
    gpu_gib = int(STATED_GPU.search(page)[1])
    monkeypatch.chdir(tmp_path)
    args = []
    for arg in command.args:
        if arg.startswith("model.path="):
            name = arg.split("/")[-1]
            config_json, kv = MODELS[name]
            shapes = qwen2_shapes(config_json["hidden_size"], config_json["intermediate_size"], config_json["vocab_size"],
                                  kv, config_json["num_hidden_layers"], tied=config_json["tie_word_embeddings"])
            arg = f"model.path={header_only_model(tmp_path / name, tiny_model_dir, config_json, shapes)}"
        for user_file in re.findall(r"([\w./-]+\.py):", arg):
            made = tmp_path / Path(user_file).name
            made.touch()
            arg = arg.replace(user_file, str(made))
        args.append(arg)
    config = compose_command([*args, f"placement.gpu_memory_gib={gpu_gib}"])
    problems = memory_problems(config, Plan.from_config(config))  # the plan the run would carry
    assert problems == [], f"{command.where} does not fit {gpu_gib} GB GPUs:\n" + "\n".join(problems)
    from hybridflow.checks.memory_budget import AUTO_SHARE, resolve_micro_batches

    resolved, said = resolve_micro_batches(config, Plan.from_config(config), gpu_bytes=gpu_gib * GIB)
    assert "WARNING" not in (said or ""), f"{command.where}: {said}"  # room for peaks above the floor
    plan = Plan.from_config(resolved)
    phases = gpu_phase_terms(resolved, plan, ModelShape.from_dir(resolved.model.path), actor_pool_roles(resolved, plan),
                             gpu_gib * GIB)
    assert sum(phases["training"].values()) <= AUTO_SHARE * gpu_gib * GIB, command.where
    for phase, terms in phases.items():  # the page shows the floor of each phase the run has, to a tenth of a GiB
        floor = f"{sum(terms.values()) / GIB:.1f} GiB"
        assert floor in page, f"{command.where}: the page does not show the {phase} floor, {floor}"
