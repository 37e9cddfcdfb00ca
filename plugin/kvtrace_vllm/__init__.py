"""kvtrace-bpf's vLLM plugin: fires the plugin tier's USDT probes
(bpf/kvtrace_probes.h) from vLLM's scheduler and block pool.

vLLM calls register() (entry point group vllm.general_plugins, name
"kvtrace") in each of its processes; VLLM_PLUGINS, when set, must name
"kvtrace" for it to load.  See docs/plugin.md.
"""

__version__ = "0.1.0"


def register():
    """vLLM's general-plugin entry point: install the hooks (once per process)."""
    try:
        from . import hooks
        hooks.install()
    except Exception:  # never break vLLM's start
        import logging
        logging.getLogger("vllm.plugins.kvtrace").warning(
            "kvtrace: plugin failed to load; vLLM runs without it", exc_info=True)
