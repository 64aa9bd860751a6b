"""Supervised fine-tuning: cross-entropy on prompt -> answer, loss on the answer tokens only.

Reuses the actor (FSDP2) and, for validation, the rollout engine: the weights are synced
into vLLM before each validation, exactly as in RL. The engine sleeps from its start to the first
validation (`WeightSync.rest`): colocated on a GPU, its KV cache would otherwise sit beside training. The answer is the
data row's `ground_truth` followed by EOS, or its multi-turn `demonstration` (tool-use
demonstrations for an agent; the tools' outputs are attended to but not trained).
Step hooks (`trainer.training_hooks`, hybridflow/training/hooks.py, e.g. spike_recovery) run
around each update; weights a hook loads reach vLLM at the next validation's sync.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.controller.memory import pool_memory_metrics
from hybridflow.data.answers import encode_sft_targets
from hybridflow.data.eos import check_eos_trained
from hybridflow.data.prompts import encode_prompts
from hybridflow.run.lifecycle import start_run
from hybridflow.run.stage import Stage
from hybridflow.run.runner import StageTimer, target_reached, validate, validation_due
from recipes.roles import actor_role, reward_role, rollout_role


def run(stage: Stage, run_dir: Path) -> dict:
    config = stage.config
    session = start_run(stage, run_dir, lambda model_dir, tokenizer: {
        "actor": actor_role(config, model_dir),
        "rollout": rollout_role(config, model_dir, tokenizer),
        "reward": reward_role(config),
    })
    tokenizer, data, groups = session.tokenizer, session.data, session.groups
    actor, rollout, reward = groups["actor"], groups["rollout"], groups["reward"]
    t = config.trainer
    training = session.training(["actor"], data.train, t.prompts_per_step)
    loader, logger, hooks, weight_sync = training.loader, training.logger, training.hooks, training.weight_sync
    step = training.step
    weight_sync.rest()  # colocated: the engine sleeps until the first validation, not beside training

    while step < config.trainer.total_steps:
        step += 1
        timer = StageTimer()
        metrics = hooks.before_update(step, actor)
        with timer("update"):
            rows = loader.next_rows()
            batch = encode_prompts(rows, tokenizer, config.data.max_prompt_tokens,
                                   truncation=config.data.prompt_truncation).union(
                encode_sft_targets(rows, tokenizer, config.rollout.max_response_tokens))
            check_eos_trained(batch["response_ids"], batch.tensors.get("loss_mask", batch["response_mask"]),
                              tokenizer.eos_token_id, f"SFT step {step}")
            metrics.update(actor.train_sft(batch)[0])
        with timer("hooks"):
            metrics.update(hooks.after_update(step, metrics, actor))
        metrics.update(timer.seconds)
        if validation_due(config, step):
            with timer("weight_sync"):
                metrics.update(weight_sync.sync(step, version=step))  # SFT's policy version: its step
            with weight_sync.generating():  # GPU: vLLM's KV cache is released again for training
                metrics.update(validate(config, rollout, reward, data.val, tokenizer, step))
            metrics.update(weight_sync.handover_seconds())  # the hand-over's steps, and the sync's probe if deferred
        metrics.update(pool_memory_metrics(groups))  # each pool's peak since the last step's read
        logger.log(step, metrics)
        if training.checkpointer.due(step):
            training.checkpointer.save(step, {"loader": loader.state_dict(), "metrics": metrics})
        if target_reached(config, step, metrics):
            break

    return session.finish(training, step)
