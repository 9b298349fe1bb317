"""Method registry: run-time name -> Method subclass, imported lazily (a method's heavy imports load only when used).

`clipfinetune/methods/<name>.py` defines one `Method` subclass whose `name` attribute is the method's name.
A method whose module does not exist yet fails with a clear "not implemented yet" error.
"""
from __future__ import annotations

import importlib
import inspect

from clipfinetune.registry import METHODS as _PAPER_METHODS
from clipfinetune.registry import MIX

from .base import Method

METHODS = (*_PAPER_METHODS, MIX)      # the registry's methods (clipfinetune/registry.py) and the custom mix


class MethodNotImplemented(NotImplementedError):
    pass


def get_method(name: str) -> type[Method]:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    module_name = f"{__name__}.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise MethodNotImplemented(
            f"method {name!r} not implemented yet (clipfinetune/methods/{name}.py does not exist)") from None
    found = [c for _, c in inspect.getmembers(module, inspect.isclass)
             if issubclass(c, Method) and c is not Method and c.__module__ == module_name and c.name == name]
    if len(found) != 1:
        raise MethodNotImplemented(f"method {name!r} not implemented yet: clipfinetune/methods/{name}.py must "
                                   f"define exactly one Method subclass with name = {name!r} (found {len(found)})")
    return found[0]


def build_method(name: str, **config) -> Method:
    return get_method(name)(**config)


__all__ = ["METHODS", "Method", "MethodNotImplemented", "build_method", "get_method"]
