"""`kvtrace-bpf doctor`: can this machine trace, and (with -p) this process?

One line per check: PASS, FAIL (with a fix on the next line), WARN (for what
is optional), SKIP (a check that could not run, and why) or INFO.  The checks
read files under /proc and /sys, import bcc, and make one trial load of a
2-instruction BPF program through the bpf() syscall; nothing is compiled (a
bcc compile takes seconds) and the target process is only read, as `probes
-p` reads it.  Where the tracer itself checks something (privileges, kernel
headers, bcc, the uprobe PMU, a process's probe files), doctor calls the
same function, so the two cannot disagree.  docs/doctor.md says why.
"""

import argparse
import ctypes
import errno
import gzip
import json
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass

from .. import __version__, abi, cache
from ..errors import EXIT_ENV, EXIT_OK, EXIT_TARGET, EnvironmentProblem, TargetError
from ..kernel import bpf, program, session, uprobes
from ..probes import catalog, discover, follow
from ..probes import target as target_mod
from .args import positive_int

EXAMPLES = """\
examples:
  sudo kvtrace-bpf doctor                    # can this machine trace?
  sudo kvtrace-bpf doctor -p $(pgrep -of 'vllm serve|vllm.entrypoints')   # ... and this vLLM's probes
  sudo kvtrace-bpf doctor -p 1234 --json     # the same, for scripts

exit codes: 0 every check passed (WARN is fine), 2 an environment check
failed, 3 only the -p target check failed (no such process, or no probes)
"""

PASS, WARN, FAIL, SKIP, INFO = "PASS", "WARN", "FAIL", "SKIP", "INFO"

# What the tracer cannot work without: the bpf() syscall, BPF programs on
# probe events, uprobes, and the uprobe PMU (perf_event_open's "uprobe" type)
REQUIRED_CONFIG = ("CONFIG_BPF", "CONFIG_BPF_SYSCALL", "CONFIG_BPF_EVENTS",
                   "CONFIG_UPROBES", "CONFIG_UPROBE_EVENTS")
TRACEFS_DIRS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
# the probe tiers, as TracedProcess.tier names them, in the user's words
TIER_NAMES = {"plugin": "plugin USDT", "usdt": "fork USDT", "uprobe": "stock uprobe",
              "none": "none"}


@dataclass
class Check:
    name: str  # what was checked: a short, stable label
    status: str  # PASS WARN FAIL SKIP INFO
    detail: str
    fix: str = ""  # one line, for FAIL (and WARN where there is one)
    target: bool = False  # a -p check: its failure is EXIT_TARGET, not EXIT_ENV


