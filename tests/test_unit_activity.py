"""What the live view says of a target before its first op
(tracer/probes/activity.py): the words for each state, and the readers of
/proc and of a log's last line, on this test's own process and files."""

import subprocess
import sys
import time

from tracer.probes import activity


def test_words_of_each_state():
    starting = activity.describe((7, "python"), 0.93, False, 3, "")
    assert starting == ("target starting: no probe site mapped yet in its 3 processes; "
                        "93% of a CPU, most in pid 7 (python)")
    busy = activity.describe((9, "VLLM::Worker"), 0.5, True, 4, "INFO loading")
    assert busy == ("target busy, probes placed: loading the model or warming up; "
                    "50% of a CPU, most in pid 9 (VLLM::Worker)\n"
                    "its log's last line: INFO loading")
    # the longest at vLLM's longest name, 15 characters, fits 120 columns
    longest = activity.describe((4194304, "VLLM::EngineCor"), 1.0, True, 4, "")
    assert len(longest) <= 120, longest
    idle = activity.describe((9, "VLLM::Worker"), 0.02, True, 4, "")
    assert idle == "target idle, probes placed: waiting for its first step; 2% of a CPU"


def test_a_long_log_line_is_cut_to_the_width():
    text = activity.describe(None, 0.0, True, 1, "x" * 500, width=80)
    line = text.splitlines()[1]
    assert len(line) == 80 and line.endswith("x…"), line


def test_last_line_skips_blank_lines_and_takes_a_progress_line_end(tmp_path):
    log = tmp_path / "log"
    log.write_bytes(b"first\nLoading: 10%\rLoading: 90%\r\n\n  \n")
    assert activity.last_line(str(log)) == "Loading: 90%"
    log.write_bytes(b"a" * 10000 + b"\nend  of   it\n")  # beyond the tail read: still found
    assert activity.last_line(str(log)) == "end of it"
    assert activity.last_line(str(tmp_path / "none")) == ""
    log.write_bytes(b"")
    assert activity.last_line(str(log)) == ""


def test_log_of_a_process_writing_to_a_file_or_a_pipe(tmp_path):
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             stdout=subprocess.PIPE, stderr=out)
    q = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert activity.log_of(p.pid) == str(log)
        assert activity.log_of(q.pid) is None  # pipes: nothing to read back
    finally:
        for proc in (p, q):
            proc.kill()
            proc.wait()


def test_cpu_share_of_a_spinning_process():
    """A process that spins is busy and named as the busiest beside one
    that sleeps.  Not timed: the look comes once the spinner has used half
    a second of CPU, whatever the wall clock took."""
    spin = subprocess.Popen([sys.executable, "-c",
                             "import time\nwhile time.process_time() < 60: pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        doing = activity.Activity()
        assert doing.line([sleeper.pid, spin.pid], lambda pid: "n", True, 0.0) == ""
        # once the spinner has used half a second of CPU since that look,
        # look again as if one second had passed: half a CPU
        start = doing._ticks[spin.pid]
        while activity.cpu_ticks(spin.pid) < start + activity.CLK_TCK // 2:
            time.sleep(0.05)
        text = doing.line([sleeper.pid, spin.pid], lambda pid: f"c{pid}", True,
                          doing._at + 1.0)
        assert text.startswith("target busy, probes placed"), text
        assert f"most in pid {spin.pid} (c{spin.pid})" in text, text
    finally:
        for proc in (spin, sleeper):
            proc.kill()
            proc.wait()
