"""What one training process of the actor's pool holds, from the model and the config alone.

The floor a run cannot go below, term by term, per process of the actor's pool (the roles
colocated with it share the process): the actor's parameters, gradients and AdamW moments in
`model.master_dtype`, sharded over the pool's ranks by FSDP2; a reference model in
`model.dtype`, sharded the same way; a critic as an actor; the rollout engine's weights in
`rollout.dtype` (its tensor-parallel share) and its KV cache (`rollout.kv_cache_space_gib` on a
CPU); the process's own runtime (measured); the actor's embeddings, which FSDP2 keeps gathered (the
root module is not resharded after forward) with their whole gradient, while a micro-batch trains;
and one micro-batch's activations and logits. The activation estimate per token and decoder
layer is 10 x hidden + 4 x intermediate + 2 x heads x sequence floats (the saved inputs of the
norms, projections, MLP and eager attention's probabilities), or one hidden vector per layer
with `actor.gradient_checkpointing`; on SmolLM2-135M in float32, 16 rows of 110 tokens, it gives
2.7 GiB against 3.1 GiB measured (bench/logprob_memory.py, docs/memory.md "Memory").

The terms are one function, `device_terms` (any roles on a pool of any size), that the run's own
check (`process_terms`, from the config and the stage's plan) and the planner's
(`hybridflow.planning.rules.memory_terms`, from its workload) both call: one memory model.

`memory_problems` refuses before anything starts a run whose floor, summed over the processes
one node holds, is above the node's memory (CPU pools on the local machine). The terms are lower
bounds, so a refused run cannot fit; one that passes may still need more (the update's and the
weight sync's transient buffers, allocator slack).

On GPUs (`gpu_memory_bytes`: `placement.gpu_memory_gib`, else this machine's first GPU) each process
has one GPU, and the floor is per phase of a step (`gpu_phase_terms`), in the colocated hand-over's
order (hybridflow/resharding/transports/colocated.py). Training: the same terms, but attention keeps
no probabilities (sdpa's flash, memory-efficient and cuDNN kernels and the packed varlen kernel never
store the sequence x sequence matrix), and a colocated engine sleeps (its weights on the host, its KV
cache freed) so it holds nothing; the host runtime is not GPU memory. Checked against
`torch.cuda.max_memory_allocated` on an H200 (bench/gpu_check.py, docs/memory.md "A GPU memory
model"): Qwen2.5-0.5B and -1.5B shapes, 16 rows of 256 + 512 tokens, floor 28.1 and 61.3 GiB, peaks
32.0-34.4 and 65.6-69.8 GiB (1.07-1.22x). With a colocated engine, the phases of what its entry says it
holds (`RolloutEngine.gpu_memory`, hybridflow/config/engines.py): vLLM's start (the training roles' weights
loaded while the engine takes its whole `rollout.gpu_memory_utilization` share: vLLM refuses to start when
that much is not free), the weight sync (the actor's parameters and AdamW moments stay, its gradients freed
at the end of the update, while the engine's weights wake alone, its KV cache still freed, one bucket in
flight) and generation (the actor's training state offloaded, the engine's whole share beside what does
not offload: a reference's weights, a critic's state); the hf engine's same three with its own copy of the
weights in `rollout.dtype` for the share, and at generation its KV cache (preallocated for
`rollout.max_num_seqs` rows at full length) and the prefill's logits at one position per row; the exact engine's generation
alone (no copy, no sync): the actor's parameters kept beside a KV cache of `actor.samples_per_micro_batch` rows
at full length and one position's logits per row. A run where a phase is above the GPU is refused before
start with that phase's arithmetic, instead of running out of memory mid-step.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from hybridflow.config.engines import GpuMemory
from hybridflow.config.engines import rollout_engine
from hybridflow.config.model_facts import ModelFacts
from hybridflow.config.schema import model_heads

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
NODE_MEMORY_SHARE = 0.95  # Ray's memory monitor kills a worker past this share of the node's memory
# A GPU's share the floor may fill: the rest is left to the caching allocator's fragmentation and the
# transient buffers the terms do not count
GPU_MEMORY_SHARE = 0.9
# What a GPU process holds before any tensor of its own: the CUDA context with its loaded kernels and
# cuBLAS's workspace (PyTorch's own docs give "a few hundred MiB" for the context; 0.5 GiB is taken for
# both: an estimate, outside torch.cuda.max_memory_allocated), and in a pool of several GPUs NCCL's
# buffers (NCCL_BUFFSIZE, 4 MiB, per channel and peer and direction: 0.25 GiB is taken, an estimate)
CUDA_CONTEXT_BYTES = int(0.5 * GIB)
NCCL_BUFFER_BYTES = int(0.25 * GIB)
# What a worker process holds besides the model: the interpreter, torch, Ray's core worker and, with an
# engine, vLLM; the resident set of the tiny model's workers at the end of a step, 0.56 GiB without an
# engine and 0.77 GiB with one (less its KV cache), rounded down (bench/runtime_memory.py)
RUNTIME_BYTES = int(0.5 * GIB)
RUNTIME_BYTES_WITH_VLLM = int(0.75 * GIB)


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    tied_embeddings: bool = True  # one vocabulary x hidden matrix for input and output, or two
    kv_width: int = 0  # key/value heads x head size: one token's keys (or values) in one layer; 0: hidden

    @property
    def kv_floats_per_token(self) -> int:
        """A KV cache's values per token: keys and values in every layer."""
        return 2 * self.layers * (self.kv_width or self.hidden)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelShape | None":
        """From the directory's `ModelFacts` (config.json and the safetensors headers: an exact
        parameter count); None when the directory cannot tell (the model's own loading reports it)."""
        facts = ModelFacts.from_dir(path)
        if facts is None or not facts.parameters or not facts.hidden:
            return None
        return cls(parameters=facts.parameters, layers=facts.layers or 1, hidden=facts.hidden,
                   intermediate=facts.intermediate, heads=facts.heads or 1, vocab=facts.vocab,
                   tied_embeddings=facts.tied_embeddings, kv_width=facts.kv_heads * facts.head_size)


