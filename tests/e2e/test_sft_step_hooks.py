"""Step hooks in recipe=sft end to end (the `hybridflow` command in one process without Ray,
placement=local with Ray's import blocked: tests/e2e/cli_in_one_process.py `without_ray`; real vLLM
on the CPU): an lr burst makes the loss spike, spike_recovery fires once, the actor then holds
exactly the SMA of the checkpoints saved before the spike, the rows of the batches since then go
back into the loader (`data: reshuffle`), and the weight sync that follows carries the merged
weights into vLLM (its per-tensor checksums are compared with the actor's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.merge.api import merge_state_dicts
from tests.e2e.cli_in_one_process import without_ray

SMALL = ["recipe=sft", "trainer.prompts_per_step=4", "rollout.max_response_tokens=4", "trainer.val_prompts=8",
         "data.synthetic.train_rows=200", "data.synthetic.val_rows=16", "actor.samples_per_micro_batch=8",
         "trainer.val_every_steps=0", "trainer.save_every_steps=1", "trainer.keep_last_checkpoints=1",
         "trainer.keep_last_weights=4", "weight_sync.checksum_every_steps=1", "actor.optim.warmup_steps=0",
         "actor.optim.lr_schedule=constant"]
# The update of step 6 runs at 1000x the lr (1e-3 -> 1: at 0.1 an early SFT step can even lower
# the loss), so the loss logged at step 7 (of the weights saved at 6) spikes; the hook merges the 2 newest checkpoints saved before step 6: steps 4 and 5, and
# puts back the 2 x 4 rows drawn at steps 6 and 7. Weights of the last 4 checkpoints are kept, so
# that steps 4 and 5 are still there after step 7's checkpoint for the offline merge below.
HOOKS = ("[{name: lr_burst, params: {at_step: 6, factor: 1000}}, "
         "{name: spike_recovery, params: {last: 2, window: 4, warmup: 3, data: reshuffle}}]")


def weights(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_spike_recovery_fires_in_sft_and_the_sync_carries_the_merge(tmp_path):
    result = without_ray([*SMALL, "trainer.total_steps=7", f"trainer.training_hooks={HOOKS}"], tmp_path, "sft")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = tmp_path / "sft"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("lr_burst/factor")] == [6]
    assert [r["step"] for r in rows if r["spike_recovery/fired"]] == [7]
    assert rows[-1]["spike_recovery/merged_from_step"] == 4 and rows[-1]["spike_recovery/merged_to_step"] == 5
    assert rows[-1]["spike_recovery/requeued_rows"] == 8
    assert rows[-1]["actor/loss"] > max(r["actor/loss"] for r in rows[:6])
    # the validation after the last step synced the recovered actor into vLLM and checked every tensor
    assert rows[-1]["weight_sync/verified_tensors"] > 0 and "val/accuracy" in rows[-1]

    checkpoints = run_dir / "checkpoints"
    expected = merge_state_dicts([weights(checkpoints / f"step_{s:08d}" / "hf") for s in (4, 5)], "sma")
    actual = weights(run_dir / "final_model")
    assert sorted(expected) == sorted(actual)
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
