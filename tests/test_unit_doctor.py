"""doctor's words for what it found (no BPF, no processes)."""

from tracer.commands.doctor import describe_probes
from tracer.probes.sdt import Probe


def probe(name, path):
    return Probe(path, "vllm", name, 0x10, 0x10, 0, 0, "")


def test_describe_probes_names_the_ops():
    files = {"/x/libkvsim_ops.so": [probe("swap_blocks", "/x/libkvsim_ops.so"),
                                    probe("reshape_and_cache", "/x/libkvsim_ops.so"),
                                    probe("reshape_and_cache", "/x/libkvsim_ops.so")],
             "/x/other.so": [probe("copy_blocks", "/x/other.so")]}
    assert describe_probes(files, stock=False) == (
        "3 vllm:* probe(s) in /x/libkvsim_ops.so (reshape_and_cache, swap_blocks), "
        "1 vllm:* probe(s) in /x/other.so (copy_blocks)")
    stock = {"/v/_C.abi3.so": [probe("cpu_attn_reshape_and_cache", "/v/_C.abi3.so"),
                               probe("concat_and_cache_mla", "/v/_C.abi3.so")]}
    assert describe_probes(stock, stock=True) == (
        "2 stock cache op(s) in /v/_C.abi3.so (concat_and_cache_mla, "
        "cpu_attn_reshape_and_cache)")


def test_uprobe_links_says_what_attach_will_do(monkeypatch):
    """The three cases of the link trial: links work; the kernel loads
    programs for links but makes none (attach would stop, so the fix names
    the perf-event switch); no link type at all (perf events, quietly)."""
    from tracer.commands import doctor as cmd_doctor
    from tracer.kernel import program, uprobes
    monkeypatch.setattr(uprobes, "trial_link", lambda kind: (False, "Invalid argument"))
    monkeypatch.setattr(program, "attach_type", lambda: uprobes.BPF_TRACE_UPROBE_MULTI)
    check = cmd_doctor.check_uprobe_links(privileged=True)
    assert check.status == cmd_doctor.WARN
    assert "attach stops" in check.detail and "KVTRACE_PERF_UPROBES=1" in check.fix
    monkeypatch.setattr(program, "attach_type", lambda: 0)
    check = cmd_doctor.check_uprobe_links(privileged=True)
    assert check.status == cmd_doctor.WARN
    assert "one perf event per probe" in check.detail and "6.6" in check.fix
    monkeypatch.setattr(uprobes, "trial_link", lambda kind: (True, ""))
    assert cmd_doctor.check_uprobe_links(privileged=True).status == cmd_doctor.PASS
