"""Tag the JSON line a bench printed last (stdin) with its tree, commit and card, append it to a results
file and print a one-line summary: ``... | python3 bench/gpu/tag_line.py TREE COMMIT CARD OUT.jsonl``
(bench/gpu/paired.sh and bench/gpu/toggled.sh)."""

import json
import sys

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
print(tree, d["model"], *(f"{k} {d.get(k)}" for k in ("engine_ms", "push_to_commit_ms", "armed_rounds", "bound_ms",
                                                      "control_rtt_ms", "checked_median_ms", "bit_exact")))
