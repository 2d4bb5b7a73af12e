# Armed pushes against plain ones, this tree, alternating in one call on the GPU machine: bench/transfer_mn.py
# as it runs by default (arms) and with --no-arm, every JSON line tagged ("arm" or "plain"), with its commit
# and card.
#
#   there: source bench/gpu/env.sh .whl
#          bash bench/gpu/armed.sh COMMIT OUT.jsonl "--senders 1 --receivers 1 --colocated --model qwen2.5-0.5b --rounds 41 --no-broadcast" [REPEATS]
set -u
commit=$1 out=$2 args=$3 reps=${4:-1}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
for _ in $(seq "$reps"); do
  for tree in plain arm; do
    flag=""; [ "$tree" = plain ] && flag=--no-arm
    # shellcheck disable=SC2086  # (the bench's arguments, split on purpose)
    timeout 280 python3 bench/transfer_mn.py $args $flag --json 2>&1 | tail -n 1 | python3 -c '
import json, sys
tree, commit, card, out = sys.argv[1:]
line = sys.stdin.read().strip()
try:
    d = json.loads(line)
except ValueError:
    print("FAILED", tree, line[-2000:])
    sys.exit()
d = {"tree": tree, "commit": commit, **d, "device": "1 x " + card}
with open(out, "a") as f:
    f.write(json.dumps(d) + "\n")
print(tree, d["model"], "engine_ms", d["engine_ms"], "push_to_commit_ms", d.get("push_to_commit_ms"), "armed_rounds",
      d.get("armed_rounds"), "bound_ms", d.get("bound_ms"), "control_rtt_ms", d["control_rtt_ms"], "bit_exact", d.get("bit_exact"))' "$tree" "$commit" "$card" "$out"
  done
done
