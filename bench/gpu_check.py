"""One command that proves the product on a borrowed GPU in eight minutes: one GPU, torch and
transformers, no Ray, vLLM or network (the hydra-core, omegaconf and antlr4 wheels carried beside the
tree: docs/gpu.md "The GPU check").

    python bench/gpu_check.py                       # every part, results in $OUT (or --out DIR)
    python bench/gpu_check.py --parts resume,pipeline --out DIR
    python bench/gpu_check.py --dry-run --out DIR   # the CPU at the tiny shapes (a test runs it)

Parts, in the order of what matters (`PARTS`: name, expected seconds on one H100 — estimates until a GPU
run records them — and timeout), each in a process of its own under its timeout, all within `--budget-s`
(480: a part that would start with less than 15 s left is skipped, each timeout cut to what is left):

1. grpo_hf_level2 (50 s, 120): the product's GRPO (`hybridflow placement=local`) on the tiny model with the
   hf engine sleeping at level 2 and per-tensor checksums at every sync, 3 steps, a checkpoint at step 3;
2. resume (30 s, 90): that run resumed from its checkpoint for a fourth step;
3. pipeline (90 s, 150): SFT -> PMA merge -> GRPO with short stages and the hf engine;
4. level1_and_exact (60 s, 120): GRPO with the hf engine at sleep level 1, then with the exact engine
   (its sampler's log-probs the trainer's, `rollout_mismatch/abs_diff_max` 0);
5. grpo_0.5b (120 s, 200): Qwen2.5-0.5B shapes (random weights), bf16 over float32 masters, 2 GRPO steps of
   16 x 8 samples of 256 + 512 tokens, the hf engine at level 2: each phase's device peak (the hand-over's
   own metrics) beside the GPU memory model's floor for it (`hybridflow.checks.memory_budget.gpu_phase_terms`);
6. engine_checks (40 s, 90): the packed-attention kernel against a dense mask; the actor under FSDP2 on
   NCCL (a policy update, an SFT step), the reference and critic, offload and reload bit for bit, the
   colocated sync into GPU buffers through the real `WeightSender` (whole and a TP-2-like slice, float32
   and bfloat16, checked tensor by tensor), on a 100M model;
7. handover_0.5b (30 s, 90): the colocated hand-over's own sequence with `PlainEngine`, a stand-in holding
   0.4 of the GPU as vLLM does, each phase's peak beside its floor;
8. speed_0.5b (50 s, 120): the actor beside the loop a user writes without a framework (float32
   parameters, autocast, trimmed micro-batches, fused AdamW) on one GRPO-shaped batch of 128 rows.

Written as it goes to the output folder (`--out`, default $OUT): `gpu_check.json`, rewritten after every
part (each part's exit status, seconds, `passed`, the product's per-step metrics of `PRODUCT_KEYS`, the
phases' floors and peaks), and `gpu_check.log`, each part's command and output; never weights (the runs'
directories stay in a temporary folder). A call cut short keeps every part before. The dry run: the same
parts on the CPU at the tiny shapes, with timeouts three times as long.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {"tiny": {}, "100m": dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=14,
                                   num_attention_heads=12, num_key_value_heads=4)}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def allocated_mb(device: str) -> float:
    return torch.cuda.memory_allocated() / 2 ** 20 if device == "cuda" else 0.0


def batch_for(model_dir: Path, rows: int):
    from transformers import AutoTokenizer

    from hybridflow.batch import Batch
    from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
    from hybridflow.data.prompts import encode_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = encode_prompts(make_arithmetic_rows(rows, ArithmeticSpec(), seed=0), tok, 16)
    generator = torch.Generator().manual_seed(0)
    return batch.union(Batch({"response_ids": torch.randint(5, 60, (rows, 8), generator=generator),
                              "response_mask": torch.ones(rows, 8, dtype=torch.bool),
                              "advantages": torch.randn(rows, 1, generator=generator).expand(rows, 8).contiguous()}))


def _first_weight(actor) -> torch.Tensor:
    """The actor's first weight, gathered now, on the host. (A parameter object held across steps
    can go stale: after a no-grad forward FSDP2 leaves the root unit unsharded, and the unsharded
    tensor's storage is freed at the next reshard.)"""
    from hybridflow.resharding.weights import full_weights

    return next(full_weights(actor.model))[1].cpu().clone()


def check_training(actor, batch, device: str) -> dict:
    """FSDP2 on the device's backend: parameters are DTensor shards on the device; a policy
    update and an SFT step change them and give finite numbers."""
    before = _first_weight(actor)
    batch = batch.union(actor.compute_log_probs(batch))
    update = actor.update_policy(batch)
    sft = actor.train_sft(batch)
    after = _first_weight(actor)
    synchronize(device)
    first = next(actor.model.parameters())  # after a backward pass every unit is resharded
    return {"fsdp2_dtensor_params": hasattr(first, "full_tensor"), "param_device": str(first.device),
            "policy_loss": update["actor/loss"], "policy_grad_norm": update["actor/grad_norm"],
            "sft_loss": sft["actor/loss"], "first_param_changed": bool((after != before).any())}


def check_reference_and_critic(model_dir: Path, ctx, actor, batch) -> dict:
    """Before any update the reference computes the actor's log-probs; the critic trains on the device."""
    from hybridflow.config.schema import HybridFlowConfig
    from recipes.roles import critic_role, reference_role
    from hybridflow.run.stage import prepare_stage

    reference = reference_role(prepare_stage(HybridFlowConfig()).config, model_dir).build(ctx)
    reference.start()
    ref = reference.compute_ref_log_probs(batch)["ref_log_probs"]
    gap = float((ref - actor.compute_log_probs(batch)["old_log_probs"]).abs().max())
    critic = critic_role(prepare_stage(HybridFlowConfig()).config, model_dir).build(ctx)
    critic.start()
    values = critic.compute_values(batch)["values"]
    returns = torch.ones_like(values) * batch["response_mask"]
    stats = critic.update_critic(batch.union(batch.__class__({"values": values, "returns": returns})))
    after = critic.compute_values(batch)["values"]
    return {"reference_vs_actor_log_prob_gap": gap, "critic_values_device_out": str(values.device),
            "critic_loss": stats["critic/value_loss"],
            "critic_grad_norm": stats["critic/grad_norm"], "critic_values_changed": bool((after != values).any())}


def check_offload(actor, batch, device: str) -> dict:
    """Offload frees the training state's device memory; reload brings it back bit for bit."""
    reference = actor.compute_log_probs(batch)["old_log_probs"]
    resident = allocated_mb(device)
    moved = actor.offload()
    offloaded = allocated_mb(device)
    actor.reload()
    reloaded = allocated_mb(device)
    again = actor.compute_log_probs(batch)["old_log_probs"]
    return {"offload_moved": moved, "allocated_mb_resident": resident, "allocated_mb_offloaded": offloaded,
            "allocated_mb_reloaded": reloaded, "log_probs_equal_after_reload": bool(torch.equal(reference, again))}


