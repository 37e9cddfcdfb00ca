"""`kvtrace-bpf agent`, scraped by a real Prometheus server: engines that
come and go under one agent, each one's figures queried in PromQL and held
against the engine's own truth (kvsim's C bookkeeping; vLLM's identities),
never against the tracer's code (docs/agent.md).

The agent follows the whole node, and this machine may run other people's
vLLM and kvsim: every agent here is started with --include of the test's
own temporary directory, which only the command lines of the test's own
targets name."""

import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from conftest import (ROOT, Kvsim, kvtrace_cmd, listening_sockets, read_line,
                      semaphore_values, uprobe_events)

pytestmark = pytest.mark.usefixtures("no_leftovers")

PROMETHEUS = ROOT / "build" / "prometheus"
PROMTOOL = ROOT / "build" / "promtool"
# the agent's first start may compile its program (seconds, more on a busy
# 2-CPU machine); later starts load it from the cache
READY_S = 600


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """`kvtrace-bpf agent` in the background, limited to the test's targets."""

    def __init__(self, tmp_path, *args):
        self.port = free_port()
        self.state = tmp_path / "agent-state.json"
        self.proc = subprocess.Popen(
            kvtrace_cmd("agent", "--prometheus", f"127.0.0.1:{self.port}", "-i", "0.2",
                        "--include", str(tmp_path), "--state", self.state, *args),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err = ""
        self.wait_for("agent ready", READY_S)

    def wait_for(self, needle, timeout=60):
        try:
            self.err += "".join(read_line(self.proc.stderr, needle, timeout))
        except AssertionError as e:
            raise AssertionError(f"{e}\nagent's stderr so far:\n{self.err[-4000:]}") from None

    def traced(self, pid, timeout=60):
        self.wait_for(f"tracing pid {pid} ", timeout)

    def traced_all(self, pids, timeout=60):
        """Until the agent said it traces each of pids, in any order."""
        deadline = time.monotonic() + timeout
        while any(f"tracing pid {pid} " not in self.err for pid in pids):
            self.wait_for("tracing pid ", max(1, deadline - time.monotonic()))

    def stop(self, sig=signal.SIGTERM, timeout=120):
        self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=timeout)
        self.err += err
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def rss_kb(self):
        """The agent's own memory: RssAnon, its heap.  Not VmRSS, which also
        counts the pages of the BPF arrays it has mapped and touched (the
        kernel allocated them all with the maps: memlock_kb)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

    def memlock_kb(self):
        """The BPF maps' memory the agent holds: fdinfo's memlock of each
        map it has open (what the kernel charges for them), once per map
        id: a map is open through several fds (the program's, and one per
        mmap of it, which Python's mmap dups), each showing the whole
        map's memlock."""
        maps = {}
        for fd in os.listdir(f"/proc/{self.proc.pid}/fdinfo"):
            try:
                with open(f"/proc/{self.proc.pid}/fdinfo/{fd}") as f:
                    text = f.read()
            except OSError:
                continue
            if "map_type:" in text:
                info = dict(l.split(":", 1) for l in text.splitlines() if ":" in l)
                maps[int(info["map_id"])] = int(info["memlock"])
        return sum(maps.values()) // 1024


class Prometheus:
    """A real Prometheus server on 127.0.0.1, scraping the agent every
    200 ms, its data in a temporary directory (make setup unpacks the
    binary from the distribution's package: scripts/setup-promtool.sh)."""

    def __init__(self, tmp_path, target_port):
        assert PROMETHEUS.exists(), f"{PROMETHEUS} is missing: run make setup"
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 200ms\n  scrape_timeout: 200ms\n"
            "scrape_configs:\n  - job_name: kvtrace\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready",
                                            timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Prometheus not ready within 60 s"
            time.sleep(0.1)

    def query(self, expr) -> dict:
        """An instant query: {frozenset(labels): value}."""
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?" +
               urllib.parse.urlencode({"query": expr}))
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return {frozenset(x["metric"].items()): float(x["value"][1])
                for x in doc["data"]["result"]}

    def one(self, expr):
        got = self.query(expr)
        assert len(got) == 1, f"{expr}: {got}"
        return next(iter(got.values()))

    def scraped_after(self, t, timeout=60):
        """Wait until Prometheus holds a scrape of an agent snapshot taken
        after Unix time t: every count of what ended before t is in it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.query("kvtrace_snapshot_timestamp_seconds")
            if got and max(got.values()) > t:
                return
            time.sleep(0.1)
        raise AssertionError(f"no scrape of a snapshot after {t} within {timeout}s")

    def gone(self, expr, timeout=60):
        """Wait until expr has no series (a series the agent stopped serving
        is stale in Prometheus from the next scrape on)."""
        deadline = time.monotonic() + timeout
        while self.query(expr):
            assert time.monotonic() < deadline, f"{expr} still has series after {timeout}s"
            time.sleep(0.1)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def agent_and_prometheus(tmp_path, bpf_env):
    made = []

    def start(*args):
        agent = Agent(tmp_path, *args)
        made.append(agent)
        prom = Prometheus(tmp_path, agent.port)
        made.append(prom)
        return agent, prom

    yield start
    for x in reversed(made):
        x.kill() if isinstance(x, Agent) else x.close()


def assert_exact(prom, pid, truth):
    """kvsim's truth, summed per engine in PromQL from Prometheus's data."""
    sel = f'{{pid="{pid}"}}'
    # a hit the kernel skipped (another BPF program preempted on that CPU:
    # any tracer's, on a busy machine) is an op the counts lack, and says so
    assert prom.one("kvtrace_probe_misses_total") == 0
    assert prom.one(f"sum(kvtrace_slots_written_total{sel})") == truth["slots_written"]
    assert prom.one(f"sum(kvtrace_block_reads_total{sel})") == truth["reads"]["reads"]
    assert prom.one(f"sum(kvtrace_steps_total{sel})") == truth["reads"]["steps"]
    for op, want in truth["ops"].items():
        if want["calls"]:
            assert prom.one(f'sum(kvtrace_ops_total{{pid="{pid}",op="{op}"}})') == \
                want["calls"], op
    for want in truth["layers"]:
        assert prom.one(f'sum(kvtrace_layer_slots_written_total{{pid="{pid}",'
                        f'layer="{want["layer"]}"}})') == sum(want["writes"])


def test_kvsim_engines_come_and_go(tmp_path, agent_and_prometheus):
    """The agent first; then kvsims start at different times, one is
    SIGKILLed mid-run (between its rounds) and another starts after it.
    Each one's figures in Prometheus equal its truth from its first op; the
    killed one's series go after --grace; SIGTERM leaves nothing attached.

    Their ops run one engine at a time, though several are alive: on a
    machine with fewer CPUs than running engines, a uprobe hit on a CPU
    where another engine's hit is preempted inside the program is skipped
    by the kernel (kvtrace_probe_misses_total), and no count is exact."""
    # each engine is checked soon after its exit, within the grace
    agent, prom = agent_and_prometheus("--grace", "5")
    # Prometheus hands its scrape loops their targets some seconds after
    # it is ready (its discovery updates are batched): an engine that ran
    # before the first scrape, and was gone after the grace, would never
    # be seen.  (The other tests' first query waits for a scrape of a
    # target still there.)
    prom.scraped_after(0)

    def run_and_check(sim):
        agent.traced(sim.pid)
        sim.go()
        assert sim.wait() == 0
        prom.scraped_after(time.time())
        assert_exact(prom, sim.pid, sim.truth())

    run_and_check(Kvsim(tmp_path, "beam"))
    # b: one round of three, then it waits for the next: killed there
    b = Kvsim(tmp_path, "default", "--rounds", "3")
    agent.traced(b.pid)
    b.go()
    read_line(b.proc.stderr, "paused", 60)
    prom.scraped_after(time.time())
    assert_exact(prom, b.pid, b.truth())
    run_and_check(Kvsim(tmp_path, "swap"))  # b still alive
    b.kill()  # SIGKILL, mid-run
    agent.wait_for(f"pid {b.pid} exited")
    run_and_check(Kvsim(tmp_path, "prefix"))  # started after the kill
    # the killed one: its series, there while it ran, go after the grace
    prom.gone(f'kvtrace_ops_total{{pid="{b.pid}"}}')
    # the others exited too: after the grace, no engine's series is left
    prom.gone("kvtrace_ops_total")
    state = wait_state(agent, lambda st: st["states"]["exited"] == 0)
    assert state["maps"]["traced_pids"] == state["maps"]["caches"] == 0, state
    assert agent.stop() == 0
    assert "SIGTERM: detaching" in agent.err


def test_sigterm_and_sigkill_leave_targets_running_untouched(tmp_path, agent_and_prometheus):
    """Paused kvsims with the agent attached: their semaphores count it.
    SIGTERM, and (a second agent) SIGKILL: every semaphore back at 0, the
    kvsims still running, and then exact and KV-correct when they go."""
    sims = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        agent = Agent(tmp_path)
        try:
            sim = Kvsim(tmp_path, "default")
            sims.append(sim)
            agent.traced(sim.pid)
            assert all(v == 1 for v in semaphore_values(sim.pid).values()), \
                semaphore_values(sim.pid)
            agent.proc.send_signal(sig)
            agent.proc.wait(120)
            assert all(v == 0 for v in semaphore_values(sim.pid).values()), \
                semaphore_values(sim.pid)
            assert sim.proc.poll() is None
        finally:
            agent.kill()
    assert "kvsim" not in uprobe_events()
    for sim in sims:
        sim.go()
        assert sim.wait() == 0  # kvsim checks its KV bytes: exit 1 on a mismatch
        assert sim.truth()["kv_checksum_ok"]


def test_default_endpoint_binds_loopback_only(tmp_path, bpf_env):
    """Without an address the agent listens on 127.0.0.1 alone: the bound
    address, from the kernel's socket table (a scrape of 127.0.0.1 would
    also succeed on 0.0.0.0)."""
    port = free_port()
    proc = subprocess.Popen(kvtrace_cmd("agent", "--prometheus", str(port), "--include",
                                        str(tmp_path)),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        err = "".join(read_line(proc.stderr, "agent ready", READY_S))
        assert f"metrics on http://127.0.0.1:{port}/metrics" in err
        assert listening_sockets(proc.pid) == {("127.0.0.1", port)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_refused_engine_is_a_log_line_and_a_metric_then_traced(tmp_path,
                                                               agent_and_prometheus):
    """As many paused kvsims as --max-procs (its default: the program the
    other tests load, no compile of its own), and one more: that one is
    refused, one log line and kvtrace_targets{state="refused"}, and the
    agent goes on; once the first has gone, it is traced and exact.
    SIGHUP with a config file that excludes it detaches it."""
    from tracer.abi import DEFAULT_MAX_PROCS

    conf = tmp_path / "agent.conf"
    conf.write_text("grace 0\n")
    agent, prom = agent_and_prometheus("--config", conf)
    sims = []
    try:
        first = Kvsim(tmp_path, "default")
        sims.append(first)
        # the others stay paused: no op of theirs runs beside another's
        sims += [Kvsim(tmp_path, "default") for _ in range(DEFAULT_MAX_PROCS - 1)]
        agent.traced_all([sim.pid for sim in sims])
        second = Kvsim(tmp_path, "beam", "--rounds", "2")
        sims.append(second)
        agent.wait_for(f"pid {second.pid}")
        assert "at once" in agent.err.splitlines()[-1], agent.err
        wait_state(agent, lambda st: st["states"]["refused"] == 1)
        prom.scraped_after(time.time())
        assert prom.one('kvtrace_targets{state="refused"}') == 1
        assert prom.one('kvtrace_targets{state="traced"}') == DEFAULT_MAX_PROCS
        first.go()
        assert first.wait() == 0
        agent.traced(second.pid)  # its place came free
        second.go()
        read_line(second.proc.stderr, "paused", 60)  # round 1 done, truth written
        prom.scraped_after(time.time())
        assert prom.one('kvtrace_targets{state="refused"}') == 0
        assert_exact(prom, second.pid, second.truth())
        # a reload that leaves it out: detached, its semaphores back at 0
        conf.write_text(f"exclude {second.truth_path.name}\n")
        agent.proc.send_signal(signal.SIGHUP)
        agent.wait_for(f"pid {second.pid}: left out by --include/--exclude: detached")
        assert all(v == 0 for v in semaphore_values(second.pid).values())
        second.go()
        assert second.wait() == 0
        assert agent.stop() == 0
    finally:
        for sim in sims:
            sim.kill()


def cycle(agent, tmp_path, n):
    """n kvsims one after the other, each traced, run and gone."""
    for _ in range(n):
        sim = Kvsim(tmp_path, "default", "--layers", "2", "--blocks", "64")
        agent.traced(sim.pid)
        sim.go()
        assert sim.wait() == 0
        agent.wait_for(f"pid {sim.pid} exited")


def wait_state(agent, cond, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = json.loads(agent.state.read_text())
            if cond(state):
                return state
        except (OSError, ValueError):
            pass  # being rewritten
        assert time.monotonic() < deadline, agent.state.read_text()
        time.sleep(0.1)


def test_memory_bounded_over_50_starts_and_exits(tmp_path, agent_and_prometheus):
    """50 kvsims come and go: the agent's map entries, BPF map memory and
    RSS after 50 equal those after 5, and the 50th kvsim, on rows others
    used before, is still exact against its truth."""
    agent, prom = agent_and_prometheus("--grace", "0")

    def settled(state):
        return state["states"]["traced"] == 0 and state["states"]["exited"] == 0

    cycle(agent, tmp_path, 5)
    state5 = wait_state(agent, settled)
    after5 = state5["maps"]
    rss5, mem5 = agent.rss_kb(), agent.memlock_kb()
    cycle(agent, tmp_path, 44)
    # the 50th: held alive after its run (--rounds 2 waits for a second
    # SIGUSR1) so that its series stay to be queried
    last = Kvsim(tmp_path, "beam", "--rounds", "2")
    agent.traced(last.pid)
    last.go()
    read_line(last.proc.stderr, "paused", 60)  # its truth is written before
    prom.scraped_after(time.time())
    assert_exact(prom, last.pid, last.truth())
    last.kill()
    agent.wait_for(f"pid {last.pid} exited")
    state50 = wait_state(agent, settled)
    after50 = state50["maps"]
    rss50, mem50 = agent.rss_kb(), agent.memlock_kb()
    assert after50 == after5, (after5, after50)
    assert after50["traced_pids"] == after50["caches"] == after50["groups"] == 0
    assert mem50 == mem5
    blocks5, blocks50 = state5["python_blocks"], state50["python_blocks"]
    print(f"RssAnon after 5: {rss5} kB, after 50: {rss50} kB; memlock {mem5} kB; "
          f"Python's blocks {blocks5}, {blocks50}")
    # Python's objects: what 45 more engines left behind (each engine's
    # state is thousands of them: its sites, caches, labels, residency)
    assert blocks50 <= blocks5 * 1.01, (blocks5, blocks50)
    # the process's heap: glibc keeps the stacks of ended threads (each
    # scrape is served by one) and free pages in its arenas, up to a bound
    # (the agent allows two arenas), which a loaded machine reaches later:
    # +2 to +7 MiB measured here.  One engine's refresh copies alone (its
    # rows of block_writes, block_moves and block_life) are over 2.5 MiB,
    # so keeping one of them per engine would be 110 MiB over 45 engines
    assert rss50 <= rss5 + 16384, (rss5, rss50)


# -- real vLLM engines under one agent -------------------------------------------

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKLOAD = ROOT / "scripts" / "vllm-workload.py"
REQUESTS = "100:8,40:8,7:3,33:5"


def tree(root):
    """root and its descendants now."""
    kids = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


class Engine:
    """scripts/vllm-workload.py --wait: vLLM built, then waiting for SIGUSR1."""

    def __init__(self, tmp_path, model, name, plugin):
        self.out, self.log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
        # one model, two names: each engine's model_name label is its own
        self.model = tmp_path / name
        self.model.symlink_to(model)
        # the plugin, or (an explicit list naming no installed plugin) none
        env = dict(os.environ, VLLM_PLUGINS="kvtrace" if plugin else "none")
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(
                [str(VLLM_PYTHON), str(WORKLOAD), "--model", str(self.model),
                 "--requests", REQUESTS, "--prefix-caching", "off", "--out", str(self.out),
                 "--wait"], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                start_new_session=True)

    def ready(self, timeout=600):
        deadline = time.monotonic() + timeout
        while f"READY {self.proc.pid}" not in self.log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                self.log.read_text()[-3000:]
            time.sleep(0.5)

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def wait_traced(agent, engine, tiers, timeout=300):
    """Until the agent said it traces a process of the engine's tree with
    each of `tiers` ('stock uprobes', 'plugin USDT probes')."""
    import re

    deadline = time.monotonic() + timeout
    while True:
        pids = set(tree(engine.proc.pid))
        said = {m.group(2) for m in re.finditer(r"tracing pid (\d+) \(.*?\): \d+ (.+?) in ",
                                                agent.err) if int(m.group(1)) in pids}
        if set(tiers) <= said:
            return
        agent.wait_for("tracing pid", max(1, deadline - time.monotonic()))


@pytest.mark.vllm
def test_vllm_engines_under_one_agent(tmp_path, tiny_model, agent_and_prometheus):
    """The agent first; then two real vLLM CPU engines, one with the kvtrace
    plugin and one without, start at different times.  The agent finds
    each one's processes (the plugin's probes in the first's engine core,
    stock uprobes in both workers) without being told a pid, and each
    engine's slots written, summed in PromQL by its model_name, equal
    vLLM's identity: every layer writes prompt_len + generated - 1 tokens
    per request (prefix caching off).  The plugin engine's requests are
    vLLM's."""
    agent, prom = agent_and_prometheus("--grace", "30")
    engines = []
    try:
        engines.append(Engine(tmp_path, tiny_model, "with-plugin", plugin=True))
        engines[0].ready()
        engines.append(Engine(tmp_path, tiny_model, "stock", plugin=False))
        wait_traced(agent, engines[0], ["stock uprobes", "plugin USDT probes"])
        engines[1].ready()
        wait_traced(agent, engines[1], ["stock uprobes"])
        for e in engines:  # one at a time: no engine's hit is skipped for another's
            os.kill(e.proc.pid, signal.SIGUSR1)
            assert e.proc.wait(600) == 0, e.log.read_text()[-3000:]
            prom.scraped_after(time.time())
            generated = json.loads(e.out.read_text())
            tokens = sum(r["prompt_len"] + len(r["generated"]) - 1
                         for r in generated["requests"])
            sel = f'{{model_name="{e.model}"}}'
            assert prom.one(f"sum(kvtrace_slots_written_total{sel})") == \
                tokens * generated["num_layers"]
            assert prom.one("kvtrace_probe_misses_total") == 0
            # the plugin engine's scheduler took in every request; the
            # stock engine has no plugin, so no scheduler events
            requests = f'sum(kvtrace_requests_total{sel})'
            if e is engines[0]:
                assert prom.one(requests) == len(generated["requests"])
            else:
                assert not prom.query(requests)
    finally:
        for e in engines:
            e.kill()