@dataclass(frozen=True)
class MemoryInputs:
    """What a device's floor depends on besides where the roles run: the model, the precisions (bytes
    per value), one training micro-batch, the engine's KV cache on a CPU. Built from a config
    (`from_config`) or from the planner's workload (`hybridflow.planning.workload.Workload.memory_inputs`):
    one memory model for the run's own check and the planner's."""

    shape: ModelShape
    compute_bytes: int  # model.dtype
    master_bytes: int  # model.master_dtype
    rollout_bytes: int  # rollout.dtype
    rows: int  # one training micro-batch's rows
    prompt_tokens: int
    response_tokens: int
    checkpointing: bool  # activation checkpointing
    kv_cache_bytes: float  # a CPU engine's fixed KV cache (rollout.kv_cache_space_gib)
    lora: bool = False  # the actor trains a LoRA adapter: its gradients and moments are small next to the rest
    engine_memory: bool = True  # the rollout engine holds weights and a KV cache of its own (vLLM; not hf)
    reward_parameters: int = 0  # a reward model's parameters (0: a reward function, no model)
    teacher_parameters: int = 0  # the distillation teachers' parameters, all of them (0: no teacher)
    teacher_bytes: int = 4  # teacher.dtype's bytes per parameter
    gpu_memory_utilization: float = 0.5  # the share of a GPU the vLLM engine takes (rollout.gpu_memory_utilization)
    bucket_bytes: int = 0  # one weight-sync bucket (weight_sync.bucket_mb)
    fp32_head: bool = False  # actor.fp32_lm_head: the logits in float32 whatever the compute dtype
    sleep_level: int = 1  # rollout.sleep_level: 1 keeps a sleeping engine's weights in host memory, 2 discards them
    engine_gpu: str = "share"  # what the engine holds on a GPU (`hybridflow.config.engines.GpuMemory`'s value)
    max_num_seqs: int = 256  # rollout.max_num_seqs: the rows an engine decodes at once
    sequences: int = 0  # samples per step (prompts x samples per prompt), over the actor's ranks; 0: unknown
    engine_fp32_head: bool = False  # rollout.fp32_lm_head: the engine's logits in float32
    packed: bool = False  # model.pack_sequences=true (null decides when the model loads: priced as padded
    # unless a role's sequence parallelism, which runs only packed, says the run packs)
    # Ulysses sequence parallelism per role (docs/long_sequences.md): actor.sequence_parallel_size (the
    # reference's too), critic.sequence_parallel_size, teacher.sequence_parallel_size
    actor_sp: int = 1
    critic_sp: int = 1
    teacher_sp: int = 1

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @classmethod
    def from_config(cls, config, shape: ModelShape, rows: int | None = None,
                    checkpointing: bool | None = None) -> "MemoryInputs":
        """The config's (`rows`, `checkpointing`: the micro-batch's, where not the config's)."""
        reward = config.reward.reward_model.path
        reward_shape = ModelShape.from_dir(reward) if reward else None
        teachers = [ModelShape.from_dir(path) for path in config.teacher.paths.values()] if config.teacher_role_runs else []
        return cls(shape=shape, compute_bytes=DTYPE_BYTES[config.model.dtype.value],
                   master_bytes=DTYPE_BYTES[config.model.master_dtype.value],
                   rollout_bytes=DTYPE_BYTES[config.rollout.dtype.value],
                   rows=config.actor.samples_per_micro_batch if rows is None else rows,
                   prompt_tokens=config.data.max_prompt_tokens, response_tokens=config.rollout.max_response_tokens,
                   checkpointing=bool(config.actor.gradient_checkpointing if checkpointing is None else checkpointing),
                   kv_cache_bytes=config.rollout.kv_cache_space_gib * GIB, lora=bool(config.actor.lora.rank),
                   engine_memory=_engine_memory(config),
                   reward_parameters=reward_shape.parameters if reward_shape is not None else 0,
                   teacher_parameters=sum(shape.parameters for shape in teachers if shape is not None),
                   teacher_bytes=DTYPE_BYTES[config.teacher.dtype or config.model.dtype.value],
                   gpu_memory_utilization=config.rollout.gpu_memory_utilization,
                   bucket_bytes=config.weight_sync.bucket_mb * 2 ** 20, fp32_head=config.actor.fp32_lm_head,
                   sleep_level=config.rollout.sleep_level or 1,  # null: resolved at compose (checks.resolved)
                   engine_gpu=_engine_gpu(config), max_num_seqs=config.rollout.max_num_seqs,
                   sequences=config.trainer.prompts_per_step * config.rollout.samples_per_prompt,
                   engine_fp32_head=config.rollout.fp32_lm_head, packed=config.model.pack_sequences is True,
                   **sequence_parallel_sizes(config))


def keeps_probabilities(inputs: MemoryInputs, cpu: bool) -> bool:
    """Whether a micro-batch's attention keeps its (heads x tokens) probabilities per token: on a CPU with
    the padded path (eager attention; measured), not on a GPU (its kernels recompute them) and not with
    packed rows, which attend in one fused kernel keeping a log-sum-exp per head and token (measured: the
    packed path's heap peak within 12% of the other terms at 2K-8K tokens, bench/sequence_parallel.py,
    docs/results/performance.md). A run with sequence parallelism on any role packs (it is refused
    otherwise)."""
    packs = inputs.packed or max(inputs.actor_sp, inputs.critic_sp, inputs.teacher_sp) > 1
    return cpu and not packs


def sequence_parallel_sizes(config) -> dict[str, int]:
    """MemoryInputs' per-role sequence-parallel sizes from the config."""
    return {"actor_sp": config.actor.sequence_parallel_size, "critic_sp": config.critic.sequence_parallel_size,
            "teacher_sp": config.teacher.sequence_parallel_size}


SP_KEYS = {"actor_sp": "actor.sequence_parallel_size", "critic_sp": "critic.sequence_parallel_size",
           "teacher_sp": "teacher.sequence_parallel_size"}
SP_OF_ROLE = {"actor": "actor_sp", "reference": "actor_sp", "critic": "critic_sp", "teacher": "teacher_sp"}


def pool_sequence_parallel(inputs: MemoryInputs, roles) -> int:
    """The sequence-parallel size a pool's one micro-batch is priced at: the smallest of its model roles'
    (the roles take turns, so the largest activations are those split the least); a reward model scores
    whole sequences in its own padded forward, so with one on the pool it is 1."""
    sizes = [getattr(inputs, SP_OF_ROLE[r]) if r in SP_OF_ROLE else 1
             for r in roles if r in MODEL_ROLES_ON_DEVICES and (r != "reward" or inputs.reward_parameters)]
    return min(sizes, default=1)


TRAINED_ROLES = ("actor", "critic")
TEACHER_TERM = "teacher weights (teacher.dtype, FSDP shard)"
MODEL_ROLES_ON_DEVICES = ("actor", "critic", "reference", "reward", "teacher")  # a micro-batch passes through each


