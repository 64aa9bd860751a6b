"""`hybridflow plan`: the placement search for a run, printed before anything starts.

    hybridflow plan [--cluster here|ray|NODESxDEVICES] [--device cpu|cuda] [--device-memory-gib G]
                    [--rates FILE | --profile NAME | --calibrate [--save-rates FILE]]
                    [--intra-node-gb-s B] [--inter-node-gb-s B] [--top K] [--refused K]
                    [--depths 0,1] [--tp-1-or-pool] [--policy NAME] [--cost-model NAME] [--json FILE]
                    [OVERRIDE ...]

The overrides are the run's (`recipe=ppo rollout.max_response_tokens=64 ...`): the workload is the
step they describe. It prints the cluster, the rates and where they came from, the ranked plans
(predicted seconds per step and per stage), the overrides that select each, each pool's memory
terms for the best, and why the refused candidates were refused. Where no plan fits at the configured
sequence-parallel sizes, it plans as placement=auto runs: at the smallest larger size that fits
(hybridflow/planning/auto.py `split_sequences`), said in its first line and in each pool's memory line.
Exit status 2 when no plan fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from hybridflow.planning.auto import cluster_for, no_split_said, split_sequences
from hybridflow.planning.cost import STAGES
from hybridflow.planning.rules import phases
from hybridflow.planning.workload import GIB, Cluster, Workload


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridflow plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default="here", help="here (this machine), ray (ray.address), or NODESxDEVICES")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="with NODESxDEVICES (default cpu)")
    p.add_argument("--device-memory-gib", type=float, default=None, help="with NODESxDEVICES")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--rates", help="a rates JSON from --calibrate --save-rates")
    source.add_argument("--profile", help="a built-in device profile (hybridflow/planning/profiles.py)")
    source.add_argument("--calibrate", action="store_true", help="profile this workload here first (minutes)")
    p.add_argument("--save-rates", help="with --calibrate: write the fitted rates here")
    p.add_argument("--intra-node-gb-s", type=float, default=None, help="collective bandwidth within a node, GB/s")
    p.add_argument("--inter-node-gb-s", type=float, default=None, help="collective bandwidth across nodes, GB/s")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--refused", type=int, default=3, help="how many refused plans to show, with why")
    p.add_argument("--depths", default="0,1", help="trainer.max_staleness values to try")
    p.add_argument("--any-tp", action="store_true", help="kept for older command lines: every tensor-parallel size "
                   "dividing a pool within a node is searched by default")
    p.add_argument("--tp-1-or-pool", action="store_true", help="search rollout TP 1 or the whole pool only")
    p.add_argument("--policy", default=None)
    p.add_argument("--cost-model", default=None)
    p.add_argument("--json", help="write every ranked plan and its prediction here")
    p.add_argument("overrides", nargs="*")
    return p


def make_cluster(args, config) -> Cluster:
    if args.cluster == "here":
        from hybridflow.precision import device_of

        return Cluster.this_machine(args.device or device_of(config.placement.device.value))
    if args.cluster == "ray":
        if config.ray.address is None:
            raise ValueError("--cluster ray reads the cluster at ray.address: add ray.address=HOST:PORT")
        return cluster_for(config)
    nodes, sep, devices = args.cluster.partition("x")
    if not (sep and nodes.isdigit() and devices.isdigit() and int(nodes) and int(devices)):
        raise ValueError(f"--cluster {args.cluster!r}: give here, ray, or NODESxDEVICES such as 16x8")
    device = args.device or "cpu"
    memory = args.device_memory_gib
    if memory is None:
        if device == "cuda":
            raise ValueError("--cluster NODESxDEVICES with --device cuda needs --device-memory-gib")
        memory = Cluster.this_machine().device_memory_bytes / GIB
    return Cluster(int(nodes), int(devices), memory * GIB, device)


def main(argv: list[str], compose_command: Callable[[list[str]], Any]) -> int:
    """`hybridflow plan ARGV`; `compose_command(overrides)` composes and checks the run's config as the
    command does (`hybridflow.run.pipeline_stages.compose_command`, passed in by `hybridflow.cli`: the stage's
    modules sit above the planner)."""
    args = parser().parse_args(argv)
    from hybridflow.planning.device_rates import load_rates

    try:
        config = compose_command(args.overrides)
        planner = config.placement.planner
        config = dataclasses.replace(config, placement=dataclasses.replace(config.placement, planner=dataclasses.replace(
            planner, policy=args.policy or planner.policy, cost_model=args.cost_model or planner.cost_model)))
        cluster = make_cluster(args, config)
        workload = Workload.from_config(config)
        from hybridflow.planning.device_rates import choose_rates, save_cached, this_device

        note = None  # which rates, for this device or not (a cluster described by hand has no device here)
        if args.calibrate:
            from hybridflow.planning.calibrate import calibrate

            rates, _ = calibrate(args.overrides, workload, cluster.devices)
            if args.save_rates:
                Path(args.save_rates).write_text(json.dumps(rates.to_dict(), indent=2))
                print(f"hybridflow plan: rates saved to {args.save_rates}")
            if args.cluster == "here":
                cached = save_cached(this_device(cluster.device), rates, "calibrated (hybridflow plan --calibrate)")
                print(f"hybridflow plan: rates cached for this device ({cached}); placement=auto uses them from now on")
        elif args.profile:
            from hybridflow.planning.profiles import PROFILES

            if args.profile not in PROFILES:
                raise ValueError(f"--profile {args.profile!r}: built-in profiles are {sorted(PROFILES)}")
            rates = PROFILES[args.profile][0]
        elif args.cluster in ("here", "ray"):
            choice = choose_rates(args.rates or planner.rates, cluster.device)
            rates, note = choice.rates, choice.note
        else:
            rates = load_rates(args.rates or planner.rates, cluster.device)
        if args.intra_node_gb_s:
            rates = dataclasses.replace(rates, intra_node_bytes_per_s=args.intra_node_gb_s * 1e9,
                                        exchange_bytes_per_s=0.0, send_bytes_per_s=0.0)
        if args.inter_node_gb_s:
            rates = dataclasses.replace(rates, inter_node_bytes_per_s=args.inter_node_gb_s * 1e9)
        depths = tuple(int(d) for d in args.depths.split(","))
        from hybridflow.planning.search import SearchOptions, build_policy, search
        from hybridflow.planning.cost import build_cost_model

        p = config.placement.planner
        cost, policy = build_cost_model(p.cost_model, rates), build_policy(p.policy)
        options = SearchOptions(any_tp=not args.tp_1_or_pool, depths=depths)
        result = search(workload, cluster, cost, policy, options)
        split, tried = None, []
        if not result.ranked:  # as placement=auto runs it: the smallest larger sequence-parallel size that fits
            split, tried = split_sequences(config, cluster,
                                           lambda raised: search(Workload.from_config(raised), cluster, cost, policy,
                                                                 options))
            if split is not None:
                workload, result = Workload.from_config(split.config), split.result
    except (ValueError, KeyError, RuntimeError) as exc:  # a ConfigError is a ValueError
        print(f"hybridflow plan: {exc}", file=sys.stderr)
        return 2
    if split is not None:
        print(split.line("hybridflow plan:"))
    print(report(result, workload, cluster, rates, args.top, args.refused, note)
          + (no_split_said(config, tried) if split is None else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"cluster": dataclasses.asdict(cluster), "rates": rates.to_dict(),
                                               "workload": dataclasses.asdict(workload),
                                               "ranked": [c.to_dict() for c in result.ranked],
                                               **({"sequence_parallel": split.to_dict()} if split else {})}, indent=2))
    return 0 if result.ranked else 2


def report(result, workload, cluster, rates, top: int, refused: int = 3, note: str | None = None) -> str:
    """The printout; `note` says which device's rates these are (device_rates.RatesChoice.note), and
    when it says BORROWED the seconds column is headed as another device's."""
    w = workload
    borrowed = note is not None and note.startswith("BORROWED")
    lines = [f"workload: {w.parameters / 1e6:.1f}M parameters, {w.prompts_per_step} prompts x {w.samples_per_prompt} "
             f"samples, {w.prompt_tokens} + {w.response_tokens} tokens; roles {', '.join(w.roles)}"
             + "".join(f"; sequence parallel {', '.join(f'{r} {n}' for r, n in w.sequence_parallel().items())}"
                       for _ in [0] if w.sequence_parallel()),
             f"cluster: {cluster.describe()}", f"rates: {note or rates.source}",
             f"searched {result.considered} plans in {result.seconds:.2f} s: {len(result.ranked)} fit, "
             f"{len(result.refused)} refused", ""]
    if not result.ranked:
        return "\n".join(lines + [result.why_none()])
    if borrowed:
        lines.append("the ranking below is by another device's seconds (borrowed rates): not a prediction for this one")
    lines.append(f"{'#':>3} {'s/step*' if borrowed else 's/step':>8} " + " ".join(f"{s:>10}" for s in STAGES) + "  plan")
    for i, c in enumerate(result.ranked[:top], 1):
        lines.append(f"{i:>3} {c.prediction.step_s:8.2f} " + " ".join(f"{c.prediction.stages[s]:10.2f}" for s in STAGES)
                     + f"  {c.plan.describe()} [{c.plan.family()}]")
    lines += ["", "overrides:"]
    for i, c in enumerate(result.ranked[:top], 1):
        lines.append(f"{i:>3} " + shlex.join(c.plan.overrides()))
    best = result.best.plan
    splits = workload.sequence_parallel()

    def split_of(pool) -> str:  # each role that splits its sequences there, and its size
        said = [f"{role} {size}" for role, size in splits.items() if role in pool.roles]
        return f", sequence parallel: {', '.join(said)}" if said else ""
    lines += ["", "memory per device of the best plan (what the check counts, per phase of the step):"]
    for pool in best.pools:
        for phase, terms in phases(best, pool, workload, cluster).items():
            lines.append(f"  pool {pool.name!r} ({'+'.join(pool.roles)} on {pool.devices}{split_of(pool)}){phase}: "
                         f"{sum(terms.values()) / GIB:.2f} of {cluster.device_memory_bytes / GIB:.1f} GiB")
            lines += [f"      {v / GIB:8.3f} GiB  {k}" for k, v in terms.items()]
    if result.refused and refused:
        lines += ["", f"refused ({len(result.refused)}), the first {min(refused, len(result.refused))}:"]
        for plan, problems in result.refused[:refused]:
            lines.append(f"  - {plan.describe()}: " + "\n      ".join(problems))
    return "\n".join(lines)
