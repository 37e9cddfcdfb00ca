"""scripts/compile-bpf.py (make setup): the programs it compiles ahead are
the ones the README's first commands load, as the CLI parses them."""

import importlib.util

from conftest import ROOT


def script():
    spec = importlib.util.spec_from_file_location("compile_bpf", ROOT / "scripts/compile-bpf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_five_distinct_programs_as_the_cli_chooses_them(tmp_path):
    mod = script()
    got = {name: mod.options(argv, str(tmp_path)) for name, argv in mod.COMMANDS.items()}
    picks = {name: (o.get("stacks", False), o["index_stream"], o["gen_fill"],
                    o.get("reuse_rows", False)) for name, o in got.items()}
    assert picks == {
        "attach": (False, "block_ids", False, False),
        "attach --folded": (True, "block_ids", False, False),
        "record, attach -o": (True, "all", False, False),
        "attach --prometheus": (False, "block_ids", True, False),
        "agent": (False, "block_ids", True, True),
    }
    # the production defaults, as a plain attach has them
    from tracer import abi
    from tracer.kernel.session import DEFAULT_MAX_PROCS
    for o in got.values():
        assert (o["max_blocks"], o["max_caches"], o["max_procs"]) == \
            (abi.DEFAULT_MAX_BLOCKS, abi.DEFAULT_MAX_CACHES, DEFAULT_MAX_PROCS)
