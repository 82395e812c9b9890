#!/usr/bin/env bash
# specjax batch on a Cloud TPU pod slice: one process per host, each using its local chips.
#
# Example: a v5litepod-16 (4 hosts x 4 chips). Every host runs the same command; JAX detects the
# process id, the process count and the coordinator from the TPU metadata (--coordinator auto).
# Host I takes input lines i with i % 4 == I and writes $OUT.part-I-of-4; host 0 merges the parts
# into $OUT once all are complete, so $OUT must be on storage every host sees (Filestore/NFS, or
# a gcsfuse mount). Without shared storage, copy the parts to one place and run the --merge line.
set -euo pipefail

TPU_NAME=${TPU_NAME:-my-v5e-16}
ZONE=${ZONE:-us-west4-a}
SHARED=${SHARED:-/mnt/shared}          # mounted on every host
IN=$SHARED/prompts.jsonl
OUT=$SHARED/results.jsonl

# 1. Input: your own JSONL ({"id", "prompt" | "messages"}), or a packaged suite, e.g.
#    specjax batch --suite sharegpt --limit 200 ... instead of --input (ids sharegpt-0, ...).

# 2. Run on all hosts. --mesh data=4: the 4 local chips split the rows (params replicated).
#    For a model too large for one chip, split it tensor-parallel: --mesh data=2,model=2 or
#    --mesh data=1,model=4.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  cd ~/specjax && .venv/bin/specjax batch \
    --input $IN --output $OUT \
    --model /path/to/model --drafter ngram --num-draft 5 \
    --temperature 0 --max-new-tokens 256 --batch-size 64 --latency-class batch \
    --mesh data=4 --coordinator auto"

# 3. A host that failed: rerun the same command on that host alone; it resumes its part (the
#    other hosts are not affected). After a failure of host 0's merge wait, or to merge by hand:
#    specjax batch --merge --output $OUT --num-processes 4
