"""Output files: created 0600 (they describe another process's memory use)."""

import os

from .errors import UsageError


def open_private(path: str, binary: bool = False):
    """Open path for writing (text, or bytes unbuffered), created with mode
    0600 (an existing file is truncated and narrowed to 0600 too)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}") from None
    return os.fdopen(fd, "wb", buffering=0) if binary else os.fdopen(fd, "w")


def check_writable(path: str):
    """Fail before tracing, not after, if an output file cannot be created."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"cannot write {path}: no such directory {parent}")
    if os.path.isdir(path):
        raise UsageError(f"cannot write {path}: is a directory")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"cannot write {path}: permission denied")
