"""Typed configuration: the schema every YAML under conf/ is validated against.

Hydra composes conf/ on top of these dataclasses (registered in its ConfigStore), so an
unknown key or a value of the wrong type fails during composition, before anything starts.
Each section's own rules live in its `__post_init__` and run when `to_config` turns the composed
config into these objects; the rules across sections, and those that ask the runtime (registered
names, the async schedules, the precision of this hardware), are `hybridflow/checks/rules.py`, which
`to_config` runs next, and the stage once its plan is decided — all before Ray starts. Every error names the key, the value and
what is allowed. This module imports only the config package and the standard library
(tests/unit/test_layering.py).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Dict, List, Optional

from hybridflow.config.pretrain import PretrainConfig
from hybridflow.config.dpo import (  # noqa: F401 - recipe=dpo's section; the names re-exported
    PREFERENCE_LOSS_BETAS, PREFERENCE_LOSS_NAMES, REFERENCE_FREE_LOSSES, TRUNCATION_MODES, DPOConfig)
from hybridflow.config.recipes import RECIPE_SPECS, recipe_spec, stage_recipes
from hybridflow.config.model_facts import ModelFacts
from hybridflow.config.hooks import HookConfig
from hybridflow.config.reward import RewardConfig
from hybridflow.config.teacher import DISTILLATION_SIGNAL_NAMES, TeacherConfig  # noqa: F401 - re-exported

ROLES = ("actor", "rollout", "reference", "critic", "reward", "teacher")


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
    auto = "auto"  # model.dtype / rollout.dtype only: chosen by the hardware when the config is checked (hybridflow/precision.py)


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
    # docs/cluster.md: only nodes with this Ray label ('tier=gen') or custom resource ('gen_node')
    node_affinity: Optional[str] = None
    exclusive_nodes: bool = False  # no other pool on this pool's nodes

    def __post_init__(self) -> None:
        _require(self.nodes >= 1, "placement.pools.<name>.nodes", self.nodes, "must be >= 1")
        _require(self.devices_per_node >= 1, "placement.pools.<name>.devices_per_node", self.devices_per_node, "must be >= 1")
        _require(self.cpus_per_device > 0, "placement.pools.<name>.cpus_per_device", self.cpus_per_device, "must be > 0")
        _require(self.node_affinity is None or bool(self.node_affinity.strip()), "placement.pools.<name>.node_affinity",
                 self.node_affinity, "a Ray node label 'key=value', a custom resource name, or null")


def _pool(name: str, value: Any) -> PoolConfig:
    if isinstance(value, PoolConfig):
        return value
    fields = set(PoolConfig.__dataclass_fields__)
    _require(isinstance(value, dict) and set(value) <= fields, f"placement.pools.{name}", value,
             f"a pool takes the keys {sorted(fields)}, e.g. +placement.pools.{name}={{devices_per_node:1}}")
    return PoolConfig(**value)


@dataclass
class PlannerConfig:
    """The placement planner (hybridflow/planning, docs/placement.md), used by placement=auto."""

    # Before Ray starts, search this run's plans on its cluster and run the fastest predicted (the
    # pools, roles' pools and rollout TP; where no plan fits at the configured <role>.sequence_parallel_size,
    # the smallest larger size the heads admit at which one fits, docs/long_sequences.md); the plan and its
    # prediction are saved as run_dir/plan.json and every step's metrics carry plan/predicted_<stage>_s.
    auto: bool = False
    # Rates JSON from `hybridflow plan --calibrate --save-rates FILE`; null: the rates cached for this
    # device, else built-in ones for it, else another device's, marked borrowed (docs/placement.md
    # "Rates per device"; a run's measured steps then become this device's cached rates).
    rates: Optional[str] = None
    policy: str = "exhaustive"  # a registered placement policy (hybridflow.planning.search.POLICIES)
    cost_model: str = "analytical"  # a registered cost model (hybridflow.planning.cost.COST_MODELS)


PLACEMENT_BACKENDS = ("ray", "local")  # placement.backend
ONE_PROCESS_BACKENDS = frozenset({"local"})  # hybridflow/controller/local.py


@dataclass
class PlacementConfig:
    device: DeviceKind = DeviceKind.auto
    # ray: worker processes placed through Ray (the default, and the only way past one device); local:
    # the driver and every role in one process on one device, no Ray (hybridflow/controller/local.py;
    # conf/placement/local.yaml; what one process cannot do is refused before start)
    backend: str = "ray"
    # name -> PoolConfig. Typed as Any so that a pool can be added from the command line
    # (`+placement.pools.gen={devices_per_node:1}`: OmegaConf refuses a new entry of a typed dict);
    # each entry is checked and turned into a PoolConfig in __post_init__.
    pools: Dict[str, Any] = field(default_factory=lambda: {"global": PoolConfig(devices_per_node=2)})
    # role -> pool name; roles on the same pool are fused into one process per device
    roles: Dict[str, str] = field(default_factory=lambda: {role: "global" for role in ROLES})
    collective_timeout_s: float = 600.0
    # A node lost mid-run (docs/cluster.md): before a restart, wait at most this long for the plan to fit again.
    node_wait_s: float = 300.0
    # Before any pool is reserved, every node the plan uses reads the model, data and code files and writes the run dir.
    check_storage: bool = True
    # CPU pools: pin each process's threads to cores of its own (cpus_per_device of them, rounded
    # up, handed out in order per node), so pools on one node do not fight over the cores.
    # A process whose cores would run past the node's is left unpinned. null: pin when the pools
    # run at the same time (trainer.max_staleness > 0); a synchronous run's pools take turns.
    pin_cpus: Optional[bool] = None
    # One GPU's memory, for the memory floor before start (micro-batch rows, activation checkpointing,
    # the refusal of a run that cannot fit). null: this machine's first GPU; a driver without a GPU
    # (submitting to a cluster) does not know it, and then nothing is chosen from it.
    gpu_memory_gib: Optional[float] = None
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        _require(self.backend in PLACEMENT_BACKENDS, "placement.backend", self.backend,
                 f"one of {list(PLACEMENT_BACKENDS)} (local: one process on one device, no Ray)")
        _require(bool(self.pools), "placement.pools", self.pools, "define at least one pool")
        self.pools = {name: _pool(name, p) for name, p in self.pools.items()}
        for role, pool in self.roles.items():
            _require(role in ROLES, f"placement.roles.{role}", pool, f"roles are {list(ROLES)}")
            _require(pool in self.pools, f"placement.roles.{role}", pool, f"must name a pool in placement.pools: {sorted(self.pools)}")
        _require(self.collective_timeout_s > 0, "placement.collective_timeout_s", self.collective_timeout_s, "must be > 0")
        _require(self.node_wait_s >= 0, "placement.node_wait_s", self.node_wait_s, "must be >= 0")
        _require(self.gpu_memory_gib is None or self.gpu_memory_gib > 0, "placement.gpu_memory_gib",
                 self.gpu_memory_gib, "must be > 0 (GiB of one GPU), or null to read this machine's")

    @property
    def one_process(self) -> bool:
        """placement.backend=local: the driver and every role in this one process (no Ray)."""
        return self.backend in ONE_PROCESS_BACKENDS


def plain(value: Any) -> Any:
    """A config (or any value holding dataclasses, enums, dicts and lists) as JSON's types: what
    config.json saves and the config reference shows."""
    if is_dataclass(value):
        return plain(asdict(value))
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def model_heads(model: "ModelConfig") -> tuple[int, int]:
    """(attention heads, key/value heads) from the tiny model config or model.path's config.json
    (`ModelFacts`); (0, 0) when the directory cannot tell (checked again when the model loads)."""
    if model.path is None:
        return model.tiny.num_attention_heads, model.tiny.num_key_value_heads
    facts = ModelFacts.from_dir(model.path)
    return (facts.heads, facts.kv_heads) if facts is not None else (0, 0)


def model_layers(model: "ModelConfig") -> int:
    """Decoder layers of the tiny model or model.path's config.json (`ModelFacts`); 1 when the
    directory cannot tell. Precision tolerances grow with it."""
    if model.path is None:
        return model.tiny.num_hidden_layers
    facts = ModelFacts.from_dir(model.path)
    return (facts.layers if facts is not None else 0) or 1


@dataclass
class TinyModelConfig:
    """The tiny Qwen2 model built offline (hybridflow.builders.build_tiny_model)."""

    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    seed: int = 0
    # The tokenizer also has '{' and '}': JSON tool calls (rollout.tool_call_parser=hermes); off, those ids
    # decode to nothing, as a random model's samples of them always have
    json_characters: bool = False

    def __post_init__(self) -> None:
        _require(self.num_attention_heads >= 1 and self.num_key_value_heads >= 1, "model.tiny.num_attention_heads/"
                 "num_key_value_heads", (self.num_attention_heads, self.num_key_value_heads), "must be >= 1")
        _require(self.hidden_size % self.num_attention_heads == 0, "model.tiny.hidden_size", self.hidden_size,
                 f"must be a multiple of num_attention_heads ({self.num_attention_heads})")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "model.tiny.num_key_value_heads",
                 self.num_key_value_heads, f"num_attention_heads ({self.num_attention_heads}) must be a multiple of it")


@dataclass
class ModelConfig:
    path: Optional[str] = None  # a Hugging Face model directory; null builds the tiny model offline
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    # Precision (docs/recipes.md#precision). What the actor, critic and reference compute in; auto:
    # float16 on CUDA GPUs (loss-scaled), float32 on CPUs: what learns (hybridflow/precision.py)
    dtype: Dtype = Dtype.float32
    # What the actor's and critic's parameters, gradient reduction and optimizer state are kept in;
    # float32 with a 16-bit dtype is mixed precision (FSDP2's MixedPrecisionPolicy), master_dtype=dtype
    # trains purely in it (less memory; an Adam step below half an ulp rounds away).
    master_dtype: Dtype = Dtype.float32
    # false: every dropout probability of the model is set to 0 when a role loads it (RL needs
    # log-probs that are a function of the weights); true: keep the config's dropout.
    keep_dropout: bool = False
    # Run the model directory's own Python code (its config.json `auto_map`): passed to the actor,
    # critic and reference model loaders and to the tokenizers of the preflight check and the RL driver.
    trust_remote_code: bool = False
    # Packed sequences in the actor's, critic's and reference's forwards and backwards
    # (hybridflow/training/packing.py): a micro-batch's real tokens as one row, attention kept within
    # each sequence, no compute on padding. null: packed wherever the model's attention allows
    # (sdpa, no soft-capping, no active sliding window); true: packed or an error at start; false: padded.
    pack_sequences: Optional[bool] = None
    # Shared prompts in the packed passes (hybridflow/training/shared_prompts.py): a micro-batch's rows
    # with equal prompt tokens (a GRPO group's samples) have the prompt computed once, every response
    # attending to it; the same log-probs, values and gradients. null: wherever packing runs; true:
    # shared or an error at start; false: every row its own prompt.
    share_prompts: Optional[bool] = None

    def __post_init__(self) -> None:
        _require(not (self.share_prompts is True and self.pack_sequences is False), "model.share_prompts", True,
                 "shared prompts are a layout of packed rows: set model.pack_sequences to null or true, "
                 "or model.share_prompts to null or false")
        _require(self.master_dtype is not Dtype.auto, "model.master_dtype", self.master_dtype.value,
                 "float32 (or model.dtype's own dtype for pure 16-bit training); auto is for model.dtype only")
        _require(self.master_dtype in (Dtype.float32, self.dtype), "model.master_dtype", self.master_dtype.value,
                 f"float32 (mixed precision: compute in model.dtype={self.dtype.value}) or model.dtype itself "
                 f"({self.dtype.value}: pure {self.dtype.value} training)")


@dataclass
class SyntheticTaskConfig:
    min_digits: int = 1
    max_digits: int = 2
    operations: List[str] = field(default_factory=lambda: ["add"])
    train_rows: int = 4000
    val_rows: int = 200
    # Training rows also carry a `demonstration` of the calculator tool (hybridflow/data/calculator.py)
    # for SFT before agent RL (recipe=agent_pipeline): model turns and tool output, alternating.
    calculator_demonstrations: bool = False
    # Training rows only: keep those whose first operand is below this (the validation rows stay the
    # whole task). An SFT stage then demonstrates part of the task, and RL on the whole task's prompts
    # has the rest to learn (the default pipeline, docs/pipeline.md). null: every row.
    train_first_operand_below: Optional[int] = None
    # With train_first_operand_below: the first this many training rows whose first operand is not below
    # it are kept too, after the others (all of them where there are fewer). A few demonstrations of the
    # rest give every seed's SFT model a foothold there, which RL then widens (docs/results/default_pipeline.md, "A
    # foothold in the other half"). 0: none.
    train_rows_not_below: int = 0

    def __post_init__(self) -> None:
        _require(1 <= self.min_digits <= self.max_digits <= 9, "data.synthetic.min_digits/max_digits",
                 (self.min_digits, self.max_digits), "need 1 <= min_digits <= max_digits <= 9")
        bad = [op for op in self.operations if op not in ("add", "sub", "mul")]
        _require(bool(self.operations) and not bad, "data.synthetic.operations", self.operations, "a non-empty subset of [add, sub, mul]")
        _require(self.train_rows >= 1 and self.val_rows >= 1, "data.synthetic.train_rows/val_rows",
                 (self.train_rows, self.val_rows), "must be >= 1")
        _require(self.train_first_operand_below is None or self.train_first_operand_below >= 1,
                 "data.synthetic.train_first_operand_below", self.train_first_operand_below,
                 "must be >= 1 (training rows whose first operand is below it), or null for every row")
        _require(self.train_rows_not_below >= 0, "data.synthetic.train_rows_not_below", self.train_rows_not_below,
                 "must be >= 0")
        _require(not self.train_rows_not_below or self.train_first_operand_below is not None,
                 "data.synthetic.train_rows_not_below", self.train_rows_not_below,
                 "keeps rows past data.synthetic.train_first_operand_below, which is null (every row is kept): "
                 "set that bound, or leave this at 0")


@dataclass
class DataConfig:
    train_path: Optional[str] = None  # .parquet / .jsonl with prompt, ground_truth, data_source; null: synthetic
    val_path: Optional[str] = None
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    max_prompt_tokens: int = 64
    seed: int = 0
    # Row checks before anything starts (hybridflow/checks/preflight.py): 'sample' reads the first rows of
    # each file (every row's prompt is checked again during the one full read, still before Ray);
    # 'all' streams every row first; 'none' checks only files, columns and row counts.
    validate_rows: str = "sample"
    # A prompt longer than max_prompt_tokens, checked on every row before Ray starts: 'error' names
    # the rows; 'left' keeps its last tokens; 'filter' leaves the row out (counted on the console).
    prompt_truncation: str = "error"

    def __post_init__(self) -> None:
        _require((self.train_path is None) == (self.val_path is None), "data.train_path/val_path",
                 (self.train_path, self.val_path), "set both to files, or leave both null for the synthetic task")
        _require(self.max_prompt_tokens >= 1, "data.max_prompt_tokens", self.max_prompt_tokens, "must be >= 1")
        _require(self.validate_rows in ("all", "sample", "none"), "data.validate_rows", self.validate_rows,
                 "one of ['all', 'sample', 'none']")
        _require(self.prompt_truncation in ("error", "left", "filter"), "data.prompt_truncation",
                 self.prompt_truncation, "one of ['error', 'left', 'filter']")


@dataclass
class OpenEnvConfig:
    """An OpenEnv environment as an agent (rollout.agent=openenv:<target>; docs/agents.md)."""

    # 'path/to/file.py:fn' or 'package.module:fn': fn(text) -> dict of the action's fields. null: the
    # text goes into the action's one string field (refused before the first step when it has none or several)
    action: Optional[str] = None
    # fn(observation: dict) -> str | None: the text the model reads. null: the observation's one string field
    observation: Optional[str] = None
    stop: List[str] = field(default_factory=list)  # texts that end a model turn, besides EOS
    startup_timeout_s: float = 60.0  # a server the run starts must answer /health within this
    # sessions a server the run starts from an Environment class holds at once (openenv's
    # max_concurrent_envs): one per trajectory in flight; more than 1 needs SUPPORTS_CONCURRENT_SESSIONS
    max_sessions: int = 256

    def __post_init__(self) -> None:
        from hybridflow.config.references import absolute_reference

        for key in ("action", "observation"):
            value = getattr(self, key)
            if value is not None:
                try:
                    setattr(self, key, absolute_reference(str(value)))
                except (ValueError, FileNotFoundError) as exc:
                    raise ValueError(f"config rollout.openenv.{key}={value!r} is invalid: {exc}; give "
                                     "'path/to/file.py:fn' or 'package.module:fn'") from None
        _require(self.startup_timeout_s > 0, "rollout.openenv.startup_timeout_s", self.startup_timeout_s,
                 "must be > 0 seconds")
        _require(self.max_sessions >= 1, "rollout.openenv.max_sessions", self.max_sessions, "must be >= 1")


@dataclass
class RolloutConfig:
    # The generation engine: a registered one (vllm; hf; exact: the actor's own module, sampling what the
    # actor's π_old computes bit for bit, the π_old pass replaying its decode; hybridflow/config/engines.py) or 'package.module:NAME'
    # naming a RolloutEngine
    backend: str = "vllm"
    max_response_tokens: int = 8
    temperature: float = 1.0
    # Truncated sampling (nucleus / top-k; -1: the whole vocabulary). Only recipes that do not train on
    # their samples (evaluate, demo) accept it: the engines report the truncated distribution's
    # log-probs, which the actor's whole-vocabulary ones never equal (hybridflow/checks/rules.py)
    top_p: float = 1.0
    top_k: int = -1
    samples_per_prompt: int = 1
    # conf/rollout/*.yaml: auto, model.dtype as resolved (hybridflow/precision.py); a RolloutConfig built in
    # Python without a HybridFlowConfig around it is never resolved, so its own default is a dtype
    dtype: Dtype = Dtype.float32
    tensor_parallel_size: int = 1
    kv_cache_space_gib: int = 1  # vLLM's KV cache on a CPU (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.5  # share of a GPU vLLM may take when colocated with training
    max_num_seqs: int = 256
    fp32_lm_head: bool = False  # the engine's output head in float32 (engines that can: hf; vLLM cannot here)
    enforce_eager: Optional[bool] = None  # null: eager on a CPU (no CUDA graphs there), CUDA graphs on a GPU
    # The hf engine on a GPU: its decode step at one shape over transformers' StaticCache, captured by
    # torch.compile (mode reduce-overhead). Off until a GPU run has measured it (docs/gpu.md): the eager
    # preallocated cache runs on every device
    compile_decode: bool = False
    # How a colocated engine sleeps while the actor trains (workers/rollout/__init__.py): 1 keeps its
    # weights (vLLM: in host memory), 2 discards them, for runs whose every sync rewrites every weight.
    # null: 2, or 1 where a sync leaves weights as they are (weight_sync.lora=adapter: the base weights)
    sleep_level: Optional[int] = None
    seed: int = 0
    # A sampler generator per request (vLLM's SamplingParams.seed, from each sample's `sample_seed`): a
    # sample's draws then do not depend on the batch it runs in, at the cost of a slower sampler on GPUs
    # (vLLM samples seeded requests one by one). false: one sampler stream per batch, seeded from its
    # first sample's seed, so a step still draws what a resumed run of it draws. Agent rollouts always seed
    # each request (their turns run as separate engine calls).
    seed_per_request: bool = False
    # Multi-turn agent rollouts (docs/agents.md): tools (typed functions) and environment classes,
    # each 'path/to/file.py:Name' or 'package.module:Name', or an OpenEnv environment,
    # 'openenv:<module:app | file.py:EnvClass | http://host:port>' (rollout.openenv); empty: one response
    # per prompt. Typed Any so one reference or a list can be given from the command line; __post_init__
    # makes it a list.
    agent: Any = None
    # rollout.agent=openenv:<target>: its text <-> action/observation mapping and its server (docs/agents.md
    # "OpenEnv environments")
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
    agent_column: str = "agent"  # with several agents: the data column naming each row's agent
    max_turns: int = 4  # model turns per trajectory; max_response_tokens bounds all its tokens
    tool_timeout_s: float = 10.0  # per tool call (environment step); past it the model reads an error
    # A step stops the run when more than this share of its environment steps failed on the environment's
    # side: timed out, or raised anything but ValueError/TypeError/LookupError (the model's call was wrong;
    # hybridflow/agents/environment.py). 1.0: never stops (the first failure is still said)
    max_env_failure_fraction: float = 0.1
    # An environment from a hub, trained unchanged (docs/agents.md "Environments from the hubs"): '<hub>:<id>',
    # e.g. verifiers:my_env (an installed verifiers taskset, or verifiers:path/to/env.py); its rows' episodes
    # reach the model through the engine's OpenAI-compatible endpoint, and reward.fn=environment is its
    # rubric. Empty: none
    environment: str = ""
    # The environment's own load arguments (verifiers: its env config, as its --env.* flags would give it),
    # a mapping. Typed Any so the whole mapping can be given from the command line; null: none
    environment_args: Any = None
    # The environment's tool calls (docs/agents.md "Tool calls through the endpoint"): the vLLM tool-call
    # parser that reads them out of the model's text, by the name `vllm serve --tool-call-parser` takes
    # (hermes: <tool_call>{json}</tool_call>, Qwen2.5/Qwen3; llama3_json, mistral, ...). Empty: a request
    # that offers tools is refused
    tool_call_parser: str = ""
    # trainer.max_staleness >= 2 (docs/async.md): what requests running when new weights arrive do.
    # 'finish': they finish on the weights they started with, and the load waits for the batch;
    # 'recompute': the load lands between two engine steps, and running requests keep their tokens
    # and log-probs and continue on the new weights (their keys and values recomputed); every
    # token records the policy version that sampled it.
    on_update: str = "finish"

    def __post_init__(self) -> None:
        from hybridflow.config.references import check_agent_references, check_environment

        self.agent = check_agent_references(self.agent, "rollout.agent")
        self.environment = check_environment(self.environment)
        _require(not (self.environment and self.agent), "rollout.environment", self.environment,
                 "an environment from a hub brings its own turn logic; unset rollout.agent, or this key")
        self.environment_args = {} if self.environment_args is None else self.environment_args
        _require(isinstance(self.environment_args, dict), "rollout.environment_args", self.environment_args,
                 "a mapping of the environment's load arguments, e.g. {agent: {max_turns: 4}}")
        _require(bool(self.environment) or not self.environment_args, "rollout.environment_args",
                 self.environment_args, "arguments of no environment: set rollout.environment, or drop them")
        _require(bool(self.environment) or not self.tool_call_parser, "rollout.tool_call_parser", self.tool_call_parser,
                 "parses the tool calls of a hub environment's agent (rollout.environment), and none is set: set "
                 "rollout.environment, or unset this key")
        if isinstance(self.openenv, OpenEnvConfig) and self.openenv != OpenEnvConfig():
            _require(any(str(a).startswith("openenv:") for a in self.agent), "rollout.openenv", self.openenv,
                     "only with an OpenEnv environment in rollout.agent (openenv:<target>): nothing else reads it")
        _require(self.max_turns >= 1, "rollout.max_turns", self.max_turns, "must be >= 1")
        _require(self.on_update in ("finish", "recompute"), "rollout.on_update", self.on_update,
                 "one of ['finish', 'recompute']")
        _require(0 <= self.max_env_failure_fraction <= 1, "rollout.max_env_failure_fraction",
                 self.max_env_failure_fraction, "must be in [0, 1] (1.0: never stop)")
        _require(self.tool_timeout_s > 0, "rollout.tool_timeout_s", self.tool_timeout_s, "must be > 0 seconds")
        _require(self.max_response_tokens >= 1, "rollout.max_response_tokens", self.max_response_tokens, "must be >= 1")
        _require(self.temperature >= 0, "rollout.temperature", self.temperature, "must be >= 0 (0 is greedy)")
        _require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        _require(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", self.top_k,
                 "must be -1 (the whole vocabulary) or >= 1")
        _require(self.samples_per_prompt >= 1, "rollout.samples_per_prompt", self.samples_per_prompt, "must be >= 1")
        _require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        _require(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        _require(self.kv_cache_space_gib >= 1, "rollout.kv_cache_space_gib", self.kv_cache_space_gib, "must be >= 1")
        _require(self.sleep_level in (None, 1, 2), "rollout.sleep_level", self.sleep_level, "one of [1, 2] or null")


@dataclass
class WeightSyncConfig:
    """Moving the actor's weights into the rollout engines each step (hybridflow.resharding)."""

    bucket_mb: float = 64.0  # tensors travel in buckets of about this size
    timeout_s: float = 300.0  # every transfer and the whole sync; past it, an error naming who did not answer
    # after every sync: probe (rollout vs actor log-probs on a probe prompt) | none. An engine that computes
    # with the actor's own parameters (rollout.backend=exact) holds no weights to check: no probe there
    check: str = "probe"
    checksum_every_steps: int = 0  # also compare per-tensor checksums every N syncs (0: never)
    # The probe's largest allowed mean log-prob gap per token (its 90th percentile may reach 4x this);
    # null: 1e-3 when model.dtype and rollout.dtype are float32, max(1e-2, 2e-3 x decoder layers) when
    # either is 16-bit (set from them when the config is read; hybridflow/resharding/parity.py).
    probe_tolerance: Optional[float] = None
    # With a LoRA actor (actor.lora.rank > 0), what a sync moves into vLLM: adapter (the LoRA factors
    # only, served by vLLM as an adapter under a new id each sync, its checksums compared every sync;
    # docs/resharding.md "LoRA served as an adapter"), folded (the whole model, W + (alpha/r)BA), or
    # auto (adapter where vLLM can serve it, folded otherwise; the console says which and why)
    lora: str = "auto"

    def __post_init__(self) -> None:
        _require(self.lora in ("auto", "adapter", "folded"), "weight_sync.lora", self.lora,
                 "one of ['auto', 'adapter', 'folded']")
        _require(self.bucket_mb > 0, "weight_sync.bucket_mb", self.bucket_mb, "must be > 0")
        _require(self.timeout_s > 0, "weight_sync.timeout_s", self.timeout_s, "must be > 0")
        _require(self.check in ("probe", "none"), "weight_sync.check", self.check, "one of ['probe', 'none']")
        _require(self.checksum_every_steps >= 0, "weight_sync.checksum_every_steps", self.checksum_every_steps,
                 "must be >= 0 (0: never)")
        _require(self.probe_tolerance is None or self.probe_tolerance > 0, "weight_sync.probe_tolerance",
                 self.probe_tolerance, "must be > 0, or null for the default of the dtypes")


