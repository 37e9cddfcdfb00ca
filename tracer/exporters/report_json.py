"""The report as JSON (docs/report-json.md): the document, its parts
serialized as they are made, and the writing.
"""

import numpy as np
import orjson

from ..analysis import heatmap, occupancy
from ..analysis.report import Report, access_figures, value_counts
from ..files import WatchedStdout

REPORT_SCHEMA = "kvtrace-bpf/report"
# 2: lifecycle.requests[].access.blocks is columns (a list per figure), not
# a list of one dict per block; 3: occupancy[].fragmentation_mean is
# unwritten_share_mean, beside access[].internal_fragmentation, layers a
# whole number (and layers_note), lifecycle.summary.reallocated
REPORT_VERSION = 3


def _occupancy_json(rep: Report) -> list:
    # layers whose writes are the same values share one Generations
    # (occupancy.distinct_caches), and its figures are made once
    made = {}
    out = []
    for c in rep.caches:
        key = (c["pid"], c["cache_id"])
        g = rep.gens.get(key)
        if g is None:
            continue
        if id(g) not in made:
            made[id(g)] = _generations_json(g)
        out.append({
            "pid": c["pid"], "layer": rep.layers[key], "cache_id": c["cache_id"],
            "source": rep.occupancy_source.name, "caveat": rep.occupancy_source.caveat,
            **made[id(g)]})
    return out


def _generations_json(g: occupancy.Generations) -> dict:
    frag = g.fragmentation
    return {
        "block_size": g.block_size, "generations": len(g),
        "started_by": {k: int(np.count_nonzero(g.kind == i))
                       for i, k in enumerate(occupancy.KINDS)},
        "fill_hist": g.fill_hist.tolist(),  # generations by tokens held at their end
        "fill_level_mean": float(g.fill.mean() / g.block_size) if len(g) else None,
        "max_writes": g.max_writes,
        "lifetime_steps": value_counts(g.lifetime_steps),
        "reuse_steps": value_counts(g.reuse_steps[g.reuse_steps >= 0]),
        "steps": g.steps,
        "active_blocks": g.active_blocks.tolist(),
        "active_tokens": g.active_tokens.tolist(),
        # not "fragmentation": access[].internal_fragmentation is that of
        # the blocks read, which differs by definition (docs/glossary.md)
        "unwritten_share_mean": float(np.nanmean(frag)) if np.any(~np.isnan(frag)) else None,
        "incomplete_ops": g.incomplete_ops,
    }


def document(rep: Report, hm: heatmap.Heatmap, rates: dict) -> dict:
    """The JSON document but its last part, "lifecycle" (the plugin tier's
    figures, rep.lifecycle): what the main side can make (and serialize:
    json_parts) while those are computed beside it."""
    t = rep.trace
    blocks = rep.agg.to_json()
    blocks["inexact_reasons"] = rep.reasons
    blocks["exact"] = not rep.reasons
    return {
        "schema": REPORT_SCHEMA, "version": REPORT_VERSION,
        "trace": {"path": t.path, "format_version": t.meta["version"],
                  "host": t.meta["host"], "kernel": t.meta["kernel"],
                  "created_utc": t.meta["created_utc"], "target": t.meta["target"],
                  "processes": list(t.processes.values()), "complete": t.complete,
                  "damage": t.damage, "duration_s": rep.duration_ns() / 1e9},
        "stream": {"ops": len(rep.ops.ops), "values": int(rep.ops.values_decoded),
                   "incomplete_ops": int(np.count_nonzero(~rep.ops.ops["complete"])),
                   "orphan_chunks": rep.ops.orphan_chunks},
        "blocks": blocks,
        "op_rates": rates,
        "heatmap": hm.to_json(),
        "occupancy": _occupancy_json(rep),
        "access": access_figures(rep),
        "derived_reads": rep.derived_check,
    }


def json_parts(doc: dict) -> dict:
    """The document's parts, each already serialized (orjson.Fragment): the
    same bytes in write_json, which then only copies them."""
    return {k: json_fragment(v) for k, v in doc.items()}


# numpy arrays as they are (report_request_access' columns: no Python object per
# value); dict keys that are numbers as strings, as json made them
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def plain(doc: dict):
    """The document as json.loads would read it back (numpy arrays as lists,
    number keys as strings): what report --check's invariants read."""
    return orjson.loads(orjson.dumps(doc, option=_JSON_OPTIONS))


def json_fragment(value) -> orjson.Fragment:
    """value serialized now, to be copied as it is into write_json's bytes
    (every request's access columns, made on the side that computes them,
    not at the end of the report)."""
    return orjson.Fragment(orjson.dumps(value, option=_JSON_OPTIONS))


def write_json(doc: dict, out):
    """The document, compact, on one line.  orjson rather than the standard
    library's encoder: the same bytes, several times as fast (docs/design.md,
    "The report's JSON").  A NaN is
    null, where json wrote NaN, which is no JSON.

    Written a piece at a time (_json_pieces), the same bytes as one
    orjson.dumps(doc): the whole document as one bytes object, grown as it
    was made, was the report's last fresh memory, tens of MB of pages each
    touched for the first time (microseconds a page on a VM)."""
    # the CLI's stdout notes a failed write; WatchedStdout also knows how to
    # put bytes on any text stream (to its buffer, or decoded without one)
    w = out if isinstance(out, WatchedStdout) else WatchedStdout(out)
    # pieces gathered into writes of a MiB or more: a small write the file's
    # buffer kept would meet a full disk again when the file is closed
    pending, size = [], 0
    for piece in _json_pieces(doc):
        pending.append(piece)
        size += len(piece)
        if size >= _JSON_WRITE_BYTES:
            w.write_bytes(b"".join(pending))
            pending, size = [], 0
    w.write_bytes(b"".join(pending + [b"\n"]))


# the items of a long list serialized at once by _json_pieces (thousands of
# requests go in pieces of under a MB), and the least bytes write_json
# writes at once (but the last)
_JSON_LIST_PIECE = 64
_JSON_WRITE_BYTES = 1 << 20


def _json_pieces(value, depth: int = 0):
    """orjson.dumps(value)'s bytes, in pieces: the members of a dict (of
    string keys, the document and its parts, two levels deep) one by one,
    the items of a long list _JSON_LIST_PIECE at a time, anything else
    whole.  orjson's compact form has no space between tokens, so the
    pieces joined are its bytes for the whole (tests/test_unit_report.py)."""
    if depth < 2 and isinstance(value, dict) and value and all(type(k) is str for k in value):
        sep = b"{"
        for k, v in value.items():
            yield sep + orjson.dumps(k) + b":"
            yield from _json_pieces(v, depth + 1)
            sep = b","
        yield b"}"
    elif isinstance(value, list) and len(value) > _JSON_LIST_PIECE:
        for i in range(0, len(value), _JSON_LIST_PIECE):
            part = orjson.dumps(value[i:i + _JSON_LIST_PIECE], option=_JSON_OPTIONS)
            yield (b"," if i else b"[") + part[1:-1]  # the items, without their brackets
        yield b"]"
    else:
        yield orjson.dumps(value, option=_JSON_OPTIONS)
