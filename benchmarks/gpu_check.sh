#!/usr/bin/env bash
# GPU check, on one CUDA machine (one GPU is enough). Three parts, each under its own time limit; PARTS picks them
# (default "throughput flux_step": at most 10 minutes; add distributed for the scale-out paths, about 5 more):
#   throughput  benchmarks/throughput.py: every script for 2 epochs on a FLUX.1 at FLUX.1-dev's widths (random
#      weights, 2 + 4 blocks) at 512 px: rollout and training seconds, s / optimizer step, TFLOP/s and MFU (the
#      scripts' own FLOPs count), peak memory, grpo's bf16 ratio drift, and the embedding cache against online
#      encoding: one table (at most 6 minutes; a run over 60 s is reported as failed and the table still prints).
#   flux_step   benchmarks/flux_step.py: a bf16 LoRA Flow-GRPO step on a FLUX.1-dev-sized transformer (random
#      weights), 512 and 1024 px, with and without gradient checkpointing: step time and peak memory.
#   distributed accelerate's real DeepSpeed ZeRO-2 and FSDP2 plugin paths (NCCL, bf16) with the unchanged scripts
#      on the tiny FLUX.1: grpo LoRA under ZeRO-2 stopped after 2 epochs and resumed must equal 3 uninterrupted
#      epochs; nft full fine-tuning under ZeRO-2 and FSDP2; grpo LoRA under FSDP2.
#   bash benchmarks/gpu_check.sh OUT_DIR        (logs and JSON land in OUT_DIR; exit status 1 if a check failed)
#   PARTS=throughput bash benchmarks/gpu_check.sh OUT_DIR      (only the table)
#   PARTS="throughput flux_step distributed" bash benchmarks/gpu_check.sh OUT_DIR    (everything, about 15 minutes)
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
export FLOWRL_CACHE=${FLOWRL_CACHE:-/tmp/flowrl-gpu-check}
status=0

check() {  # check NAME TIMEOUT_S COMMAND...: run, log, report the outcome in one line
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  if timeout "$limit" "$@" >"$out/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - start)) s)"
  else
    echo "FAIL $name ($((SECONDS - start)) s): $(grep -v '^\s*$' "$out/$name.log" | tail -n 3 | tr '\n' ' ' | cut -c1-400)"
    status=1
  fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, accelerate, deepspeed, diffusers, peft; print('torch', torch.__version__, '| accelerate', \
accelerate.__version__, '| deepspeed', deepspeed.__version__, '| diffusers', diffusers.__version__, '| peft', peft.__version__)"

parts=" ${PARTS:-throughput flux_step} "

# THROUGHPUT_ARGS="--size tiny --resolution 64 --scripts grpo nft" tries it on a CPU in a few minutes
if [[ $parts == *" throughput "* ]]; then
  check throughput 360 python3 benchmarks/throughput.py ${THROUGHPUT_ARGS:-} --output-dir /tmp/gpu-check-throughput \
    --json-out "$out/throughput.json"
  grep -E '; FLUX.1 at|^\||^embedding cache' "$out/throughput.log"
fi

# FLUX_STEP_ARGS="--size tiny --resolutions 64" tries the whole script on a CPU in a few minutes
if [[ $parts == *" flux_step "* ]]; then
  check flux_step 200 python3 benchmarks/flux_step.py ${FLUX_STEP_ARGS:-} --json-out "$out/flux_step.json"
  grep '^|\|^transformer' "$out/flux_step.log"
fi
[[ $parts == *" distributed "* ]] || exit $status

tiny=(--preset tiny --batch-size 4 --eval-every 1 --eval-num-prompts 4 --ema --kl-beta 0.01 --save-every 1)
ds=(python3 -m accelerate.commands.launch --config_file configs/deepspeed_zero2.yaml --num_processes 1)
fsdp=(python3 -m accelerate.commands.launch --config_file configs/fsdp2.yaml --num_processes 1)
runs=/tmp/gpu-check-runs
rm -rf "$runs"
check ds_grpo_3 90 "${ds[@]}" algos/grpo.py "${tiny[@]}" --epochs 3 --output-dir $runs/ds3
check ds_grpo_2 90 "${ds[@]}" algos/grpo.py "${tiny[@]}" --epochs 2 --output-dir $runs/ds2
check ds_grpo_resume 90 "${ds[@]}" algos/grpo.py "${tiny[@]}" --epochs 3 --output-dir $runs/ds2 --resume
check ds_resume_equal 30 python3 - $runs/ds3 $runs/ds2 <<'EOF'
import json, sys
skip = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu", "peak_memory_gb"}
a, b = ([{k: v for k, v in json.loads(l).items() if k not in skip} for l in open(f"{d}/metrics.jsonl")] for d in sys.argv[1:])
print(json.dumps(a[-1]))
assert len(a) == len(b) == 3 and a == b, [{k: (x[k], y[k]) for k in x if x[k] != y[k]} for x, y in zip(a, b)]
EOF
check ds_nft_full 100 "${ds[@]}" algos/nft.py --preset tiny --epochs 1 --batch-size 4 --full-finetune \
  --learning-rate 1e-3 --kl-beta 0.01 --output-dir $runs/ds_nft
check fsdp_grpo 90 "${fsdp[@]}" algos/grpo.py "${tiny[@]}" --epochs 2 --output-dir $runs/fsdp
check fsdp_nft_full 100 "${fsdp[@]}" algos/nft.py --preset tiny --epochs 1 --batch-size 4 --full-finetune \
  --learning-rate 1e-3 --kl-beta 0.01 --output-dir $runs/fsdp_nft
# accelerate falls back to DDP silently where a backend cannot run: the scripts print which one ran
check backends 5 bash -c "grep -q 'backend: DeepSpeed ZeRO-2, 1 process(es) on cuda' $out/ds_grpo_3.log \
  && grep -q 'backend: DeepSpeed ZeRO-2, 1 process(es) on cuda' $out/ds_nft_full.log \
  && grep -q 'backend: FSDP2, 1 process(es) on cuda' $out/fsdp_grpo.log \
  && grep -q 'backend: FSDP2, 1 process(es) on cuda' $out/fsdp_nft_full.log"
for d in ds3 ds_nft fsdp fsdp_nft; do
  echo "$d: $(tail -n 1 $runs/$d/metrics.jsonl 2>/dev/null | cut -c1-300)"
done
exit $status