DYNAMIC_SAMPLING_METRICS = ("accuracy", "reward", "shaped_reward")  # algorithm.dynamic_sampling_metric
# algorithm.rollout_correction: auto and hybridflow.algos.rollout_correction's presets (the schema imports
# no runtime module; tests/unit/test_rollout_mismatch.py checks the two lists agree)
ROLLOUT_CORRECTION_PRESETS = ("auto", "none", "token_tis", "seq_tis", "token_mis", "seq_mis", "geo_mask", "icepop",
                              "token_mask")


@dataclass
class AlgorithmConfig:
    # A registered advantage estimator (gae, grpo, dr_grpo, rloo, reinforce_plus_plus, remax) or 'module:fn'.
    advantage_estimator: str = "grpo"
    use_critic: bool = False  # gae needs a critic; the critic-free estimators do not
    gamma: float = 1.0
    lam: float = 1.0
    kl_penalty_coef: float = 0.0  # KL to the reference as a reward penalty (0: off)
    kl_penalty_estimator: str = "k1"
    kl_controller: str = "fixed"  # fixed | adaptive (starts at kl_penalty_coef, which must then be > 0)
    kl_target: float = 0.1  # adaptive controller's target KL per sequence
    kl_horizon: int = 10000  # adaptive controller's horizon, in samples
    # Rollout correction (docs/algorithms.md "Rollout correction"): how the update corrects for sampling
    # from the engine's policy μ instead of π_old. auto: token_tis on batches from an older policy whose
    # π_old the actor recomputes (trainer.old_log_probs=actor), nothing otherwise; none, token_tis,
    # seq_tis, token_mis, seq_mis, geo_mask, icepop, token_mask: on every batch, fresh or stale (the actor
    # then recomputes π_old: trainer.old_log_probs=auto chooses actor, =sampler is refused)
    rollout_correction: str = "auto"
    rollout_correction_cap: float = 2.0  # C of token_tis and seq_tis (and auto): the weight is min(ratio, C)
    # the ratio band [low, high] outside which token_mis, seq_mis, geo_mask, icepop and token_mask mask;
    # null: the preset's own (token_mis, seq_mis, token_mask [0.5, 2]; geo_mask [1/1.001, 1.001];
    # icepop [0.5, 5])
    rollout_correction_low: Optional[float] = None
    rollout_correction_high: Optional[float] = None
    # Folded into rollout_correction_cap; kept only to name the fix when a config still sets it.
    behavior_is_cap: Optional[float] = None
    # A console line when a step's per-token KL(sampler ‖ trainer) (k3, `rollout_mismatch/k3_kl`) is
    # above this; null: no line
    mismatch_warn_kl: Optional[float] = None
    # DAPO's dynamic sampling (docs/algorithms.md "Dynamic sampling"): a group whose samples' rewards all
    # agree is dropped and more prompts are generated, up to this many extra rounds per step, so the
    # step trains on trainer.prompts_per_step groups that carry a signal (0: off)
    dynamic_sampling_rounds: int = 0
    # what a group's samples must differ in to be kept: accuracy (the reward's `accuracy` extra; verl's
    # filter_groups.metric=acc, as its DAPO recipe sets), reward (the reward role's total; verl's
    # seq_reward), shaped_reward (after the overlong shaping, what the advantages see; verl's seq_final_reward)
    dynamic_sampling_metric: str = "accuracy"
    # when the extra rounds run out short of trainer.prompts_per_step informative groups: raise (as verl
    # does past max_num_gen_batches), or top_up (train a full batch topped up with groups that agree)
    dynamic_sampling_on_limit: str = "raise"
    # prompts drawn and generated per round (verl's data.gen_batch_size; its DAPO recipe draws 3x the
    # training batch), a multiple of trainer.prompts_per_step; 0: trainer.prompts_per_step
    dynamic_sampling_prompts_per_round: int = 0
    # DAPO's overlong shaping: a response within this many tokens of rollout.max_response_tokens loses
    # up to overlong_penalty from its reward, linearly, the whole of it at the limit (0: off)
    overlong_buffer_tokens: int = 0
    overlong_penalty: float = 1.0  # the most a response at the limit loses (DAPO: 1, the reward's scale)

    def __post_init__(self) -> None:
        _require(self.use_critic or self.advantage_estimator != "gae", "algorithm.use_critic", self.use_critic,
                 "advantage_estimator=gae needs a critic: set algorithm.use_critic=true (or recipe=ppo)")
        _require(0 <= self.gamma <= 1, "algorithm.gamma", self.gamma, "must be in [0, 1]")
        _require(0 <= self.lam <= 1, "algorithm.lam", self.lam, "must be in [0, 1]")
        _require(self.kl_penalty_coef >= 0, "algorithm.kl_penalty_coef", self.kl_penalty_coef, "must be >= 0")
        _require(self.kl_controller != "adaptive" or self.kl_penalty_coef > 0, "algorithm.kl_penalty_coef",
                 self.kl_penalty_coef, "algorithm.kl_controller=adaptive starts from algorithm.kl_penalty_coef and "
                 "scales it, so from 0 it can never move: set algorithm.kl_penalty_coef to its starting value "
                 "(e.g. 0.05), or use algorithm.kl_controller=fixed")
        _require(self.dynamic_sampling_rounds >= 0, "algorithm.dynamic_sampling_rounds", self.dynamic_sampling_rounds,
                 "must be >= 0 (0: off)")
        _require(self.dynamic_sampling_metric in DYNAMIC_SAMPLING_METRICS, "algorithm.dynamic_sampling_metric",
                 self.dynamic_sampling_metric, f"must be one of {list(DYNAMIC_SAMPLING_METRICS)}")
        _require(self.dynamic_sampling_on_limit in ("raise", "top_up"), "algorithm.dynamic_sampling_on_limit",
                 self.dynamic_sampling_on_limit, "must be raise (stop the run) or top_up (train on groups that agree)")
        _require(self.dynamic_sampling_prompts_per_round >= 0, "algorithm.dynamic_sampling_prompts_per_round",
                 self.dynamic_sampling_prompts_per_round, "must be >= 0 (0: trainer.prompts_per_step)")
        _require(not self.dynamic_sampling_rounds or self.advantage_estimator != "remax",
                 "algorithm.dynamic_sampling_rounds", self.dynamic_sampling_rounds,
                 "ReMax's baseline is a greedy response, not the group: dynamic sampling needs a group estimator "
                 "(grpo, dr_grpo, rloo); set it to 0")
        _require(self.overlong_buffer_tokens >= 0, "algorithm.overlong_buffer_tokens", self.overlong_buffer_tokens,
                 "must be >= 0 (0: off)")
        _require(self.overlong_penalty >= 0, "algorithm.overlong_penalty", self.overlong_penalty, "must be >= 0")
        self._check_rollout_correction()
        _require(self.kl_target > 0, "algorithm.kl_target", self.kl_target,
                 "must be > 0 (the adaptive controller's target KL per sequence)")
        _require(self.kl_horizon > 0, "algorithm.kl_horizon", self.kl_horizon,
                 "must be > 0 (the adaptive controller's horizon in samples; Ziegler et al. use 10000)")

    def _check_rollout_correction(self) -> None:
        preset, low, high = self.rollout_correction, self.rollout_correction_low, self.rollout_correction_high
        _require(self.behavior_is_cap is None, "algorithm.behavior_is_cap", self.behavior_is_cap,
                 "was folded into algorithm.rollout_correction (docs/algorithms.md \"Rollout correction\"): set "
                 "algorithm.rollout_correction_cap to the same cap (rollout_correction=auto applies it to stale "
                 "batches, as behavior_is_cap did), or algorithm.rollout_correction=none for no weight (cap 0)")
        _require(preset in ROLLOUT_CORRECTION_PRESETS, "algorithm.rollout_correction", preset,
                 f"must be one of {list(ROLLOUT_CORRECTION_PRESETS)}")
        _require(self.rollout_correction_cap >= 1, "algorithm.rollout_correction_cap", self.rollout_correction_cap,
                 "must be >= 1 (a weight capped below 1 would shrink every token whose ratio is 1)")
        masks = preset in ("token_mis", "seq_mis", "geo_mask", "icepop", "token_mask")
        for key, value in (("algorithm.rollout_correction_low", low), ("algorithm.rollout_correction_high", high)):
            _require(value is None or masks, key, value, "only token_mis, seq_mis, geo_mask, icepop and token_mask "
                     f"read a band, and algorithm.rollout_correction={preset}: drop the key, or choose one of them")
        _require(low is None or 0 < low <= 1, "algorithm.rollout_correction_low", low,
                 "must be in (0, 1]: the band must hold ratio 1 (the sampler agreeing with the trainer)")
        _require(high is None or high >= 1, "algorithm.rollout_correction_high", high,
                 "must be >= 1: the band must hold ratio 1 (the sampler agreeing with the trainer)")
        _require(self.mismatch_warn_kl is None or self.mismatch_warn_kl > 0, "algorithm.mismatch_warn_kl",
                 self.mismatch_warn_kl, "must be > 0 (a per-token KL, e.g. 0.001), or null for no console line")


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    # constant | cosine (decays to min_lr_ratio * lr at schedule_steps) | wsd (warmup-stable-decay:
    # constant, then linear to min_lr_ratio * lr over the last decay_steps of schedule_steps)
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    decay_steps: int = 0  # read by wsd only
    # Steps the schedule spans; null: trainer.total_steps. More than total_steps ends the run partway
    # down the schedule (an SFT stage that hands on a model while it is still learning fast).
    schedule_steps: Optional[int] = None
    max_grad_norm: float = 1.0  # 0 disables clipping
    # PyTorch's fused AdamW (one kernel over every parameter): null, on CUDA; true, on the CPU too (a real
    # model's step 6-7x faster there, docs/results/performance.md "The optimizer step"; off by default on
    # the CPU until the documented CPU runs are remeasured with it); false, never.
    fused: Optional[bool] = None

    def __post_init__(self) -> None:
        _require(self.lr > 0, "<role>.optim.lr", self.lr, "must be > 0")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "<role>.optim.betas", self.betas,
                 "two numbers in [0, 1)")
        _require(self.lr_schedule in ("constant", "cosine", "wsd"), "<role>.optim.lr_schedule", self.lr_schedule,
                 "one of ['constant', 'cosine', 'wsd']")
        _require(self.decay_steps >= (1 if self.lr_schedule == "wsd" else 0), "<role>.optim.decay_steps",
                 self.decay_steps, "must be >= 0, and >= 1 with lr_schedule=wsd (the length of its decay)")
        _require(self.max_grad_norm >= 0, "<role>.optim.max_grad_norm", self.max_grad_norm, "must be >= 0")
        _require(self.schedule_steps is None or self.schedule_steps >= 1, "<role>.optim.schedule_steps",
                 self.schedule_steps, "must be >= 1, or null to span trainer.total_steps")


