"""The CUDA paths of the colocated engine, run on one GPU in one process, without Ray or vLLM.

    python bench/gpu_check.py [--model 100m] [--device cuda] [--dtype bfloat16] [--out result.json]

Run by hand where a GPU is lent (CI never does; `--device cpu` is a dry run over gloo). The GPU
machines here have torch and transformers but neither Ray nor vLLM, so the worker classes are
built in-process (they import neither) and a plain transformers module on the GPU stands in for
the vLLM engine at the receiving end. In order:

`--dtype` is the compute dtype (`model.dtype`; the master weights stay float32, so bfloat16 runs
FSDP2's mixed precision, which needs FSDP2 even on one rank: float32 on one rank is a plain module).

1. the actor under FSDP2 on NCCL: start, log-probs, a policy update, an SFT step; the reference
   worker's log-probs equal the actor's before the update; the critic's values and update;
2. offload and reload around generation: device memory before and after, log-probs unchanged;
3. the colocated weight sync into GPU buffers through the real `WeightSender`: the whole model
   (TP 1) and a tensor-parallel-like slice (the first half of every weight's rows, what rank 0
   of TP 2 holds of a column-parallel layer), in float32 and bfloat16; checked tensor by tensor
   and by a log-prob probe; seconds against a device-to-device copy of the same bytes.

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

    reference = reference_role(HybridFlowConfig(), model_dir).build(ctx)
    reference.start()
    ref = reference.compute_ref_log_probs(batch)["ref_log_probs"]
    gap = float((ref - actor.compute_log_probs(batch)["old_log_probs"]).abs().max())
    critic = critic_role(HybridFlowConfig(), model_dir).build(ctx)
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

        def load(self, buckets):
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
    from hybridflow.resharding.layout import Box, buckets, layout_minimum, numel
    from hybridflow.resharding.receiver import register_local
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
        register_local(actor.ctx.group_name, receiver)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="100m")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                        help="model.dtype, the compute dtype over float32 master weights")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import torch.distributed as dist

    from hybridflow.builders.tiny_model import build_tiny_model
    from hybridflow.config.schema import ActorConfig, Dtype, HybridFlowConfig, ModelConfig, OptimConfig, TinyModelConfig
    from hybridflow.controller import WorkerContext
    from recipes.roles import actor_role

    backend = "nccl" if args.device == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "backend": backend,
              "torch": torch.__version__, "model": args.model, "compute_dtype": args.dtype, "master_dtype": "float32"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / args.model, TinyModelConfig(**MODELS[args.model]))
        ctx = WorkerContext(device=args.device, backend=backend)
        config = HybridFlowConfig(model=ModelConfig(dtype=Dtype(args.dtype), master_dtype=Dtype.float32),
                                  actor=ActorConfig(optim=OptimConfig(lr=1e-4), samples_per_micro_batch=8,
                                                    gradient_checkpointing=False))
        actor = actor_role(config, model_dir).build(ctx)
        actor.start()
        report["parameters"] = sum(p.numel() for p in actor.model.parameters())
        report["parameter_dtypes"] = sorted({str(p.dtype) for p in actor.model.parameters()})  # the masters'
        report["fsdp_mixed_precision"] = str(getattr(_fsdp_policy(actor.model), "param_dtype", None))
        batch = batch_for(model_dir, rows=8)
        report["reference_and_critic"] = check_reference_and_critic(model_dir, ctx, actor, batch)
        report["training"] = check_training(actor, batch, args.device)
        report["offload"] = check_offload(actor, batch, args.device)
        report["sync"] = [r for dtype in ("float32", "bfloat16")
                          for r in check_sync(actor, model_dir, args.device, dtype, args.syncs)]
    dist.destroy_process_group()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
