"""deploy/: each file parses as what it is, and the agent's command lines
in them are ones the agent accepts (docs/agent.md)."""

import configparser
import shlex
import shutil
import subprocess

import yaml

from conftest import ROOT

DEPLOY = ROOT / "deploy"
PROMTOOL = ROOT / "build" / "promtool"


def agent_args(argv):
    """argv (after the program) parsed by the agent's own parser, and its
    settings (--config's file read) checked as the agent checks them."""
    from tracer.cli import build_parser
    from tracer.commands import agent

    args = build_parser("agent").parse_args(["agent", *argv])
    args.prometheus_at = agent.prometheus.parse_endpoint(args.prometheus)
    return args


def test_prometheus_scrape_config_passes_promtool():
    assert PROMTOOL.exists(), f"{PROMTOOL} is missing: run make setup"
    r = subprocess.run([str(PROMTOOL), "check", "config", str(DEPLOY / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = [t for job in doc["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]]
    assert "127.0.0.1:9472" in targets  # the agent's default endpoint


def test_systemd_unit(tmp_path):
    text = (DEPLOY / "kvtrace-bpf-agent.service").read_text()
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(text)
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"].replace("\\\n", " "))
    assert argv[0].endswith("/kvtrace-bpf") and argv[1] == "agent"
    args = agent_args(argv[2:])
    assert args.prometheus_at == ("127.0.0.1", 9472)
    assert service["ExecReload"].endswith("-HUP $MAINPID")
    # the config file it names parses as the agent reads it
    from tracer.commands import agent

    args.config = str(DEPLOY / "agent.conf")
    selection, grace = agent._settings(args)
    assert grace == 60
    # systemd's own check, with ExecStart pointing at this checkout's tracer
    if shutil.which("systemd-analyze"):
        exe = ROOT / ".venv" / "bin" / "kvtrace-bpf"
        assert exe.exists(), f"{exe} is missing: run make setup"
        local = tmp_path / "kvtrace-bpf-agent.service"
        local.write_text(text.replace(argv[0], str(exe)))
        r = subprocess.run(["systemd-analyze", "verify", str(local)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "kvtrace-bpf-agent" not in r.stderr, r.stderr


def kinds(path):
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}


def test_daemonset_is_privileged_with_host_pid_and_the_mounts():
    ds = kinds(DEPLOY / "daemonset.yaml")["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    (c,) = pod["containers"]
    assert c["securityContext"]["privileged"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/sys/fs/bpf", "/sys/kernel/tracing", "/sys/kernel/debug", "/lib/modules"} <= mounts
    vols = {v["name"]: v for v in pod["volumes"]}
    for m in c["volumeMounts"]:
        assert m["name"] in vols
    assert c["command"][-1] == "agent"
    args = agent_args(c["args"])
    port = args.prometheus_at[1]
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= \
        ds["spec"]["template"]["metadata"]["labels"].items()


def test_pod_and_service_monitors_select_the_agent():
    ds = kinds(DEPLOY / "daemonset.yaml")["DaemonSet"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    ns = ds["metadata"]["namespace"]
    pm = kinds(DEPLOY / "podmonitor.yaml")["PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["namespace"] == ns
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    sm_file = kinds(DEPLOY / "servicemonitor.yaml")
    svc, sm = sm_file["Service"], sm_file["ServiceMonitor"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == \
        [p["name"] for p in svc["spec"]["ports"]]
