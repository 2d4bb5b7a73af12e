"""Public names of a package imported on first use (PEP 562), so importing the package stays light."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, public: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``public`` maps each name to the module that defines it;
    the first access imports that module and keeps the value in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        module = public.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
