#!/usr/bin/env bash
# GRPO from the untrained tiny model in float32, in bfloat16 with float32 master weights (mixed
# precision, the default for model.dtype=bfloat16) and in pure bfloat16; reward: the share of digits
# in the response (bench/digit_reward.py). Writes runs under $1 (default runs/precision) and
# bench/results/precision_grpo.png. Usage: flock /tmp/hf-heavy.lock bash bench/precision_curves.sh [OUT]
set -euo pipefail
out=${1:-runs/precision}
common=(recipe=grpo trainer.total_steps=30 trainer.prompts_per_step=8 rollout.samples_per_prompt=4
        rollout.max_response_tokens=8 actor.optim.lr=1e-3 trainer.val_every_steps=0 trainer.val_prompts=8
        trainer.export_hf=false reward.fn=bench/digit_reward.py:score logger.output_root=$out)
.venv/bin/hybridflow "${common[@]}" logger.run_name=float32
.venv/bin/hybridflow "${common[@]}" logger.run_name=bf16_mixed model.dtype=bfloat16 rollout.dtype=bfloat16
.venv/bin/hybridflow "${common[@]}" logger.run_name=bf16_pure model.dtype=bfloat16 model.master_dtype=bfloat16 \
  rollout.dtype=bfloat16
.venv/bin/python bench/precision_curves.py bench/results/precision_grpo.png "$out"/float32 "$out"/bf16_mixed "$out"/bf16_pure
