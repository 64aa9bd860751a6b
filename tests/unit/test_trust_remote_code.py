"""`model.trust_remote_code` reaches the model loader of every trained or frozen model role the
PPO recipe builds (actor, critic, reference)."""

from __future__ import annotations

import sys

import pytest
from transformers import AutoTokenizer

from hybridflow.config import compose
from hybridflow.controller import WorkerContext
from recipes.ppo import build_roles


@pytest.mark.parametrize("trust", [True, False])
@pytest.mark.parametrize("role", ["actor", "critic", "reference"])
def test_model_trust_remote_code_reaches_the_role_model_loader(role, trust, tiny_model_dir, monkeypatch):
    from hybridflow.run.stage import prepare_stage

    config = compose(["recipe=ppo", f"model.trust_remote_code={str(trust).lower()}", "algorithm.kl_penalty_coef=0.1"])
    config = prepare_stage(config).config  # the stage's config, micro-batch sizes chosen, as a run builds its roles
    spec = build_roles(config, tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir))[role]
    module = sys.modules[spec.cls.__module__]  # the worker's module: it calls load_model by that name
    real, seen = module.load_model, []

    def recording_load_model(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "load_model", recording_load_model)
    spec.cls(WorkerContext(), **spec.kwargs).start()
    assert seen == [trust]
