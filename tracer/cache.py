"""Small on-disk caches of what the tracer learned about files, so that a
second attach skips the work: root-owned, mode 0600, in a 0700 directory.
A cache is only ever a shortcut: a missing or unreadable one is rebuilt."""

import json
import os
from pathlib import Path

CACHE_DIR = Path(os.environ.get("KVTRACE_CACHE_DIR", "/var/cache/kvtrace-bpf"))


def load(name: str):
    """The JSON document cached under `name`, or None."""
    try:
        return json.loads((CACHE_DIR / name).read_text())
    except (OSError, ValueError):
        return None


def store(name: str, doc):
    try:
        CACHE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = CACHE_DIR / name
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError:
        pass  # read-only or full: next time does the work again