@dataclass
class LoraConfig:
    rank: int = 0  # 0: full fine-tuning
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    # Checkpoints' hf/ and final_model/ hold the peft adapter (adapter_config.json,
    # adapter_model.safetensors) instead of the whole model with the adapter folded in.
    save_adapter_only: bool = False

    def __post_init__(self) -> None:
        _require(not self.save_adapter_only or self.rank > 0, "actor.lora.save_adapter_only", self.save_adapter_only,
                 "needs actor.lora.rank > 0 (a full fine-tune has no adapter); set actor.lora.rank or drop the key")


@dataclass
class ActorConfig:
    # the output head's matmul and logits in float32 when the model computes in a 16-bit dtype (the
    # reference's too), as the field's answer to rollout-training mismatch; priced in the memory floor
    fp32_lm_head: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    samples_per_mini_batch: int = 0  # global; 0: the step's whole batch is one mini-batch (on-policy)
    # per rank; null: the most rows (up to 64) that fit the memory available, chosen before start
    # (hybridflow/checks/memory_budget.py, docs/memory.md "Memory")
    samples_per_micro_batch: Optional[int] = None
    # per rank; the most tokens a micro-batch holds (its real tokens when packed, rows x its longest
    # prompt + response when padded), rows grouped by length and balanced (training/sequences.py); null:
    # samples_per_micro_batch rows of the batch's full width, the memory the choice above priced
    tokens_per_micro_batch: Optional[int] = None
    epochs_per_step: int = 1
    policy_loss: str = "ppo_clip"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip_c: Optional[float] = None
    loss_aggregation: str = "token-mean"
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0  # KL to the reference as a loss term (0: off)
    kl_loss_estimator: str = "k3"
    # Leave samples whose advantages are all 0 out of the update's forward/backward when that
    # changes no gradient (a loss that declares it, no entropy or KL term): same update, less compute.
    skip_zero_advantage_samples: bool = True
    # null: on only when fewer than 8 rows of a micro-batch would fit without it (chosen before start)
    gradient_checkpointing: Optional[bool] = None
    # Ulysses sequence parallelism: each packed row of the actor's training forward split along its length
    # over this many consecutive ranks (docs/long_sequences.md); must divide the actor's ranks and the
    # model's attention and key/value heads; needs packed sequences. The reference (the actor's starting
    # model, scoring as the actor does) splits its rows over as many of its own ranks
    sequence_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require(self.sequence_parallel_size >= 1, "actor.sequence_parallel_size", self.sequence_parallel_size,
                 "must be >= 1 (1: every rank computes whole sequences)")
        _require(self.samples_per_mini_batch >= 0, "actor.samples_per_mini_batch", self.samples_per_mini_batch, "must be >= 0")
        _require(self.samples_per_micro_batch is None or self.samples_per_micro_batch >= 1, "actor.samples_per_micro_batch",
                 self.samples_per_micro_batch, "must be >= 1, or null to choose from the memory available")
        _require(self.tokens_per_micro_batch is None or self.tokens_per_micro_batch >= 1, "actor.tokens_per_micro_batch",
                 self.tokens_per_micro_batch, "must be >= 1, or null: samples_per_micro_batch full-width rows' worth")
        _require(self.epochs_per_step >= 1, "actor.epochs_per_step", self.epochs_per_step, "must be >= 1")
        _require(self.dual_clip_c is None or self.dual_clip_c > 1, "actor.dual_clip_c", self.dual_clip_c, "null or > 1")
        _require(0 <= self.clip_ratio_low < 1, "actor.clip_ratio_low", self.clip_ratio_low,
                 "must be in [0, 1): the ratio is clipped below at 1 - clip_ratio_low > 0")
        _require(self.clip_ratio_high >= 0, "actor.clip_ratio_high", self.clip_ratio_high, "must be >= 0")
        _require(self.kl_loss_coef >= 0, "actor.kl_loss_coef", self.kl_loss_coef, "must be >= 0 (0: no KL loss)")


