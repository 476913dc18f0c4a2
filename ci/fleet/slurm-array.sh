#!/usr/bin/env bash
# A nightly gate split over a Slurm job array, one GPU per task (docs/FLEET.md): task $SLURM_ARRAY_TASK_ID
# runs that shard of $SLURM_ARRAY_TASK_COUNT, launching its own server pair from the preset, and writes
# its journal under $REPORTS (a file system every node sees). Submit the shards, then the merge once
# every task has ended, whatever it ended with:
#
#   jid=$(sbatch --parsable --array=0-15 ci/fleet/slurm-array.sh)
#   sbatch --dependency=afterany:$jid --wrap "specparity merge $REPORTS/shard-* --report $REPORTS/merged"
#
# A shard's exit code 1 is its own provisional verdict (the merge re-judges under the run's threshold), so
# the task succeeds on 0 and 1; a requeued task (--requeue, a lost node) resumes its journal.
#SBATCH --job-name=specparity-shard
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
#SBATCH --requeue
set -uo pipefail
: "${REPORTS:?set REPORTS to a directory every node sees}"
: "${TARGET:?set TARGET to the target model directory}"
dir="$REPORTS/shard-$SLURM_ARRAY_TASK_ID"
resume=()
[ -s "$dir/results.jsonl" ] && resume=(--resume)
export HF_HUB_OFFLINE=1
specparity run --engine vllm --preset vllm-mtp --target "$TARGET" --engine-opt parallel_start=true \
  --shard "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT" --report "$dir" "${resume[@]}" -q
rc=$?
[ "$rc" -le 1 ] || exit "$rc"
