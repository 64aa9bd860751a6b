"""The planner at the HybridFlow paper's scale, by simulation (docs/placement.md, "At the paper's scale").

The paper's §8.3 settings: PPO with actor, critic, reference and reward model of one size (7B, 13B,
34B, 70B; Llama-2 shapes, CodeLlama-34B's for 34B), 1,024 prompts per step, 1,024 prompt and 1,024
response tokens, on 16–128 A100 80 GB GPUs, 8 per node. The planner searches every plan with the
A100 profile (hybridflow/planning/profiles.py), synchronous (depth 0, as the paper), any tensor-parallel
size within a node (as the paper's engines), bf16 compute with fp32 masters, activation
checkpointing with one sequence per micro-batch, and four optimizer steps per step (mini-batches of 256
prompts, verl's example). It prints the winning plan family (colocate / split / standalone) beside
the paper's and the search time.

    .venv/bin/python bench/paper_placement.py
    .venv/bin/python bench/paper_placement.py --dry-run   # one case (13B on 16 GPUs) through the same table
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridflow.planning.cost import Analytical  # noqa: E402
from hybridflow.planning.profiles import A100_80GB, A100_MEMORY_BYTES  # noqa: E402
from hybridflow.planning.search import SearchOptions, SearchResult, search  # noqa: E402
from hybridflow.planning.workload import Cluster, Workload  # noqa: E402

# parameters, layers, hidden, heads, key/value heads (vocabulary 32,000 for all)
MODELS = {"7B": (6.7e9, 32, 4096, 32, 32), "13B": (13.0e9, 40, 5120, 40, 40), "34B": (33.7e9, 48, 8192, 64, 8),
          "70B": (69.0e9, 80, 8192, 64, 8)}
GPUS = (16, 32, 64, 96, 128)
# The paper's winners as the issue states them (§8.3, Fig. 12/13): colocate from 16 to 64 GPUs; split at
# 96–128 for 34B and at 96 for 13B; at 128 the 13B run's best plan is standalone.
PAPER = {("13B", 16): "colocate", ("13B", 32): "colocate", ("13B", 64): "colocate", ("13B", 96): "split",
         ("13B", 128): "standalone", ("34B", 16): "colocate", ("34B", 32): "colocate", ("34B", 64): "colocate",
         ("34B", 96): "split", ("34B", 128): "split"}


def paper_workload(model: str) -> Workload:
    parameters, layers, hidden, heads, kv_heads = MODELS[model]
    return Workload(parameters=int(parameters), layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                    vocab=32000, prompts_per_step=1024, samples_per_prompt=1, prompt_tokens=1024,
                    response_tokens=1024, roles=("actor", "rollout", "critic", "reference", "reward"),
                    actor_forward=True, epochs=1, optimizer_steps=4, compute_bytes=2, master_bytes=4,
                    rollout_bytes=2, micro_batch_rows=1, checkpointing=True, name=f"PPO {model}")


def paper_case(model: str, gpus: int) -> SearchResult:
    return search(paper_workload(model), Cluster(gpus // 8, 8, A100_MEMORY_BYTES, "cuda"), Analytical(A100_80GB),
                  options=SearchOptions(any_tp=True, depths=(0,)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="one case, 13B on 16 GPUs, through the same table")
    args = parser.parse_args()
    cases = [("13B", 16)] if args.dry_run else [(model, gpus) for model in MODELS for gpus in GPUS]
    print("| model | GPUs | paper | planner | best plan | predicted s/step (best colocate / split / standalone) "
          "| plans (fit / searched) | search s |")
    print("|---|---|---|---|---|---|---|---|")
    agree = total = 0
    for model, gpus in cases:
        start = time.perf_counter()
        result = paper_case(model, gpus)
        seconds = time.perf_counter() - start
        paper = PAPER.get((model, gpus), "")
        if not result.ranked:
            print(f"| {model} | {gpus} | {paper} | none fits | | | 0 / {result.considered} | {seconds:.1f} |")
            total += bool(paper)
            continue
        best = result.best
        family: dict[str, float] = {}
        for c in result.ranked:
            family.setdefault(c.plan.family(), c.prediction.step_s)
        shown = " / ".join(f"{family[f]:.0f}" if f in family else "–" for f in ("colocate", "split", "standalone"))
        if paper:
            total += 1
            agree += best.plan.family() == paper
        print(f"| {model} | {gpus} | {paper} | {best.plan.family()} | {best.plan.describe()} | {shown} "
              f"| {len(result.ranked)} / {result.considered} | {seconds:.1f} |")
    print(f"\nagrees with the paper in {agree} of {total} published cases")


if __name__ == "__main__":
    main()