@dataclass
class CriticConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    samples_per_mini_batch: int = 0
    samples_per_micro_batch: Optional[int] = None  # null: the actor's choice (memory available)
    tokens_per_micro_batch: Optional[int] = None  # as actor.tokens_per_micro_batch
    epochs_per_step: int = 1
    value_clip_range: float = 0.2
    loss_aggregation: str = "token-mean"
    # as actor.sequence_parallel_size, over the critic's ranks (docs/long_sequences.md): its forward and value
    # loss split each packed row over this many consecutive ranks
    sequence_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require(self.sequence_parallel_size >= 1, "critic.sequence_parallel_size", self.sequence_parallel_size,
                 "must be >= 1 (1: every rank computes whole sequences)")
        _require(self.tokens_per_micro_batch is None or self.tokens_per_micro_batch >= 1,
                 "critic.tokens_per_micro_batch", self.tokens_per_micro_batch,
                 "must be >= 1, or null: samples_per_micro_batch full-width rows' worth")


# A step's stages, in order: what the recipes time (timing/<stage>_s) and trainer.stage_timeout_s names;
# the planner prices four of them (hybridflow.planning.cost.PRICED_STAGES)
STEP_STAGES = ("generate", "score", "advantages", "update", "weight_sync")
FAULT_KINDS = ("kill", "hang", "corrupt")


