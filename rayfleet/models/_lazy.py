"""Lazy re-exports for a package's ``__init__`` (PEP 562): each name loads its module on first use.

A process that only reads a package's light modules (a job's driver validating its spec, Ray
Train's controller unpickling the loop's config) then never imports the heavy ones (torch,
DTensor): about 2 s of CPU per process start on this project's 2-core machines.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, home: Mapping[str, tuple[str, ...]],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package`` whose names live in the submodules of
    ``home`` (submodule -> names); a loaded name is cached in ``namespace`` (the package's globals)."""
    module_of = {name: module for module, names in home.items() for name in names}
    names = [name for group in home.values() for name in group]

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__, names