def device_terms(inputs: MemoryInputs, roles, ranks: int, tp: int, device: str,
                 kv: tuple[str, float] | None = None) -> dict[str, float]:
    """Bytes one device (one process) of a pool of `ranks` devices holds, term by term, with `roles` on
    it: the trained roles' parameters, gradients and AdamW moments and the other models' weights
    sharded over the pool by FSDP2, the rollout engine's 1/`tp` of the weights and its KV cache
    (`kv`: (label, bytes) where not the CPU's fixed cache), the process's runtime (on a CPU; on a GPU
    the host runtime is not GPU memory) and, while a micro-batch trains, the actor's gathered
    embeddings and one micro-batch's activations and logits. The one memory model: the run's
    check (`process_terms`) and the planner's (`hybridflow.planning.rules.memory_terms`) both call it."""
    s, p, cpu = inputs.shape, inputs.shape.parameters, device == "cpu"
    master, compute = inputs.master_bytes, inputs.compute_bytes
    trained = 0 if inputs.lora else p  # LoRA's adapter is small next to the rest
    terms: dict[str, float] = {}
    if "actor" in roles:
        terms["actor parameters (model.master_dtype, FSDP shard)"] = p * master / ranks
        terms["actor gradients (FSDP shard)"] = trained * master / ranks
        terms["actor AdamW moments (2 per parameter, FSDP shard)"] = 2 * trained * master / ranks
    if "reference" in roles:
        terms["reference weights (model.dtype, FSDP shard)"] = p * compute / ranks
    if "critic" in roles:
        terms["critic parameters, gradients and AdamW moments (FSDP shard)"] = 4 * p * master / ranks
    if "reward" in roles and inputs.reward_parameters:
        terms["reward model weights (model.dtype, FSDP shard)"] = inputs.reward_parameters * compute / ranks
    if "teacher" in roles and inputs.teacher_parameters:
        terms[TEACHER_TERM] = inputs.teacher_parameters * inputs.teacher_bytes / ranks
    engine = "rollout" in roles and inputs.engine_memory
    if engine:
        terms[f"vLLM weights (rollout.dtype, 1/{tp} of the model)"] = p * inputs.rollout_bytes / tp
        label, kv_bytes = kv or ("vLLM KV cache (rollout.kv_cache_space_gib)", inputs.kv_cache_bytes)
        terms[label] = kv_bytes
    if cpu:  # on a GPU the host runtime is not GPU memory
        terms[f"the process's own runtime (Python, torch, Ray{', vLLM' if engine else ''}; measured)"] = (
            RUNTIME_BYTES_WITH_VLLM if engine else RUNTIME_BYTES)
    else:
        terms.update(gpu_process_terms(ranks))
    if "actor" in roles and (ranks > 1 or compute != master):
        # FSDP2: the root's parameters stay gathered from forward to backward
        embeddings = s.vocab * s.hidden * (1 if s.tied_embeddings else 2)
        terms["actor embeddings gathered, and their gradient (model.dtype, whole)"] = 2 * embeddings * compute
    if any(r in roles for r in MODEL_ROLES_ON_DEVICES):
        sp = pool_sequence_parallel(inputs, roles)
        terms.update(micro_batch_terms(inputs, attention_probabilities=keeps_probabilities(inputs, cpu), sp=sp))
    return terms


def process_terms(config, plan, shape: ModelShape, roles: set[str], rows: int | None = None,
                  checkpointing: bool | None = None) -> dict[str, float]:
    """Bytes per process of the actor's pool while it trains, term by term, under `plan` (the stage's
    `hybridflow.planning.plan.Plan`: the actor's ranks, the rollout's TP, the device); `roles`: the
    roles placed on that pool; `rows`, `checkpointing`: the micro-batch's, where not the config's. On
    GPUs the GPU's bytes, a colocated engine asleep (see the module docstring)."""
    return _actor_pool_terms(MemoryInputs.from_config(config, shape, rows, checkpointing), plan, roles)


def _actor_pool_terms(inputs: MemoryInputs, plan, roles: set[str]) -> dict[str, float]:
    """`process_terms` for inputs already built (`choose_micro_batch` builds them once)."""
    roles = set(roles) | {"actor"}
    if plan.device != "cpu":
        roles.discard("rollout")  # on a GPU a colocated engine sleeps while the actor trains
    return device_terms(inputs, roles, plan.devices_of("actor"), plan.rollout_tp, plan.device)


