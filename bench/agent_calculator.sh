#!/usr/bin/env bash
# The measurement of docs/agents.md: the 3x3-digit multiplication task with and without the
# calculator tool, SFT then GRPO, on this machine (one training rank with both CPU cores).
#   bash bench/agent_calculator.sh OUT_DIR
# 1. SFT on tool-use demonstrations, a checkpoint every 50 steps;
# 2. GRPO with multi-turn tool rollouts from the first SFT checkpoint at >= 0.15 held-out accuracy
#    (a start that is neither hopeless nor already solved);
# 3. the same model without the tool: SFT on the bare answers for the same steps, then GRPO;
# 4. bench/learning_curves.py plots held-out accuracy against wall-clock minutes.
set -euo pipefail
OUT=${1:?output directory}
HF=${HYBRIDFLOW:-.venv/bin/hybridflow}
PY=${PYTHON:-.venv/bin/python}
TASK="placement.pools.global.devices_per_node=1 placement.pools.global.cpus_per_device=2
  data.synthetic.min_digits=3 data.synthetic.max_digits=3 data.synthetic.operations=[mul]
  data.synthetic.train_rows=20000 data.synthetic.val_rows=300 trainer.val_prompts=300 logger.output_root=$OUT"
TOOL="rollout.agent=[hybridflow.data.calculator:calc] rollout.max_response_tokens=32 rollout.max_turns=3"
SFT="recipe=sft trainer.prompts_per_step=64 actor.samples_per_micro_batch=64 actor.optim.lr=3.0e-3
  actor.optim.warmup_steps=5 actor.optim.lr_schedule=constant trainer.val_every_steps=50"
GRPO="recipe=grpo trainer.val_every_steps=25 trainer.prompts_per_step=32
  rollout.samples_per_prompt=8 actor.samples_per_micro_batch=256 actor.optim.lr=${GRPO_LR:-1.0e-4}
  actor.clip_ratio_high=0.28"

$HF $SFT $TASK $TOOL data.synthetic.calculator_demonstrations=true trainer.total_steps=${SFT_STEPS:-1500} \
  trainer.save_every_steps=50 trainer.keep_last_checkpoints=null logger.run_name=sft_tool
STEP=$($PY - "$OUT/sft_tool" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if "val/accuracy" in l]
rows = [r for r in rows if "val/accuracy" in r]
good = [r for r in rows if r["val/accuracy"] >= 0.15]
print((good[0] if good else max(rows, key=lambda r: r["val/accuracy"]))["step"])
PY
)
echo "GRPO starts from SFT step $STEP"
START=$OUT/sft_tool/checkpoints/step_$(printf %08d "$STEP")/hf
$HF $GRPO $TASK $TOOL model.path=$START trainer.total_steps=${GRPO_STEPS:-500} logger.run_name=grpo_tool

$HF $SFT $TASK rollout.max_response_tokens=8 trainer.total_steps=$STEP trainer.save_every_steps=0 \
  logger.run_name=sft_no_tool
$HF $GRPO $TASK rollout.max_response_tokens=8 model.path=$OUT/sft_no_tool/final_model logger.run_name=grpo_no_tool \
  trainer.total_steps=${NO_TOOL_GRPO_STEPS:-500}

$PY bench/learning_curves.py "$OUT/agent_calculator.png" "sft (tool)=$OUT/sft_tool" "sft (no tool)=$OUT/sft_no_tool" \
  "grpo (tool)=$OUT/grpo_tool" "grpo (no tool)=$OUT/grpo_no_tool"
