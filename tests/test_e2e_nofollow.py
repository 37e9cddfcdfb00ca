"""Files the tracer writes as root are opened without following a symbolic
link (O_NOFOLLOW): a link planted where it writes would have it truncate
the file the link names.  One line, exit 1, the linked file untouched."""

import pytest

from conftest import KVSIM, assert_one_line_error, run_kvtrace

pytestmark = pytest.mark.usefixtures("bpf_env")


@pytest.fixture
def planted(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    return link, victim


@pytest.mark.parametrize("flag", ["--json", "-o", "--folded"])
def test_attach_refuses_a_symlinked_output(planted, flag):
    link, victim = planted
    r = run_kvtrace("attach", "-q", flag, link, "--", KVSIM, "--quiet")
    assert_one_line_error(r, 1, "symbolic link", str(link))
    assert victim.read_text() == "keep me\n"


def test_agent_refuses_a_symlinked_state_file(planted):
    link, victim = planted
    r = run_kvtrace("agent", "--state", link)
    assert_one_line_error(r, 1, "symbolic link", str(link))
    assert victim.read_text() == "keep me\n"


def test_open_private_never_follows(planted):
    """The check at open, for a link made after the check before tracing."""
    from tracer import errors, files

    link, victim = planted
    with pytest.raises(errors.UsageError, match="symbolic link"):
        files.open_private(str(link))
    with pytest.raises(errors.UsageError, match="symbolic link"):
        files.write_file(str(link), "overwritten\n")
    assert victim.read_text() == "keep me\n"
    # a regular file is still written, and created 0600
    plain = link.parent / "plain.json"
    files.write_file(str(plain), "x\n")
    assert plain.read_text() == "x\n" and plain.stat().st_mode & 0o777 == 0o600
