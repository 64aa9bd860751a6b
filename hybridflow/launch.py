"""Building a run from config at the edge: model, data, Ray, pools and worker groups.

Recipes call these so that inner code receives built objects. Placement is configuration:
`placement.roles` maps each role to a pool, and all roles on one pool are fused into one
process per device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hybridflow.builders import TinyModelSpec, build_tiny_model
from hybridflow.config.schema import DeviceKind, HybridFlowConfig, PlacementConfig
from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, WorkerGroup, spawn_workers
from hybridflow.controller.runtime import connect
from hybridflow.data import ArithmeticSpec, make_arithmetic_split, read_rows, write_rows


def prepare_model(config: HybridFlowConfig, run_dir: Path) -> Path:
    """The model directory: `model.path`, or the tiny model built into run_dir/base_model."""
    if config.model.path is not None:
        path = Path(config.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path={config.model.path!r}: no config.json there; give a Hugging Face model directory")
        return path
    spec = TinyModelSpec(**vars(config.model.tiny))
    return build_tiny_model(run_dir / "base_model", spec)


@dataclass
class Datasets:
    train: list[dict]
    val: list[dict]
    train_path: Path
    val_path: Path


def prepare_data(config: HybridFlowConfig, run_dir: Path) -> Datasets:
    """Rows from data.train_path / val_path, or the synthetic task written to run_dir/data."""
    data = config.data
    if data.train_path is not None:
        train_path, val_path = Path(data.train_path), Path(data.val_path)
        return Datasets(read_rows(train_path), read_rows(val_path), train_path, val_path)
    syn = data.synthetic
    spec = ArithmeticSpec(syn.min_digits, syn.max_digits, tuple(syn.operations))
    train, val = make_arithmetic_split(syn.train_rows, syn.val_rows, spec, seed=data.seed)
    if syn.calculator_demonstrations:
        from hybridflow.data.calculator import demonstration

        train = [{**row, "demonstration": demonstration(row["prompt"])} for row in train]
    train_path = write_rows(train, run_dir / "data" / "train.parquet")
    val_path = write_rows(val, run_dir / "data" / "val.parquet")
    return Datasets(train, val, train_path, val_path)


def slots_needed(placement: PlacementConfig) -> float:
    used = set(placement.roles.values())
    return sum(p.nodes * p.devices_per_node * p.cpus_per_device for name, p in placement.pools.items() if name in used)


def start_ray(config: HybridFlowConfig) -> str:
    r = config.ray
    num_cpus = r.num_cpus or max(1, math.ceil(slots_needed(config.placement)) + 1)
    return connect(address=r.address, num_cpus=num_cpus, dashboard=r.dashboard,
                   dashboard_host=r.dashboard_host, namespace=r.namespace)


def use_gpu(placement: PlacementConfig) -> bool:
    if placement.device is DeviceKind.auto:
        import ray

        return ray.cluster_resources().get("GPU", 0) > 0
    return placement.device is DeviceKind.cuda


def spawn_roles(config: HybridFlowConfig, roles: dict[str, RoleSpec], env_vars: dict[str, str] | None = None
                ) -> dict[str, WorkerGroup]:
    """Spawn `roles` on their pools (from placement.roles); roles sharing a pool share processes."""
    placement = config.placement
    gpu = use_gpu(placement)
    by_pool: dict[str, dict[str, RoleSpec]] = {}
    for role, spec in roles.items():
        if role not in placement.roles:
            raise KeyError(f"role {role!r} has no pool: add placement.roles.{role}=<pool name>")
        by_pool.setdefault(placement.roles[role], {})[role] = spec
    groups: dict[str, WorkerGroup] = {}
    for pool_name, pool_roles in by_pool.items():
        p = placement.pools[pool_name]
        pool = ResourcePool(PoolSpec(pool_name, p.nodes, p.devices_per_node, gpu, p.cpus_per_device))
        groups.update(spawn_workers(pool, pool_roles, env_vars=env_vars,
                                    collective_timeout_s=placement.collective_timeout_s))
    _SPAWNED.extend(groups.values())
    return groups


_SPAWNED: list[WorkerGroup] = []


def release_all() -> None:
    """Shut down every worker group this driver spawned, so the next stage gets the devices."""
    seen = set()
    while _SPAWNED:
        group = _SPAWNED.pop()
        if group.pool is not None and id(group.pool) in seen:
            continue
        seen.add(id(group.pool))
        group.shutdown()


def vllm_env(config: HybridFlowConfig) -> dict[str, str]:
    """Environment for processes hosting an in-process vLLM engine."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(config.rollout.kv_cache_space_gib),
        "TOKENIZERS_PARALLELISM": "false",
    }


