"""Supervised fine-tuning: cross-entropy on prompt -> answer, loss on the answer tokens only.

Reuses the actor (FSDP2) and, for validation, the rollout engine: the weights are synced
into vLLM before each validation, exactly as in RL. The answer is the
data row's `ground_truth` followed by EOS, or its multi-turn `demonstration` (tool-use
demonstrations for an agent; the tools' outputs are attended to but not trained).
Step hooks (`trainer.training_hooks`, hybridflow/training/hooks.py, e.g. spike_recovery) run
around each update; weights a hook loads reach vLLM at the next validation's sync.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.controller.memory import pool_memory_metrics
from hybridflow.data.answers import encode_sft_targets
from hybridflow.data.loader import PromptLoader
from hybridflow.data.prompts import encode_prompts
from hybridflow.data.tokenizer import load_tokenizer
from hybridflow.launch import build_weight_sync, prepare_data, prepare_model, spawn_roles, start_ray, vllm_env
from hybridflow.runner import Checkpointer, StageTimer, validate, validation_due
from hybridflow.tracking import MetricsLogger
from hybridflow.training.hooks import StepHooks, batches_to_remember
from recipes.roles import actor_role, reward_role, rollout_role


def run(config: HybridFlowConfig, run_dir: Path) -> dict:
    model_dir = prepare_model(config, run_dir)
    tokenizer = load_tokenizer(model_dir, config.model.trust_remote_code)
    data = prepare_data(config, run_dir, tokenizer)
    start_ray(config)
    groups = spawn_roles(config, {
        "actor": actor_role(config, model_dir),
        "rollout": rollout_role(config, model_dir, tokenizer),
        "reward": reward_role(config),
    }, env_vars=vllm_env(config))
    actor, rollout, reward = groups["actor"], groups["rollout"], groups["reward"]
    for future in [actor.start.remote(), reward.start.remote(), rollout.start_engine.remote()]:
        future.get()

    checkpointer = Checkpointer(config, run_dir, model_dir, {"actor": actor})
    t = config.trainer
    loader = PromptLoader(data.train, t.prompts_per_step, seed=config.seed,
                          remember_batches=batches_to_remember(t.training_hooks, t.save_every_steps))
    state = checkpointer.resume() or {}
    step = int(state.get("step", 0))
    if state:
        loader.load_state_dict(state["loader"])
    logger = MetricsLogger(run_dir, config.logger, total_steps=config.trainer.total_steps)
    weight_sync = build_weight_sync(config, actor, rollout)
    weight_sync.setup()
    hooks = StepHooks.build(t.training_hooks, run_dir, loader)

    while step < config.trainer.total_steps:
        step += 1
        timer = StageTimer()
        metrics = hooks.before_update(step, actor)
        with timer("update"):
            rows = loader.next_rows()
            batch = encode_prompts(rows, tokenizer, config.data.max_prompt_tokens,
                                   truncation=config.data.prompt_truncation).union(
                encode_sft_targets(rows, tokenizer, config.rollout.max_response_tokens))
            metrics.update(actor.train_sft(batch)[0])
        with timer("hooks"):
            metrics.update(hooks.after_update(step, metrics, actor))
        metrics.update(timer.seconds)
        if validation_due(config, step):
            with timer("weight_sync"):
                metrics.update(weight_sync.sync(step, version=step))  # SFT's policy version: its step
            with weight_sync.generating():  # GPU: vLLM's KV cache is released again for training
                metrics.update(validate(config, rollout, reward, data.val, tokenizer, step))
        metrics.update(pool_memory_metrics(groups))  # each pool's peak since the last step's read
        logger.log(step, metrics)
        if checkpointer.due(step):
            checkpointer.save(step, {"loader": loader.state_dict(), "metrics": metrics})

    final_model = checkpointer.export_final(run_dir) if config.trainer.export_hf else None
    logger.close()
    return {"final_model": final_model, "steps": step}
