"""`kvtrace-bpf doctor` on this machine and on real processes: kvsim, sleep,
a pid that does not exist, real vLLM, and as users without privileges.
Every check runs for real (its BPF trial load included); nothing is faked.
The last tests are unit tests of pure logic: the kernel-config parser on a
made-up config, and how check results map to exit codes."""

import json
import os
import re
import subprocess

import pytest

from conftest import NOBODY, NOBODY_UID, ROOT, Kvsim, kvtrace_cmd, run_as, semaphore_values, unused_pid
# the real-vLLM workload and its model, from their one home (a fixture too)
from test_e2e_vllm import Workload
from tracer.commands.doctor import FAIL, PASS, Check, config_state, exit_code, parse_kernel_config

EXIT_OK, EXIT_ENV, EXIT_TARGET = 0, 2, 3
ENVIRONMENT_CHECKS = ("architecture", "kernel config", "uprobe PMU", "BPF program load",
                      "BPF callbacks", "uprobe links", "privileges", "bcc privileges", "bcc",
                      "kernel headers", "program cache", "tracefs", "perf_event_paranoid")
LINE = re.compile(r"(PASS|WARN|FAIL|SKIP|INFO)  (\S+(?: \S+)*) {2,}(.*)")
NO_CAPS = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]


def doctor(*args, prefix=()):
    return subprocess.run([*prefix, *kvtrace_cmd("doctor", *args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def checks_of(r) -> dict:
    """{check name: (status, detail, fix)} from doctor's lines; every line
    of its output is a check, a fix, or the final verdict."""
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    checks, last = {}, None
    lines = r.stdout.splitlines()
    assert lines[-1].startswith("doctor: "), r.stdout
    for line in lines[:-1]:
        if line.lstrip().startswith("fix: "):
            assert last is not None and checks[last][2] == "", line
            checks[last] = (*checks[last][:2], line.split("fix: ", 1)[1])
            continue
        m = LINE.fullmatch(line)
        assert m, f"not a check line: {line!r}"
        last = m.group(2)
        checks[last] = (m.group(1), m.group(3), "")
    return checks


def test_doctor_as_root_passes(bpf_env):
    r = doctor()
    assert r.returncode == EXIT_OK, r.stdout + r.stderr
    assert r.stderr == ""
    checks = checks_of(r)
    assert set(ENVIRONMENT_CHECKS) <= set(checks), sorted(checks)
    assert "target" not in checks and "probe tier" not in checks  # no -p
    for name, (status, detail, _) in checks.items():
        assert status in ("PASS", "WARN", "INFO"), (name, status, detail)
    # root may load BPF: the trial load ran and succeeded, not skipped
    assert checks["BPF program load"][0] == "PASS"
    assert checks["BPF callbacks"][0] == "PASS"
    # a kernel from 6.6 on makes uprobe_multi links (the tracer's default)
    release = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    assert checks["uprobe links"][0] == ("PASS" if release >= (6, 6) else "WARN")
    assert checks["privileges"][0] == "PASS" and "euid 0" in checks["privileges"][1]
    # the config source named is the one this machine has
    config = checks["kernel config"]
    if os.path.exists("/proc/config.gz"):
        assert config[0] == "PASS" and "/proc/config.gz" in config[1], config
    elif os.path.exists(f"/boot/config-{os.uname().release}"):
        assert config[0] == "PASS" and f"/boot/config-{os.uname().release}" in config[1]
    else:
        assert config[0] == "WARN", config
    assert "uprobe PMU" in checks["tracefs"][1]  # says why tracefs is only informational
    with open("/proc/sys/kernel/perf_event_paranoid") as f:
        assert checks["perf_event_paranoid"][1].startswith(f"{int(f.read())}: ")


def test_doctor_json_agrees_with_text(bpf_env):
    text = checks_of(doctor())
    r = doctor("--json")
    assert r.returncode == EXIT_OK, r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == EXIT_OK
    assert {c["name"]: c["status"] for c in doc["checks"]} == \
        {name: status for name, (status, _, _) in text.items()}


def test_doctor_kvsim_is_plugin_usdt(tmp_path, bpf_env):
    """kvsim fires the plugin tier's probes beside the fork's op probes: the
    richest tier it offers is the plugin's."""
    sim = Kvsim(tmp_path, "default")  # paused until go()
    try:
        r = doctor("-p", sim.pid)
        assert r.returncode == EXIT_OK, r.stdout + r.stderr
        checks = checks_of(r)
        assert checks["target"][0] == "PASS" and f"pid {sim.pid} (kvsim)" in checks["target"][1]
        status, detail, _ = checks["probe tier"]
        assert status == "PASS" and detail.startswith("plugin USDT: "), detail
        assert f"pid {sim.pid} (kvsim)" in detail
        assert os.path.realpath(ROOT / "tests/target/libkvsim_ops.so") in detail
        # doctor only read the target: every probe is still off, and kvsim
        # runs to its end as if nothing had looked at it
        assert set(semaphore_values(sim.pid).values()) == {0}
        sim.go()
        assert sim.wait() == 0
    finally:
        sim.kill()


def test_doctor_sleep_has_no_tier(bpf_env):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        r = doctor("-p", sleeper.pid)
        assert r.returncode == EXIT_TARGET, r.stdout + r.stderr
        checks = checks_of(r)
        assert checks["target"][0] == "PASS"
        status, detail, fix = checks["probe tier"]
        assert status == FAIL and detail.startswith("none: "), detail
        assert f"pid {sleeper.pid} (sleep)" in detail and fix
        # the environment checks still pass: exit 3 is the target's alone
        assert all(s != FAIL for n, (s, _, _) in checks.items() if n != "probe tier")
        assert sleeper.poll() is None  # untouched
    finally:
        sleeper.kill()
        sleeper.wait()


def test_doctor_missing_pid(bpf_env):
    pid = unused_pid()
    r = doctor("-p", pid)
    assert r.returncode == EXIT_TARGET, r.stdout + r.stderr
    status, detail, fix = checks_of(r)["target"]
    assert status == FAIL and detail == f"no process with pid {pid}" and fix


def test_doctor_as_nobody_fails_privileges():
    r = run_as(NOBODY, "doctor")
    assert r.returncode == EXIT_ENV, r.stdout + r.stderr
    checks = checks_of(r)
    status, detail, fix = checks["privileges"]
    assert status == FAIL and "euid 65534" in detail and "CAP_BPF" in detail, detail
    assert "root" in fix
    assert checks["BPF program load"] == ("SKIP", "skipped: needs privileges (see below)", "")
    assert checks["BPF callbacks"] == ("SKIP", "skipped: needs privileges (see below)", "")
    assert checks["uprobe links"] == ("SKIP", "skipped: needs privileges (see below)", "")


@pytest.mark.parametrize("mode", [0o700, 0o755])
def test_doctor_as_nobody_says_roots_cache_is_as_it_should_be(tmp_path, monkeypatch, mode):
    """A cache directory of root's that only root may write (what attach,
    run as root, makes): a user other than root is told that it is root's
    and safe, not that others may write it, nor to chown and chmod it
    into the state it is in.  Root's own doctor uses it."""
    where = tmp_path / "cache"
    where.mkdir()
    where.chmod(mode)
    assert where.stat().st_uid == 0
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(where))
    status, detail, fix = checks_of(run_as(NOBODY, "doctor"))["program cache"]
    assert status == "INFO" and not fix, (status, detail, fix)
    assert f"{where}: root's (mode {mode:o}), as it should be" in detail, detail
    assert "euid 65534" in detail and "writable" not in detail, detail
    status, detail, fix = checks_of(doctor())["program cache"]
    assert status == PASS and detail.startswith(f"{where}: 0 compiled program(s)"), detail


@pytest.mark.parametrize("mode,owner,why", [
    (0o770, 0, "writable by others than its owner (mode 770)"),
    (0o700, NOBODY_UID, f"belongs to uid {NOBODY_UID}, not to this user (euid 0"),
])
def test_doctor_warns_of_an_unsafe_cache(tmp_path, monkeypatch, mode, owner, why):
    """A directory others may write, or another user's, is not used: root's
    doctor says which, with the fix."""
    where = tmp_path / "cache"
    where.mkdir()
    where.chmod(mode)
    os.chown(where, owner, owner)
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(where))
    status, detail, fix = checks_of(doctor())["program cache"]
    assert status == "WARN" and why in detail, detail
    assert fix.startswith(f"chown root {where} && chmod 700 {where}"), fix


def test_doctor_root_without_capabilities_fails_privileges(bpf_env):
    r = doctor(prefix=NO_CAPS)
    assert r.returncode == EXIT_ENV, r.stdout + r.stderr
    checks = checks_of(r)
    status, detail, fix = checks["privileges"]
    assert status == FAIL and "euid 0" in detail and "CAP_PERFMON" in detail, detail
    assert fix
    assert checks["BPF program load"][0] == "SKIP"
    assert checks["BPF callbacks"][0] == "SKIP"
    assert checks["uprobe links"][0] == "SKIP"


def doctor_vllm(tmp_path, model):
    """doctor -p on a vLLM whose engine is built and waits for SIGUSR1:
    its probe-tier check (status, detail) and the pid doctor was given."""
    wl = Workload(tmp_path, model)
    try:
        r = doctor("-p", wl.pid)
    finally:
        wl.kill()
    assert r.returncode == EXIT_OK, r.stdout + r.stderr
    status, detail, _ = checks_of(r)["probe tier"]
    return status, detail, wl.pid


@pytest.mark.vllm
def test_doctor_stock_vllm_is_stock_uprobe(tmp_path, tiny_model, monkeypatch):
    """The process the user started maps no vLLM library itself; doctor
    finds the worker among its descendants, as attach -p does.  vLLM's
    plugins off: the stock tier alone."""
    monkeypatch.setenv("VLLM_PLUGINS", "")  # the workload inherits it
    status, detail, pid = doctor_vllm(tmp_path, tiny_model)
    assert status == PASS and detail.startswith("stock uprobe: "), detail
    assert re.search(r"/vllm/_C(_\w+)?\.abi3\.so", detail), detail
    worker = re.search(r"pid (\d+) \(([^)]*)\), a descendant", detail)
    assert worker and int(worker.group(1)) != pid, detail
    assert re.search(r"vllm|worker|engine", worker.group(2), re.I), detail


# -- pure logic ------------------------------------------------------------------

def test_parse_kernel_config():
    config = parse_kernel_config(
        "#\n# Automatically generated file; DO NOT EDIT.\n#\n"
        "CONFIG_BPF=y\n"
        "CONFIG_BPF_SYSCALL=y\n"
        "CONFIG_UPROBES=m\n"
        "# CONFIG_UPROBE_EVENTS is not set\n"
        'CONFIG_LOCALVERSION="-test"\n'
        "CONFIG_NR_CPUS=64\n")
    assert config_state(config, "CONFIG_BPF") == "y"
    assert config_state(config, "CONFIG_UPROBES") == "m"
    assert config_state(config, "CONFIG_UPROBE_EVENTS") == "n"
    assert config_state(config, "CONFIG_BPF_EVENTS") == "missing"
    assert config["CONFIG_LOCALVERSION"] == '"-test"' and config["CONFIG_NR_CPUS"] == "64"


def test_exit_code_of_checks():
    ok, warn = Check("a", PASS, ""), Check("b", "WARN", "")
    env_fail, target_fail = Check("c", FAIL, ""), Check("d", FAIL, "", target=True)
    assert exit_code([ok, warn]) == EXIT_OK
    assert exit_code([ok, target_fail]) == EXIT_TARGET
    assert exit_code([env_fail, target_fail]) == EXIT_ENV
    assert exit_code([ok, env_fail]) == EXIT_ENV


def test_doctor_help():
    r = subprocess.run(kvtrace_cmd("doctor", "--help"), cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "examples:" in r.stdout and "doctor -p" in r.stdout


@pytest.mark.vllm
def test_doctor_stock_vllm_with_the_plugin(tmp_path, tiny_model, monkeypatch):
    """The plugin installed (make setup): both tiers, each where it lives:
    the plugin's probes in the engine core (the scheduler's process only),
    the stock sites in the worker."""
    monkeypatch.setenv("VLLM_PLUGINS", "kvtrace")
    status, detail, _ = doctor_vllm(tmp_path, tiny_model)
    assert status == PASS and detail.startswith("plugin USDT + stock uprobe: "), detail
    procs = dict(re.findall(r"pid \d+ \(([^)]*)\), a descendant: ([^;]*)", detail))
    assert len(procs) == 2, detail
    engine = [w for c, w in procs.items() if re.search(r"engine", c, re.I)]
    worker = [w for c, w in procs.items() if re.search(r"worker", c, re.I)]
    assert engine and "kvtrace_vllm/_probes" in engine[0] and "block_alloc" in engine[0], detail
    assert worker and re.search(r"/vllm/_C(_\w+)?\.abi3\.so", worker[0]), detail
