"""The CUDA paths of the colocated engine and the actor's speed beside a plain loop, on one GPU in
one process, without Ray or vLLM.

    python bench/gpu_check.py [--sizes 0.5b,1.5b] [--model 100m] [--dtype bfloat16] [--out gpu_check.json]
    python bench/gpu_check.py --dry-run --out x.json   # the CPU over gloo at the tiny shapes (a test runs it)

Run by hand where a GPU is lent (docs/results/gpu.md "On a GPU" says how to carry the three wheels
it needs there). The GPU machines here have torch and transformers but neither Ray nor vLLM, so
the worker classes are built in-process (they import neither) and a plain transformers module on
the GPU stands in for the vLLM engine at the receiving end. The JSON is rewritten after every part,
so a run cut short keeps what it measured. Parts, in order:

`--dtype` is the compute dtype (`model.dtype`; the master weights stay float32, so bfloat16 runs
FSDP2's mixed precision, which needs FSDP2 even on one rank: float32 on one rank is a plain module).

1. the actor under FSDP2 on NCCL: start, log-probs, a policy update, an SFT step; the reference
   worker's log-probs equal the actor's before the update; the critic's values and update;
2. offload and reload around generation: device memory before and after, log-probs unchanged;
3. the colocated weight sync into GPU buffers through the real `WeightSender`: the whole model
   (TP 1) and a tensor-parallel-like slice (the first half of every weight's rows, what rank 0
   of TP 2 holds of a column-parallel layer), in float32 and bfloat16; checked tensor by tensor
   and by a log-prob probe; seconds against a device-to-device copy of the same bytes.

4. per `--handover` entry (the shapes and batch of part 5): the colocated hand-over through the
   transport's own sequence (`Colocated.wakes_for_sync`, `sync_calls`, `generating`) with the actor and
   `PlainEngine`, a stand-in holding `--share` of the GPU as vLLM does (weights and KV cache, level-1
   sleep): one step (generate, log-probs, update, sync, generate), each phase's device peak beside the
   GPU memory model's floor of that phase (`hybridflow.memory_budget.gpu_phase_terms`);
5. per `--sizes` entry (Qwen2.5-0.5B / -1.5B shapes, random weights, tied embeddings): one
   GRPO-shaped batch (128 rows, prompts left-padded to 256 tokens with real lengths uniform in
   64-256, responses right-padded to 512 with real lengths uniform in 64-512), the actor as a run
   builds it (FSDP2, bf16 compute over float32 masters, 16 rows per micro-batch, no activation
   checkpointing): the log-prob pass, the policy update (ppo_clip), offload and reload, peak
   memory; then the loop a user writes without a framework on the same model and batch (float32
   parameters, `torch.autocast(bfloat16)`, the same trimmed micro-batches, `logits_to_keep`,
   log-softmax + gather in float32, PPO-clip, `clip_grad_norm_`, fused AdamW); and a profile of
   our log-prob pass and update (the ten costliest operators).

6. `--product` (on by default): the product itself, as a user runs it, in one process with
   `placement=local` (no Ray, no vLLM: the `hf` engine, which sleeps on the GPU): (a) the default
   pipeline end to end (SFT -> PMA merge -> GRPO on the tiny model and the arithmetic task) with its
   accuracies; (b) per `--product-sizes` entry, GRPO steps at that model's shapes (random weights,
   `--product-steps` steps of 16 prompts x 8 samples, prompts up to 256 and responses up to 512
   tokens): each stage's seconds (generate, score, update, weight sync, the hand-over's phases) and the
   device peaks the run reads, from its own metrics.jsonl. The dry run: a shortened pipeline and two
   GRPO steps at the tiny shapes on the CPU.

One GPU means one training rank: the all-to-all between training ranks (two or more GPUs) and
the cross-pool transfer did not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
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
    from hybridflow.stage import prepare_stage

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
    from hybridflow.stage import prepare_stage
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
    """The project's memory floor for this actor (`hybridflow.memory_budget.process_terms`, one rank,
    the batch's widths), term by term in GiB: data for a GPU memory model, beside the peaks."""
    from hybridflow.memory_budget import GIB, ModelShape, process_terms
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
    from hybridflow.memory_budget import GIB, ModelShape, gpu_phase_terms
    from hybridflow.planning.auto import decide_plan
    from hybridflow.resharding.layout import buckets, numel
    from hybridflow.resharding.sender import SyncPlan
    from hybridflow.resharding.transports import Colocated
    from hybridflow.resharding.weights import checkpoint_shapes
    from hybridflow.stage import prepare_stage
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
PRODUCT_KEYS = ("timing/generate_s", "timing/score_s", "timing/update_s", "timing/weight_sync_s", "timing/step_s",
                "timing/offload_s", "timing/engine_wake_s", "timing/engine_sleep_s", "timing/reload_s",
                "memory/global_device_peak_gib", "memory/global_peak_gib", "weight_sync/probe_log_prob_gap",
                "rollout/log_prob_diff", "reward/score", "val/accuracy")