def add_parser(sub):
    p = sub.add_parser(
        "doctor", help="check that this machine (and a process) can be traced",
        description="Check the kernel, privileges, bcc, kernel headers, tracefs and "
                    "perf_event_paranoid; with -p, whether a process (or one of its "
                    "descendants) offers probe sites and of which tier. Compiles "
                    "nothing; takes about a second.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    # a pid <= 0 is a usage error (exit 1), as in attach, record and probes
    p.add_argument("-p", "--pid", type=positive_int,
                   help="also check this process and its descendants (vLLM's workers)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(run=run)
    return p


# -- kernel config -------------------------------------------------------------

def parse_kernel_config(text: str) -> dict:
    """{option: value} of a kernel .config: 'y', 'm', a string or number, or
    'n' for '# CONFIG_X is not set'.  Options the text lacks are absent."""
    config = {}
    for line in text.splitlines():
        line = line.strip()
        m = re.fullmatch(r"(CONFIG_\w+)=(.*)", line)
        if m:
            config[m.group(1)] = m.group(2)
            continue
        m = re.fullmatch(r"# (CONFIG_\w+) is not set", line)
        if m:
            config[m.group(1)] = "n"
    return config


def config_state(config: dict, option: str) -> str:
    """'y', 'm', 'n' (not set) or 'missing' (not in this kernel's config)."""
    return config.get(option, "missing")


def read_kernel_config():
    """(the config file's path, its text); (None, None) if there is none.
    /proc/config.gz (CONFIG_IKCONFIG_PROC) first, then the distribution's
    /boot/config-RELEASE."""
    for path in ("/proc/config.gz", f"/boot/config-{os.uname().release}"):
        if not os.path.exists(path):
            continue
        if path.endswith(".gz"):
            with gzip.open(path, "rt", errors="replace") as f:
                return path, f.read()
        with open(path, errors="replace") as f:
            return path, f.read()
    return None, None


def check_kernel_config() -> list:
    try:
        path, text = read_kernel_config()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        return [Check("kernel config", WARN, f"unreadable ({e}); the trials below decide")]
    if path is None:
        return [Check("kernel config", WARN,
                      f"neither /proc/config.gz nor /boot/config-{os.uname().release} "
                      "exists; the trials below decide",
                      fix="modprobe configs (for /proc/config.gz), or install the "
                          "kernel's config under /boot")]
    config = parse_kernel_config(text)
    states = {opt: config_state(config, opt) for opt in REQUIRED_CONFIG}
    shown = " ".join(f"{opt}={state}" for opt, state in states.items())
    off = [opt for opt, state in states.items() if state not in ("y", "m")]
    checks = [Check("kernel config", FAIL if off else PASS, f"{shown} (from {path})",
                    fix=f"a kernel built with {', '.join(o + '=y' for o in off)}" if off else "")]
    btf = config_state(config, "CONFIG_DEBUG_INFO_BTF")
    checks.append(Check("kernel BTF", INFO,
                        f"CONFIG_DEBUG_INFO_BTF={btf} (not needed: bcc compiles against "
                        "the kernel headers)"))
    return checks


# -- kernel support, by trying -------------------------------------------------

def check_uprobe_pmu() -> Check:
    try:
        pmu = uprobes.pmu_type()
        shift = uprobes._pmu_format_shift("ref_ctr_offset")
    except EnvironmentProblem as e:
        return Check("uprobe PMU", FAIL, str(e),
                     fix="a kernel >= 4.20 built with CONFIG_UPROBE_EVENTS=y")
    return Check("uprobe PMU", PASS,
                 f"perf event type {pmu}, ref_ctr_offset at config bit {shift} "
                 "(the kernel owns the USDT semaphores)")


def _kernel_version() -> tuple:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", os.uname().release)
    return tuple(int(x or 0) for x in m.groups()) if m else (0, 0, 0)


def load_trivial_program() -> int:
    """Load `mov r0, 0; exit` as a kprobe program, the type the tracer's
    programs are (it needs what tracing needs, CAP_BPF + CAP_PERFMON, where a
    socket filter may load without them), and close it: 0, or the errno the
    kernel answered."""
    major, minor, patch = _kernel_version()
    # checked against the running kernel's version before 5.0
    fd = bpf.trivial_program(0, b"kvtrace_doctor",
                                 (major << 16) | (minor << 8) | min(patch, 255))
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


def check_bpf_load(privileged: bool) -> Check:
    name = "BPF program load"
    if not privileged:
        return Check(name, SKIP, "skipped: needs privileges (see below)")
    err = load_trivial_program()
    if err == 0:
        return Check(name, PASS, "a 2-instruction kprobe program loaded and closed")
    fix = {
        errno.ENOSYS: "a kernel built with CONFIG_BPF_SYSCALL=y",
        errno.EPERM: "check kernel lockdown (/sys/kernel/security/lockdown), seccomp "
                     "(containers), and on kernels < 5.11 `ulimit -l unlimited`",
        errno.EINVAL: "a kernel built with CONFIG_BPF_EVENTS=y",
    }.get(err, "see dmesg")
    return Check(name, FAIL, f"the kernel refused a 2-instruction kprobe program: "
                             f"{os.strerror(err)}", fix=fix)


def check_bpf_callbacks(privileged: bool) -> Check:
    name = "BPF callbacks"
    if not privileged:
        return Check(name, SKIP, "skipped: needs privileges (see below)")
    err = program.trial_callback_load()
    if err == 0:
        return Check(name, PASS, "a program passing a callback to bpf_loop() loaded and closed")
    return Check(name, FAIL, f"the kernel refused a program with a bpf_loop() callback: "
                             f"{os.strerror(err)}",
                 fix="Linux >= 5.17 with the BPF JIT on: the table stage counts block "
                     "tables in a bpf_loop() callback (docs/design.md)")


def check_uprobe_links(privileged: bool) -> Check:
    name = "uprobe links"
    if not privileged:
        return Check(name, SKIP, "skipped: needs privileges (see below)")
    kind = program.attach_type()
    ok, why = uprobes.trial_link(kind)
    if ok:
        return Check(name, PASS, "a uprobe_multi link opened and closed: one link per "
                                 "traced file, no perf event per probe")
    if kind == uprobes.BPF_TRACE_UPROBE_MULTI:
        # the session loads its programs for links here, and such a program
        # goes on no perf event (program.attach_type()): attach would stop
        return Check(name, WARN, f"the kernel loads programs for uprobe_multi links but "
                                 f"made none ({why}): attach stops at its first probe",
                     fix="KVTRACE_PERF_UPROBES=1 attaches one perf event per probe "
                         "(docs/design.md, \"One link per file\")")
    return Check(name, WARN, f"no uprobe_multi link ({why}): one perf event per probe, "
                             "which costs the target at every context switch",
                 fix="Linux >= 6.6 (docs/design.md, \"One link per file\")")


# -- privileges, bcc, headers ----------------------------------------------------

def check_privileges(caps: set) -> list:
    missing = session.missing_privileges(caps)
    who = f"euid {os.geteuid()}"
    if missing:
        checks = [Check("privileges", FAIL,
                        f"{who} lacks {' and '.join(missing)} (tracing needs CAP_BPF and "
                        "CAP_PERFMON, or CAP_SYS_ADMIN)",
                        fix="run it as root (sudo), or with CAP_BPF and CAP_PERFMON in "
                            "its effective capabilities")]
    else:
        have = ", ".join(n for n in session.CAPABILITIES if n in caps)
        checks = [Check("privileges", PASS, f"{who}, effective {have}")]
    # what bcc needs besides: before 5.8 there is no CAP_BPF (CAP_SYS_ADMIN
    # does everything), and before 5.11 BPF memory counts against
    # RLIMIT_MEMLOCK, which bcc raises (CAP_SYS_RESOURCE)
    version = _kernel_version()[:2]
    needed = [cap for cap, before in (("CAP_SYS_ADMIN", (5, 8)), ("CAP_SYS_RESOURCE", (5, 11)))
              if version < before]
    lacking = [cap for cap in needed if cap not in caps]
    kernel = f"kernel {version[0]}.{version[1]}"
    text = ("bcc also needs CAP_SYS_ADMIN on kernels < 5.8 and CAP_SYS_RESOURCE "
            "(RLIMIT_MEMLOCK) on kernels < 5.11: ")
    if lacking:
        checks.append(Check("bcc privileges", WARN,
                            text + f"{kernel} needs {', '.join(needed)}; this process lacks "
                            f"{', '.join(lacking)}",
                            fix="run it as root, with every capability"))
    else:
        checks.append(Check("bcc privileges", INFO,
                            text + (f"{kernel} needs {', '.join(needed)}, which this process has"
                                    if needed else f"{kernel} needs neither")))
    return checks


def check_bcc() -> Check:
    try:
        bcc = session._import_bcc()
    except EnvironmentProblem as e:
        return Check("bcc", FAIL, str(e),
                     fix="apt install python3-bpfcc, in a venv made with "
                         "--system-site-packages (`make setup` does both)")
    version = getattr(bcc, "__version__", "of unknown version")
    return Check("bcc", PASS, f"bcc {version} ({os.path.dirname(bcc.__file__)}), "
                              f"python {platform.python_version()}")


def check_kernel_headers() -> Check:
    try:
        where = session.check_kernel_headers()
    except EnvironmentProblem as e:
        return Check("kernel headers", FAIL, str(e),
                     fix=f"`make setup`, or apt install linux-headers-{os.uname().release}")
    return Check("kernel headers", PASS, f"{where} (what bcc compiles against)")


def check_program_cache() -> Check:
    """Whether the next attach loads the compiled program or compiles it.
    Only read: a missing directory is not created here."""
    path = cache.configured()
    if path is None:
        return Check("program cache", INFO, "off (KVTRACE_CACHE_DIR): every attach "
                     "compiles the BPF program (seconds)")
    if not os.path.isdir(path):
        return Check("program cache", INFO, f"{path} does not exist yet: the first attach "
                     "compiles the BPF program (seconds) and caches it there")
    euid = os.geteuid()
    try:
        st = os.stat(path)
    except OSError as e:
        return Check("program cache", WARN, f"{path}: {e.strerror}: every attach compiles "
                     "the BPF program (seconds)", fix=f"KVTRACE_CACHE_DIR, or remove {path}")
    if euid != 0 and st.st_uid == 0 and not cache.unsafe(st, euid=0):
        # as it should be: attach runs as root (sudo), and root's cache is
        # for root alone; this user could not use it, and need not
        return Check("program cache", INFO, f"{path}: root's (mode "
                     f"{st.st_mode & 0o777:o}), as it should be: an attach as root (sudo) "
                     "loads the compiled program from it. An attach as this user (euid "
                     f"{euid}) would not use it, and compile (seconds)")
    where, why = cache.directory()
    if where is None:
        return Check("program cache", WARN, f"not used ({why}): every attach compiles "
                     "the BPF program (seconds)",
                     fix=f"chown root {path} && chmod 700 {path}, or KVTRACE_CACHE_DIR")
    n = len(list(where.glob("bpf-*.json")))
    return Check("program cache", PASS, f"{where}: {n} compiled program(s); an attach "
                 "whose options match one loads it without compiling")


# -- tracefs, perf_event_paranoid --------------------------------------------------

def check_tracefs() -> Check:
    with open("/proc/self/mounts") as f:
        mounted = {fields[1] for fields in (line.split() for line in f)
                   if len(fields) > 2 and fields[2] == "tracefs"}
    # debugfs mounts tracefs under itself on its own
    found = [d for d in TRACEFS_DIRS if d in mounted or os.path.exists(f"{d}/uprobe_events")]
    # tracefs is where uprobes someone left registered show (uprobe_events)
    why = ("informational: the tracer attaches through uprobe_multi links or the uprobe PMU, not "
           "tracefs text entries")
    if found:
        return Check("tracefs", PASS, f"mounted at {found[0]} ({why})")
    return Check("tracefs", WARN, f"not mounted at {' or '.join(TRACEFS_DIRS)} ({why})",
                 fix="mount -t tracefs nodev /sys/kernel/tracing (scripts/setup-tracefs.sh)")


# what each perf_event_paranoid level denies to users without CAP_PERFMON
# (Documentation/admin-guide/sysctl/kernel.rst; 3 and up: Debian's patch)
_PARANOID = {
    -1: "no restriction for unprivileged users",
    0: "unprivileged users may not use raw tracepoints",
    1: "unprivileged users may not use raw tracepoints or CPU-wide events",
    2: "unprivileged users may only profile their own processes in user space",
}


def check_perf_event_paranoid() -> Check:
    try:
        with open("/proc/sys/kernel/perf_event_paranoid") as f:
            value = int(f.read())
    except FileNotFoundError:
        return Check("perf_event_paranoid", WARN,
                     "/proc/sys/kernel/perf_event_paranoid is missing: a kernel without "
                     "perf events (CONFIG_PERF_EVENTS) cannot open uprobes",
                     fix="a kernel built with CONFIG_PERF_EVENTS=y")
    if value >= 3:
        meaning = "unprivileged users may not use perf_event_open at all"
    else:
        meaning = _PARANOID[max(value, -1)]
    return Check("perf_event_paranoid", PASS,
                 f"{value}: {meaning}; root and CAP_PERFMON are unaffected (the tracer "
                 "needs CAP_PERFMON anyway: the uprobe PMU refuses anyone else)")


# -- the target (-p) ----------------------------------------------------------------

_GIVE_A_PID = "give the pid of vLLM (the process you started, or a worker) or of kvsim"


def _proc(pid: int) -> str:
    return f"pid {pid} ({discover.comm(pid)})"


def check_target(pid: int) -> list:
    """The process, its descendants, and which probe tier serves them."""
    try:
        target_mod.check_pid(pid)
    except TargetError as e:
        return [Check("target", FAIL, str(e), fix=_GIVE_A_PID)]
    try:
        discover.read_maps(pid)
    except TargetError as e:  # another user's process, or it just exited
        if not os.path.exists(f"/proc/{pid}"):
            fix = _GIVE_A_PID
        elif os.geteuid() == 0:  # root and still refused: a ptrace access check said no
            fix = ("it is out of this root's reach (another user namespace, or Yama/an LSM "
                   "restricting ptrace access): run doctor and the tracer where it runs")
        else:
            fix = "run it as root"
        return [Check("target", FAIL, str(e), fix=fix)]
    # the tracer's own scan of the tree (calls_only: no tensor-layout discovery)
    follower = follow.Follower(pid, calls_only=True)
    try:
        found = follower.scan()
    finally:
        follower.close()
    tree = [pid, *follower.parent_of]
    checks = [Check("target", PASS, f"{_proc(pid)} and {len(tree) - 1} descendant(s)")]
    tiers = {p: session.TracedProcess(p, 0, discover.comm(p), probe_files=files).tier
             for p, files in found.items()}
    checks += _plugin_checks(follower.plugin_status)
    if not found:
        checks.append(_no_probes(pid, tree))
        return checks
    # every tier the tree offers, the richest first (docs/tiers.md): with the
    # plugin, its scheduler probes in the engine core and the op sites in
    # the worker
    present = [t for t in ("plugin", "usdt", "uprobe") if t in tiers.values()] or ["uprobe"]
    where = [f"{_proc(p)}{', a descendant' if p != pid else ''}: "
             + describe_probes(files, tiers[p] == "uprobe") for p, files in found.items()]
    checks.append(Check("probe tier", PASS, " + ".join(TIER_NAMES[t] for t in present)
                        + f": {'; '.join(where)}"))
    return checks


def _plugin_checks(statuses: dict) -> list:
    """The kvtrace vLLM plugin's install outcome where the tree runs it
    (docs/plugin.md, "What the tracer is told"), one line a process: a
    tested release passes; an untested one is traced and labelled; a
    refused one says what vLLM lacks."""
    checks = []
    for pid, line in sorted(statuses.items()):
        if line.startswith("tested ") and "; not exact here: " not in line:
            checks.append(Check("vLLM plugin", PASS, f"{_proc(pid)}: {line}"))
        elif line.startswith("tested "):
            checks.append(Check("vLLM plugin", WARN, f"{_proc(pid)}: {line}",
                                fix="docs/tiers.md, \"Blind spots\": what it does not report"))
        elif line.startswith("untested "):
            checks.append(Check("vLLM plugin", WARN,
                                f"{_proc(pid)}: {line}: traced, its figures labelled so",
                                fix="docs/tiers.md lists the tested releases"))
        else:
            checks.append(Check("vLLM plugin", WARN,
                                f"{_proc(pid)}: {line}: no plugin tier",
                                fix="docs/plugin.md, \"Versions\": what the plugin needs "
                                    "of vLLM"))
    return checks


def describe_probes(files: dict, stock: bool) -> str:
    """{path: [Probe]} in words: how many sites in each file, and which ops
    they are, so that an op missing from the list reads as "not on this
    build" before anyone wonders why its count stays 0."""
    what = "stock cache op(s)" if stock else f"{abi.PROVIDER}:* probe(s)"
    return ", ".join(
        f"{len(probes)} {what} in {path} ({', '.join(sorted({p.name for p in probes}))})"
        for path, probes in files.items())


def _vllm_libraries(tree: list) -> dict:
    """{pid: [vLLM extension libraries it maps]} in the tree."""
    libs = {}
    for p in tree:
        try:
            paths = {m.path for m in discover.read_maps(p)}
        except TargetError:
            continue  # gone meanwhile, or not ours to read
        mine = sorted(path for path in paths if catalog.is_vllm_library(path))
        if mine:
            libs[p] = mine
    return libs


def _no_probes(pid: int, tree: list) -> Check:
    """Why no process of the tree has probes, and what to do about it."""
    libs = _vllm_libraries(tree)
    if libs:
        why = ("; ".join(f"{_proc(p)} maps {', '.join(paths)}" for p, paths in libs.items())
               + f", but with none of the cache ops tracer/catalog.py knows and no "
                 f"{abi.PROVIDER}:* probes (another vLLM version?)")
        fix = "use the vLLM fork with the vllm:* probes (docs/fork.md), or add a catalog entry"
    else:
        why = (f"{_proc(pid)} and its {len(tree) - 1} descendant(s) map neither vLLM's "
               f"library nor a file with {abi.PROVIDER}:* probes")
        fix = _GIVE_A_PID
        if "vllm" in follow.cmdline(pid).lower():
            why += " (it looks like vLLM: its workers may not have loaded the model yet)"
            fix = f"run `kvtrace-bpf doctor -p {pid}` again once vLLM has loaded the model"
    return Check("probe tier", FAIL, "none: " + why, fix=fix)


# -- running the checks ---------------------------------------------------------------

def _guarded(name: str, fn, *args, debug: bool = False) -> list:
    """A check's lines.  What the environment can throw at a check (an
    unreadable /proc or /sys file, a garbled value) is that check's failure,
    not a traceback."""
    try:
        result = fn(*args)
    except (OSError, ValueError) as e:
        if debug:
            raise
        return [Check(name, FAIL, f"could not check: {e}")]
    return result if isinstance(result, list) else [result]


def run_checks(pid=None, debug: bool = False) -> list:
    caps = session.effective_capabilities()
    privileged = not session.missing_privileges(caps)
    checks = []
    for name, fn, *args in (
            ("architecture", _check_arch),
            ("kernel config", check_kernel_config),
            ("uprobe PMU", check_uprobe_pmu),
            ("BPF program load", check_bpf_load, privileged),
            ("BPF callbacks", check_bpf_callbacks, privileged),
            ("uprobe links", check_uprobe_links, privileged),
            ("privileges", check_privileges, caps),
            ("bcc", check_bcc),
            ("kernel headers", check_kernel_headers),
            ("program cache", check_program_cache),
            ("tracefs", check_tracefs),
            ("perf_event_paranoid", check_perf_event_paranoid)):
        checks += _guarded(name, fn, *args, debug=debug)
    if pid is not None:
        for check in _guarded("target", check_target, pid, debug=debug):
            check.target = True
            checks.append(check)
    return checks


def _check_arch() -> Check:
    try:
        discover.check_arch()
    except EnvironmentProblem as e:
        return Check("architecture", FAIL, str(e), fix="an x86_64 machine")
    return Check("architecture", PASS, f"{platform.machine()}, Linux {os.uname().release}")


def exit_code(checks: list) -> int:
    failed = [c for c in checks if c.status == FAIL]
    if any(not c.target for c in failed):
        return EXIT_ENV
    return EXIT_TARGET if failed else EXIT_OK


def run(args) -> int:
    checks = run_checks(args.pid, debug=args.debug)
    code = exit_code(checks)
    if args.json:
        json.dump({"version": __version__, "checks": [asdict(c) for c in checks],
                   "exit_code": code}, sys.stdout, indent=1)
        print()
        return code
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.status}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in (FAIL, WARN):
            print(f"{'':4}  {'':<{width}}  fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, SKIP)}
    verdict = {EXIT_OK: "ready to trace", EXIT_ENV: "this machine cannot trace yet",
               EXIT_TARGET: "this machine can trace, but not that process"}[code]
    print(f"doctor: {verdict} ({', '.join(f'{n} {s}' for s, n in counts.items() if n)})")
    return code
