"""User-facing errors and the exit codes they map to (docs/exit-codes.md).

Every failure a user can cause or meet is one of these: the CLI prints its
message on one line and exits with its code.  Anything else is a bug and keeps
its traceback (always with --debug).
"""

EXIT_OK = 0
EXIT_USAGE = 1  # bad flags or arguments
EXIT_ENV = 2  # privileges, kernel support, bcc, headers, tracefs
EXIT_TARGET = 3  # no such process, no probes, target went away during attach
EXIT_DATA = 4  # unreadable or corrupt input files
EXIT_OUTPUT = 5  # an output could not be written once tracing or reading was done


class KvtraceError(Exception):
    exit_code = EXIT_USAGE


class UsageError(KvtraceError):
    exit_code = EXIT_USAGE


class EnvironmentProblem(KvtraceError):
    exit_code = EXIT_ENV


class TargetError(KvtraceError):
    exit_code = EXIT_TARGET


class DataError(KvtraceError):
    exit_code = EXIT_DATA


class OutputError(KvtraceError):
    """A write failed (disk full, I/O error) after the work was done: the
    message names every output lost; the others were written."""
    exit_code = EXIT_OUTPUT