def run_product(root: Path, name: str, overrides: list[str], timeout_s: float) -> dict:
    """`hybridflow placement=local rollout=hf <overrides>` as a command of its own (Ray blocked); its
    wall seconds, its stages' summaries (a pipeline) and, per step, the keys of `PRODUCT_KEYS` it logged."""
    import subprocess

    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", WITHOUT_RAY.format(root=str(ROOT)), "placement=local", "rollout=hf",
                           *overrides, f"logger.output_root={root}", f"logger.run_name={name}"],
                          capture_output=True, text=True, timeout=timeout_s)
    out = {"seconds": round(time.perf_counter() - start, 1), "returncode": done.returncode}
    if done.returncode != 0:
        out["error"] = (done.stdout[-2000:] + done.stderr[-3000:])
        return out
    run_dir = root / name
    for stage_file in sorted(run_dir.glob("*/STAGE_COMPLETE")):
        stage = json.loads(stage_file.read_text())
        out.setdefault("stages", {})[stage_file.parent.name] = {
            k: stage.get(k) for k in ("init_accuracy", "final_accuracy", "steps")}
    metric_files = sorted(run_dir.glob("**/metrics.jsonl"))
    if metric_files:
        rows = [json.loads(line) for line in metric_files[-1].read_text().splitlines()]
        out["steps"] = [{k: r[k] for k in ("step", *PRODUCT_KEYS) if k in r} for r in rows]
    return out


def check_product(root: Path, args, shape_sizes: list[str]) -> dict:
    """Part 6: the default pipeline and GRPO runs at model sizes, through the product in one process."""
    device = f"placement.device={args.device}"
    small = ["trainer.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_response_tokens=4",
             "trainer.val_prompts=8", "data.synthetic.train_rows=200", "data.synthetic.val_rows=16"]
    short = [*small, "stages.sft.trainer.total_steps=8",  # a plain key reaches every stage that reads it
             "stages.sft.trainer.save_every_steps=2", "stages.grpo.trainer.total_steps=2",
             "stages.grpo.actor.samples_per_mini_batch=16"] if args.dry_run else []
    report = {"pipeline": run_product(root, "pipeline", [device, *short], 3600)}
    for size in shape_sizes:
        model_dir = sized_model_dir(root, size, "cpu")
        dims = ["rollout.max_response_tokens=16", "data.max_prompt_tokens=16"] if args.dry_run else \
            ["rollout.max_response_tokens=512", "data.max_prompt_tokens=256"]
        report[f"grpo_{size}"] = run_product(root, f"grpo-{size}", [
            device, "recipe=grpo", "model=local_hf", f"model.path={model_dir}", f"model.dtype={args.dtype}",
            f"trainer.total_steps={2 if args.dry_run else args.product_steps}", "trainer.prompts_per_step=16",
            "rollout.samples_per_prompt=8", "trainer.val_every_steps=0", "trainer.export_hf=false",
            "trainer.save_every_steps=0", "weight_sync.check=none", *dims], 3600)
    return report


