"""Give every NIXL agent a non-zero progress-thread delay.

NIXL's Python API builds its agent config with `pthrDelay = 0` hardcoded (`nixl_cu12/_api.py`),
so UCX's progress thread busy-polls a whole core per agent even when idle; no environment
variable changes it. This module swaps the bindings' `nixlAgentConfig` for a subclass that
turns that 0 into `KVROUTE_NIXL_PTHR_DELAY_US` microseconds (default 100). Measured here, one
idle agent: delay 0 -> 1.76 s of CPU per 2 s, 100 us or 1000 us -> 0.05 s; a 2 MiB READ
between two processes takes ~0.4 ms at 100 us but ~2 ms at 1000 us (completion is seen on
the progress thread's cadence), hence 100.

Python imports `sitecustomize` at start-up from the first folder on sys.path that has one,
so putting this folder on PYTHONPATH patches every process, its children included (vLLM's
engine core and workers). The patch is lazy: nothing of NIXL is imported until the process
imports it itself. Self-contained on purpose: the vLLM virtualenv has no kvroute installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

ENV = "KVROUTE_NIXL_PTHR_DELAY_US"
DEFAULT_DELAY_US = 100
_BINDINGS = ("nixl_cu12._bindings", "nixl_cu13._bindings", "nixl_rocm._bindings")


def delay_us() -> int:
    """The delay to apply: the environment's, else the default (never 0: that spins)."""
    try:
        value = int(os.environ.get(ENV, DEFAULT_DELAY_US))
    except ValueError:
        value = DEFAULT_DELAY_US
    return value if value > 0 else DEFAULT_DELAY_US


def patch_bindings(bindings: ModuleType, delay: int | None = None) -> None:
    """Replace `bindings.nixlAgentConfig` so that assigning `pthrDelay = 0` sets `delay`."""
    base = bindings.nixlAgentConfig
    if getattr(base, "_kvroute_patched", False):
        return
    chosen = delay if delay is not None else delay_us()

    class PatchedAgentConfig(base):  # type: ignore[misc, valid-type]
        _kvroute_patched = True

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay" and value == 0:
                value = chosen
            super().__setattr__(name, value)

    setattr(bindings, "nixlAgentConfig", PatchedAgentConfig)  # noqa: B010


def patch_loaded(delay: int | None = None) -> bool:
    """Patch the bindings already imported in this process; True if any were."""
    found = False
    for name in _BINDINGS:
        module = sys.modules.get(name)
        if module is not None:
            patch_bindings(module, delay)
            found = True
    return found


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        patch_bindings(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of NIXL's bindings so they are patched as soon as they load."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _BINDINGS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Patch now if NIXL is loaded, and whenever it loads later (idempotent)."""
    patch_loaded()
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
