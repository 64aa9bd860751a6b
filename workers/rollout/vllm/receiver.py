"""The receiving end of the weight path in an in-process vLLM engine: `VLLMReceiver`.

The rollout worker (workers/rollout/vllm_rollout.py) builds the engine with
`weight_transfer_config={"backend": "hybridflow"}` and hands it to a `VLLMReceiver`, which its
registered weight methods delegate to (`workers.rollout.RolloutEngineBase`). The receiver drives
our transfer engine inside vLLM (`workers.rollout.vllm.transfer`) through `collective_rpc`: it joins the plan's
transport route (`join`), loads what a colocated sender hands over in this process (`load`) or
what the route receives (`receive`), each inside one vLLM update session that ends by resetting
the prefix cache (`reset_prefix_cache`); disaggregated, it stages a push in host memory while
the engine generates (`stage`) and loads the newest staged version between two batches or two
engine steps (`load_staged`, `load_newer`), agreeing on it across a tensor-parallel engine's
ranks. With weight_sync.lora=adapter it serves the actor's LoRA as a vLLM adapter
(`load_adapter`, `adapter.py`). It answers the checks: parameter checksums and the log-prob probe.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable

import torch

from hybridflow.resharding import faults
from hybridflow.resharding.receiver import Receiver, verify
from hybridflow.resharding.verify import WeightSyncError


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
        from workers.rollout.vllm.transfer import needed_boxes

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
        from workers.rollout.vllm.transfer import stage_bucket

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
        from workers.rollout.vllm.transfer import received_bytes, refresh_cpu_kernels

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
        from workers.rollout.vllm.transfer import param_checksums

        return self.engine.collective_rpc(param_checksums)[0]

    def buffer_checksums(self) -> dict[str, tuple[float, float]]:
        """The model's buffers in vLLM's worker (rotary caches: kept in host memory across a level-2 sleep
        by vLLM and put back when the weights wake), compared after each such reload."""
        from workers.rollout.vllm.transfer import buffer_checksums

        return self.engine.collective_rpc(buffer_checksums)[0]

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
