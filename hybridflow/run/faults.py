"""Faults on purpose (`trainer.fault_injection`): kill a role's rank, make a method hang, or truncate
a file of the newest checkpoint, at the start of a named step — to check that a run survives them
(`trainer.max_restarts`, and the checksum check at resume).

Each fault fires once per run directory (`faults_fired.json` records it), so the step that is
run again after the restart goes through.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.output.console import say
from hybridflow.controller import WorkerGroup


def inject_faults(config: HybridFlowConfig, step: int, groups: dict[str, WorkerGroup], run_dir: Path) -> None:
    """Fire the faults configured for `step` that have not fired in this run directory yet."""
    if not any(fault.step == step for fault in config.trainer.fault_injection):
        return
    record = run_dir / "faults_fired.json"
    fired = json.loads(record.read_text()) if record.exists() else []
    for i, fault in enumerate(config.trainer.fault_injection):
        if fault.step != step or i in fired or (fault.kind != "corrupt" and fault.role not in groups):
            continue
        if fault.kind == "corrupt":
            fired.append(i)
            record.write_text(json.dumps(fired))
            say(f"hybridflow: fault injection: truncated {corrupt_newest_checkpoint(run_dir)} at step {step}")
            continue
        group = groups[fault.role]
        if fault.rank >= group.world_size:
            raise ValueError(f"trainer.fault_injection[{i}]: rank {fault.rank} of role {fault.role!r}, which has "
                             f"{group.world_size} rank(s)")
        fired.append(i)
        record.write_text(json.dumps(fired))
        host = group.hosts[fault.rank]
        say(f"hybridflow: fault injection: {fault.kind} {fault.role} rank {fault.rank}"
            + (f" method {fault.method}" if fault.method else "") + f" at step {step}")
        if fault.kind == "kill":  # kill and hang are refused with placement.backend=local (config rules)
            host.kill()
        else:
            host.ask("inject_hang", fault.role, fault.method)


def corrupt_newest_checkpoint(run_dir: Path) -> Path:
    """Cut the largest file of the newest complete checkpoint to half its size; returns its path."""
    complete = sorted(p.parent for p in (run_dir / "checkpoints").glob("step_*/COMPLETE"))
    if not complete:
        raise ValueError(f"trainer.fault_injection kind=corrupt: no complete checkpoint in {run_dir}/checkpoints yet; "
                         "set trainer.save_every_steps and a later step")
    files = [f for f in complete[-1].rglob("*") if f.is_file() and f.name not in ("COMPLETE", "MANIFEST.json")]
    target = max(files, key=lambda f: f.stat().st_size)
    with target.open("r+b") as f:
        f.truncate(target.stat().st_size // 2)
    return target