# ---- role specs from config ------------------------------------------------------------------


def optim_settings(o, total_steps: int):
    from hybridflow.training.fsdp import OptimSettings

    return OptimSettings(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), warmup_steps=o.warmup_steps,
                         total_steps=o.schedule_steps or total_steps, lr_schedule=o.lr_schedule,
                         min_lr_ratio=o.min_lr_ratio, max_grad_norm=o.max_grad_norm)


def actor_settings(config: HybridFlowConfig, model_dir: Path):
    from hybridflow.training.fsdp import LoraSpec
    from workers.actor import ActorSettings

    a, o = config.actor, config.actor.optim
    lora = LoraSpec(a.lora.rank, a.lora.alpha, a.lora.dropout, tuple(a.lora.target_modules)) if a.lora.rank else None
    return ActorSettings(
        model_path=str(model_dir), dtype=config.model.dtype.value, optim=optim_settings(o, config.trainer.total_steps),
        samples_per_mini_batch=a.samples_per_mini_batch,
        samples_per_micro_batch=a.samples_per_micro_batch, epochs_per_step=a.epochs_per_step,
        policy_loss=a.policy_loss, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
        dual_clip_c=a.dual_clip_c, loss_aggregation=a.loss_aggregation, entropy_coef=a.entropy_coef,
        kl_loss_coef=a.kl_loss_coef, kl_loss_estimator=a.kl_loss_estimator,
        skip_zero_advantage_samples=a.skip_zero_advantage_samples,
        temperature=config.rollout.temperature, lora=lora, gradient_checkpointing=a.gradient_checkpointing,
        trust_remote_code=config.model.trust_remote_code, seed=config.seed)


def critic_settings(config: HybridFlowConfig, model_dir: Path):
    from workers.critic import CriticSettings

    c, o = config.critic, config.critic.optim
    return CriticSettings(
        model_path=str(model_dir), dtype=config.model.dtype.value, optim=optim_settings(o, config.trainer.total_steps),
        samples_per_mini_batch=c.samples_per_mini_batch,
        samples_per_micro_batch=c.samples_per_micro_batch, epochs_per_step=c.epochs_per_step,
        value_clip_range=c.value_clip_range, loss_aggregation=c.loss_aggregation,
        trust_remote_code=config.model.trust_remote_code, seed=config.seed)


def rollout_role(config: HybridFlowConfig, model_dir: Path, tokenizer) -> RoleSpec:
    from hybridflow.config.schema import RolloutBackend

    if config.rollout.backend is RolloutBackend.vllm:
        from workers.rollout.vllm_rollout import VLLMRollout as rollout_cls
    else:
        from workers.rollout.hf_rollout import HFRollout as rollout_cls
    return RoleSpec(rollout_cls, dict(
        model_path=str(model_dir), rollout=config.rollout, max_prompt_tokens=config.data.max_prompt_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        verifiable_weights=config.weight_sync.checksum_every_steps > 0,
        trust_remote_code=config.model.trust_remote_code),
        replica_size=config.rollout.tensor_parallel_size)


def build_weight_sync(config: HybridFlowConfig, actor: WorkerGroup, rollout: WorkerGroup):
    """The one object that moves the actor's weights into the rollout each step: in-process when
    the two share a pool, over a gloo group spanning the two pools otherwise."""
    from hybridflow.resharding.sync import WeightSync

    transport = "colocated" if config.placement.rollout_colocated else "gloo"
    return WeightSync(actor, rollout, config.weight_sync, transport, config.rollout.dtype.value)
