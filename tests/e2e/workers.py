"""Test-only worker subclasses (imported by Ray workers by module path)."""

from __future__ import annotations

from hybridflow.controller import Dispatch, register
from workers.actor import ActorWorker
from workers.rollout.vllm_rollout import VLLMRollout


class FaultyActor(ActorWorker):
    @register(Dispatch.ONE_TO_ALL)
    def exit_sending_bucket(self, bucket: int) -> bool:
        """This process dies when its weight sender is about to send bucket `bucket`."""
        from hybridflow.resharding import faults

        faults.exit_sending_bucket(bucket)
        return True


class CorruptibleVLLMRollout(VLLMRollout):
    @register(Dispatch.ONE_TO_ALL)
    def corrupt_parameter(self, name_fragment: str) -> str:
        """Add 1 to the first engine parameter whose name contains `name_fragment`."""

        def corrupt(worker, fragment=name_fragment):
            for name, param in worker.model_runner.get_model().named_parameters():
                if fragment in name and param.numel():
                    param.data.add_(1.0)
                    return name
            raise KeyError(f"no vLLM parameter matches {fragment!r}")

        return self.engine.collective_rpc(corrupt)[0]

    @register(Dispatch.ONE_TO_ALL)
    def inject_weight_sync_fault(self, kind: str, bucket: int) -> bool:
        """`corrupt` the received bucket, or `exit` this process when it arrives."""
        from hybridflow.resharding import faults

        {"corrupt": faults.corrupt_bucket, "exit": faults.exit_at_bucket}[kind](bucket)
        return True

    @register(Dispatch.ONE_TO_ALL)
    def hold_staged(self, version: int, seconds: float, rank: int) -> bool:
        """Rank `rank` registers the staged push of policy `version` `seconds` after it arrived."""
        from hybridflow.resharding import faults

        if self.ctx.rank == rank:
            faults.hold_staged(version, seconds)
        return True


class PausingVLLMRollout(CorruptibleVLLMRollout):
    """A stepwise batch (rollout.on_update=recompute) waits before its third engine step until newer
    staged weights have arrived: a load lands mid-batch on purpose, after each request has
    sampled two tokens."""

    def between_steps(self, steps: int) -> None:
        import time

        if steps == 2:
            deadline = time.monotonic() + 60
            while not self.receiver.has_newer() and time.monotonic() < deadline:
                time.sleep(0.01)


class RecordingVLLMRollout(VLLMRollout):
    """Records what the engine was asked and what it sampled, as token ids (agent tests)."""

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> float:
        seconds = super().start()
        self.records: list[tuple[list[int], list[int]]] = []  # (prompt ids, sampled ids) per request
        generate = self.engine.generate

        def recording(prompts, params, **kwargs):
            outputs = generate(prompts, params, **kwargs)
            self.records += [(list(p["prompt_token_ids"]), list(o.outputs[0].token_ids))
                             for p, o in zip(prompts, outputs)]
            return outputs

        self.engine.generate = recording
        return seconds

    @register(Dispatch.ONE_TO_ALL)
    def recorded(self) -> list[tuple[list[int], list[int]]]:
        return self.records


class PrefixCacheVLLMRollout(VLLMRollout):
    """Greedy probes that report vLLM's prefix-cache hits, and a weight load of the model's own
    weights scaled (the prefix-cache test)."""

    @register(Dispatch.ONE_TO_ALL)
    def greedy(self, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], list[float], int]:
        """(tokens, their log-probs, prompt tokens read from the prefix cache)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0, ignore_eos=True)
        out = self.engine.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)[0]
        tokens = list(out.outputs[0].token_ids)
        return tokens, [e[t].logprob for t, e in zip(tokens, out.outputs[0].logprobs)], out.num_cached_tokens

    @register(Dispatch.ONE_TO_ALL)
    def load_scaled(self, scale: float, reset_prefix_cache: bool) -> None:
        """Load the starting weights times `scale` through the receiver's load session; without
        `reset_prefix_cache` the session skips the reset (to show what it prevents)."""
        from unittest import mock

        from transformers import AutoModelForCausalLM

        from hybridflow.resharding.transports import Colocated

        model = AutoModelForCausalLM.from_pretrained(self.model_path)
        bucket = [(name, p.detach() * scale) for name, p in model.named_parameters()]
        if reset_prefix_cache:
            self.receiver.load([bucket], route=Colocated())  # tensors handed over in this process
            return
        with mock.patch("workers.rollout.vllm.receiver.reset_prefix_cache"):
            self.receiver.load([bucket], route=Colocated())


class AdapterFaultVLLMRollout(VLLMRollout):
    """Plants the faults of an adapter sync (weight_sync.lora=adapter) in this rollout process."""

    @register(Dispatch.ONE_TO_ALL)
    def plant_adapter_fault(self, kind: str, version: int = 0) -> bool:
        """`drop`: the adapter of policy `version` arrives but is never registered with the engine;
        `other_weights`: the actor's next payload is built from other weights than it holds (colocated
        only: the actor shares this process); `base`: every request from now on goes out without the adapter."""
        from hybridflow.resharding import faults

        if kind == "drop":
            faults.drop_adapter(version)
        elif kind == "other_weights":  # the actor's side: it shares this process when colocated
            faults.adapter_from_other_weights()
        else:
            faults.serve_base_model()
        return True


def spawn_actor_and_rollout(actor, rollout, actor_ranks: int, rollout_ranks: int | None, name: str,
                            env_vars: dict) -> dict:
    """Actor and rollout groups (RoleSpecs), on one pool of `actor_ranks` when `rollout_ranks` is
    None, else on pools of their own; both started."""
    from hybridflow.controller import PoolSpec, ResourcePool, spawn_workers

    if rollout_ranks is None:
        groups = spawn_workers(ResourcePool(PoolSpec(name, devices_per_node=actor_ranks)),
                               {"actor": actor, "rollout": rollout}, env_vars=env_vars)
    else:
        groups = spawn_workers(ResourcePool(PoolSpec(f"{name}-train", devices_per_node=actor_ranks)),
                               {"actor": actor}, env_vars=env_vars)
        groups.update(spawn_workers(ResourcePool(PoolSpec(f"{name}-gen", devices_per_node=rollout_ranks)),
                                    {"rollout": rollout}, env_vars=env_vars))
    for future in [groups["actor"].start.remote(), groups["rollout"].start.remote()]:
        future.get()
    return groups
