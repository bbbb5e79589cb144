"""The vLLM part of the seam: the entries of ``trl_moe_replay_vllm_plugin``, the one module of ours that uses vLLM's
private names.

vLLM loads the plugin in its own processes, where it must not import this package (nor TRL), so the plugin keeps its
entries itself, next to the code that uses them: plain data (``VLLM_ENTRIES``, the names each declares and the
versions it was read from and verified on) and a check that imports vLLM only when called (``check_vllm``). This part
registers them with every other entry of the seam (library ``vllm``) and turns the plugin's findings into
:class:`Finding` s. Checked only where vLLM is importable and on its CPU platform: elsewhere the plugin does nothing, so nothing relies
on them.
"""

from __future__ import annotations

import functools
import importlib.util

import trl_moe_replay_vllm_plugin as plugin

from .entries import Entry, Finding, entry


VLLM_ENTRIES: dict[str, Entry] = {
    name: entry(name, "vllm", plugin.VLLM_READ, plugin.VLLM_VERIFIED) for name in plugin.VLLM_ENTRIES
}


def plugin_acts_here() -> bool:
    """Whether vLLM is importable and on its CPU platform: the one place the plugin acts, and so relies on its entries
    (checked without importing vLLM where it is absent)."""
    return importlib.util.find_spec("vllm") is not None and plugin.on_vllm_cpu()


@functools.cache
def check_vllm() -> tuple[Finding, ...]:
    """The plugin's entries against the installed vLLM (empty: all good, or no vLLM on CPU here to check against)."""
    if not plugin_acts_here():
        return ()
    return tuple(Finding(VLLM_ENTRIES[name], problem) for name, problem in plugin.check_vllm())
