"""Role specs from config: where the schema's nodes meet the worker classes.

Each worker takes its own config node (`config.actor`, `config.rollout`, `config.reward`, ...)
and, as explicit keywords, the few values that live elsewhere in the config or are made at run
time (the model directory). The schema is the only copy of every default. The framework
(hybridflow/) never imports workers/; the recipes do, here.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.checks.rules import lora_sync
from hybridflow.config.engines import rollout_engine
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.registry import load_object
from hybridflow.controller import RoleSpec
from workers.actor import ActorWorker
from workers.critic import CriticWorker
from workers.reference import ReferenceWorker
from workers.reward import RewardWorker
from workers.teacher import TeacherWorker


def _sized(config: HybridFlowConfig, role: str) -> HybridFlowConfig:
    """`config`, whose micro-batch sizes the stage chose before anything started (hybridflow.run.stage.prepare_stage)."""
    unsized = [key for key, value in (("actor.samples_per_micro_batch", config.actor.samples_per_micro_batch),
                                      ("actor.gradient_checkpointing", config.actor.gradient_checkpointing),
                                      ("critic.samples_per_micro_batch", config.critic.samples_per_micro_batch))
               if value is None]
    if unsized:
        raise ValueError(f"{role}_role: {', '.join(unsized)} left null; build roles from the stage's config "
                         "(hybridflow.run.stage.prepare_stage(config).config), which chooses them for its plan")
    return config


def actor_role(config: HybridFlowConfig, model_dir: str | Path) -> RoleSpec:
    """The actor; its replicas span `actor.sequence_parallel_size` ranks, which receive the same rows."""
    config = _sized(config, "actor")
    return RoleSpec(ActorWorker, replica_size=config.actor.sequence_parallel_size, kwargs=dict(
        actor=config.actor, model_path=str(model_dir), dtype=config.model.dtype.value,
        master_dtype=config.model.master_dtype.value, keep_dropout=config.model.keep_dropout,
        temperature=config.rollout.temperature, total_steps=config.trainer.total_steps,
        trust_remote_code=config.model.trust_remote_code, seed=config.seed,
        pack_sequences=config.model.pack_sequences,
        share_prompts=config.model.share_prompts, exact_rollout=rollout_engine(config.rollout.backend).exact,
        engine_dtype=config.rollout.dtype.value))


def critic_role(config: HybridFlowConfig, model_dir: str | Path) -> RoleSpec:
    """The critic; its replicas span `critic.sequence_parallel_size` ranks, which receive the same rows."""
    config = _sized(config, "critic")
    return RoleSpec(CriticWorker, replica_size=config.critic.sequence_parallel_size, kwargs=dict(
        critic=config.critic, model_path=str(model_dir), dtype=config.model.dtype.value,
        master_dtype=config.model.master_dtype.value, keep_dropout=config.model.keep_dropout,
        total_steps=config.trainer.total_steps, trust_remote_code=config.model.trust_remote_code, seed=config.seed,
        pack_sequences=config.model.pack_sequences,
        share_prompts=config.model.share_prompts))


def reference_role(config: HybridFlowConfig, model_dir: str | Path) -> RoleSpec:
    """The reference: the actor's starting model, scoring as the actor does, its rows split over
    `actor.sequence_parallel_size` ranks as the actor's are."""
    config = _sized(config, "reference")
    return RoleSpec(ReferenceWorker, replica_size=config.actor.sequence_parallel_size, kwargs=dict(
        model_path=str(model_dir), dtype=config.model.dtype.value, keep_dropout=config.model.keep_dropout,
        samples_per_micro_batch=config.actor.samples_per_micro_batch, temperature=config.rollout.temperature,
        tokens_per_micro_batch=config.actor.tokens_per_micro_batch, fp32_lm_head=config.actor.fp32_lm_head,
        trust_remote_code=config.model.trust_remote_code, pack_sequences=config.model.pack_sequences,
        share_prompts=config.model.share_prompts, sequence_parallel_size=config.actor.sequence_parallel_size))


def teacher_role(config: HybridFlowConfig, path: str) -> RoleSpec:
    """A teacher (teacher.path, or one of teacher.teachers), scoring as the reference does, in teacher.dtype
    (null: model.dtype); its replicas span `teacher.sequence_parallel_size` ranks."""
    config = _sized(config, "teacher")
    return RoleSpec(TeacherWorker, replica_size=config.teacher.sequence_parallel_size, kwargs=dict(
        model_path=path, dtype=config.teacher.dtype or config.model.dtype.value, keep_dropout=False,
        samples_per_micro_batch=config.actor.samples_per_micro_batch, temperature=config.rollout.temperature,
        tokens_per_micro_batch=config.actor.tokens_per_micro_batch, fp32_lm_head=config.actor.fp32_lm_head,
        trust_remote_code=config.model.trust_remote_code, pack_sequences=config.model.pack_sequences,
        share_prompts=config.model.share_prompts, sequence_parallel_size=config.teacher.sequence_parallel_size))


def reward_role(config: HybridFlowConfig) -> RoleSpec:
    return RoleSpec(RewardWorker, {"reward": config.reward})


def rollout_role(config: HybridFlowConfig, model_dir: str | Path, tokenizer) -> RoleSpec:
    """The worker of the engine `rollout.backend` names (hybridflow/config/engines.py: vLLM, Hugging Face
    generate, or one of the user's); the launcher makes one replica span the plan's tensor-parallel
    ranks (`Plan.replica_size`), which the worker reads from its context."""
    rollout_cls = load_object(rollout_engine(config.rollout.backend).worker)
    return RoleSpec(rollout_cls, dict(
        model_path=str(model_dir), rollout=config.rollout, max_prompt_tokens=config.data.max_prompt_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        verifiable_weights=config.weight_sync.checksum_every_steps > 0,
        trust_remote_code=config.model.trust_remote_code,
        **({"lora_rank": config.actor.lora.rank} if lora_sync(config)[0] == "adapter" else {})))
