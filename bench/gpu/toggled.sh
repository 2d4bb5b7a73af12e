# This tree with one of bench/transfer_mn.py's switches off and on, alternating in one call on the GPU machine:
# every JSON line tagged "off" (run with FLAG, e.g. --no-arm, --no-streams) or "on" (the default), with its
# commit and card.
#
#   there: source bench/gpu/env.sh .whl
#          bash bench/gpu/toggled.sh --no-streams COMMIT OUT.jsonl "--senders 1 --receivers 1 --colocated --model qwen2.5-0.5b --rounds 41 --no-broadcast" [REPEATS]
set -u
flag=$1 commit=$2 out=$3 args=$4 reps=${5:-1}
root=$PWD
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); [ -n "$card" ] || card="CPU of $(nproc) cores"
for _ in $(seq "$reps"); do
  for tree in off on; do
    with=""; [ "$tree" = off ] && with=$flag
    # shellcheck disable=SC2086  # (the bench's arguments, split on purpose)
    timeout 200 python3 bench/transfer_mn.py $args $with --json 2>&1 | tail -n 1 | python3 "$root/bench/gpu/tag_line.py" "$tree" "$commit" "$card" "$out"
  done
done
