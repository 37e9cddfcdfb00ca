#!/usr/bin/env bash
# Mount tracefs if it is missing.  kvtrace-bpf itself never writes there (it
# attaches through perf_event_open), but bcc and the tests read it, and it is
# where a leftover uprobe would show (uprobe_events).
set -euo pipefail
if mountpoint -q /sys/kernel/tracing; then
    echo "setup: tracefs mounted"
else
    mount -t tracefs nodev /sys/kernel/tracing
    echo "setup: mounted tracefs at /sys/kernel/tracing"
fi