def _scrape(port) -> dict:
    """The agent's /metrics, read directly: {sample name: [(labels, value)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _scrape_after(port, t, timeout=60) -> dict:
    """A scrape of a snapshot the agent took after Unix time t."""
    deadline = time.monotonic() + timeout
    while True:
        m = _scrape(port)
        if max((v for _, v in m.get("kvtrace_snapshot_timestamp_seconds", [])),
               default=0) > t:
            return m
        assert time.monotonic() < deadline, f"no snapshot after {t} within {timeout}s"
        time.sleep(0.1)


def _of(m, name, pid):
    return sum(v for labels, v in m.get(name, []) if labels.get("pid") == str(pid))


def test_derived_reads_of_a_plugin_tier_engine_then_none_after_it_goes(tmp_path, bpf_env):
    """A kvsim whose reads only step_rows carries (--no-block-table, as the
    plugin's scheduler fires no table without --verify-rows): the agent's
    /metrics has its reads, derived from its events, equal to kvsim's own
    count.  With --grace 0 it is forgotten as soon as it exits, while the
    events of its last second are still held back (LiveResidency.HOLD_S):
    they must not bring its series back once they come in."""
    from tracer.analysis.lifecycle import LiveResidency

    hold = LiveResidency.HOLD_S
    agent = Agent(tmp_path, "--grace", "0")
    sim = None
    try:
        sim = Kvsim(tmp_path, "prefix", "--no-block-table", "--rounds", "2")
        agent.traced(sim.pid)
        sim.go()
        read_line(sim.proc.stderr, "paused", 60)  # round 1 done, its truth written
        truth = sim.truth()["reads"]
        # its events are taken in once HOLD_S old: until then, fewer reads
        deadline = time.monotonic() + 60
        while True:
            m = _scrape_after(agent.port, time.time())
            got = {k: _of(m, f"kvtrace_{k}_total", sim.pid) for k in ("block_reads", "steps")}
            if got == {"block_reads": truth["reads"], "steps": truth["steps"]}:
                break
            assert time.monotonic() < deadline, (got, truth)
        assert truth["reads"] > 0
        # round 2, and its exit right after its last step
        sim.go()
        assert sim.wait() == 0
        agent.wait_for(f"pid {sim.pid} exited")  # and forgotten: --grace 0
        gone = time.time()
        assert _of(_scrape_after(agent.port, gone), "kvtrace_ops_total", sim.pid) == 0
        # every event it sent has come in by then, swept as it came
        m = _scrape_after(agent.port, gone + 2 * hold + 1)
        assert [labels for labels, _ in m.get("kvtrace_block_reads_total", [])
                if labels.get("pid") == str(sim.pid)] == []
        assert _of(m, "kvtrace_ops_total", sim.pid) == 0
        assert agent.stop() == 0
    finally:
        agent.kill()
        if sim is not None:
            sim.kill()


@pytest.mark.parametrize("workload,max_blocks", [("prefix", None), ("swap", 1024),
                                                 ("window", 1024), ("prefix", 256)])
def test_refresh_copies_lifecycle_rows_to_their_last_counted_block(tmp_path, bpf_env,
                                                                   workload, max_blocks):
    """The agent's refresh (read_maps(used_only=True)) copies each process's
    lifecycle rows up to their last counted block, found from the 64th of
    the block range the kernel marks, not by scanning the whole rows: the
    length is the one kvsim's own lifecycle counts give, and the rows are
    kvsim's counts (several 64ths in use where --max-blocks is small)."""
    from tracer import abi
    from tracer.kernel.session import Tracer
    from tracer.probes import discover

    sim = Kvsim(tmp_path, workload)
    tracer = Tracer(**({"max_blocks": max_blocks} if max_blocks else {}))
    try:
        tracer.attach(sim.pid, discover.process_probe_files(sim.pid))
        sim.go()
        assert sim.wait() == 0
        raw = tracer.read_maps(used_only=True)
        marks = tracer.life_pages[tracer.procs[sim.pid].index].tolist()
    finally:
        tracer.close()
        sim.kill()
    life = sim.truth()["lifecycle"]["blocks"]
    limit = max_blocks or tracer.max_blocks
    counted = {kind: [(b, n) for b, n in pairs if b < limit] for kind, pairs in life.items()}
    last = max(b for pairs in counted.values() for b, _ in pairs)
    rows = raw["life"][sim.pid]
    assert rows.shape[1] == last + 1 > 1
    for i, kind in enumerate(abi.LIFE):
        want = [0] * (last + 1)
        for b, n in counted[kind]:
            want[b] = n
        assert rows[i].tolist() == want, kind
    # the kernel's marks: the 64ths of the range holding a counted block
    page = max(1, limit // 64)
    want = {b // page for pairs in counted.values() for b, n in pairs if b and n}
    assert {k for k in range(64) if marks[k]} == want
