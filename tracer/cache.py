"""Small on-disk caches of what the tracer learned or built, so that a
second attach skips the work: root-owned, mode 0600, in a 0700 directory.
A cache is only ever a shortcut: a missing or unreadable one is rebuilt.

One directory holds them all: KVTRACE_CACHE_DIR (default
/var/cache/kvtrace-bpf; "off" turns caching off).  The compiled BPF program
is among them (program.py) and gets loaded into the kernel, so a directory
that anyone but its owner, this user, could write is not used at all."""

import json
import os
from pathlib import Path

DEFAULT_DIR = "/var/cache/kvtrace-bpf"


def configured():
    """The cache directory asked for, or None when KVTRACE_CACHE_DIR turns
    caching off.  Nothing is checked or created."""
    path = os.environ.get("KVTRACE_CACHE_DIR") or DEFAULT_DIR
    return None if path.lower() in ("off", "none", "0") else path


def directory():
    """(Path, None) when the cache can be used, else (None, why not)."""
    path = configured()
    if path is None:
        return None, "KVTRACE_CACHE_DIR turns it off"
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        return None, f"{path}: {e.strerror}"
    why = unsafe(st)
    return (None, f"{path} {why}") if why else (Path(path), None)


def unsafe(st, euid=None):
    """Why a directory of this stat is not for this user's cache, or ''.
    Its owner's write is fine when the owner is this user; a group's or
    anyone's is not."""
    euid = os.geteuid() if euid is None else euid
    if st.st_mode & 0o022:
        return f"is writable by others than its owner (mode {st.st_mode & 0o777:o})"
    if st.st_uid != euid:
        return (f"belongs to uid {st.st_uid}, not to this user (euid {euid}; "
                f"mode {st.st_mode & 0o777:o})")
    return ""


def load(name: str):
    """The JSON document cached under `name`, or None."""
    where, _ = directory()
    if where is None:
        return None
    try:
        return json.loads((where / name).read_text())
    except (OSError, ValueError):
        return None


def store(name: str, doc):
    where, _ = directory()
    if where is None:
        return
    try:
        path = where / name
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError:
        pass  # read-only or full: next time does the work again
