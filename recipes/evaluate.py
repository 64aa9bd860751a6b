"""Held-out accuracy of one model directory: greedy decoding on the validation prompts."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.launch import prepare_data, prepare_model, spawn_roles, start_ray, vllm_env
from hybridflow.runner import validate
from hybridflow.tracking import MetricsLogger
from recipes.roles import reward_role, rollout_role


def run(config: HybridFlowConfig, run_dir: Path) -> dict:
    model_dir = prepare_model(config, run_dir)
    data = prepare_data(config, run_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=config.model.trust_remote_code)
    start_ray(config)
    groups = spawn_roles(config, {"rollout": rollout_role(config, model_dir, tokenizer),
                                  "reward": reward_role(config)}, env_vars=vllm_env(config))
    for future in [groups["reward"].start.remote(), groups["rollout"].start_engine.remote()]:
        future.get()
    metrics = validate(config, groups["rollout"], groups["reward"], data.val, tokenizer, step=0)
    logger = MetricsLogger(run_dir, config.logger)
    logger.log(0, metrics)
    logger.close()
    return {"final_model": str(model_dir), **metrics}
