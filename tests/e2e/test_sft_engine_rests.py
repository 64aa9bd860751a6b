"""recipe=sft starts its engine asleep (hybridflow/resharding/sync.py `WeightSync.rest`): the engine's first
use is the first validation, so it sleeps from its start to that validation's weight sync instead of holding
its memory beside training. Shown by recorded calls on the real run, in one process without Ray
(placement=local, the hf engine, which at rollout.sleep_level=2 frees its weights on the CPU too): the
engine's own state (workers/rollout/__init__.py) says it sleeps when the first training step runs, and the
validation's sync loads every weight back, checked tensor by tensor (the level-2 rule)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The command's code with the engine's start and sleep and the actor's SFT step recorded, in order, with the
# engine's awake parts at each (the run's own classes, wrapped keeping their dispatch metadata)
RECORDING = """
import functools, json, os, sys
sys.modules['ray'] = None
from workers.actor import ActorWorker
from workers.rollout import RolloutEngineBase
from workers.rollout.hf_rollout import HFRollout
calls, engines = [], []
def recorded(cls, name, before=None):
    method = getattr(cls, name)
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if before:
            before(self)
        out = method(self, *args, **kwargs)
        if isinstance(self, RolloutEngineBase):
            engines[:] = [self]
        calls.append([name, out if isinstance(out, bool) else None, engines[0].awake_parts() if engines else None])
        return out
    setattr(cls, name, wrapper)
recorded(HFRollout, 'start')
recorded(RolloutEngineBase, 'sleep')
recorded(ActorWorker, 'train_sft')
from hybridflow.cli import run_command
try:
    code = run_command()
finally:
    open(os.environ['CALLS_OUT'], 'w').write(json.dumps(calls))
sys.exit(code)
"""


def test_sft_puts_its_engine_to_sleep_before_the_first_training_step(tmp_path):
    calls_out = tmp_path / "calls.json"
    args = ["placement=local", "recipe=sft", "rollout=hf", "rollout.sleep_level=2", "trainer.total_steps=2",
            "trainer.val_every_steps=2", "trainer.prompts_per_step=4", "rollout.max_response_tokens=4",
            "trainer.val_prompts=8", "data.synthetic.train_rows=64", "data.synthetic.val_rows=8",
            "trainer.save_every_steps=0", "trainer.export_hf=false", "weight_sync.checksum_every_steps=1",
            f"logger.output_root={tmp_path}", "logger.run_name=sft"]
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "CALLS_OUT": str(calls_out),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", RECORDING, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    calls = json.loads(calls_out.read_text())
    names = [c[0] for c in calls]
    assert names[:3] == ["start", "sleep", "train_sft"], calls
    assert calls[1][1] is True and calls[1][2] == []  # it slept: neither its weights nor its KV cache awake
    assert calls[2][2] == []  # still asleep while the first step trains
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # the validation's sync woke the weights, loaded every one and compared them all with the actor's
    assert rows[-1]["weight_sync/verified_tensors"] > 0 and "val/accuracy" in rows[-1]
    assert "weight_sync/reload_checksum_s" in rows[-1]
