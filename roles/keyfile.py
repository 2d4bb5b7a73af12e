"""The shared auth key, read from a file: one line of at least ``wire.auth.MIN_KEY_BYTES`` bytes.

How this works: ``read_key_file`` reads and checks the key; a file that cannot be read, or holds too
short a key, is a ``ConfigError`` naming the option it came from (the CLI's ``--auth-key-file``, the
vLLM backend's ``auth_key_file``). Light on purpose: the CLI calls it without importing torch.
"""

from __future__ import annotations

from weightsync.engine.errors import ConfigError
from weightsync.wire.auth import check_key


def read_key_file(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return check_key(f.read().strip())
    except OSError as exc:
        raise ConfigError(field, f"cannot read {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise ConfigError(field, f"{path}: {exc}") from exc
