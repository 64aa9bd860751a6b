"""Benchmark: the weight sync in every placement, against the layout minimum and a plain copy.

    PYTHONPATH=. .venv/bin/python bench/weight_sync.py [--models tiny,100m] [--syncs 5]
    PYTHONPATH=. .venv/bin/python bench/weight_sync.py --dry-run --models tiny [--out dry.json]  # seconds; no Ray

For each model (the tiny default, and a ~100M-parameter Qwen2 built offline from a config)
and each mode — colocated TP 1 and TP 2 over 2 FSDP2 ranks, disaggregated 1 -> 1, 2 -> 1 and
1 -> 2 (rollout TP 2) — it starts the real actor and vLLM rollout groups on a local Ray, runs
one warm-up sync and then `--syncs` timed ones through `WeightSync` (the same object the
recipes use), and records per sync: seconds, bytes received per rank (max over ranks), the
layout minimum for the pair of layouts (from the shapes), and the ratio to the copy floor:
a plain `torch` copy, on the same machine, of the bytes one rank's engine holds (its whole
generation slice: the least any sync must write). Checks are off while timing (the probe
costs a generation). Results go to docs/results/resharding_benchmark.md.

--dry-run starts nothing: each model is built and counted, and each mode's placement composed
and checked as `hybridflow` would run it (`command`: GRPO on that model, float32, checks off),
then held against what `run_mode` would spawn: its pools, its roles' specs (built, not started)
and its transport. One line per mode; `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = [  # name, actor ranks, rollout ranks (None: the actor's processes), rollout TP
    ("colocated TP1", 2, None, 1),
    ("colocated TP2", 2, None, 2),
    ("disaggregated 1->1", 1, 1, 1),
    ("disaggregated 2->1", 2, 1, 1),
    ("disaggregated 1->2 (TP2)", 1, 2, 2),
]
MODELS = {
    "tiny": dict(),
    "100m": dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=14, num_attention_heads=12,
                 num_key_value_heads=4),
}


def mode_roles(model_dir: Path, tp: int) -> dict:
    """The actor's and the rollout's specs for one mode (the rollout's engines `tp` ranks wide)."""
    from transformers import AutoTokenizer

    from hybridflow.config.schema import HybridFlowConfig, RolloutConfig
    from hybridflow.controller import RoleSpec
    from recipes.roles import actor_role
    from hybridflow.run.stage import prepare_stage
    from workers.rollout.vllm_rollout import VLLMRollout

    tok = AutoTokenizer.from_pretrained(model_dir)
    rollout = RoleSpec(VLLMRollout, dict(model_path=str(model_dir), rollout=RolloutConfig(tensor_parallel_size=tp),
                                         max_prompt_tokens=16, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id), replica_size=tp)
    return {"actor": actor_role(prepare_stage(HybridFlowConfig()).config, model_dir), "rollout": rollout}


def mode_pools(actor_ranks: int, rollout_ranks: int | None, tag: str) -> list:
    """(pool, the roles it hosts) for one mode: one pool for both (colocated), or one each."""
    from hybridflow.controller import PoolSpec

    if rollout_ranks is None:
        return [(PoolSpec(f"b{tag}", devices_per_node=actor_ranks), ["actor", "rollout"])]
    return [(PoolSpec(f"t{tag}", devices_per_node=actor_ranks), ["actor"]),
            (PoolSpec(f"g{tag}", devices_per_node=rollout_ranks), ["rollout"])]


def run_mode(model_dir: Path, actor_ranks: int, rollout_ranks: int | None, tp: int, syncs: int) -> dict:
    from hybridflow.config.schema import WeightSyncConfig
    from hybridflow.controller import ResourcePool, spawn_workers
    from hybridflow.resharding.sync import WeightSync
    from hybridflow.resharding.transports import build_transport

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    roles = mode_roles(model_dir, tp)
    tag = f"{actor_ranks}{rollout_ranks}{tp}{time.monotonic_ns() % 10000}"
    groups = {}
    for pool, hosted in mode_pools(actor_ranks, rollout_ranks, tag):
        groups.update(spawn_workers(ResourcePool(pool), {role: roles[role] for role in hosted}, env_vars=env))
    try:
        for future in [groups["actor"].start.remote(), groups["rollout"].start.remote()]:
            future.get()
        sync = WeightSync(groups["actor"], groups["rollout"], WeightSyncConfig(check="none"),
                          build_transport(rollout_ranks is None), "float32")
        setup = sync.setup()
        sync.sync(step=0, version=0)  # warm-up
        runs = [sync.sync(step=i + 1, version=i + 1) for i in range(syncs)]
    finally:
        for group in {id(g.pool): g for g in groups.values()}.values():
            group.shutdown()
    seconds = statistics.median(r["weight_sync/seconds"] for r in runs)
    exchange = statistics.median(r.get("weight_sync/exchange_s", 0.0) for r in runs)
    return {"seconds": seconds, "exchange": exchange, "received": runs[0]["weight_sync/bytes_received_per_rank"],
            "minimum": runs[0]["weight_sync/min_bytes_per_rank"], "engine": setup["weight_sync/engine_bytes_per_rank"],
            "floor_s": setup["weight_sync/copy_floor_s"], "ratio": seconds / setup["weight_sync/copy_floor_s"]}


RELOAD_SCRIPT = """
import os, sys, time
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
from transformers import AutoModelForCausalLM
from vllm import LLM
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64)
weights = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(sys.argv[1]).named_parameters()]
times = []
for _ in range(4):
    start = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
    times.append(time.perf_counter() - start)
print("RELOAD", sorted(times[1:])[1])
"""


def command(name: str, actor_ranks: int, rollout_ranks: int | None, tp: int) -> list[str]:
    """The `hybridflow` overrides of a GRPO run on model `name` in one mode's placement, its weights
    synced as the bench syncs them (float32, no check)."""
    if rollout_ranks is None:
        placement = ["placement=colocated", f"placement.pools.global.devices_per_node={actor_ranks}"]
    else:
        placement = ["placement=disaggregated", f"placement.pools.train.devices_per_node={actor_ranks}",
                     f"placement.pools.gen.devices_per_node={rollout_ranks}"]
    return ["recipe=grpo", *(f"model.tiny.{key}={value}" for key, value in MODELS[name].items()), *placement,
            f"rollout.tensor_parallel_size={tp}", "model.dtype=float32", "rollout.dtype=float32",
            "weight_sync.check=none"]


def differences(config, name: str, pools: list, roles: dict) -> dict[str, tuple]:
    """What the composed `config` of model `name` gives otherwise than the bench spawns it (`pools`,
    `roles`): {what: (the config's, the bench's)}; empty when they agree."""
    from hybridflow.planning.auto import decide_plan

    plan, rollout = decide_plan(config).plan, roles["rollout"]  # the config's pools and TP, as a run reads them
    spawned = {role: pool.devices_per_node for pool, hosted in pools for role in hosted}
    checks = {
        "ranks per role": ({r: plan.devices_of(r) for r in spawned}, spawned),
        "one pool for both": (plan.rollout_colocated, len(pools) == 1),
        "engine TP": (plan.rollout_tp, rollout.kwargs["rollout"].tensor_parallel_size),
        "ranks per engine": (plan.replica_size("rollout"), rollout.replica_size),
        "dtypes": ((config.model.dtype.value, config.rollout.dtype.value),
                   (roles["actor"].kwargs["dtype"], rollout.kwargs["rollout"].dtype.value)),
        "model": ({key: getattr(config.model.tiny, key) for key in MODELS[name]}, MODELS[name])}
    return {what: pair for what, pair in checks.items() if pair[0] != pair[1]}


def dry_run(models: list[str]) -> dict:
    """Each model built and counted, each mode's command composed and checked (hybridflow.run.pipeline_stages)
    and held against what `run_mode` spawns (`differences`), its roles' specs and transport built.
    Nothing started."""
    from hybridflow.builders import build_tiny_model
    from hybridflow.config.schema import TinyModelConfig
    from hybridflow.run.pipeline_stages import compose_command
    from hybridflow.resharding.transports import build_transport

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            model_dir = build_tiny_model(Path(tmp) / name, TinyModelConfig(**MODELS[name]))
            params = _parameters(model_dir)
            for mode, actor_ranks, rollout_ranks, tp in MODES:
                overrides = command(name, actor_ranks, rollout_ranks, tp)
                pools, roles = mode_pools(actor_ranks, rollout_ranks, "dry"), mode_roles(model_dir, tp)
                wrong = differences(compose_command(overrides), name, pools, roles)
                if wrong:
                    raise SystemExit(f"{name}, {mode}: `hybridflow {' '.join(overrides)}` is not what the bench "
                                     f"spawns: " + "; ".join(f"{what} {ours} there, {theirs} here"
                                                             for what, (ours, theirs) in wrong.items()))
                transport = build_transport(colocated=len(pools) == 1)
                print(f"{name}, {mode}: hybridflow {' '.join(overrides)} ({transport} transport)")
                report[f"{name}, {mode}"] = {
                    "overrides": overrides, "parameters": params, "pools": len(pools), "tensor_parallel_size": tp,
                    "ranks": {role: pool.devices_per_node for pool, hosted in pools for role in hosted},
                    "transport": str(transport)}
    return report


def vllm_reload_seconds(model_dir: Path) -> float:
    """vLLM's own reload of the whole model from memory (median of 3 after a warm-up)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, str(model_dir)], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    return float(out.split("RELOAD")[-1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,100m")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--output", default=str(ROOT / "docs" / "results" / "resharding_benchmark.md"))
    parser.add_argument("--dry-run", action="store_true",
                        help="build the models, compose and check each mode's command; start nothing")
    parser.add_argument("--out", default=None, help="a dry run's report (JSON)")
    args = parser.parse_args()
    if args.out and not args.dry_run:
        parser.error("--out is a dry run's report: add --dry-run (the benchmark writes --output)")
    if args.dry_run:
        report = dry_run(args.models.split(","))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        return

    import ray

    from hybridflow.builders import build_tiny_model
    from hybridflow.config.schema import TinyModelConfig

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    lines = ["| model | parameters | mode | seconds (median) | of which exchange (s) | bytes received / rank | "
             "layout minimum / rank | engine bytes / rank | copy floor (s) | ratio to floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    reloads = ["| model | parameters | vLLM reload_weights, whole model, one engine alone (s) |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = build_tiny_model(Path(tmp) / name, TinyModelConfig(**MODELS[name]))
            params = _parameters(model_dir)
            reload_s = vllm_reload_seconds(model_dir)
            print(f"{name}: vLLM reload_weights of the whole model from memory: {reload_s:.4f} s", flush=True)
            reloads.append(f"| {name} | {params / 1e6:.1f}M | {reload_s:.4f} |")
            for mode, actor_ranks, rollout_ranks, tp in MODES:
                r = run_mode(model_dir, actor_ranks, rollout_ranks, tp, args.syncs)
                line = (f"| {name} | {params / 1e6:.1f}M | {mode} | {r['seconds']:.4f} | {r['exchange']:.4f} | "
                        f"{_mb(r['received'])} | "
                        f"{_mb(r['minimum'])} | {_mb(r['engine'])} | {r['floor_s']:.4f} | {r['ratio']:.2f} |")
                print(line, flush=True)
                lines.append(line)
    ray.shutdown()
    command = f"PYTHONPATH=. .venv/bin/python bench/weight_sync.py --models {args.models} --syncs {args.syncs}"
    text = ("# Weight sync benchmark\n\nMeasured by `bench/weight_sync.py` (see its docstring) on this machine "
            f"(2 cores, no GPU), float32, {time.strftime('%Y-%m-%d')}:\n\n```bash\n{command}\n```\n\n"
            + "\n".join(lines) + "\n\nvLLM's own loader, for comparison (the tensors already in memory, no transport):\n\n"
            + "\n".join(reloads) + "\n")
    Path(args.output).write_text(text)
    print(f"wrote {args.output}")


def _parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                n = 1
                for s in f.get_slice(key).get_shape():
                    n *= s
                total += n
    return total


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:.2f} MiB"


if __name__ == "__main__":
    main()