def make_receivers(model_dir: Path, device: str, dtype: str):
    """The receiving ends: a plain module on the device, whole (TP 1) or a row-slice (TP 2 rank 0)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.resharding.layout import Box
    from hybridflow.resharding.receiver import ModuleReceiver
    from hybridflow.resharding.weights import checkpoint_shapes

    class SliceReceiver(ModuleReceiver):
        """Needs the first half of every weight's rows, as rank 0 of TP 2 does of a column-parallel layer."""

        def needed_boxes(self, shapes):
            return {n: Box(((0, (s[0] + 1) // 2),) + tuple((0, d) for d in s[1:])).ranges for n, s in shapes.items()}

        def load(self, buckets, route):
            start = time.perf_counter()
            params = dict(self.model.named_parameters())
            for bucket in buckets:
                for name, tensor in bucket:
                    half = (tensor.shape[0] + 1) // 2
                    params[name].data[:half].copy_(tensor[:half])
            return {"received_bytes": 0.0, "load_seconds": time.perf_counter() - start}

    def engine():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        for p in model.parameters():
            p.data.zero_()  # nothing right by accident: every checked byte must come through the sync
        return model

    tok_pad = 0
    whole, sliced = ModuleReceiver(engine(), tok_pad), SliceReceiver(engine(), tok_pad)
    shapes = checkpoint_shapes(whole.model)
    return {"TP1 (whole)": whole, "TP2 rank 0 (row slice)": sliced}, shapes


def copy_floor_seconds(nbytes: int, device: str, repeats: int = 5) -> float:
    src = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def check_sync(actor, model_dir: Path, device: str, dtype: str, syncs: int) -> list[dict]:
    from hybridflow.controller import introduce
    from hybridflow.resharding.layout import Box, buckets, layout_minimum, numel
    from hybridflow.resharding.sender import SyncPlan
    from hybridflow.resharding.transports import Colocated
    from hybridflow.resharding.verify import PROBE_NEW_TOKENS, PROBE_PROMPTS
    from hybridflow.resharding.weights import full_weights

    receivers, shapes = make_receivers(model_dir, device, dtype)
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    out = []
    for mode, receiver in receivers.items():
        need = {n: Box.of(r) for n, r in receiver.needed_boxes(shapes).items()}
        plan = SyncPlan(Colocated(), dtype, 64 * 2 ** 20, 60.0, [receiver.needed_boxes(shapes)],
                        buckets=buckets(list(shapes), {n: numel(s) * size for n, s in shapes.items()}, 64 * 2 ** 20),
                        shapes=shapes)
        introduce([actor, ReceivingEnd(receiver)])  # as a host introduces the workers of one process
        actor.setup_weight_sender(plan)
        times = []
        for _ in range(syncs + 1):  # the first is a warm-up
            synchronize(device)
            start = time.perf_counter()
            actor.send_weights()
            synchronize(device)
            times.append(time.perf_counter() - start)
        engine_bytes = max(layout_minimum(shapes, [need], None, size))
        floor = copy_floor_seconds(engine_bytes, device)
        got = dict(receiver.model.named_parameters())
        mismatched = [n for n, t in full_weights(actor.model, getattr(torch, dtype))
                      if not torch.equal(got[n].detach()[need[n].slices()], t[need[n].slices()].to(device))]
        result = {"mode": mode, "dtype": dtype, "engine_bytes": engine_bytes, "seconds": statistics.median(times[1:]),
                  "copy_floor_s": floor, "tensors_checked": len(shapes), "tensors_mismatched": mismatched[:5]}
        result["copy_floor_ratio"] = result["seconds"] / floor
        if mode.startswith("TP1") and dtype == "float32":
            tokens, engine_lp = receiver.probe(PROBE_PROMPTS, PROBE_NEW_TOKENS)
            actor_lp = actor.probe_log_probs(PROBE_PROMPTS, tokens)
            result["probe_log_prob_gap"] = float((engine_lp - actor_lp).abs().max())
        out.append(result)
    return out


def _fsdp_policy(model):
    """FSDP2's mixed-precision policy of the model's root (None for a plain module)."""
    state = getattr(model, "_get_fsdp_state", None)
    return state()._mp_policy if state is not None else None


# ---- 5. the actor beside a plain loop ---------------------------------------------------------

SIZES = {  # Qwen2.5 shapes; "tiny" is the dry run's
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
GRPO_SHAPE = dict(rows=128, prompt_width=256, prompt_min=64, response_width=512, response_min=64, micro=16)
DRY_SHAPE = dict(rows=8, prompt_width=16, prompt_min=4, response_width=16, response_min=4, micro=4)


def sized_model_dir(root: Path, size: str, device: str) -> Path:
    """A Hugging Face directory of a Qwen2 model at `size`'s shapes with random weights (the tiny
    model's tokenizer files, which only make the directory loadable: the batch is token ids drawn at
    random below every size's vocabulary, never text)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hybridflow.builders.tiny_model import build_tiny_model

    out = root / f"qwen2-{size}"
    tokenizer_dir = build_tiny_model(root / "tokenizer")
    config = Qwen2Config(**SIZES[size], tie_word_embeddings=True, max_position_embeddings=1024,
                         rope_theta=1e6, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    del model
    for item in tokenizer_dir.iterdir():
        if "token" in item.name or item.name.endswith(".txt") or item.name == "vocab.json":
            (out / item.name).write_bytes(item.read_bytes())
    return out


def grpo_batch(shape: dict, vocab: int, seed: int = 0):
    """Left-padded prompts and right-padded responses of uniform random real lengths, advantages per row."""
    from hybridflow.batch import Batch

    g = torch.Generator().manual_seed(seed)
    rows, pw, rw = shape["rows"], shape["prompt_width"], shape["response_width"]
    prompt_len = torch.randint(shape["prompt_min"], pw + 1, (rows,), generator=g)
    response_len = torch.randint(shape["response_min"], rw + 1, (rows,), generator=g)
    prompt_mask = torch.arange(pw).unsqueeze(0) >= (pw - prompt_len).unsqueeze(1)
    response_mask = torch.arange(rw).unsqueeze(0) < response_len.unsqueeze(1)
    prompt_ids = torch.randint(5, vocab, (rows, pw), generator=g) * prompt_mask
    response_ids = torch.randint(5, vocab, (rows, rw), generator=g) * response_mask
    advantages = torch.randn(rows, 1, generator=g).expand(rows, rw) * response_mask
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask, "advantages": advantages.contiguous()})


def timed_cuda(fn, device: str):
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else 0.0


def free_device_memory(device: str) -> None:
    import gc

    gc.collect()  # FSDP2's hooks hold reference cycles
    if device == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def profile_table(fn, device: str, rows: int = 10) -> list[dict]:
    """The `rows` operators with the most self device time (self CPU time on the CPU) in one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    events = sorted(averages, key=lambda e: getattr(e, key, 0), reverse=True)[:rows]
    busy_ms = sum(getattr(e, key, 0) for e in averages) / 1e3  # the device's busy time (all kernels)
    return {"busy_ms": round(busy_ms, 1), "ops": [
        {"op": e.key[:60], "calls": e.count, "self_ms": round(getattr(e, key, 0) / 1e3, 2),
         "cpu_total_ms": round(e.cpu_time_total / 1e3, 2)} for e in events]}


def ours(model_dir: Path, batch, shape: dict, device: str, dtype: str, repeats: int, packed: bool,
         profile: bool = True, diagnose: bool = False) -> dict:
    """The actor as a run builds it: the log-prob pass, the policy update, offload and reload;
    `packed`: `model.pack_sequences` true (else false: the padded path, trimmed)."""
    from hybridflow.config.schema import ActorConfig, Dtype, HybridFlowConfig, ModelConfig, OptimConfig
    from hybridflow.controller import WorkerContext
    from hybridflow.run.stage import prepare_stage
    from recipes.roles import actor_role

    config = HybridFlowConfig(model=ModelConfig(dtype=Dtype(dtype), master_dtype=Dtype.float32, pack_sequences=packed),
                              actor=ActorConfig(optim=OptimConfig(lr=1e-6), samples_per_micro_batch=shape["micro"],
                                                gradient_checkpointing=False, policy_loss="ppo_clip"))
    actor = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext(device=device, backend="nccl" if device == "cuda"
                                                              else "gloo"))
    out: dict = {}
    out["start_s"], started = timed_cuda(actor.start, device)
    out["packed_sequences"] = started["packed_sequences"]
    try:  # data beside the measurement: never its end
        out["floor_terms_gib"] = floor_terms(config, model_dir, shape)
    except Exception as error:  # noqa: BLE001
        out["floor_terms_gib"] = {"error": f"{type(error).__name__}: {error}"}
    out["allocated_after_start_gib"] = allocated_gib(device)
    reset_peak(device)
    lp_times, update_times = [], []
    for _ in range(repeats):
        t, lp = timed_cuda(lambda: actor.compute_log_probs(batch), device)
        lp_times.append(t)
    out["log_prob_pass_s"], out["log_prob_pass_first_s"] = min(lp_times), lp_times[0]
    trained = batch.union(lp.select(["old_log_probs"]))
    for _ in range(repeats):
        t, stats = timed_cuda(lambda: actor.update_policy(trained), device)
        update_times.append(t)
    out["update_s"], out["update_first_s"] = min(update_times), update_times[0]
    out["peak_gib"] = peak_gib(device)
    out["allocated_after_update_gib"] = allocated_gib(device)  # parameters, gradients, AdamW moments
    out["loss"], out["grad_norm"] = stats["actor/loss"], stats["actor/grad_norm"]
    if device == "cuda":
        moved = sum(p.numel() * p.element_size() for p in actor.model.parameters()) + sum(
            v.numel() * v.element_size() for st in actor.optimizer.state.values() for v in st.values()
            if torch.is_tensor(v) and v.dim() > 0)
        before = actor.compute_log_probs(batch)["old_log_probs"]
        for i in range(repeats):
            t_off, _ = timed_cuda(actor.offload, device)
            left = torch.cuda.memory_allocated() / 2 ** 30
            t_on, _ = timed_cuda(actor.reload, device)
        out.update(offload_s=t_off, reload_s=t_on, offloaded_gib=moved / 2 ** 30, allocated_gib_offloaded=left,
                   offload_gb_per_s=moved / t_off / 1e9, reload_gb_per_s=moved / t_on / 1e9)
        again = actor.compute_log_probs(batch)["old_log_probs"]
        out["log_probs_equal_after_reload"] = bool(torch.equal(again, before))
    if profile:
        out["profile_log_prob_pass"] = profile_table(lambda: actor.compute_log_probs(batch), device)
        out["profile_update"] = profile_table(lambda: actor.update_policy(trained), device)
    if diagnose:
        out.update(one_chunk(actor, batch, trained, device))
    actor = None  # freed before the next part builds its model
    free_device_memory(device)
    return out, lp["old_log_probs"]


def sized_config(config, model_dir: Path, shape: dict, device=None):
    """`config` for the memory model at this part's model and batch widths, one rank (`device`: the
    placement's device kind, where not the config's)."""
    from dataclasses import replace

    from hybridflow.config.schema import PoolConfig

    placement = replace(config.placement, pools={"global": PoolConfig(devices_per_node=1)},
                        **({"device": device} if device is not None else {}))
    return replace(config, model=replace(config.model, path=str(model_dir)),
                   data=replace(config.data, max_prompt_tokens=shape["prompt_width"]),
                   rollout=replace(config.rollout, max_response_tokens=shape["response_width"]), placement=placement)


def floor_terms(config, model_dir: Path, shape: dict) -> dict:
    """The project's memory floor for this actor (`hybridflow.checks.memory_budget.process_terms`, one rank,
    the batch's widths), term by term in GiB: data for a GPU memory model, beside the peaks."""
    from hybridflow.checks.memory_budget import GIB, ModelShape, process_terms
    from hybridflow.planning.auto import decide_plan

    sized = sized_config(config, model_dir, shape)
    terms = process_terms(sized, decide_plan(sized).plan, ModelShape.from_dir(model_dir), {"actor"},
                          rows=shape["micro"], checkpointing=False)
    return {k: round(v / GIB, 3) for k, v in terms.items()} | {"total": round(sum(terms.values()) / GIB, 3)}


def allocated_gib(device: str) -> float | None:
    return round(torch.cuda.memory_allocated() / 2 ** 30, 3) if device == "cuda" else None


def one_chunk(actor, batch, trained, device: str) -> dict:
    """A diagnosis (`--diagnose`): the log-prob pass and update with the vocabulary in one chunk."""
    out = {}
    import hybridflow.algos.entropy as entropy_module  # a diagnosis: the vocabulary in one chunk per micro-batch

    chunk = entropy_module.FLOAT32_CHUNK_BYTES, entropy_module.CUDA_FLOAT32_CHUNK_BYTES
    entropy_module.FLOAT32_CHUNK_BYTES = entropy_module.CUDA_FLOAT32_CHUNK_BYTES = 2 ** 40
    try:
        out["log_prob_pass_one_chunk_s"] = timed_cuda(lambda: actor.compute_log_probs(batch), device)[0]
        reset_peak(device)
        out["update_one_chunk_s"] = timed_cuda(lambda: actor.update_policy(trained), device)[0]
        out["update_one_chunk_peak_gib"] = peak_gib(device)
    finally:
        entropy_module.FLOAT32_CHUNK_BYTES, entropy_module.CUDA_FLOAT32_CHUNK_BYTES = chunk
    if device == "cuda":  # host synchronisations in one update (each drains the GPU's queue)
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                actor.update_policy(trained)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out["host_syncs_in_update"] = sum("synchroniz" in str(w.message) for w in caught)
        try:  # the same update with PyTorch's fused AdamW (one kernel for all parameters), as the plain loop has
            params = [p for group in actor.optimizer.param_groups for p in group["params"]]
            actor.optimizer = torch.optim.AdamW(params, lr=actor.optimizer.param_groups[0]["lr"], fused=True)
            actor.update_policy(trained)  # its state made
            out["update_fused_adamw_s"] = min(timed_cuda(lambda: actor.update_policy(trained), device)[0]
                                              for _ in range(2))
        except Exception as error:  # noqa: BLE001 - a diagnosis: record why it cannot run
            out["update_fused_adamw_s"] = f"{type(error).__name__}: {error}"[:300]
    return out


def plain(model_dir: Path, batch, shape: dict, device: str, dtype: str, repeats: int, old_log_probs) -> dict:
    """The loop a user writes: float32 parameters, autocast, trimmed micro-batches, fused AdamW."""
    from transformers import AutoModelForCausalLM

    from hybridflow.training.sequences import trimmed_inputs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")
    autocast = torch.autocast(device, dtype=getattr(torch, dtype), enabled=dtype != "float32")
    batch = batch.to(device)
    old_log_probs = old_log_probs.to(device)

    def forward(micro):
        inputs, _, width = trimmed_inputs(micro)
        with autocast:
            logits = model(**inputs, use_cache=False, logits_to_keep=width + 1).logits[:, :width]
        z = logits.float()
        log_probs = z.log_softmax(-1)
        picked = log_probs.gather(-1, micro["response_ids"][:, :width].unsqueeze(-1)).squeeze(-1)
        return picked, z, log_probs, width

    @torch.no_grad()
    def log_prob_pass():
        model.eval()
        out = []
        for micro in batch.split(shape["micro"]):
            picked, _, _, _ = forward(micro)
            out.append(picked)  # the same outputs as ours: log-probs (no entropy since 2026-11-27; before, both sides)
        return out

    calls = [0]

    def update():  # rows shuffled into micro-batches anew each call, as the actor's mini-batches are
        model.train()
        optimizer.zero_grad(set_to_none=True)
        calls[0] += 1
        order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(calls[0])).to(device)
        shuffled, shuffled_old = batch.reorder(order), old_log_probs[order]
        tokens = batch["response_mask"].sum()
        for i, micro in enumerate(shuffled.split(shape["micro"])):
            picked, _, _, width = forward(micro)
            mask = micro["response_mask"][:, :width]
            old = shuffled_old[i * shape["micro"]:(i + 1) * shape["micro"], :width]
            ratio = torch.exp(picked - old)
            adv = micro["advantages"][:, :width]
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
            ((loss * mask).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    reset_peak(device)
    lp = [timed_cuda(log_prob_pass, device)[0] for _ in range(repeats)]
    up = [timed_cuda(update, device)[0] for _ in range(repeats)]
    out = {"log_prob_pass_s": min(lp), "log_prob_pass_first_s": lp[0], "update_s": min(up), "update_first_s": up[0],
           "peak_gib": peak_gib(device)}
    model = optimizer = None
    free_device_memory(device)
    return out


def check_speed(root: Path, size: str, device: str, dtype: str, shape: dict, repeats: int,
                diagnose: bool = False) -> dict:
    model_dir = sized_model_dir(root, size, device)
    batch = grpo_batch(shape, vocab=min(SIZES[size]["vocab_size"], 500))  # ids valid for every size
    real = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    result = {"size": size, "rows": shape["rows"], "real_tokens": real,
              "padded_tokens": shape["rows"] * (shape["prompt_width"] + shape["response_width"])}
    result["ours"], old = ours(model_dir, batch, shape, device, dtype, repeats, packed=False, profile=False,
                               diagnose=diagnose)
    result["ours_packed"], old_packed = ours(model_dir, batch, shape, device, dtype, repeats, packed=True,
                                             diagnose=diagnose)
    mask = batch["response_mask"]
    result["packed_vs_padded_max_log_prob_gap"] = float((old_packed - old)[mask].abs().max())
    result["packed_vs_padded_mean_log_prob_gap"] = float((old_packed - old)[mask].abs().mean())
    result["plain"] = plain(model_dir, batch, shape, device, dtype, repeats, old)
    for side, suffix in (("ours", ""), ("ours_packed", "_packed")):
        for key in ("log_prob_pass_s", "update_s", "peak_gib"):
            if result["plain"][key]:
                result[f"ratio{suffix}_{key}"] = result[side][key] / result["plain"][key]
    return result


class ReceivingEnd:
    """A bare receiver as the colocated sync's end in the actor's process (a `ColocatedReceiver`): part 3 times
    the sync alone, with no engine state around the load."""

    def __init__(self, receiver) -> None:
        self.receiver = receiver

    def load_colocated(self, buckets, route) -> dict[str, float]:
        return self.receiver.load(buckets, route=route)


class PlainEngine:
    """The colocated engine's stand-in on the device (the GPU machines have no vLLM), with vLLM's
    level-1 sleep contract (`VLLMRollout.sleep` / `wake_up(parts)`): its weights, a plain transformers
    module in the rollout dtype that the weight sync loads (`ModuleReceiver`), and its KV cache, one
    block that fills the rest of its share of the GPU as vLLM's start-up profiling does. Asleep, the
    weights are on the host and the KV cache is freed. On the CPU nothing sleeps (as vLLM's CPU backend)."""

    SLEEPING_PARTS = ("weights", "kv_cache")

    def __init__(self, model_dir: Path, dtype: str, share: float, device: str) -> None:
        from transformers import AutoModelForCausalLM

        from hybridflow.resharding.receiver import ModuleReceiver

        self.device = device
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        total = gpu_bytes(device) if device == "cuda" else 0
        self.kv_bytes = max(2 ** 20, int(share * total) - self.weight_bytes)
        self.receiver = ModuleReceiver(model, pad_token_id=0)
        self.kv_cache = torch.empty(self.kv_bytes, dtype=torch.uint8, device=device)
        self.sleeping: set[str] = set()

    def sleep(self) -> bool:
        if self.device != "cuda" or self.sleeping:
            return False
        self.receiver.model.to("cpu")
        self.kv_cache = None
        torch.cuda.empty_cache()  # vLLM unmaps its memory; the caching allocator would keep it otherwise
        self.sleeping = set(self.SLEEPING_PARTS)
        return True

    def wake_up(self, parts: list[str] | None = None) -> bool:
        wanted = [p for p in (parts or self.SLEEPING_PARTS) if p in self.sleeping]
        if "weights" in wanted:
            self.receiver.model.to(self.device)
        if "kv_cache" in wanted:
            self.kv_cache = torch.empty(self.kv_bytes, dtype=torch.uint8, device=self.device)
        self.sleeping -= set(wanted)
        return bool(wanted)

    def load_colocated(self, buckets, route) -> dict[str, float]:
        """The colocated sync's end in this process (`ColocatedReceiver`), as an engine's: its weights awake."""
        assert "weights" not in self.sleeping, "a colocated weight load with the weights asleep"
        return self.receiver.load(buckets, route=route)

    def generate(self) -> tuple:
        from hybridflow.resharding.verify import PROBE_NEW_TOKENS, PROBE_PROMPTS

        assert not self.sleeping, f"generating with {sorted(self.sleeping)} asleep"
        return self.receiver.probe(PROBE_PROMPTS, PROBE_NEW_TOKENS)


class OneRankGroup:
    """The transport's view of the in-process actor: a worker group of one rank (a result per rank;
    `send_weights.remote()` runs the call, there is no Ray here)."""

    def __init__(self, actor) -> None:
        from types import SimpleNamespace

        self.actor = actor
        self.send_weights = SimpleNamespace(remote=actor.send_weights)

    def offload(self) -> list:
        return [self.actor.offload()]

    def reload(self) -> list:
        return [self.actor.reload()]

    def device_peak_bytes(self) -> list:
        return [self.actor.device_peak_bytes()]


GPU_FRACTION = [1.0]  # --gpu-gib: the share of the device the allocator may use


def gpu_bytes(device: str) -> int:
    """The GPU's memory as the run sees it: `torch.cuda.set_per_process_memory_fraction`'s cap (`--gpu-gib`)
    where set, else the device's (80 GiB on the CPU, the GPU model's worked example)."""
    if device != "cuda":
        return 80 * 2 ** 30
    return int(torch.cuda.get_device_properties(0).total_memory * GPU_FRACTION[0])




def check_handover(root: Path, size: str, device: str, dtype: str, shape: dict, share: float) -> dict:
    """The colocated hand-over through the transport's own sequence (`Colocated.wakes_for_sync`, `sync_calls`
    and `generating`): the actor as a run builds it and `PlainEngine` with `share` of the GPU, one
    GRPO-shaped step (generate, log-probs, update, sync, generate), each phase's device peak against
    the GPU memory model's floor of that phase (`memory_budget.gpu_phase_terms`). Two updates between
    the generations: the second is a steady step's (AdamW's moments exist from the first)."""

    from hybridflow.config.schema import (ActorConfig, DeviceKind, Dtype, HybridFlowConfig, ModelConfig, OptimConfig,
                                          RolloutConfig)
    from hybridflow.controller import WorkerContext, introduce
    from hybridflow.controller.memory import phase_peak_bytes
    from hybridflow.checks.memory_budget import GIB, ModelShape, gpu_phase_terms
    from hybridflow.planning.auto import decide_plan
    from hybridflow.resharding.layout import buckets, numel
    from hybridflow.resharding.sender import SyncPlan
    from hybridflow.resharding.transports import Colocated
    from hybridflow.resharding.weights import checkpoint_shapes
    from hybridflow.run.stage import prepare_stage
    from recipes.roles import actor_role

    model_dir = sized_model_dir(root, size, device)
    config = HybridFlowConfig(model=ModelConfig(dtype=Dtype(dtype), master_dtype=Dtype.float32),
                              actor=ActorConfig(optim=OptimConfig(lr=1e-6), samples_per_micro_batch=shape["micro"],
                                                gradient_checkpointing=False, policy_loss="ppo_clip"),
                              rollout=RolloutConfig(dtype=Dtype(dtype), gpu_memory_utilization=share))
    actor = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext(device=device, backend="nccl" if device == "cuda"
                                                              else "gloo"))
    phase_peak_bytes()  # what came before is not this part's
    actor.start()
    engine = PlainEngine(model_dir, dtype, share, device)
    peaks = {"start": phase_peak_bytes()}
    group, transport = OneRankGroup(actor), Colocated()
    shapes = checkpoint_shapes(engine.receiver.model)
    size_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    bucket_bytes = int(config.weight_sync.bucket_mb * 2 ** 20)
    plan = SyncPlan(transport, dtype, bucket_bytes, 60.0, [engine.receiver.needed_boxes(shapes)],
                    buckets=buckets(list(shapes), {n: numel(s) * size_bytes for n, s in shapes.items()}, bucket_bytes),
                    shapes=shapes)
    introduce([actor, engine])  # as a host introduces the workers of one process: the actor keeps the engine
    actor.setup_weight_sender(plan)
    batch = grpo_batch(shape, vocab=min(SIZES[size]["vocab_size"], 500))
    out: dict = {"size": size, "share": share, "gpu_gib": gpu_bytes(device) / GIB, "rows_per_micro_batch": shape["micro"], "engine_weight_gib": engine.weight_bytes / GIB,
                 "engine_kv_cache_gib": engine.kv_bytes / GIB}
    with transport.generating(group, engine):  # the first step's generation: the engine awake since its start
        engine.generate()
    out["first_generation"] = dict(transport.handover)
    phase_peak_bytes()
    trained = batch.union(actor.compute_log_probs(batch).select(["old_log_probs"]))
    actor.update_policy(trained)
    phase_peak_bytes()
    stats = actor.update_policy(trained)
    peaks["training"] = phase_peak_bytes()
    engine.wake_up(list(transport.wakes_for_sync))  # the engine's weights alone, as WeightSync wakes them
    sent = transport.sync_calls(group, engine)[0]  # the actor sends
    peaks["weight sync"] = sent.get("device_peak_bytes")
    with transport.generating(group, engine):
        tokens, engine_lp = engine.generate()
    out["second_generation"] = dict(transport.handover)
    peaks["generation"] = (transport.handover.get("memory/device_peak_generate_gib", 0) * GIB) or None
    if device == "cuda":
        from hybridflow.resharding.verify import PROBE_PROMPTS

        out["probe_log_prob_gap_after_sync"] = float((engine_lp - actor.probe_log_probs(PROBE_PROMPTS, tokens)).abs().max())
    out["policy_loss"], out["sync_received_bytes"] = stats["actor/loss"], sent.get("received_bytes")
    gpu = gpu_bytes(device)
    sized = sized_config(config, model_dir, shape, DeviceKind.cuda)  # the GPU model, also in the dry run
    model = gpu_phase_terms(sized, decide_plan(sized).plan, ModelShape.from_dir(model_dir), {"actor", "rollout"}, gpu)
    out["phases"] = {}
    for phase, terms in model.items():
        floor = sum(terms.values()) / GIB
        row = {"floor_gib": round(floor, 3), "terms_gib": {k: round(v / GIB, 3) for k, v in terms.items()}}
        if peaks.get(phase) is not None:
            row["peak_gib"] = round(peaks[phase] / GIB, 3)
            row["peak_over_floor"] = round(peaks[phase] / GIB / floor, 3)
        out["phases"][phase] = row
    actor = engine = group = None
    free_device_memory(device)
    return out


def check_packed_attention(device: str, dtype: str) -> dict:
    """`hybridflow.training.packing.packed_attention` against a dense block-diagonal causal mask on
    random tensors (3 sequences, GQA), forward and backward; which kernel served it (PyTorch's
    variable-length flash attention on CUDA in 16 bits, else one call over the sequences laid out padded)."""
    from hybridflow.training import packing

    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = [37, 200, 91]
    total, heads, kv_heads, head_dim = sum(lengths), 8, 2, 64
    torch_dtype = getattr(torch, dtype)
    q, k, v = (torch.randn(1, h, total, head_dim, generator=g).to(device, torch_dtype).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    module = torch.nn.Module()
    served = "varlen" if packing._varlen_serves(q, 0.0, None) else "padded layout"
    out, _ = packing.packed_attention(module, q, k, v, None, scaling=head_dim ** -0.5, cu_seq_lens_q=cu,
                                      max_length_q=max(lengths))
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    position = torch.arange(total, device=device)
    allowed = (segment[:, None] == segment[None]) & (position[:, None] >= position[None])
    kr, vr = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    reference = torch.nn.functional.scaled_dot_product_attention(q.float(), kr.float(), vr.float(), attn_mask=allowed)
    reference = reference.transpose(1, 2)
    ref_grads = torch.autograd.grad(reference.square().sum(), (q, k, v))
    return {"kernel": served, "torch": torch.__version__, "varlen_available": packing.varlen_kernel() is not None,
            "max_output_gap": float((out.float() - reference).abs().max()),
            "max_grad_gap": max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, ref_grads)),
            "output_scale": float(reference.abs().max()),
            "grad_scale": max(float(b.float().abs().max()) for b in ref_grads)}


WITHOUT_RAY = ("import sys; sys.path.insert(0, {root!r}); sys.modules['ray'] = None; "
               "from hybridflow.cli import main; sys.exit(main())")
# the product's metrics each part keeps per step (all of them would be the run's whole metrics.jsonl)
PRODUCT_KEYS = ("timing/generate_s", "timing/score_s", "timing/update_s", "timing/weight_sync_s", "timing/step_s",
                "timing/offload_s", "timing/engine_wake_s", "timing/engine_sleep_s", "timing/reload_s",
                "memory/global_device_peak_gib", "memory/global_peak_gib", "memory/device_peak_sync_gib",
                "memory/device_peak_offload_gib", "memory/device_peak_engine_wake_gib", "memory/device_peak_generate_gib",
                "memory/device_peak_engine_sleep_gib", "memory/device_peak_reload_gib", "weight_sync/verified_tensors",
                "weight_sync/reload_s", "weight_sync/reload_checksum_s", "weight_sync/probe_log_prob_gap",
                "weight_sync/seconds", "rollout_mismatch/abs_diff_max", "actor/loss", "actor/grad_norm",
                "reward/score", "val/accuracy")
# the phases of the GPU memory model (hybridflow.checks.memory_budget.gpu_phase_terms) against the peak the run reads
# for each: the hand-over's generation and sync phases, and the step's whole peak for training (an upper bound
# of training's own)
PHASE_PEAKS = {"training": "memory/global_device_peak_gib", "weight sync": "memory/device_peak_sync_gib",
               "generation": "memory/device_peak_generate_gib"}
SMALL = ["trainer.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_response_tokens=8",
         "trainer.val_prompts=8", "data.synthetic.train_rows=200", "data.synthetic.val_rows=16",
         "actor.samples_per_micro_batch=8"]
GRPO_TINY = ["recipe=grpo", *SMALL, "trainer.total_steps=3", "trainer.val_every_steps=3", "trainer.save_every_steps=3",
             "trainer.export_hf=false"]


@dataclass(frozen=True)
class Part:
    """One part of the check: run in a process of its own under `timeout_s` (less where the budget has less
    left), expected to take `expected_s` on one H100 (estimates until a GPU run records them: docs/gpu.md)."""
    name: str
    expected_s: int
    timeout_s: int
    what: str


# In the order of what matters: a call cut short keeps the parts before
PARTS = (
    Part("grpo_hf_level2", 50, 120, "the product's GRPO on the tiny model, the hf engine sleeping at level 2, "
         "checksums every sync"),
    Part("resume", 30, 90, "the same run resumed from its step-3 checkpoint for one more step"),
    Part("pipeline", 90, 150, "SFT -> PMA merge -> GRPO, short stages"),
    Part("level1_and_exact", 60, 120, "GRPO with the hf engine at sleep level 1, then with the exact engine"),
    Part("grpo_0.5b", 120, 200, "a Qwen2.5-0.5B-shaped bf16 GRPO run, 16 x 8 samples of 256 + 512 tokens, each "
         "phase's peak against the GPU memory model"),
    Part("engine_checks", 40, 90, "the packed-attention kernel; the actor under FSDP2 on NCCL, reference, critic, "
         "offload and reload, the colocated sync into GPU buffers (the 100M model)"),
    Part("handover_0.5b", 30, 90, "the colocated hand-over's sequence with a stand-in engine holding a share"),
    Part("speed_0.5b", 50, 120, "the actor beside a plain PyTorch loop, 128 GRPO-shaped rows"),
)
BUDGET_S = 480  # 8 minutes of an H100: the parts after are skipped, each part's timeout cut to what is left
EXPECTED_S = sum(p.expected_s for p in PARTS)


def run_product(root: Path, name: str, overrides: list[str], timeout_s: float, log) -> dict:
    """`hybridflow placement=local <overrides>` as a command of its own (Ray blocked), its run directory under
    `root` (never the output folder: it holds weights); its exit status, seconds, output in `log`, and per
    step the keys of `PRODUCT_KEYS` it logged, read from its metrics.jsonl also when it failed or timed out."""
    import subprocess

    command = [sys.executable, "-c", WITHOUT_RAY.format(root=str(ROOT)), "placement=local", *overrides,
               f"logger.output_root={root}", f"logger.run_name={name}"]
    start = time.perf_counter()
    out: dict = {"overrides": overrides}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        out["returncode"], text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        out["timed_out"], text = True, _text(exc.stdout) + _text(exc.stderr)
    out["seconds"] = round(time.perf_counter() - start, 1)
    log(f"$ hybridflow placement=local {' '.join(overrides)}\n{text[-20000:]}\n")
    if out.get("returncode"):
        out["error"] = text[-1500:]
    run_dir = root / name
    for stage_file in sorted(run_dir.glob("*/STAGE_COMPLETE")):
        stage = json.loads(stage_file.read_text())
        out.setdefault("stages", {})[stage_file.parent.name] = {
            k: stage.get(k) for k in ("init_accuracy", "final_accuracy", "steps")}
    metric_files = sorted(run_dir.glob("**/metrics.jsonl"))
    if metric_files:
        rows = [json.loads(line) for line in metric_files[-1].read_text().splitlines() if line.strip()]
        out["steps"] = [{k: r[k] for k in ("step", *PRODUCT_KEYS) if k in r} for r in rows]
    return out


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _passed(run: dict, *conditions) -> bool:
    return run.get("returncode") == 0 and bool(run.get("steps")) and all(conditions)


def part_grpo_level2(root: Path, args, timeout_s: float, log) -> dict:
    run = run_product(root, "grpo", [args.device_override, *GRPO_TINY, "rollout=hf", "rollout.sleep_level=2",
                                     "weight_sync.checksum_every_steps=1"], timeout_s, log)
    steps = run.get("steps", [])
    run["passed"] = _passed(run, len(steps) == 3, all(s.get("weight_sync/verified_tensors", 0) > 0 for s in steps[1:]))
    return run


def part_resume(root: Path, args, timeout_s: float, log) -> dict:
    """The first part's run resumed (trainer.resume=true) from its step-3 checkpoint for a fourth step."""
    if not (root / "grpo" / "checkpoints").exists():
        return {"skipped": "the first part left no checkpoint"}
    before = len((root / "grpo" / "metrics.jsonl").read_text().splitlines())
    run = run_product(root, "grpo", [args.device_override, *GRPO_TINY, "rollout=hf", "rollout.sleep_level=2",
                                     "weight_sync.checksum_every_steps=1", "trainer.resume=true",
                                     "trainer.total_steps=4"], timeout_s, log)
    run["steps"] = run.get("steps", [])[before:]
    run["passed"] = _passed(run, [s["step"] for s in run["steps"]] == [4])
    return run


def part_pipeline(root: Path, args, timeout_s: float, log) -> dict:
    short = [*SMALL, "rollout=hf", "stages.sft.trainer.total_steps=8", "stages.sft.trainer.save_every_steps=2",
             "stages.grpo.trainer.total_steps=2", "stages.grpo.actor.samples_per_mini_batch=16"]
    run = run_product(root, "pipeline", [args.device_override, *short], timeout_s, log)
    stages = run.get("stages", {})
    run["passed"] = _passed(run, sorted(stages) == ["00-sft", "01-grpo"],
                            stages.get("01-grpo", {}).get("final_accuracy") is not None)
    return run


def part_level1_and_exact(root: Path, args, timeout_s: float, log) -> dict:
    start, out = time.perf_counter(), {}
    out["hf_level1"] = run_product(root, "level1", [args.device_override, *GRPO_TINY, "rollout=hf",
                                                    "rollout.sleep_level=1", "weight_sync.checksum_every_steps=1"],
                                   timeout_s / 2, log)
    out["exact"] = run_product(root, "exact", [args.device_override, *GRPO_TINY, "rollout=exact"],
                               max(1.0, timeout_s - (time.perf_counter() - start)), log)
    exact = out["exact"].get("steps", [])
    out["passed"] = _passed(out["hf_level1"]) and _passed(
        out["exact"], all(s.get("rollout_mismatch/abs_diff_max") == 0.0 for s in exact if "rollout_mismatch/abs_diff_max" in s))
    return out


def part_grpo_sized(root: Path, args, timeout_s: float, log) -> dict:
    """GRPO through the product at a model size's shapes (random weights), bf16 over float32 masters, the hf
    engine at level 2: each phase's peak beside the GPU memory model's floor of that phase."""
    start = time.perf_counter()
    model_dir = sized_model_dir(root, args.size, "cpu")  # this process never opens a CUDA context: the runs' GPU
    dims = (["rollout.max_response_tokens=16", "data.max_prompt_tokens=16", "trainer.prompts_per_step=4",
             "rollout.samples_per_prompt=4"] if args.dry_run else
            ["rollout.max_response_tokens=512", "data.max_prompt_tokens=256", "trainer.prompts_per_step=16",
             "rollout.samples_per_prompt=8"])
    overrides = ["recipe=grpo", "model=local_hf", f"model.path={model_dir}", f"model.dtype={args.dtype}",
                 "model.master_dtype=float32", "rollout=hf", f"rollout.dtype={args.dtype}", "rollout.sleep_level=2",
                 "trainer.total_steps=2", "trainer.val_every_steps=0", "trainer.export_hf=false",
                 "trainer.save_every_steps=0", "weight_sync.check=none", "actor.samples_per_micro_batch=16",
                 "actor.gradient_checkpointing=false", *dims]
    run = run_product(root, f"grpo-{args.size}", [args.device_override, *overrides],
                      max(1.0, timeout_s - (time.perf_counter() - start)), log)
    run["phases"] = phase_floors(["placement=local", *overrides, "placement.device=cuda"], model_dir, run.get("steps", []))
    run["passed"] = _passed(run)
    return run


def phase_floors(overrides: list[str], model_dir: Path, steps: list[dict]) -> dict:
    """Per phase of the GPU memory model for the run's config on this GPU (80 GiB where there is none): its
    floor term by term, the run's peak for it (`PHASE_PEAKS`, the largest over the steps) and their ratio."""
    from hybridflow.config import compose
    from hybridflow.checks.memory_budget import (GIB, ModelShape, actor_pool_roles, gpu_phase_terms, local_gpus,
                                          resolve_micro_batches)
    from hybridflow.planning.plan import Plan

    gpus = local_gpus()  # read through nvidia-smi: no CUDA context in this process beside the runs'
    gpu = gpus[0][1] if gpus else 80 * GIB
    config = compose(overrides)
    config = resolve_micro_batches(config, Plan.from_config(config), gpu_bytes=gpu)[0]
    plan = Plan.from_config(config)
    out = {}
    for phase, terms in gpu_phase_terms(config, plan, ModelShape.from_dir(model_dir), actor_pool_roles(config, plan),
                                        gpu).items():
        floor = sum(terms.values()) / GIB
        row = {"floor_gib": round(floor, 3), "terms_gib": {k: round(v / GIB, 3) for k, v in terms.items()}}
        peaks = [s[PHASE_PEAKS[phase]] for s in steps if PHASE_PEAKS.get(phase) in s]
        if peaks:
            row["peak_gib"] = round(max(peaks), 3)
            row["peak_over_floor"] = round(max(peaks) / floor, 3)
        out[phase] = row
    return out


def part_in_process(name: str, args, timeout_s: float, log) -> dict:
    """An in-process part of the check (`--only NAME`), in a process of its own so that its timeout holds."""
    import subprocess

    with tempfile.NamedTemporaryFile(suffix=".json") as part_out:
        command = [sys.executable, str(Path(__file__).resolve()), "--only", name, "--out", part_out.name,
                   *(["--dry-run"] if args.dry_run else ["--dtype", args.dtype])]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            text, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            text, code = _text(exc.stdout) + _text(exc.stderr), None
        log(f"$ gpu_check.py --only {name}\n{text[-20000:]}\n")
        report = json.loads(Path(part_out.name).read_text() or "{}") if Path(part_out.name).stat().st_size else {}
    report.pop("seconds", None)
    report["returncode"] = code
    if code is None:
        report["timed_out"] = True
    report["passed"] = code == 0 and not any(isinstance(v, dict) and "error" in v for v in report.values())
    return report


PRODUCT_PARTS = {"grpo_hf_level2": part_grpo_level2, "resume": part_resume, "pipeline": part_pipeline,
                 "level1_and_exact": part_level1_and_exact, "grpo_0.5b": part_grpo_sized}


class Report:
    """The JSON report (`gpu_check.json`) and the parts' output (`gpu_check.log`) in the output folder,
    rewritten after every part: a call cut short keeps what ran."""

    def __init__(self, folder: str, **head) -> None:
        self.folder = Path(folder) if folder else None
        self.data = dict(head)
        if self.folder:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / "gpu_check.log").write_text("")

    def log(self, text: str) -> None:
        if self.folder:
            with open(self.folder / "gpu_check.log", "a") as f:
                f.write(text)

    def add(self, key: str, fn) -> None:
        start = time.perf_counter()
        try:
            self.data[key] = fn()
        except Exception as exc:  # a broken part is reported and the next one runs
            import traceback

            self.data[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        self.data.setdefault("seconds", {})[key] = round(time.perf_counter() - start, 2)
        self.write()
        print(f"== {key} ({self.data['seconds'][key]} s)\n" + json.dumps(self.data[key], default=str)[:3000],
              flush=True)

    def write(self) -> None:
        if self.folder:
            (self.folder / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def run_parts(args) -> None:
    """Every part in `PARTS` order, each in a process of its own under its timeout, within `--budget-s`."""
    report = Report(args.out, device=_device_name(args.device), torch=torch.__version__, compute_dtype=args.dtype,
                    budget_s=args.budget_s, parts={p.name: {"expected_s": p.expected_s, "timeout_s": p.timeout_s,
                                                           "what": p.what} for p in PARTS})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for part in PARTS:
            if args.parts and part.name not in args.parts.split(","):
                continue
            left = args.budget_s - (time.perf_counter() - started)
            if left < 15:
                report.data[part.name] = {"skipped": f"the budget of {args.budget_s} s is spent"}
                report.write()
                continue
            timeout = min(part.timeout_s * (3 if args.dry_run else 1), left)
            if part.name in PRODUCT_PARTS:
                report.add(part.name, lambda: PRODUCT_PARTS[part.name](Path(tmp), args, timeout, report.log))
            else:
                report.add(part.name, lambda: part_in_process(part.name, args, timeout, report.log))
    report.data["passed"] = [p.name for p in PARTS if isinstance(report.data.get(p.name), dict)
                             and report.data[p.name].get("passed")]
    report.data["total_s"] = round(time.perf_counter() - started, 1)
    report.write()


def _device_name(device: str) -> str:
    """The GPU's name and memory as nvidia-smi reports them (no CUDA context in this process), or "cpu"."""
    from hybridflow.checks.memory_budget import local_gpus

    gpus = local_gpus() if device == "cuda" else []
    return f"{gpus[0][0]} ({gpus[0][1] / 2 ** 30:.1f} GiB)" if gpus else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", ""),
                        help="the output folder (default $OUT): gpu_check.json and gpu_check.log, never weights")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                        help="model.dtype, the compute dtype over float32 master weights")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole check's seconds")
    parser.add_argument("--parts", default="", help="only these parts (comma-separated names of PARTS)")
    parser.add_argument("--dry-run", action="store_true", help="--device cpu, the tiny shapes")
    parser.add_argument("--only", default="", help=argparse.SUPPRESS)  # an in-process part, in this process
    args = parser.parse_args()
    if args.dry_run:
        args.device = "cpu"
    args.size = "tiny" if args.dry_run else "0.5b"
    args.device_override = f"placement.device={args.device}"
    if args.only:
        return run_in_process_part(args)
    run_parts(args)


def run_in_process_part(args) -> None:
    """One in-process part (`--only`): the engine checks, a hand-over or the speed beside a plain loop, into
    the JSON file `--out`."""
    import torch.distributed as dist

    backend = "nccl" if args.device == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    report = Report("")
    report.data = {"backend": backend}
    shape, size = (DRY_SHAPE, "tiny") if args.dry_run else (GRPO_SHAPE, "0.5b")
    args.model, args.syncs, args.repeats = ("tiny", 1, 1) if args.dry_run else ("100m", 3, 2)
    with tempfile.TemporaryDirectory() as tmp:
        if args.only == "engine_checks":
            report.add("packed_attention", lambda: check_packed_attention(args.device, args.dtype))
            engine_checks(report, Path(tmp), args)
        elif args.only.startswith("handover_"):
            report.add("handover", lambda: check_handover(Path(tmp), size, args.device, args.dtype, shape, 0.4))
        elif args.only.startswith("speed_"):
            report.add("speed", lambda: check_speed(Path(tmp), size, args.device, args.dtype, shape, args.repeats))
        Path(args.out).write_text(json.dumps(report.data, indent=2, default=str) + "\n")
    dist.destroy_process_group()


def engine_checks(report: Report, tmp: Path, args) -> None:
    """Parts 1-3 on the `--model` model."""
    from hybridflow.builders.tiny_model import build_tiny_model
    from hybridflow.config.schema import ActorConfig, Dtype, HybridFlowConfig, ModelConfig, OptimConfig, TinyModelConfig
    from hybridflow.controller import WorkerContext
    from hybridflow.run.stage import prepare_stage
    from recipes.roles import actor_role

    model_dir = build_tiny_model(tmp / args.model, TinyModelConfig(**MODELS[args.model]))
    backend = "nccl" if args.device == "cuda" else "gloo"
    ctx = WorkerContext(device=args.device, backend=backend)
    config = HybridFlowConfig(model=ModelConfig(dtype=Dtype(args.dtype), master_dtype=Dtype.float32),
                              actor=ActorConfig(optim=OptimConfig(lr=1e-4), samples_per_micro_batch=8,
                                                gradient_checkpointing=False))
    actor = actor_role(prepare_stage(config).config, model_dir).build(ctx)
    actor.start()
    report.data["parameters"] = sum(p.numel() for p in actor.model.parameters())
    report.data["parameter_dtypes"] = sorted({str(p.dtype) for p in actor.model.parameters()})  # the masters'
    report.data["fsdp_mixed_precision"] = str(getattr(_fsdp_policy(actor.model), "param_dtype", None))
    batch = batch_for(model_dir, rows=8)
    report.add("reference_and_critic", lambda: check_reference_and_critic(model_dir, ctx, actor, batch))
    report.add("training", lambda: check_training(actor, batch, args.device))
    report.add("offload", lambda: check_offload(actor, batch, args.device))
    report.add("sync", lambda: [r for dtype in ("float32", "bfloat16")
                                for r in check_sync(actor, model_dir, args.device, dtype, args.syncs)])
    actor = None  # freed before the next part builds its model


if __name__ == "__main__":
    main()
