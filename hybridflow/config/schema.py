"""Typed configuration: the schema every YAML under conf/ is validated against.

Hydra composes conf/ on top of these dataclasses (registered in its ConfigStore), so an
unknown key or a value of the wrong type fails during composition, before anything starts.
Rules across fields live in `__post_init__` and run when `to_config` turns the composed
config into these objects — also before Ray starts. Every error names the key, the value and
what is allowed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

ROLES = ("actor", "rollout", "reference", "critic", "reward")


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config {key}={value!r} is invalid: {allowed}")


class DeviceKind(enum.Enum):
    auto = "auto"  # GPUs when the cluster has them, else CPU slots
    cpu = "cpu"
    cuda = "cuda"


class Dtype(enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class RolloutBackend(enum.Enum):
    vllm = "vllm"
    hf = "hf"


@dataclass
class RayConfig:
    address: Optional[str] = None  # None: join RAY_ADDRESS if set (ray job submit), else start a local Ray
    num_cpus: Optional[int] = None  # logical CPU slots of a local Ray; None: enough for the pools
    dashboard: bool = False
    dashboard_host: str = "127.0.0.1"  # loopback unless configured otherwise
    namespace: str = "hybridflow"

    def __post_init__(self) -> None:
        _require(self.num_cpus is None or self.num_cpus >= 1, "ray.num_cpus", self.num_cpus, "must be >= 1 or null")


@dataclass
class PoolConfig:
    nodes: int = 1
    devices_per_node: int = 1  # GPUs per node, or CPU slots per node without GPUs
    cpus_per_device: float = 1.0

    def __post_init__(self) -> None:
        _require(self.nodes >= 1, "placement.pools.<name>.nodes", self.nodes, "must be >= 1")
        _require(self.devices_per_node >= 1, "placement.pools.<name>.devices_per_node", self.devices_per_node, "must be >= 1")
        _require(self.cpus_per_device > 0, "placement.pools.<name>.cpus_per_device", self.cpus_per_device, "must be > 0")


@dataclass
class PlacementConfig:
    device: DeviceKind = DeviceKind.auto
    pools: Dict[str, PoolConfig] = field(default_factory=lambda: {"global": PoolConfig(devices_per_node=2)})
    # role -> pool name; roles on the same pool are fused into one process per device
    roles: Dict[str, str] = field(default_factory=lambda: {role: "global" for role in ROLES})
    collective_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _require(bool(self.pools), "placement.pools", self.pools, "define at least one pool")
        for role, pool in self.roles.items():
            _require(role in ROLES, f"placement.roles.{role}", pool, f"roles are {list(ROLES)}")
            _require(pool in self.pools, f"placement.roles.{role}", pool, f"must name a pool in placement.pools: {sorted(self.pools)}")
        _require(self.collective_timeout_s > 0, "placement.collective_timeout_s", self.collective_timeout_s, "must be > 0")


@dataclass
class TinyModelConfig:
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    seed: int = 0


@dataclass
class ModelConfig:
    path: Optional[str] = None  # a Hugging Face model directory; null builds the tiny model offline
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: Dtype = Dtype.float32  # training parameter dtype
    trust_remote_code: bool = False


@dataclass
class SyntheticTaskConfig:
    min_digits: int = 1
    max_digits: int = 2
    operations: List[str] = field(default_factory=lambda: ["add"])
    train_rows: int = 4000
    val_rows: int = 200

    def __post_init__(self) -> None:
        _require(1 <= self.min_digits <= self.max_digits <= 9, "data.synthetic.min_digits/max_digits",
                 (self.min_digits, self.max_digits), "need 1 <= min_digits <= max_digits <= 9")
        bad = [op for op in self.operations if op not in ("add", "sub", "mul")]
        _require(bool(self.operations) and not bad, "data.synthetic.operations", self.operations, "a non-empty subset of [add, sub, mul]")
        _require(self.train_rows >= 1 and self.val_rows >= 1, "data.synthetic.train_rows/val_rows",
                 (self.train_rows, self.val_rows), "must be >= 1")


@dataclass
class DataConfig:
    train_path: Optional[str] = None  # .parquet / .jsonl with prompt, ground_truth, data_source; null: synthetic
    val_path: Optional[str] = None
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    max_prompt_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        _require((self.train_path is None) == (self.val_path is None), "data.train_path/val_path",
                 (self.train_path, self.val_path), "set both to files, or leave both null for the synthetic task")
        _require(self.max_prompt_tokens >= 1, "data.max_prompt_tokens", self.max_prompt_tokens, "must be >= 1")


@dataclass
class RolloutConfig:
    backend: RolloutBackend = RolloutBackend.vllm
    max_response_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    samples_per_prompt: int = 1
    dtype: Dtype = Dtype.float32
    tensor_parallel_size: int = 1
    kv_cache_space_gib: int = 1  # vLLM's KV cache on a CPU (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.5  # share of a GPU vLLM may take when colocated with training
    max_num_seqs: int = 256
    enforce_eager: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.max_response_tokens >= 1, "rollout.max_response_tokens", self.max_response_tokens, "must be >= 1")
        _require(self.temperature >= 0, "rollout.temperature", self.temperature, "must be >= 0 (0 is greedy)")
        _require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        _require(self.samples_per_prompt >= 1, "rollout.samples_per_prompt", self.samples_per_prompt, "must be >= 1")
        _require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        _require(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        _require(self.kv_cache_space_gib >= 1, "rollout.kv_cache_space_gib", self.kv_cache_space_gib, "must be >= 1")


@dataclass
class RewardConfig:
    # A registered name or 'package.module:function' / 'path/to/file.py:function'.
    fn: str = "exact_match"
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _require(bool(self.fn), "reward.fn", self.fn, "name a reward function")
        _require(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "must be > 0")


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0

    def __post_init__(self) -> None:
        _require(0 <= self.gamma <= 1, "algorithm.gamma", self.gamma, "must be in [0, 1]")
        _require(0 <= self.lam <= 1, "algorithm.lam", self.lam, "must be in [0, 1]")


@dataclass
class LoggerConfig:
    output_root: str = "runs"  # each run gets output_root/<run_name>
    run_name: Optional[str] = None  # null: <recipe>-<YYYYmmdd-HHMMSS>
    backends: List[str] = field(default_factory=lambda: ["console", "jsonl"])

    def __post_init__(self) -> None:
        allowed = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
        bad = [b for b in self.backends if b not in allowed]
        _require(not bad, "logger.backends", self.backends, f"each must be one of {list(allowed)}")


RECIPE_NAMES = ("demo",)


@dataclass
class RecipeConfig:
    # A built-in recipe, or 'package.module:function' / 'path/to/file.py:function' taking the config.
    name: str = "demo"
    demo_prompts: int = 8  # demo recipe: how many validation prompts to generate for

    def __post_init__(self) -> None:
        _require(self.name in RECIPE_NAMES or ":" in self.name, "recipe.name", self.name,
                 f"built-in recipes are {list(RECIPE_NAMES)}, or give 'module:function'")


@dataclass
class HybridFlowConfig:
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    seed: int = 0
