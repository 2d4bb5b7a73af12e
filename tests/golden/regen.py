"""Regenerate tests/golden/vectors.json from tests/wire_samples.py.

Run only when the wire format changes on purpose (and bump PROTOCOL_VERSION when it breaks peers):
    .venv/bin/python tests/golden/regen.py
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from weightsync.wire import PROTOCOL_VERSION, encode  # noqa: E402
from wire_samples import samples  # noqa: E402

vectors = {name: [f.hex() for f in encode(env)] for name, env in samples().items()}
out = {"protocol_version": list(PROTOCOL_VERSION), "vectors": vectors}
path = pathlib.Path(__file__).with_name("vectors.json")
path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
print(f"wrote {len(vectors)} vectors to {path}")
