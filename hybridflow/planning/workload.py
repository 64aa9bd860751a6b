"""What the planner prices: the work of one step (`Workload`) and the devices it may use (`Cluster`).

Both are plain frozen values, made from a run's config (`Workload.from_config`) and from this
machine, the Ray cluster a run would join, or flags (`Cluster.*`), so that a search, a test and the
paper-scale simulation (docs/placement.md) build them the same way without Ray or a model loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# GIB: the planner's modules read it here
from hybridflow.config.model_facts import ModelFacts
from hybridflow.checks.memory_budget import (DTYPE_BYTES, GIB, MemoryInputs, ModelShape,  # noqa: F401
                                             sequence_parallel_sizes)

MODEL_ROLES = ("actor", "rollout", "critic", "reference", "reward", "teacher")  # in the order plans print them


@dataclass(frozen=True)
class Workload:
    """One step's work: the model's shape, the batch, the roles that hold a model, the precisions."""

    parameters: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    prompts_per_step: int
    samples_per_prompt: int
    prompt_tokens: int
    response_tokens: int
    # roles that hold a model on devices: actor and rollout always; critic, reference, and reward
    # (a reward model) when the run has them. A reward function runs beside whichever pool it is put on.
    roles: tuple[str, ...] = ("actor", "rollout")
    actor_forward: bool = False  # at depth 0, the actor recomputes old log-probs (a forward pass before the update)
    old_log_probs: str = "auto"  # trainer.old_log_probs: at a stale depth, 'auto' is run as 'actor' (docs/async.md)
    epochs: int = 1
    optimizer_steps: int = 1  # per step: mini-batches x epochs
    compute_bytes: int = 4
    master_bytes: int = 4
    rollout_bytes: int = 4
    micro_batch_rows: int = 4  # rows of one training micro-batch (its activations are a memory term)
    checkpointing: bool = False  # activation checkpointing: less memory, a recomputed forward (8·P·T, not 6)
    kv_cache_gib: float = 1.0  # a CPU engine's KV cache (rollout.kv_cache_space_gib)
    intermediate: int = 0  # the MLP's width (0: 4 x hidden, as the paper's models)
    tied_embeddings: bool = True
    lora: bool = False  # the actor trains a LoRA adapter
    engine_memory: bool = True  # the rollout engine holds weights and a KV cache of its own
    engine_gpu: str = "share"  # what it holds on a GPU (hybridflow.config.engines.GpuMemory's value)
    gpu_memory_utilization: float = 0.5  # a GPU engine's share of its GPU (rollout.gpu_memory_utilization)
    bucket_bytes: int = 0  # one weight-sync bucket (weight_sync.bucket_mb)
    teacher_parameters: int = 0  # a distillation teacher's (teacher.path), in teacher_bytes each
    teacher_bytes: int = 4
    # Ulysses sequence parallelism per role (docs/long_sequences.md): each rank of a group computes 1/SP of a
    # micro-batch's tokens, so its activations are 1/SP (hybridflow/checks/memory_budget.py `micro_batch_terms`)
    actor_sp: int = 1  # actor.sequence_parallel_size, the reference's too
    critic_sp: int = 1
    teacher_sp: int = 1
    packed: bool = False  # model.pack_sequences=true: no attention probabilities kept (`keeps_probabilities`)
    name: str = "workload"

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def head_dim(self) -> int:
        return self.hidden // max(self.heads, 1)

    @property
    def tokens(self) -> int:
        """Tokens one forward pass over the step's samples reads (prompt and response)."""
        return self.sequences * (self.prompt_tokens + self.response_tokens)

    def actor_forwards(self, stale: bool) -> bool:
        """Whether the actor recomputes old log-probs: the config's choice at depth 0; at a stale
        depth unless trainer.old_log_probs=sampler."""
        return self.old_log_probs != "sampler" if stale else self.actor_forward

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.rollout_bytes

    def memory_inputs(self) -> MemoryInputs:
        """What the memory model (hybridflow/checks/memory_budget.py `device_terms`) needs of this step; a
        reward model, when the workload has one, is taken to be the actor's size."""
        shape = ModelShape(parameters=self.parameters, layers=self.layers, hidden=self.hidden,
                           intermediate=self.intermediate or 4 * self.hidden, heads=self.heads, vocab=self.vocab,
                           tied_embeddings=self.tied_embeddings, kv_width=self.kv_heads * self.head_dim)
        return MemoryInputs(shape=shape, compute_bytes=self.compute_bytes, master_bytes=self.master_bytes,
                            rollout_bytes=self.rollout_bytes, rows=self.micro_batch_rows,
                            prompt_tokens=self.prompt_tokens, response_tokens=self.response_tokens,
                            checkpointing=self.checkpointing, kv_cache_bytes=self.kv_cache_gib * GIB, lora=self.lora,
                            engine_memory=self.engine_memory, engine_gpu=self.engine_gpu,
                            sequences=self.sequences,
                            reward_parameters=self.parameters if "reward" in self.roles else 0,
                            gpu_memory_utilization=self.gpu_memory_utilization, bucket_bytes=self.bucket_bytes,
                            teacher_parameters=self.teacher_parameters if "teacher" in self.roles else 0,
                            teacher_bytes=self.teacher_bytes, actor_sp=self.actor_sp, critic_sp=self.critic_sp,
                            teacher_sp=self.teacher_sp, packed=self.packed)

    def sequence_parallel(self) -> dict[str, int]:
        """The roles that split sequences, and their sizes (those above 1)."""
        sizes = {"actor": self.actor_sp, "reference": self.actor_sp, "critic": self.critic_sp,
                 "teacher": self.teacher_sp}
        return {role: size for role, size in sizes.items() if size > 1 and role in self.roles}

    @classmethod
    def from_config(cls, config, name: str = "workload") -> "Workload":
        """The step the config describes, for its model (model.path's config.json and weights, or
        model.tiny's shape)."""
        shape = model_shape(config)
        a, t = config.actor, config.trainer
        roles = config.model_roles
        from hybridflow.batch_keys import clips_against_sampler
        from hybridflow.config.engines import rollout_engine

        sequences = t.prompts_per_step * config.rollout.samples_per_prompt
        mini = a.samples_per_mini_batch or sequences
        return cls(parameters=shape["parameters"], layers=shape["layers"], hidden=shape["hidden"],
                   heads=shape["heads"], kv_heads=shape["kv_heads"], vocab=shape["vocab"],
                   prompts_per_step=t.prompts_per_step, samples_per_prompt=config.rollout.samples_per_prompt,
                   prompt_tokens=config.data.max_prompt_tokens, response_tokens=config.rollout.max_response_tokens,
                   roles=roles, actor_forward=not clips_against_sampler(config), old_log_probs=t.old_log_probs,
                   epochs=a.epochs_per_step,
                   optimizer_steps=a.epochs_per_step * max(1, sequences // max(mini, 1)),
                   compute_bytes=DTYPE_BYTES[config.model.dtype.value],
                   master_bytes=DTYPE_BYTES[config.model.master_dtype.value],
                   rollout_bytes=DTYPE_BYTES[config.rollout.dtype.value],
                   micro_batch_rows=min(a.samples_per_micro_batch or 4, sequences),
                   checkpointing=bool(a.gradient_checkpointing), kv_cache_gib=config.rollout.kv_cache_space_gib,
                   intermediate=shape["intermediate"], tied_embeddings=shape["tied_embeddings"], lora=bool(a.lora.rank),
                   engine_memory=rollout_engine(config.rollout.backend).engine_memory,
                   engine_gpu=rollout_engine(config.rollout.backend).gpu_memory.value,
                   gpu_memory_utilization=config.rollout.gpu_memory_utilization,
                   bucket_bytes=config.weight_sync.bucket_mb * 2 ** 20, packed=config.model.pack_sequences is True,
                   name=name,
                   **_teacher(config), **sequence_parallel_sizes(config))


def _teacher(config) -> dict[str, int]:
    """The teachers' parameters, all of them, and bytes per parameter (each directory's config.json and weights); a size
    read when its directory exists (a pipeline stage's teacher is made by an earlier stage: the stage's
    own check counts it when it starts)."""
    if not config.teacher_role_runs:
        return {}
    facts = [ModelFacts.from_dir(path) for path in config.teacher.paths.values()]
    return {"teacher_parameters": sum(f.parameters for f in facts if f is not None and f.parameters),
            "teacher_bytes": DTYPE_BYTES[config.teacher.dtype or config.model.dtype.value]}


def model_shape(config) -> dict[str, int]:
    """Parameters, layers, hidden size, heads, key/value heads and vocabulary of the run's model."""
    if config.model.path is None:
        tiny = config.model.tiny
        from hybridflow.builders.tiny_model import tiny_vocab_size

        h, i, n = tiny.hidden_size, tiny.intermediate_size, tiny.num_hidden_layers
        kv = tiny.num_key_value_heads * (h // tiny.num_attention_heads)
        per_layer = h * h * 2 + 2 * h * kv + 3 * h * i + 2 * h + (h + 2 * kv)  # q,o; k,v; MLP; norms; biases
        vocab = tiny_vocab_size()
        embeddings = vocab * h * (1 if tiny.tie_word_embeddings else 2)
        return {"parameters": n * per_layer + embeddings + h, "layers": n, "hidden": h, "intermediate": i,
                "heads": tiny.num_attention_heads, "kv_heads": tiny.num_key_value_heads, "vocab": vocab,
                "tied_embeddings": tiny.tie_word_embeddings}
    facts = ModelFacts.from_dir(config.model.path)
    if facts is None or not facts.parameters or not facts.hidden:
        raise ValueError(f"model.path={config.model.path!r}: the planner needs config.json and *.safetensors there "
                         "to count the model's parameters")
    heads = facts.heads or 1
    return {"parameters": facts.parameters, "layers": facts.layers or 1, "hidden": facts.hidden,
            "intermediate": facts.intermediate, "heads": heads, "kv_heads": facts.kv_heads or heads,
            "vocab": facts.vocab, "tied_embeddings": facts.tied_embeddings}


@dataclass(frozen=True)
class Cluster:
    """Identical nodes of `devices_per_node` devices each. On a CPU a device is one process's
    share of the cores (`cores_per_device`), and its memory a share of the node's."""

    nodes: int
    devices_per_node: int
    device_memory_bytes: float
    device: str = "cpu"  # cpu | cuda
    cores_per_device: float = 1.0
    labels: dict = field(default_factory=dict, compare=False)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def describe(self) -> str:
        return (f"{self.nodes} node(s) x {self.devices_per_node} {self.device} device(s), "
                f"{self.device_memory_bytes / GIB:.1f} GiB each")

    @classmethod
    def this_machine(cls, device: str = "cpu") -> "Cluster":
        """One node: on `device` cuda, this machine's GPUs (their count, the smallest one's memory, their
        name as a label; the cores shared among them); on cpu, its cores, one device per core, the
        memory Ray lets it use split evenly."""
        from hybridflow.checks.memory_budget import NODE_MEMORY_SHARE, local_gpus, node_memory_bytes

        cores = len(os.sched_getaffinity(0))
        if device == "cuda":
            gpus = local_gpus()
            if not gpus:
                raise ValueError("placement.device=cuda, and this machine shows no GPU (nvidia-smi): run the driver "
                                 "on a GPU node, or describe the cluster with `hybridflow plan --cluster NODESxDEVICES "
                                 "--device cuda --device-memory-gib G` and run the overrides it prints")
            return cls(1, len(gpus), min(b for _, b in gpus), "cuda", max(1.0, cores / len(gpus)),
                       labels={"gpu": gpus[0][0]})
        return cls(1, cores, NODE_MEMORY_SHARE * node_memory_bytes() / cores)

    @classmethod
    def from_ray(cls, device: str = "cpu") -> "Cluster":
        """The alive nodes of the Ray cluster this process is connected to that can host a pool (a
        head started with no slots, as the driver's node often is, is left out), as `device` ones (the
        device the run computes on: its GPUs, or its CPU slots); the smallest describes them all: the
        planner assumes identical nodes."""
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) >= 1]
        if not nodes:
            raise ValueError("the Ray cluster has no alive node with a CPU slot to place a pool on")
        gpus = min(int(n["Resources"].get("GPU", 0)) for n in nodes)
        if device == "cuda" and not gpus:
            raise ValueError(f"placement.device=cuda, and {'a node' if len(nodes) > 1 else 'the node'} of the Ray "
                             "cluster has no GPU: run on GPU nodes, or set placement.device=cpu")
        if device == "cuda":
            from hybridflow.checks.memory_budget import local_gpus

            here = local_gpus()
            if not here:  # Ray's resources do not say how much memory a GPU has
                raise ValueError("the Ray cluster has GPUs, but this process sees none, so it cannot tell how much "
                                 "memory each has: run the driver on a GPU node, or describe the cluster with "
                                 "`hybridflow plan --cluster NODESxDEVICES --device cuda --device-memory-gib G` and "
                                 "run the overrides it prints")
            return cls(len(nodes), gpus, min(b for _, b in here), "cuda", labels={"gpu": here[0][0]})
        cpus = min(int(n["Resources"].get("CPU", 1)) for n in nodes)
        memory = min(n["Resources"].get("memory", 0) for n in nodes)
        return cls(len(nodes), max(1, cpus), memory / max(1, cpus))