def micro_batch_terms(inputs: MemoryInputs, rows: int | None = None, checkpointing: bool | None = None,
                      attention_probabilities: bool = True, sp: int = 1) -> dict[str, float]:
    """One micro-batch's activations (kept for the backward pass) and logits, in bytes, on one rank; `rows`
    and `checkpointing` default to the inputs'; `attention_probabilities`: whether attention keeps its
    (heads x sequence) probabilities per token (priced on CPUs, where it was measured; GPU kernels
    never store them).

    `sp`: the sequence-parallel size (hybridflow/training/ulysses.py). The micro-batch's rows are packed
    into one row of rows x tokens, padded to a multiple of SP, and each rank computes 1/SP of it: its
    activations are those of t = ceil(rows x tokens / SP) tokens (per token the same floats: a rank
    attends with H/SP heads over every one of the T keys, so its probabilities are (T/SP) x H x T, the same
    2 x heads x sequence per token it holds). Its logits are at the response positions it holds, at most
    min(rows x response, t). Besides, at SP > 1:
    - the all-to-all buffers: each `all_to_all_single` call (`_all_to_all`) sends a contiguous copy of its
      input (`torch.stack` of the chunks) and receives into a buffer of the same size, both freed when the
      call returns; per layer four calls forward (q: t x heads x head size, k and v: t x key/value heads x
      head size, the attention output: t x heads x head size) and their reverses backward, one at a time,
      so the peak is the largest call's: 2 x t x heads x head size (= hidden) x model.dtype's bytes. What
      each call returns (the gathered q/k/v, H/SP heads of every token, and the output) is what attention
      and the output projection keep at SP 1 too, already in the per-token floats;
    - the gathered per-token values, whole on every rank (`SequenceShard.gather`): the (B, R) log-probs and
      entropy in float32, each with the all-gather's received parts and their concatenation (3 copies of
      rows x response): 2 x 3 x rows x response x 4 bytes."""
    shape = inputs.shape
    rows = inputs.rows if rows is None else rows
    checkpointing = inputs.checkpointing if checkpointing is None else checkpointing
    tokens, compute = inputs.tokens, inputs.compute_bytes
    if checkpointing:  # one hidden vector per layer, and one layer's worth recomputed
        per_token = shape.hidden * shape.layers + _layer_floats(shape, tokens, attention_probabilities)
    else:
        per_token = _layer_floats(shape, tokens, attention_probabilities) * shape.layers
    mine = -(-rows * tokens // sp)  # this rank's tokens of the packed row, padded to a multiple of SP
    predicted = rows * inputs.response_tokens
    logits = min(predicted, mine) * shape.vocab
    head = "float32: actor.fp32_lm_head" if inputs.fp32_head else ""
    if sp == 1:
        return {f"activations of one micro-batch ({rows} rows x {tokens} tokens, actor.samples_per_micro_batch)":
                rows * tokens * per_token * compute,
                "its logits and their gradient (response positions x vocabulary" + (f", {head})" if head else ")"):
                2 * logits * (4 if inputs.fp32_head else compute)}
    return {f"activations of one micro-batch (1/{sp} of {rows} rows x {tokens} tokens on each rank: {mine} tokens, "
            f"sequence parallel {sp})": mine * per_token * compute,
            f"its logits and their gradient (the {min(predicted, mine)} response positions a rank holds at most x "
            "vocabulary" + (f", {head})" if head else ")"): 2 * logits * (4 if inputs.fp32_head else compute),
            f"sequence parallel {sp}: all-to-all send and receive buffers (2 x {mine} tokens x {shape.hidden}, "
            "one call at a time)": 2 * mine * shape.hidden * compute,
            f"sequence parallel {sp}: gathered log-probs and entropy ({rows} x {inputs.response_tokens}, float32, "
            "whole on every rank, 3 copies)": 2 * 3 * predicted * 4}


# actor/critic.samples_per_micro_batch and actor.gradient_checkpointing left null are chosen before
# start: the most rows (at most AUTO_MAX_ROWS) whose floor stays within AUTO_SHARE of what one process
# of the actor's pool may use. The floor is a lower bound (measured peaks were at most 1.5x it, on
# SmolLM2 and a 0.5B model, docs/results/memory.md), hence the share; beyond 64 rows a micro-batch gains
# little on a CPU.
AUTO_MAX_ROWS = 64
AUTO_SHARE = 2 / 3
AUTO_MIN_ROWS_WITHOUT_CHECKPOINTING = 8  # fewer rows fit: recompute activations instead (about 1.3x compute)
GPU_DEFAULT_ROWS = 16  # on GPUs whose memory is unknown before start (placement.gpu_memory_gib unset, no local GPU)


@dataclass(frozen=True)
class MicroBatchChoice:
    rows: int
    gradient_checkpointing: bool
    why: str  # one console line


def choose_micro_batch(config, plan, shape: ModelShape | None, node_bytes: int | None = None,
                       gpu_bytes: int | None = None) -> MicroBatchChoice:
    """The actor's rows per micro-batch and activation checkpointing: the config's where set, else
    the most rows whose floor (`process_terms`) fits AUTO_SHARE of a process's share of the node (on
    GPUs: of one GPU, `gpu_bytes` or `gpu_memory_bytes`), without checkpointing when that fits
    AUTO_MIN_ROWS_WITHOUT_CHECKPOINTING rows, else with it."""
    rows_set, ckpt_set = config.actor.samples_per_micro_batch, config.actor.gradient_checkpointing
    cpu = plan.device == "cpu"
    gpu = None if cpu else (gpu_bytes or gpu_memory_bytes(config))
    if shape is None or (not cpu and gpu is None):
        return MicroBatchChoice(rows_set or (AUTO_MAX_ROWS if cpu else GPU_DEFAULT_ROWS), bool(ckpt_set),
                                "the model's size is unknown before start" if shape is None else
                                "the GPU's memory is unknown before start: no GPU on this machine; set "
                                "placement.gpu_memory_gib")
    pool = plan.pool_of("actor")
    if cpu:
        budget = AUTO_SHARE * NODE_MEMORY_SHARE * (node_bytes or node_memory_bytes()) / pool.devices_per_node
        where = "one process of the actor's pool may use"
    else:  # one GPU per process
        budget, where = AUTO_SHARE * gpu, "one GPU holds"
    # every term but the micro-batch's: the whole floor at one row, less that row's terms
    inputs = MemoryInputs.from_config(config, shape, rows=1, checkpointing=False)
    roles = actor_pool_roles(config, plan) | {"actor"}
    sp = pool_sequence_parallel(inputs, roles)
    probabilities = keeps_probabilities(inputs, cpu)
    fixed = (sum(_actor_pool_terms(inputs, plan, roles).values())
             - sum(micro_batch_terms(inputs, attention_probabilities=probabilities, sp=sp).values()))

    def fits(rows: int, ckpt: bool) -> bool:
        return fixed + sum(micro_batch_terms(inputs, rows, ckpt, attention_probabilities=probabilities, sp=sp).values()) <= budget

    def most_rows(ckpt: bool) -> int:
        candidates = [rows_set] if rows_set else range(AUTO_MAX_ROWS, 0, -1)
        return next((r for r in candidates if fits(r, ckpt)), 0)

    plain = most_rows(False) if ckpt_set is not True else 0
    enough = min(rows_set or AUTO_MAX_ROWS, AUTO_MIN_ROWS_WITHOUT_CHECKPOINTING)
    if ckpt_set is False or (ckpt_set is None and plain >= enough):
        rows, ckpt = plain, False
    else:
        rows, ckpt = most_rows(True), True
    share = f"{AUTO_SHARE:.0%} of the {budget / AUTO_SHARE / GIB:.1f} GiB {where}"
    if rows == 0:  # the smallest; memory_problems refuses it when even its floor cannot fit
        rows, ckpt = rows_set or 1, ckpt_set if ckpt_set is not None else True
        floor = fixed + sum(micro_batch_terms(inputs, rows, ckpt, attention_probabilities=probabilities, sp=sp).values())
        fix = ("Set rollout.dtype=bfloat16 (or model.master_dtype=bfloat16), or lower rollout.kv_cache_space_gib"
               if cpu else "Put more GPUs in the actor's pool (FSDP2 shards the training state), or set "
               "model.master_dtype=bfloat16")
        return MicroBatchChoice(rows, ckpt, f"WARNING: even this floor, {floor / GIB:.2f} GiB, is above {share}; "
                                f"peaks reach 1.5x the floor, so {'Ray may kill a worker for memory' if cpu else 'the GPU may run out of memory'}. {fix}")
    return MicroBatchChoice(rows, ckpt, f"the floor at that size fits {share}")


def resolve_micro_batches(config, plan, node_bytes: int | None = None, model_dir: str | Path | None = None,
                          gpu_bytes: int | None = None):
    """`config` with actor/critic.samples_per_micro_batch and actor.gradient_checkpointing filled in
    where null (`choose_micro_batch`, for the model in `model_dir`, default `model.path`, under the
    stage's `plan`), and the
    console line that says what was chosen (None when everything was set)."""
    import dataclasses

    actor, critic = config.actor, config.critic
    if actor.samples_per_micro_batch and actor.gradient_checkpointing is not None and critic.samples_per_micro_batch:
        return config, None
    model_dir = model_dir or config.model.path
    shape = ModelShape.from_dir(model_dir) if model_dir else None
    choice = choose_micro_batch(config, plan, shape, node_bytes, gpu_bytes)
    chosen = {}
    if not actor.samples_per_micro_batch:
        chosen["actor.samples_per_micro_batch"] = choice.rows
    if actor.gradient_checkpointing is None:
        chosen["actor.gradient_checkpointing"] = choice.gradient_checkpointing
    if not critic.samples_per_micro_batch:  # the same model's activations, at another time in the step
        chosen["critic.samples_per_micro_batch"] = choice.rows
    config = dataclasses.replace(
        config, actor=dataclasses.replace(actor, samples_per_micro_batch=choice.rows,
                                          gradient_checkpointing=choice.gradient_checkpointing),
        critic=dataclasses.replace(critic, samples_per_micro_batch=critic.samples_per_micro_batch or choice.rows))
    if shape is None:  # the tiny model (always fits) or a size unknown before start: nothing worth a line
        return config, None
    said = ", ".join(f"{k}={str(v).lower()}" for k, v in chosen.items())
    return config, f"hybridflow: chose {said} ({choice.why}; docs/memory.md, \"Memory\")"


def _layer_floats(shape: ModelShape, tokens: int, attention_probabilities: bool = True) -> int:
    return 10 * shape.hidden + 4 * shape.intermediate + (2 * shape.heads * tokens if attention_probabilities else 0)


def node_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_gpus() -> list[tuple[str, int]]:
    """This machine's GPUs as (name, bytes of memory), read through NVML (`nvidia-smi`), not
    torch.cuda: the driver must not open a CUDA context on a GPU its workers use. Empty without
    nvidia-smi, or when it reports no GPU it can read."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        gpus = []
        for line in out.strip().splitlines():
            name, _, mib = line.rpartition(",")
            gpus.append((name.strip() or "unknown GPU", int(float(mib) * 2 ** 20)))
        return gpus
    except (subprocess.SubprocessError, OSError, ValueError):  # no GPU it can read
        return []


def gpu_memory_bytes(config) -> int | None:
    """One GPU's memory: `placement.gpu_memory_gib`, else this machine's first GPU's (`local_gpus`),
    else None (unknown before start: a driver without a GPU submitting to a cluster)."""
    if config.placement.gpu_memory_gib:
        return int(config.placement.gpu_memory_gib * GIB)
    gpus = local_gpus()
    return gpus[0][1] if gpus else None


def _engine_gpu(config) -> str:
    """What the rollout engine holds on a GPU (`RolloutEngine.gpu_memory`'s value)."""
    return rollout_engine(config.rollout.backend).gpu_memory.value


def _engine_memory(config) -> bool:
    """Whether the rollout engine holds weights and a KV cache of its own (`RolloutEngine.engine_memory`)."""
    return rollout_engine(config.rollout.backend).engine_memory


def gpu_process_terms(ranks: int) -> dict[str, float]:
    """What every GPU process holds in every phase before its tensors: the CUDA context and cuBLAS's
    workspace, and with several ranks NCCL's buffers (estimates; see CUDA_CONTEXT_BYTES)."""
    terms = {"CUDA context and cuBLAS workspace (per GPU process; estimate)": CUDA_CONTEXT_BYTES}
    if ranks > 1:
        terms["NCCL buffers (a pool of several GPUs; estimate)"] = NCCL_BUFFER_BYTES
    return terms


def gpu_phase_terms(config, plan, shape: ModelShape, roles: set[str], gpu_bytes: int) -> dict[str, dict[str, float]]:
    """GPU bytes per process of the actor's pool in each phase of a step, term by term (floors; the
    module docstring): `gpu_device_phases` for the config's run on the stage's plan."""
    return gpu_device_phases(MemoryInputs.from_config(config, shape), set(roles) | {"actor"},
                             plan.devices_of("actor"), plan.rollout_tp, gpu_bytes)


def gpu_device_phases(inputs: MemoryInputs, roles, ranks: int, tp: int, gpu_bytes: float
                      ) -> dict[str, dict[str, float]]:
    """GPU bytes per device of a pool of `ranks` GPUs holding `roles`, in each phase of a step, term by
    term: "training" when a model trains or scores there, and with a colocated engine the phases its
    `GpuMemory` (`inputs.engine_gpu`, hybridflow/config/engines.py) gives it:
    - a share (vLLM): "start" (the models' weights beside the engine's whole share,
      `gpu_memory_utilization` of the GPU: vLLM refuses to start when it is not free), "weight sync"
      (with the actor: its parameters and AdamW moments, its gradients freed at the end of the update,
      beside the engine's weights alone, 1/`tp`, and one bucket in flight) and "generation" (the
      engine's share beside what does not offload: only the actor moves to the host);
    - its own copy (hf): the same three phases with the engine's weights in rollout.dtype in place of a
      share, and at generation its KV cache (preallocated for rollout.max_num_seqs rows of this rank's
      samples x (prompt + response) tokens) and one position's logits per row (the prefill's);
    - the actor's module (exact): "generation" alone (no copy, no sync): the actor's parameters stay on the
      device beside a KV cache of actor.samples_per_micro_batch rows x (prompt + response) tokens and one
      position's logits per row (its π_old pass replays the same decode).
    With the actor on the pool the engine sleeps while it trains (the colocated hand-over,
    hybridflow/resharding/transports/colocated.py); a vLLM engine without it stays awake. The run's GPU
    check and the planner's both call it."""
    roles = set(roles)
    kind = GpuMemory(inputs.engine_gpu) if "rollout" in roles else None
    share = inputs.gpu_memory_utilization
    vllm = kind is GpuMemory.SHARE and inputs.engine_memory
    engine = {f"vLLM's share: weights, activations and KV cache (rollout.gpu_memory_utilization={share} of "
              f"{gpu_bytes / GIB:.1f} GiB)": share * gpu_bytes} if vllm else {}
    phases = {}
    if roles & set(MODEL_ROLES_ON_DEVICES):
        phases["training"] = {**device_terms(inputs, roles - {"rollout"}, ranks, tp, "cuda"),
                              **({} if "actor" in roles else engine)}
    if kind is None or kind is GpuMemory.UNCOUNTED or (kind is GpuMemory.SHARE and not vllm):
        return phases
    p, master = inputs.shape.parameters, inputs.master_bytes
    trained = 0 if inputs.lora else p
    stays, loaded = _staying_terms(inputs, roles, ranks)
    actor_weights = ({"actor parameters (model.master_dtype, FSDP shard)": p * master / ranks}
                     if "actor" in roles else {})
    process = gpu_process_terms(ranks)
    if kind is GpuMemory.ACTOR_MODULE:
        phases["generation"] = {**process, **stays, **actor_weights, **_exact_forward_terms(inputs, ranks)}
        return phases
    if kind is GpuMemory.OWN_COPY:
        engine = {"hf engine weights (rollout.dtype, its own copy)": p * inputs.rollout_bytes}
    phases["start"] = {**process, **actor_weights, **loaded, **engine}
    if "actor" in roles:
        awake = (f"vLLM weights awake (rollout.dtype, 1/{tp} of the model; its KV cache still freed)"
                 if vllm else "hf engine weights (rollout.dtype, its own copy)")
        phases["weight sync"] = {
            **process, **actor_weights,
            "actor AdamW moments (2 per parameter, FSDP shard; its gradients freed after the update)":
                2 * trained * master / ranks,
            **stays, awake: p * inputs.rollout_bytes / (tp if vllm else 1),
            "one bucket in flight (weight_sync.bucket_mb)": inputs.bucket_bytes}
    phases["generation"] = {**process, **stays, **engine,
                            **(_hf_generation_terms(inputs, ranks) if kind is GpuMemory.OWN_COPY else {})}
    return phases


def _staying_terms(inputs: MemoryInputs, roles: set[str], ranks: int) -> tuple[dict, dict]:
    """(what does not offload around generation: every model but the actor's; what of it the start loads)."""
    p, master, compute = inputs.shape.parameters, inputs.master_bytes, inputs.compute_bytes
    stays, loaded = {}, {}
    if "reference" in roles:
        stays["reference weights (model.dtype, FSDP shard)"] = p * compute / ranks
        loaded.update(stays)
    if "critic" in roles:
        stays["critic parameters, gradients and AdamW moments (FSDP shard)"] = 4 * p * master / ranks
        loaded["critic parameters (FSDP shard)"] = p * master / ranks
    if "reward" in roles and inputs.reward_parameters:
        reward = {"reward model weights (model.dtype, FSDP shard)": inputs.reward_parameters * compute / ranks}
        stays.update(reward)
        loaded.update(reward)
    if "teacher" in roles and inputs.teacher_parameters:
        teacher = {TEACHER_TERM: inputs.teacher_parameters * inputs.teacher_bytes / ranks}
        stays.update(teacher)
        loaded.update(teacher)
    return stays, loaded


def generation_rows(inputs: MemoryInputs, ranks: int) -> int:
    """The rows an engine of one rank decodes at once: rollout.max_num_seqs, or this rank's share of the
    step's samples where fewer."""
    mine = -(-inputs.sequences // ranks) if inputs.sequences else inputs.max_num_seqs
    return max(1, min(inputs.max_num_seqs, mine))


HF_KV_TERM = "hf engine KV cache"
HF_LOGITS_TERM = "hf engine prefill logits"


def _hf_generation_terms(inputs: MemoryInputs, ranks: int) -> dict[str, float]:
    """The hf engine's own at generation: its KV cache (keys and values of every layer), allocated whole for a
    batch of rows at full length (hybridflow/training/kv_cache.py: data.max_prompt_tokens + rollout.max_response_tokens
    positions, the most a batch's prompt width reaches; on a GPU exactly that, its StaticCache), and the prefill's
    logits, one position per row."""
    s, rows = inputs.shape, generation_rows(inputs, ranks)
    logit_bytes = 4 if inputs.engine_fp32_head else inputs.rollout_bytes
    return {f"{HF_KV_TERM} ({rows} rows, rollout.max_num_seqs, x {inputs.tokens} tokens x 2 x {s.layers} layers x "
            f"{s.kv_width or s.hidden} key/value values, rollout.dtype)":
            rows * inputs.tokens * s.kv_floats_per_token * inputs.rollout_bytes,
            f"{HF_LOGITS_TERM} ({rows} rows x one position x {s.vocab} vocabulary"
            + (", float32: rollout.fp32_lm_head)" if inputs.engine_fp32_head else ", rollout.dtype)"):
            rows * s.vocab * logit_bytes}


def _exact_forward_terms(inputs: MemoryInputs, ranks: int) -> dict[str, float]:
    """The exact engine's decode (hybridflow/training/exact_layout.py), and the actor's π_old pass that replays it:
    the actor's gathered embeddings where FSDP2 keeps the root gathered, a KV cache of actor.samples_per_micro_batch
    rows at full length in model.dtype (hybridflow/training/kv_cache.py), and the prefill's logits at one position
    per row with their float32 log-softmax."""
    s, rows, compute = inputs.shape, inputs.rows, inputs.compute_bytes
    terms = {}
    if ranks > 1 or compute != inputs.master_bytes:
        terms["actor embeddings gathered (model.dtype, whole)"] = s.vocab * s.hidden * (1 if s.tied_embeddings else 2) * compute
    terms[f"exact engine KV cache ({rows} rows, actor.samples_per_micro_batch, x {inputs.tokens} tokens x 2 x "
          f"{s.layers} layers x {s.kv_width or s.hidden} key/value values, model.dtype)"] = (
        rows * inputs.tokens * s.kv_floats_per_token * compute)
    logits = rows * s.vocab
    terms[f"one decode step's logits ({rows} rows x one position x {s.vocab} vocabulary"
          + (", float32: actor.fp32_lm_head)" if inputs.fp32_head else ", model.dtype)")] = (
        logits * (4 if inputs.fp32_head else compute))
    terms["their float32 log-softmax"] = 4 * logits
    return terms


def gpu_host_terms(inputs: MemoryInputs, roles, ranks: int, tp: int) -> dict[str, float]:
    """Host memory one GPU process of the actor's pool holds for the colocated hand-over, term by term:
    the actor's parameters and AdamW moments offloaded while the engine generates (page-locked; PyTorch's
    caching host allocator keeps the blocks from one offload to the next, so they stay held), the
    engine's weights while the actor trains at `rollout.sleep_level` 1 (vLLM copies them to page-locked
    memory; level 2 discards them), and the process's host runtime. Empty without both on the pool."""
    if not {"actor", "rollout"} <= set(roles):
        return {}
    p, master = inputs.shape.parameters, inputs.master_bytes
    trained = 0 if inputs.lora else p
    kind = GpuMemory(inputs.engine_gpu)
    if kind is GpuMemory.ACTOR_MODULE:  # the exact engine generates with the parameters: only the moments move
        terms = {"actor AdamW moments offloaded while the engine generates (page-locked, FSDP shard)":
                 2 * trained * master / ranks}
    else:
        terms = {"actor parameters and AdamW moments offloaded while the engine generates (page-locked, FSDP shard)":
                 (p + 2 * trained) * master / ranks}
    if inputs.sleep_level == 1 and kind in (GpuMemory.SHARE, GpuMemory.OWN_COPY):
        terms[f"engine weights asleep while the actor trains (rollout.sleep_level=1, page-locked, 1/{tp})"] = (
            p * inputs.rollout_bytes / tp)
    terms["the process's own runtime (Python, torch, Ray, the engine; measured on a CPU)"] = RUNTIME_BYTES_WITH_VLLM
    return terms


def actor_pool_roles(config, plan) -> set[str]:
    """The roles with a model that share the actor's processes in this run under `plan`
    (`config.model_roles`: a reference only when a KL term needs one and LoRA does not stand in for
    it, a critic only with algorithm.use_critic, a reward only as a reward model)."""
    return set(plan.pool_of("actor").roles) & set(config.model_roles)


def memory_problems(config, plan, roles: set[str] | None = None, node_bytes: int | None = None,
                    gpu_bytes: int | None = None) -> list[str]:
    """The refusal, with its arithmetic, of a run whose actor pool cannot fit on a node of this
    machine's memory (`node_bytes`), or on GPUs in one GPU's memory (`gpu_bytes`, else
    `gpu_memory_bytes`: training, and a colocated engine's weight sync); empty when it may fit or the
    check does not apply."""
    if config.model.path is None:
        return []
    shape = ModelShape.from_dir(config.model.path)
    if shape is None:
        return []
    if plan.device != "cpu":
        return _gpu_problems(config, plan, shape, roles, gpu_bytes or gpu_memory_bytes(config), node_bytes)
    asked = config
    config, _ = resolve_micro_batches(config, plan, node_bytes)  # null sizes: the choice the run would make
    pool = plan.pool_of("actor")
    roles = actor_pool_roles(config, plan) if roles is None else roles
    terms = process_terms(config, plan, shape, roles)
    per_process = sum(terms.values())
    node = pool.devices_per_node * per_process
    available = NODE_MEMORY_SHARE * (node_bytes or node_memory_bytes())
    if node <= available:
        return []

    def fits(other) -> bool:
        other, _ = resolve_micro_batches(other, plan, node_bytes)
        return pool.devices_per_node * sum(process_terms(other, plan, shape, roles).values()) <= available

    split = _sequence_parallel_line(asked, plan, roles | {"actor"}, fits)
    lines = _lines(terms)
    return [f"model.path={config.model.path!r} ({shape.parameters / 1e6:.0f}M parameters, {shape.layers} layers) does "
            f"not fit: each of the {pool.devices_per_node} processes of the actor's pool on a node holds at least "
            f"{per_process / GIB:.2f} GiB:{lines}\n    = {node / GIB:.2f} GiB per node, above the "
            f"{available / GIB:.2f} GiB Ray lets a node use ({NODE_MEMORY_SHARE:.0%} of {available / NODE_MEMORY_SHARE / GIB:.1f} "
            f"GiB).{split} Fix: actor.gradient_checkpointing=true, a smaller actor.samples_per_micro_batch, "
            "model.dtype=bfloat16 with model.master_dtype=bfloat16, fewer ranks per node "
            "(placement.pools.<pool>.devices_per_node), or rollout.kv_cache_space_gib=1"]


def sequence_parallel_keys(roles) -> list[str]:
    """MemoryInputs' sequence-parallel fields (`SP_KEYS`) of the roles in `roles` that split sequences, sorted."""
    return sorted({SP_OF_ROLE[r] for r in roles if r in SP_OF_ROLE})


def admitted_sequence_parallel(config, keys) -> list[int]:
    """The sequence-parallel sizes above the smallest configured one of `keys` that the heads admit: common
    divisors of the model's attention and key/value heads (and of each teacher's, with the teacher's key)."""

    def admitted(heads: tuple[int, int]) -> set[int]:
        return {d for d in range(1, min(heads) + 1) if heads[0] % d == 0 and heads[1] % d == 0}

    sizes = admitted(model_heads(config.model))
    if "teacher_sp" in keys:
        for path in config.teacher.paths.values():
            facts = ModelFacts.from_dir(path)
            if facts is not None and facts.heads:
                sizes &= admitted((facts.heads, facts.kv_heads or facts.heads))
    now = min(getattr(config, SP_KEYS[k].split(".")[0]).sequence_parallel_size for k in keys)
    return sorted(d for d in sizes if d > now)


def raise_sequence_parallel(config, keys, size: int) -> tuple[object, dict[str, int]]:
    """`config` with each of `keys` configured below `size` raised to it, and the keys raised
    ({'actor.sequence_parallel_size': size, ...}); a size configured at or above it is kept."""
    raised = {}
    for k in sorted(keys):
        section = SP_KEYS[k].split(".")[0]
        if getattr(config, section).sequence_parallel_size < size:
            raised[section] = dataclasses.replace(getattr(config, section), sequence_parallel_size=size)
    return dataclasses.replace(config, **raised), {f"{section}.sequence_parallel_size": size for section in raised}


def sequence_parallel_fix(config, plan, roles, fits) -> str | None:
    """The sequence-parallel size that would fit, for a refusal: the smallest size above the configured ones
    of the model roles on the actor's pool that their heads admit (`admitted_sequence_parallel`) and that
    divides their pools' ranks, whose floor `fits(config)` (a bool) says fits, as the keys to set; the sizes
    the heads admit when none does; None when no role on the pool splits sequences or no size above 1 is
    admitted."""
    keys = sequence_parallel_keys(roles)
    if not keys or (config.reward.reward_model.path is not None and "reward" in roles):
        return None  # a reward model scores whole sequences beside them
    ranks = {"actor_sp": [plan.devices_of("actor"), *([plan.devices_of("reference")] if "reference" in roles else [])],
             "critic_sp": [plan.devices_of("critic")] if "critic" in roles else [],
             "teacher_sp": [plan.devices_of(r) for r in roles if r == "teacher"]}
    sizes = [d for d in admitted_sequence_parallel(config, keys) if all(n % d == 0 for k in keys for n in ranks[k])]
    if not sizes:
        return None
    for size in sizes:
        raised, chosen = raise_sequence_parallel(config, keys, size)
        if fits(raised):
            return ", ".join(f"{key}={value}" for key, value in chosen.items()) + (
                f" (each rank then holds 1/{size} of a micro-batch's tokens; the sizes the heads and the pool admit: "
                f"{sizes})")
    return (f"no sequence_parallel_size the heads and the pool admit ({sizes}) fits either; with more ranks in the "
            "pool a larger one may")


def _sequence_parallel_line(config, plan, roles, fits) -> str:
    """The refusal's sentence on the longest sequence and the sequence-parallel size that would fit it
    (`sequence_parallel_fix`); empty where no size above the configured one is admitted."""
    fix = sequence_parallel_fix(config, plan, roles, fits)
    if fix is None:
        return ""
    tokens = config.data.max_prompt_tokens + config.rollout.max_response_tokens
    sp = config.actor.sequence_parallel_size
    return (f" The longest sequence, data.max_prompt_tokens + rollout.max_response_tokens = {tokens} tokens, is "
            f"{'whole on one rank' if sp == 1 else f'split over {sp} ranks'} (actor.sequence_parallel_size={sp}); "
            f"split it further: {fix}.")


def _host_problems(config, plan, shape: ModelShape, roles: set[str], node_bytes: int | None, model: str,
                   more: str) -> list[str]:
    """A GPU node's host memory against what the colocated hand-over keeps there (`gpu_host_terms`),
    summed over the node's processes; checked where the node's memory is known: `node_bytes`, or this
    machine's when it is a GPU node (a driver without GPUs submitting to a cluster does not know it)."""
    if node_bytes is None and not local_gpus():
        return []
    pool = plan.pool_of("actor")
    inputs = MemoryInputs.from_config(config, shape)
    terms = gpu_host_terms(inputs, set(roles) | {"actor"}, plan.devices_of("actor"), plan.rollout_tp)
    node = pool.devices_per_node * sum(terms.values())
    available = NODE_MEMORY_SHARE * (node_bytes or node_memory_bytes())
    if not terms or node <= available:
        return []
    fix = [more, "fewer GPUs per node in the actor's pool (placement.pools.<pool>.devices_per_node)",
           "or a rollout pool of its own (placement.roles.rollout)"]
    if inputs.sleep_level == 1:
        fix.insert(0, "rollout.sleep_level=2 (the engine's weights discarded, not kept, while the actor trains; "
                      "not with weight_sync.lora=adapter, whose syncs never send the base weights again)")
    return [f"{model} does not fit in a node's host memory: each of the {pool.devices_per_node} GPU processes of the "
            f"actor's pool on a node keeps at least {sum(terms.values()) / GIB:.2f} GiB there for the colocated "
            f"hand-over:{_lines(terms)}\n    = {node / GIB:.2f} GiB per node, above the {available / GIB:.2f} GiB "
            f"({NODE_MEMORY_SHARE:.0%} of the node's {available / NODE_MEMORY_SHARE / GIB:.1f} GiB). Fix: "
            + ", ".join(fix)]


def _lines(terms: dict[str, float]) -> str:
    return "".join(f"\n      {v / GIB:7.2f} GiB  {k}" for k, v in terms.items())


def _engine_of_its_own(phase: str, terms: dict[str, float], usable: float, more: str, rows: int) -> tuple[str, str]:
    """Why a phase of an hf or exact engine does not fit, and the fix (with the hf engine at generation, the
    most rows of rollout.max_num_seqs that fit: what its KV cache and prefill logits cost a row)."""
    if phase == "start":
        return ("when the engine starts: its own copy of the weights beside the training roles' weights",
                f"rollout.dtype=bfloat16, {more}, or rollout.backend=exact (no copy: it generates with the actor's module)")
    per_row = {k: v for k, v in terms.items() if k.startswith((HF_KV_TERM, HF_LOGITS_TERM))}
    if not per_row:  # the exact engine: a training micro-batch's rows decode together
        return ("while the exact engine generates: the actor's parameters stay on the GPU beside the KV cache of "
                "actor.samples_per_micro_batch rows at full length",
                f"a smaller actor.samples_per_micro_batch, shorter rollout.max_response_tokens, {more}, or "
                "rollout.backend=hf")
    rest = sum(terms.values()) - sum(per_row.values())
    fitting = max(0, int((usable - rest) // (sum(per_row.values()) / rows)))
    return ("while the colocated hf engine generates: its weights, its KV cache and the prefill's logits for "
            f"{rows} rows at once, beside what does not offload (only the actor moves to the host)",
            f"rollout.max_num_seqs={fitting} or lower ({sum(per_row.values()) / rows / 2 ** 20:.1f} MiB a row), "
            f"shorter data.max_prompt_tokens or rollout.max_response_tokens, rollout.dtype=bfloat16 where float32, or {more}")


def _gpu_problems(config, plan, shape: ModelShape, roles: set[str] | None, gpu: int | None,
                  node_bytes: int | None = None) -> list[str]:
    if gpu is None:  # unknown before start (said when the micro-batch is chosen)
        return []
    asked = config
    config, _ = resolve_micro_batches(config, plan, gpu_bytes=gpu)
    roles = actor_pool_roles(config, plan) if roles is None else roles
    model = f"model.path={config.model.path!r} ({shape.parameters / 1e6:.0f}M parameters, {shape.layers} layers)"
    phases = gpu_phase_terms(config, plan, shape, roles, gpu)
    more = "more GPUs in the actor's pool (FSDP2 shards the parameters, gradients and AdamW moments over them)"
    problems = _host_problems(config, plan, shape, roles, node_bytes, model, more)
    usable = GPU_MEMORY_SHARE * gpu
    for phase, terms in phases.items():
        total = sum(terms.values())
        if total <= usable:
            continue
        if phase == "training":
            why, fix = "while it trains", (f"actor.gradient_checkpointing=true, a smaller actor.samples_per_micro_batch, "
                                          f"{more}, or model.master_dtype=bfloat16")

            def fits(other) -> bool:
                other, _ = resolve_micro_batches(other, plan, gpu_bytes=gpu)
                return sum(gpu_phase_terms(other, plan, shape, roles, gpu)["training"].values()) <= usable

            split = _sequence_parallel_line(asked, plan, set(roles) | {"actor"}, fits)
            fix = f"{fix}.{split}" if split else fix
        elif phase in ("start", "generation") and any(k.startswith("vLLM") for k in terms):
            beside = sum(v for k, v in terms.items() if not k.startswith("vLLM"))
            why = ("when the colocated vLLM engine starts: it takes its whole share of the GPU while the training "
                   "roles' weights are loaded (vLLM refuses to start when that share is not free)" if phase == "start"
                   else "while the colocated vLLM engine generates: its whole share of the GPU beside what does not "
                   "offload (only the actor moves to the host)")
            fix = (f"rollout.gpu_memory_utilization={max(0.0, (usable - beside) / gpu):.2f} or lower, {more}, "
                   "or a rollout pool of its own (placement.roles.rollout)")
        elif phase in ("start", "generation"):
            why, fix = _engine_of_its_own(phase, terms, usable, more,
                                          generation_rows(MemoryInputs.from_config(config, shape), plan.devices_of("actor")))
        else:
            why = ("at the weight sync: the actor keeps its parameters and AdamW moments on the GPU while the "
                   "colocated engine's weights wake")
            fix = (f"{more}, a larger rollout.tensor_parallel_size (each engine rank holds 1/TP of the weights), "
                   "model.master_dtype=bfloat16, or a rollout pool of its own (placement.roles.rollout)"
                   if any(k.startswith("vLLM") for k in terms) else
                   f"{more}, model.master_dtype=bfloat16, rollout.dtype=bfloat16, or rollout.backend=exact (no copy)")
        problems.append(f"{model} does not fit {why}: each GPU of the actor's pool holds at least {total / GIB:.2f} "
                        f"GiB:{_lines(terms)}\n    above {GPU_MEMORY_SHARE:.0%} of the GPU's {gpu / GIB:.1f} GiB "
                        f"({usable / GIB:.1f} GiB: the rest is left to the allocator's fragmentation and the "
                        f"transient buffers the terms do not count). Fix: {fix}")
    return problems
