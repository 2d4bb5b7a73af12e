# Armed pushes against plain ones, this tree, alternating in one call on the GPU machine: bench/transfer_mn.py
# as it runs by default (arms) and with --no-arm, every JSON line tagged ("arm" or "plain"), with its commit
# and card.
#
#   there: source bench/gpu/env.sh .whl
#          bash bench/gpu/armed.sh COMMIT OUT.jsonl "--senders 1 --receivers 1 --colocated --model qwen2.5-0.5b --rounds 41 --no-broadcast" [REPEATS]
set -u
commit=$1 out=$2 args=$3 reps=${4:-1}
root=$PWD
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
for _ in $(seq "$reps"); do
  for tree in plain arm; do
    flag=""; [ "$tree" = plain ] && flag=--no-arm
    # shellcheck disable=SC2086  # (the bench's arguments, split on purpose)
    timeout 280 python3 bench/transfer_mn.py $args $flag --json 2>&1 | tail -n 1 | python3 "$root/bench/gpu/tag_line.py" "$tree" "$commit" "$card" "$out"
  done
done
