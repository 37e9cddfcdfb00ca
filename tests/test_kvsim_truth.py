"""kvsim's read ground truth against itself: no tracer, no BPF.

The tracer's read counts are checked against kvsim's "reads" truth
elsewhere; these tests make sure that truth is worth checking against.  Its
fields are derived in kvsim from the block table it hands attention; here
each total is recomputed from another field (the per-step rows, the per-block
counts, the sharing histogram, the block writes) or from the workload's
definition, so that one miscounted field cannot agree with itself."""

import json
import re
import subprocess

import pytest

from conftest import KVSIM, KVSIM_LIB

WORKLOADS = ("default", "beam", "swap", "stress", "mla", "prefix", "window", "long")


def kvsim_truth(tmp_path, workload, *extra):
    path = tmp_path / f"truth-{workload}.json"
    r = subprocess.run([KVSIM, "--workload", workload, "--truth", path, "--truth-steps",
                        "--quiet", *map(str, extra)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr  # 0: its KV bytes and attention sums checked out
    truth = json.loads(path.read_text())
    assert truth["kv_checksum_ok"] is True
    return truth


@pytest.mark.parametrize("workload,extra", [(w, ()) for w in WORKLOADS] + [
    # a window with swaps (null entries in swapped-out tables) and forks
    ("swap", ("--sliding-window", 40)), ("beam", ("--sliding-window", 17))])
def test_read_totals_agree_with_their_parts(tmp_path, workload, extra):
    t = kvsim_truth(tmp_path, workload, *extra)
    rd = t["reads"]
    bs = rd["block_size"]
    assert (rd["layers"], bs) == (t["num_layers"], t["block_size"])
    assert rd["steps"] == t["steps"] > 0  # every step runs attention
    assert rd["group_id"] > 0

    # the per-step rows sum to the totals, one row per step, in order
    live = rd["live_sets"]
    assert [row[0] for row in live] == list(range(1, rd["steps"] + 1))
    for col, name in enumerate(("requests", "reads", "distinct", "tokens", "null_entries",
                                "held_tokens"), start=1):
        assert sum(row[col] for row in live) == rd[name], name

    # entries read per row = ceil(seq_len / block_size), null or not, so
    # per step bs * entries - (bs - 1) * rows <= tokens <= bs * entries
    for step, rows, reads, distinct, tokens, nulls, held in live:
        entries = reads + nulls
        assert 1 <= distinct <= reads
        assert rows <= entries  # every row holds at least one token
        assert bs * entries - (bs - 1) * rows <= tokens <= bs * entries, step
        # each block read holds 1..bs tokens, and the rows' seq_lens cover them
        assert distinct <= held <= min(bs * distinct, tokens), step

    # per-block counts and the sharing histogram count the same reads
    per_block = dict(rd["per_block"])
    assert sum(per_block.values()) == rd["reads"]
    assert sum(n for _, n in rd["sharing"]) == rd["distinct"]
    assert sum(d * n for d, n in rd["sharing"]) == rd["reads"]
    assert all(d >= 1 and n > 0 for d, n in rd["sharing"])

    # the null block is never handed out, so never read or written; null
    # entries within the read lengths are the sliding window's only
    assert 0 not in per_block
    assert all(w[0] == 0 for w in (l["writes"] for l in t["layers"]))
    assert t["token_writes"][0] == 0
    assert (rd["null_entries"] > 0) == (t["window_drops"] > 0)

    # last reads: the same blocks, within the run, the last step among them
    last = dict(rd["last_step"])
    assert sorted(last) == sorted(per_block)
    assert all(1 <= s <= rd["steps"] for s in last.values())
    assert max(last.values()) == rd["steps"]

    # a block is read only once something put tokens in it: a write,
    # a fork's copy or a swap-in
    for b in per_block:
        assert t["token_writes"][b] + t["copy_dst"][b] + t["swap_in"][b] > 0, b


def test_window_nulls_replace_reads(tmp_path):
    """--workload window is default with a 72-token sliding window; nothing
    else differs, and default never runs short of blocks, so both run the
    same schedule: the same rows and seq_lens, hence the same entries, of
    which the window makes some null.  Blocks drop whole, never the one
    holding a sequence's newest token."""
    full = kvsim_truth(tmp_path, "default")
    win = kvsim_truth(tmp_path, "window")
    assert full["preemptions"] == win["preemptions"] == 0
    assert full["reads"]["null_entries"] == 0 and win["window_drops"] > 0
    for a, b in zip(full["reads"]["live_sets"], win["reads"]["live_sets"], strict=True):
        step, rows, reads, _, tokens, _, _ = a
        assert [step, rows, tokens] == [b[0], b[1], b[4]]
        assert b[2] + b[5] == reads, step  # entries: reads + nulls
        assert b[2] >= rows  # each row still reads its last block
    assert win["reads"]["null_entries"] > 0
    # the writes do not change
    assert [l["writes"] for l in win["layers"]] == [l["writes"] for l in full["layers"]]
    assert win["slots_written"] == full["slots_written"]


def test_private_sequences_share_nothing(tmp_path):
    """default: one sample per request and no prefix: no block has two readers."""
    rd = kvsim_truth(tmp_path, "default")["reads"]
    assert rd["sharing"] == [[1, rd["distinct"]]]
    assert rd["distinct"] == rd["reads"]
    # nothing shared, nothing null: the blocks read hold every row's tokens
    assert rd["held_tokens"] == rd["tokens"]


def test_beam_samples_share_their_prompt(tmp_path):
    t = kvsim_truth(tmp_path, "beam")
    degrees = [d for d, _ in t["reads"]["sharing"]]
    assert t["forks"] > 0 and t["prefix_hits"] == 0
    assert max(degrees) > 1
    assert max(degrees) <= 4  # the beam workload's 4 samples, one row each


def test_prefix_blocks_are_written_once_and_read_by_every_row(tmp_path):
    """--workload prefix: a 136-token common prefix, 8 full blocks of 16.

    Every request's row starts with the 8 cached blocks, so each of them is
    read by every row of every step; they are written once (by the first
    request) and every later request takes all 8 from the cache."""
    t = kvsim_truth(tmp_path, "prefix")
    rd = t["reads"]
    prefix_blocks = 136 // 16
    assert t["preemptions"] == 0  # a swapped-in request would hold private copies
    assert t["requests"] == 24
    assert t["prefix_hits"] == (t["requests"] - 1) * prefix_blocks

    everyone = [b for b, n in rd["per_block"] if n == rd["requests"]]
    assert len(everyone) == prefix_blocks
    last = dict(rd["last_step"])
    for b in everyone:
        assert t["token_writes"][b] == 16  # each token once, not once per request
        assert all(l["writes"][b] == 16 for l in t["layers"])
        assert last[b] == rd["steps"]
    # each step's rows all share them: a degree per step equal to its rows
    sharing = dict(rd["sharing"])
    rows_per_step = {}
    for _, rows, *_ in rd["live_sets"]:
        rows_per_step[rows] = rows_per_step.get(rows, 0) + 1
    for rows, steps in rows_per_step.items():
        assert sharing.get(rows, 0) >= prefix_blocks * steps, rows
    # the shared blocks' tokens count once per step, not once per row
    for _, rows, _, _, tokens, _, held in rd["live_sets"]:
        assert held == tokens - (rows - 1) * prefix_blocks * 16


def test_prefix_sharing_follows_the_block_size(tmp_path):
    """Blocks of 48: only 2 full blocks of the 136-token prefix are cached."""
    t = kvsim_truth(tmp_path, "prefix", "--block-size", 48)
    assert t["prefix_hits"] == (t["requests"] - 1) * (136 // 48)


def test_repeat_accumulates_and_numbers_steps_on(tmp_path):
    """Runs are identical, so --repeat 2 doubles every count, and the steps of
    the second run are numbered after the first's."""
    one = kvsim_truth(tmp_path, "prefix")["reads"]
    two = kvsim_truth(tmp_path, "prefix", "--repeat", 2)["reads"]
    n = one["steps"]
    assert two["steps"] == 2 * n
    for name in ("requests", "tokens", "reads", "distinct"):
        assert two[name] == 2 * one[name], name
    assert two["per_block"] == [[b, 2 * c] for b, c in one["per_block"]]
    assert two["sharing"] == [[d, 2 * c] for d, c in one["sharing"]]
    assert two["last_step"] == [[b, s + n] for b, s in one["last_step"]]
    assert [row[1:] for row in two["live_sets"][n:]] == [row[1:] for row in one["live_sets"]]


def test_per_step_rows_only_on_request(tmp_path):
    path = tmp_path / "truth.json"
    r = subprocess.run([KVSIM, "--workload", "default", "--truth", path, "--quiet"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rd = json.loads(path.read_text())["reads"]
    assert rd["live_sets"] is None
    assert rd["reads"] > 0


def test_block_table_probe_note_has_a_semaphore():
    r = subprocess.run(["readelf", "-n", KVSIM_LIB], capture_output=True, text=True,
                       check=True)
    notes = re.findall(r"Name: (\w+)\n\s+Location: \S+, Base: \S+, Semaphore: (0x[0-9a-f]+)\n"
                       r"\s+Arguments: (.*)", r.stdout)
    (site,) = [(sem, args) for name, sem, args in notes if name == "block_table"]
    assert int(site[0], 16) != 0
    assert len(site[1].split()) == 8  # the ABI's eight arguments
    r = subprocess.run(["readelf", "-n", KVSIM_LIB.with_name("libkvsim_ops-noprobes.so")],
                       capture_output=True, text=True, check=True)
    assert "stapsdt" not in r.stdout