@dataclass
class FaultConfig:
    # kill: the rank's process dies; hang: the method never returns; corrupt: the largest file of
    # the newest complete checkpoint is cut to half (the next resume must name it and fall back)
    kind: str = "kill"
    role: str = "actor"
    rank: int = 0
    step: int = 1  # at the start of this step (once per run directory)
    method: str = ""  # hang: the worker method that hangs (e.g. generate)

    def __post_init__(self) -> None:
        _require(self.kind in FAULT_KINDS, "trainer.fault_injection[*].kind", self.kind, f"one of {list(FAULT_KINDS)}")
        _require(self.role in ROLES, "trainer.fault_injection[*].role", self.role, f"one of {list(ROLES)}")
        _require(self.step >= 1 and self.rank >= 0, "trainer.fault_injection[*].step/rank", (self.step, self.rank),
                 "step >= 1 and rank >= 0")
        _require(self.kind != "hang" or bool(self.method), "trainer.fault_injection[*].method", self.method,
                 "kind=hang needs the worker method that hangs, e.g. method=generate")


@dataclass
class TrainerConfig:
    total_steps: int = 20
    prompts_per_step: int = 16
    val_every_steps: int = 5  # 0: validate only at the end
    val_prompts: int = 200  # validation prompts (greedy decoding); at most the validation set
    save_every_steps: int = 0  # 0: no periodic checkpoints
    # A console line (once a run) when a step's update changes less than this share of the weights it
    # moved in the float32 master as the actor computes with them or the engine samples from them
    # (`precision/moved_fraction/*`, hybridflow/training/resolution.py): updates below the 16-bit dtype's
    # resolution (SmolLM2 GRPO at lr 1e-5: bfloat16 0.02-0.06 a step, float16 0.11-0.22); null: no line
    warn_moved_fraction: Optional[float] = 0.08
    # The no-signal guard (hybridflow/training/signal.py): an RL run stops after this many steps in a row
    # whose reward gave every sample (or every group's samples) the same score, so every advantage was 0;
    # the first such step is said on the console. null: the line and `guard/steps_without_signal` only
    max_steps_without_signal: Optional[int] = 10
    # SFT, GRPO and PPO end after the first validation whose val/accuracy reaches this (their final model is
    # that step's; trainer.total_steps is then a ceiling): a stage that hands a model on at a skill level,
    # not at a step count that moves with the CPU's arithmetic. null: run total_steps
    stop_at_val_accuracy: Optional[float] = None
    # Retention (docs/checkpoints.md): the newest N checkpoints keep their full training state
    # (optimizer, RNG, data position: enough to resume; null keeps every one); older ones within
    # the newest keep_last_weights keep only their hf/ weights, for merges (null: every older one;
    # 0: none). A pipeline sets keep_last_weights to what the next stage's merge hook reads.
    keep_last_checkpoints: Optional[int] = 2
    keep_last_weights: Optional[int] = None
    # A checkpoint whose files fail their checksums at resume: 'previous' moves it aside and
    # resumes from the one before; 'stop' raises, naming the file.
    on_corrupt_checkpoint: str = "previous"
    resume: bool = False  # continue from the latest complete checkpoint of logger.run_name
    use_sampler_log_probs: bool = True  # on-policy single update: skip the old-log-prob forward pass
    # Before the update, reorder the step's samples so each data-parallel rank of the actor gets about
    # the same number of tokens (verl's trainer.balance_batch); false: the rows in generation order.
    balance_batch: bool = True
    # Asynchronous RL (docs/async.md): how many policy versions a batch may lag the weights it
    # trains on. 0: generate, then train (the default); 1: the next batch generates while this
    # one trains (needs the rollout on a pool of its own, rollout=vllm and trainer.old_log_probs);
    # N >= 2: up to N batches in flight, new weights received while the rollout generates.
    max_staleness: int = 0
    # What the update clips against (π_old): 'auto' (at max_staleness 0: the sampler's log-probs
    # when on-policy, see use_sampler_log_probs, and no algorithm.rollout_correction preset is chosen;
    # else the actor's), 'actor' (recomputed by the actor, with algorithm.rollout_correction
    # correcting for the sampler) or 'sampler'.
    old_log_probs: str = "auto"
    # Engine parity (docs/recipes.md#engine-parity): on the first batch, before any update, the
    # sampler's and the actor's log-probs of the same tokens (`rollout/log_prob_diff`) must agree
    # within this, or the run stops naming the gap. null: 1e-3 when actor and rollout compute in
    # float32, max(1e-2, 2e-3 x decoder layers) when either computes in 16 bits. Raise it to accept a
    # known difference.
    engine_parity_tolerance: Optional[float] = None
    export_hf: bool = True  # save the final actor as a Hugging Face directory
    # Run after each actor update (only at multiples of params.every_steps when given), e.g.
    # {name: reference_ema, params: {every_steps: 10, alpha: 0.1}}; they need a reference role.
    # A registered training hook (reference_ema, reference_reset) or 'module:fn', and its params.
    training_hooks: List[HookConfig] = field(default_factory=list)
    # PPO with a critic: the first N steps train only the critic (the actor waits for useful values).
    critic_warmup_steps: int = 0
    # Faults survived (docs/reliability.md): after a worker dies, raises or a stage overruns its
    # deadline, tear the groups down and resume from the last complete checkpoint, at most N times.
    max_restarts: int = 0
    default_stage_timeout_s: float = 3600.0  # every controller wait on a worker ends by then
    # Per stage (generate, score, advantages, update, weight_sync), e.g. +trainer.stage_timeout_s.generate=600.
    # Typed Any so a stage can be named from the command line (OmegaConf refuses new keys of a typed dict).
    stage_timeout_s: Dict[str, Any] = field(default_factory=dict)
    # Faults on purpose, to check that a cluster survives them (off by default), e.g.
    # [{kind: kill, role: actor, rank: 0, step: 2}] or [{kind: hang, role: rollout, method: generate, step: 2}].
    fault_injection: List[FaultConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(self.critic_warmup_steps >= 0, "trainer.critic_warmup_steps", self.critic_warmup_steps,
                 "must be >= 0")
        _require(self.total_steps >= 1, "trainer.total_steps", self.total_steps, "must be >= 1")
        _require(self.prompts_per_step >= 1, "trainer.prompts_per_step", self.prompts_per_step, "must be >= 1")
        _require(self.val_every_steps >= 0, "trainer.val_every_steps", self.val_every_steps, "must be >= 0")
        _require(self.save_every_steps >= 0, "trainer.save_every_steps", self.save_every_steps, "must be >= 0")
        _require(self.stop_at_val_accuracy is None or 0 < self.stop_at_val_accuracy <= 1,
                 "trainer.stop_at_val_accuracy", self.stop_at_val_accuracy, "must be in (0, 1], or null")
        _require(self.max_steps_without_signal is None or self.max_steps_without_signal >= 1,
                 "trainer.max_steps_without_signal", self.max_steps_without_signal, "must be >= 1, or null (no stop)")
        _require(self.warn_moved_fraction is None or 0 < self.warn_moved_fraction <= 1, "trainer.warn_moved_fraction",
                 self.warn_moved_fraction, "must be in (0, 1] (a share of the weights, e.g. 0.25), or null for no line")
        _require(self.keep_last_checkpoints is None or self.keep_last_checkpoints >= 1,
                 "trainer.keep_last_checkpoints", self.keep_last_checkpoints,
                 "must be >= 1 (the newest checkpoint is what a resume loads), or null to keep every one")
        _require(self.keep_last_weights is None or self.keep_last_weights >= 0, "trainer.keep_last_weights",
                 self.keep_last_weights, "must be >= 0, or null to keep the weights of every checkpoint")
        _require(self.on_corrupt_checkpoint in ("previous", "stop"), "trainer.on_corrupt_checkpoint",
                 self.on_corrupt_checkpoint, "one of ['previous', 'stop']")
        _require(self.max_restarts >= 0, "trainer.max_restarts", self.max_restarts, "must be >= 0")
        _require(self.max_staleness >= 0, "trainer.max_staleness", self.max_staleness,
                 "must be >= 0: 0 (synchronous), 1 (one-step-off), N (up to N batches in flight)")
        _require(self.old_log_probs in ("auto", "actor", "sampler"), "trainer.old_log_probs", self.old_log_probs,
                 "one of ['auto', 'actor', 'sampler']")
        _require(self.engine_parity_tolerance is None or self.engine_parity_tolerance > 0,
                 "trainer.engine_parity_tolerance", self.engine_parity_tolerance, "must be > 0, or null for the default")
        _require(self.default_stage_timeout_s > 0, "trainer.default_stage_timeout_s", self.default_stage_timeout_s,
                 "must be > 0 seconds")
        bad = {k: v for k, v in self.stage_timeout_s.items()
               if k not in STEP_STAGES or not isinstance(v, (int, float)) or v <= 0}
        _require(not bad, "trainer.stage_timeout_s", bad, f"stages are {list(STEP_STAGES)}, each with seconds > 0")


@dataclass
class LoggerConfig:
    output_root: str = "runs"  # each run gets output_root/<run_name>
    run_name: Optional[str] = None  # null: <recipe>-<YYYYmmdd-HHMMSS>
    backends: List[str] = field(default_factory=lambda: ["console", "jsonl"])
    # false: the console shows progress lines, validation results and errors; everything vLLM, Ray,
    # transformers and torch print goes to <run_dir>/logs/ (hybridflow/output/console.py). true: all of it
    # reaches the console too, as the libraries print it.
    verbose: bool = False
    # How the tracking backends file the run (hybridflow/output/tracking.py): the W&B project and the MLflow
    # experiment (unless logger.experiment); tags on the run in both (TensorBoard: a text summary).
    project: str = "hybridflow"
    tags: List[str] = field(default_factory=list)
    entity: Optional[str] = None  # W&B entity (team or user); null: the account's default
    experiment: Optional[str] = None  # MLflow experiment; null: logger.project

    def __post_init__(self) -> None:
        allowed = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
        bad = [b for b in self.backends if b not in allowed]
        _require(not bad, "logger.backends", self.backends, f"each must be one of {list(allowed)}")


RECIPE_NAMES = tuple(RECIPE_SPECS.names())


@dataclass
class StageConfig:
    name: str = "stage"
    recipe: str = "sft"  # a recipe that can be a stage: pretrain | sft | grpo | ppo
    overrides: List[str] = field(default_factory=list)  # Hydra overrides for this stage only
    # How this stage's starting model is made from the previous stage (ignored for the first).
    # A registered stage hook (pma_sma, pma_ema, pma_wma, last_checkpoint, final_model, pipeline_start)
    # or 'module:fn'.
    init: HookConfig = field(default_factory=lambda: HookConfig("final_model"))
    # The earlier stage whose run the init hook reads, where not the previous one (e.g. a distillation
    # stage whose student is the SFT stage's model while its teacher is the GRPO stage's)
    init_stage: Optional[str] = None
    evaluate_init: bool = False  # also measure the starting model's held-out accuracy (e.g. a merge)
    # The name of an earlier stage whose final model is this stage's teacher (teacher.path; recipe=distill,
    # or a distillation term in grpo / ppo): e.g. GRPO trains a teacher, then a fresh student is distilled
    teacher_stage: Optional[str] = None


@dataclass
class PipelineConfig:
    stages: List[StageConfig] = field(default_factory=list)
    common_overrides: List[str] = field(default_factory=list)  # applied to every stage first
    # Set by the `hybridflow` command to what was typed on it: each override goes to the stages whose
    # recipe reads its key, `stages.<name>.<key>=value` to that stage only (hybridflow/run/pipeline_stages.py).
    command_overrides: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        _require(len(set(names)) == len(names), "pipeline.stages[*].name", names, "stage names must be unique")
        for i, stage in enumerate(self.stages):
            _require(stage.recipe in stage_recipes(), f"pipeline.stages[{i}].recipe", stage.recipe,
                     f"one of {stage_recipes()}")
            _require(stage.init_stage is None or stage.init_stage in names[:i], f"pipeline.stages[{i}].init_stage",
                     stage.init_stage, f"the name of an earlier stage, whose run the init hook reads: one of {names[:i]}")
            _require(stage.teacher_stage is None or stage.teacher_stage in names[:i],
                     f"pipeline.stages[{i}].teacher_stage", stage.teacher_stage,
                     f"the name of an earlier stage, whose final model teaches this one: one of {names[:i]}")
            _require(stage.teacher_stage is None or recipe_spec(stage.recipe).reads_key("teacher"),
                     f"pipeline.stages[{i}].teacher_stage", stage.teacher_stage,
                     f"recipe={stage.recipe} has no teacher: use recipe=distill (or grpo / ppo with a distillation term)")


@dataclass
class RecipeConfig:
    # A built-in recipe, or 'package.module:function' / 'path/to/file.py:function' taking the stage (hybridflow.run.stage.Stage: the resolved config and its plan) and the run directory.
    name: str = "demo"
    demo_prompts: int = 8  # demo recipe: how many validation prompts to generate for
    # evaluate recipe: sampled answers per prompt for val/pass@k and val/sampled_reward_mean (0: greedy only)
    eval_samples: int = 0

    def __post_init__(self) -> None:
        _require(self.name in RECIPE_NAMES or ":" in self.name, "recipe.name", self.name,
                 f"built-in recipes are {list(RECIPE_NAMES)}, or give 'module:function'")
        _require(self.eval_samples >= 0, "recipe.eval_samples", self.eval_samples, "must be >= 0 (0: greedy only)")


@dataclass
class HybridFlowConfig:
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)  # recipe=pretrain's corpus
    dpo: DPOConfig = field(default_factory=DPOConfig)  # recipe=dpo's loss
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # on-policy distillation (recipe=distill)
    seed: int = 0

    @property
    def needs_reference(self) -> bool:
        """Whether the run computes reference log-probs: a KL term (penalty in the reward or loss), or
        a preference loss tied to the reference (recipe=dpo). The one place this is decided;
        `reference_role_runs` says who computes them."""
        if recipe_spec(self.recipe.name).preference:
            return self.dpo.needs_reference
        return self.algorithm.kl_penalty_coef > 0 or self.actor.kl_loss_coef > 0

    @property
    def reference_role_runs(self) -> bool:
        """Whether the reference role is started: reference log-probs are needed and no LoRA adapter
        stands in for it (with LoRA the actor computes them with its adapter disabled)."""
        return self.needs_reference and not self.actor.lora.rank

    @property
    def model_roles(self) -> tuple[str, ...]:
        """The roles of an RL step that hold a model: the actor and the rollout engine always; the
        critic with algorithm.use_critic; the reference when `reference_role_runs`; the reward when a
        reward model scores (reward.reward_model.path); the teacher when one distils (teacher.path, read by
        the recipe). Decided here once, for the recipes' roles, the memory model and the planner's workload."""
        return ("actor", "rollout", *(("critic",) if self.algorithm.use_critic else ()),
                *(("reference",) if self.reference_role_runs else ()),
                *(("reward",) if self.reward.reward_model.path is not None else ()),
                *(("teacher",) if self.teacher_role_runs else ()))

    @property
    def teacher_role_runs(self) -> bool:
        """Whether a teacher scores the samples: teacher.path is set and the recipe reads it."""
        return self.teacher.runs and recipe_spec(self.recipe.name).reads_key("teacher")