class Report:
    """The JSON report, rewritten after every part (a run cut short keeps what it measured)."""

    def __init__(self, path: str, **head) -> None:
        self.path, self.data = path, dict(head)

    def add(self, key: str, fn) -> None:
        start = time.perf_counter()
        try:
            self.data[key] = fn()
        except Exception as exc:  # a broken part is reported and the next one runs
            import traceback

            self.data[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        self.data.setdefault("seconds", {})[key] = round(time.perf_counter() - start, 2)
        text = json.dumps(self.data, indent=2, default=str)
        print(f"== {key} ({self.data['seconds'][key]} s)\n" + json.dumps(self.data[key], default=str)[:3000],
              flush=True)
        if self.path:
            Path(self.path).write_text(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="100m", help="the engine checks' model")
    parser.add_argument("--sizes", default="0.5b,1.5b", help="the speed part's model sizes (comma-separated; "
                        "'' skips it)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls of each speed measurement (best kept)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                        help="model.dtype, the compute dtype over float32 master weights")
    parser.add_argument("--dry-run", action="store_true", help="--device cpu, the tiny shapes, one sync")
    parser.add_argument("--skip-engine", action="store_true", help="parts 1-3 skipped")
    parser.add_argument("--no-cudnn-attention", action="store_true",
                        help="a diagnosis: scaled_dot_product_attention without its cuDNN backend")
    parser.add_argument("--diagnose", action="store_true",
                        help="also our pass and update (padded and packed) with the vocabulary in one chunk")
    parser.add_argument("--handover", default="0.5b,1.5b", help="the colocated hand-over's model sizes "
                        "(comma-separated; '' skips it)")
    parser.add_argument("--share", type=float, default=0.4, help="the stand-in engine's rollout.gpu_memory_utilization")
    parser.add_argument("--handover-micro", type=int, default=0, help="the hand-over's rows per micro-batch "
                        "(0: part 5's)")
    parser.add_argument("--gpu-gib", type=float, default=0.0, help="cap the allocator at this many GiB "
                        "(torch.cuda.set_per_process_memory_fraction): a smaller GPU on a larger one")
    parser.add_argument("--product", action=argparse.BooleanOptionalAction, default=True,
                        help="part 6: the pipeline and GRPO runs through the product (placement=local)")
    parser.add_argument("--product-sizes", default="0.5b,1.5b", help="part 6's GRPO model sizes ('' skips them)")
    parser.add_argument("--product-steps", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    shape = GRPO_SHAPE
    if args.dry_run:
        args.device, args.model, args.sizes, args.syncs, args.repeats, shape = "cpu", "tiny", "tiny", 1, 1, DRY_SHAPE
        args.handover, args.product_sizes = "tiny", "tiny"

    import torch.distributed as dist

    backend = "nccl" if args.device == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.device == "cuda":
        torch.cuda.set_device(0)
        if args.gpu_gib:
            GPU_FRACTION[0] = min(1.0, args.gpu_gib * 2 ** 30 / torch.cuda.get_device_properties(0).total_memory)
            torch.cuda.set_per_process_memory_fraction(GPU_FRACTION[0])
        if args.no_cudnn_attention:
            torch.backends.cuda.enable_cudnn_sdp(False)
    dist.init_process_group(backend, rank=0, world_size=1)
    report = Report(args.out, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    backend=backend, torch=torch.__version__, model=args.model, compute_dtype=args.dtype,
                    master_dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
        report.add("packed_attention", lambda: check_packed_attention(args.device, args.dtype))
        if "error" in report.data["packed_attention"]:  # measure packing with the padded layout instead
            from hybridflow.training import packing

            packing._VARLEN = None
            report.data["varlen_kernel_disabled_after_its_error"] = True
        if not args.skip_engine:
            engine_checks(report, Path(tmp), args)
        handover_shape = dict(shape, micro=args.handover_micro or shape["micro"])
        for size in filter(None, args.handover.split(",")):
            report.add(f"handover_{size}", lambda: check_handover(Path(tmp), size, args.device, args.dtype,
                                                                  handover_shape, args.share))
        for size in filter(None, args.sizes.split(",")):
            report.add(f"speed_{size}", lambda: check_speed(Path(tmp), size, args.device, args.dtype, shape,
                                                            args.repeats, args.diagnose))
        if args.product:
            report.add("product", lambda: check_product(Path(tmp), args, list(filter(None, args.product_sizes.split(",")))))
    dist.destroy_process_group()


def engine_checks(report: Report, tmp: Path, args) -> None:
    """Parts 1-3 on the `--model` model."""
    from hybridflow.builders.tiny_model import build_tiny_model
    from hybridflow.config.schema import ActorConfig, Dtype, HybridFlowConfig, ModelConfig, OptimConfig, TinyModelConfig
    from hybridflow.controller import WorkerContext
    from hybridflow.stage import prepare_stage
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
