"""Output files: created 0600 (they describe another process's memory use),
and written so that a failed write (a full disk, an I/O error) is one line
with its exit code, never a traceback, and costs only that one output."""

import contextlib
import errno
import glob
import os
import shutil
import stat
import sys
import tempfile

from .errors import OutputError, UsageError


def symlink_refused(path: str) -> str:
    """The one-line error for an output path that is a symbolic link."""
    return (f"cannot write {path}: it is a symbolic link, which the tracer does not "
            "follow (it runs as root: a link could point it at any file); name the "
            "file itself")


def open_private(path: str, binary: bool = False):
    """Open path for writing (text, or bytes unbuffered), created with mode
    0600 (an existing regular file is truncated and narrowed to 0600 too; a
    device such as /dev/null keeps its mode: it is not ours).  A symbolic
    link is refused (O_NOFOLLOW): the tracer runs as root, and a link
    planted where it writes (a shared directory, a name reused) would have
    it truncate whatever file the link names."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC |
                     os.O_NOFOLLOW, 0o600)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fchmod(fd, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise UsageError(symlink_refused(path)) from None
        raise UsageError(f"cannot write {path}: {e.strerror}") from None
    return os.fdopen(fd, "wb", buffering=0) if binary else os.fdopen(fd, "w")


def check_writable(path: str):
    """Fail before tracing, not after, if an output file cannot be created."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"cannot write {path}: no such directory {parent}")
    if os.path.islink(path):
        raise UsageError(symlink_refused(path))
    if os.path.isdir(path):
        raise UsageError(f"cannot write {path}: is a directory")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"cannot write {path}: permission denied")


def not_regular(mode: int) -> str:
    """What a file that is not a regular file is ("" for a regular file):
    the offline commands read regular files only, since a named pipe with no
    writer, or a device such as /dev/zero, would keep them waiting forever."""
    for test, what in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return what
    return "" if stat.S_ISREG(mode) else "not a regular file"


def open_regular(path: str):
    """Open path for reading (bytes) without blocking on a named pipe, and
    refuse anything that is not a regular file: OSError as open() raises
    it, or (what it is) as IsNotRegular."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        what = not_regular(os.fstat(fd).st_mode)
        if what:
            raise IsNotRegular(what)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


class IsNotRegular(Exception):
    pass


def silence_stdout():
    """After a failed write to stdout: point its fd at /dev/null, so that the
    interpreter's own flush at exit (of what is still buffered) cannot fail
    again and print a traceback of its own."""
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, sys.stdout.fileno())
    os.close(fd)


class WatchedStdout:
    """sys.stdout, noting the error of a write or flush that failed: so that
    the CLI tells a full disk behind stdout (one line, exit 5) from an
    OSError of anything else (a bug: its traceback is kept)."""

    def __init__(self, f):
        self._f = f
        self.error = None

    def write(self, s):
        try:
            return self._f.write(s)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        try:
            return self._f.flush()
        except OSError as e:
            self.error = e
            raise

    def write_bytes(self, data: bytes):
        """Bytes, after the text written so far (report's JSON: orjson makes
        bytes, and decoding 66 MB only to encode it again is waste); as
        text to a stream that only takes text (io.StringIO, in tests)."""
        binary = getattr(self._f, "buffer", None)
        if binary is None:
            return self.write(data.decode())
        self.flush()
        try:
            return binary.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name):
        return getattr(self._f, name)


class Outputs:
    """Writes several outputs, each on its own: one that fails is noted and
    the rest are still written.  finish() then raises one OutputError naming
    every failure, or returns 141 if only stdout's reader left (`| head`)."""

    def __init__(self):
        self.failed = []
        self.pipe_closed = False

    def write(self, what: str, fn, stdout: bool = False):
        try:
            fn()
            if stdout:
                sys.stdout.flush()  # a full disk shows here, not at exit
        except OutputError as e:
            self.failed.append(str(e))
        except OSError as e:
            if stdout:
                silence_stdout()
                if e.errno == errno.EPIPE:
                    self.pipe_closed = True
                    return
            self.failed.append(f"cannot write {what}: {e.strerror or e}")

    def fail(self, message: str):
        self.failed.append(message)

    def finish(self) -> int:
        if self.failed:
            raise OutputError("; ".join(self.failed))
        return 141 if self.pipe_closed else 0


def write_file(path: str, text: str):
    """Write text to a new 0600 file; a failed write is an OutputError."""
    f = open_private(path)
    try:
        with f:
            f.write(text)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None


@contextlib.contextmanager
def private_tmpdir(prefix: str):
    """A TMPDIR of one run's own (the test suite's, the bench's) for every
    process it starts, removed at the end: vLLM, killed as they kill it,
    leaves its ZMQ sockets (/tmp/UUID), file-store rendezvous files
    (/tmp/vllm_dist_*) and torch's compile cache behind, a hundred a test
    run.  Named PREFIX-PID-random: a run that was killed, not ended, never
    removed its own, and the next run with that prefix removes it."""
    saved = os.environ.get("TMPDIR")
    for old in glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}-*-*")):
        pid = os.path.basename(old)[len(prefix) + 1:].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}") and \
                os.stat(old).st_uid == os.geteuid():
            shutil.rmtree(old, ignore_errors=True)
    path = tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-")  # 0700
    os.environ["TMPDIR"] = tempfile.tempdir = path
    try:
        yield path
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved
        tempfile.tempdir = None
        shutil.rmtree(path, ignore_errors=True)
