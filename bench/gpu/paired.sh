# An earlier tree beside this one in one call on the GPU machine: bench/transfer_mn.py run alternately in
# each, every JSON line tagged with its tree ("base" or "new"), commit and card; a short summary printed.
#
#   here:  mkdir -p .gpu/base && git archive BASE | tar -x -C .gpu/base      (carry .gpu and .whl)
#   there: source bench/gpu/env.sh .whl
#          bash bench/gpu/paired.sh NEW BASE OUT.jsonl "--senders 1 --receivers 1 --colocated --model empty --rounds 41 --no-broadcast" [REPEATS]
set -u
new=$1 base=$2 out=$3 args=$4 reps=${5:-1}
root=$PWD
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
for _ in $(seq "$reps"); do
  for tree in base new; do
    if [ "$tree" = base ]; then dir=$root/.gpu/base commit=$base; else dir=$root commit=$new; fi
    # shellcheck disable=SC2086  # (the bench's arguments, split on purpose)
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 280 python3 bench/transfer_mn.py $args --json 2>&1 | tail -n 1) \
      | python3 "$root/bench/gpu/tag_line.py" "$tree" "$commit" "$card" "$out"
  done
done
