#!/usr/bin/env bash
# specjax batch on GPUs: one node with 8 GPUs, then several such nodes.
set -euo pipefail

IN=${IN:-prompts.jsonl}
OUT=${OUT:-results.jsonl}
MODEL=${MODEL:-/path/to/model}

# --- One node, 8 GPUs, one process -------------------------------------------------------------
# Rows split over the 8 GPUs (params replicated on each):
specjax batch --input "$IN" --output "$OUT" --model "$MODEL" --drafter ngram --num-draft 5 \
  --max-new-tokens 256 --batch-size 64 --mesh data=8

# A model that needs two GPUs: 4 replicas, each split tensor-parallel over 2 GPUs:
#   specjax batch ... --mesh data=4,model=2

# --- Several nodes (here 2): one process per node, all 8 GPUs each -----------------------------
# Node 0 hosts the coordinator (any free port reachable from the other nodes). $OUT must be on a
# filesystem both nodes see for process 0's automatic merge; otherwise merge after copying parts.
# JAX_LOCAL_DEVICE_IDS keeps all 8 GPUs visible (under SLURM, JAX otherwise gives each process one).
COORD=${COORD:-node0.example:12355}
export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7
# on node 0:
#   specjax batch --input "$IN" --output "$OUT" --model "$MODEL" --mesh data=8 \
#     --coordinator "$COORD" --num-processes 2 --process-id 0
# on node 1:
#   specjax batch --input "$IN" --output "$OUT" --model "$MODEL" --mesh data=8 \
#     --coordinator "$COORD" --num-processes 2 --process-id 1
# Under SLURM (srun sets the process id and count; node 0's address is the coordinator):
#   srun --nodes=2 --ntasks-per-node=1 specjax batch --input "$IN" --output "$OUT" --model "$MODEL" \
#     --mesh data=8 --coordinator auto
#
# Restart one failed process alone: the same command without --coordinator, e.g. on node 1
#   specjax batch --input "$IN" --output "$OUT" --model "$MODEL" --mesh data=8 --num-processes 2 --process-id 1
# and, if process 0 stopped waiting meanwhile:
#   specjax batch --merge --output "$OUT" --num-processes 2
