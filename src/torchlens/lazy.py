"""Names a package loads on first use, so that importing it stays cheap (PEP 562).

``exports(package, names)`` returns the package's ``__getattr__`` and ``__dir__``.  ``names`` maps each
lazy name to where it lives: ``".module"`` (the name is an attribute of that submodule) or
``(".module", None)`` (the name is the submodule itself).  A name loaded once is stored in the package,
so later reads are plain attribute reads.
"""

from __future__ import annotations

import importlib
import sys


def exports(package: str, names: dict) -> tuple:
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``), loading ``names`` on first use."""

    def __getattr__(name):
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        submodule, attribute = (where, name) if type(where) is str else where
        module = importlib.import_module(submodule, package)
        value = module if attribute is None else getattr(module, attribute)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(names))  # lazy names listed without loading them

    return __getattr__, __dir__
