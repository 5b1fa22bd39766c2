"""Run code in a rank once the script has imported a module, without importing it ourselves (the
runner's hooks on torch: a script that never imports torch pays nothing for them)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

_waiting: dict[str, _AfterImport] = {}  # one finder per module: a second would never be asked


def when_imported(name: str, then: Callable[[], None]) -> None:
    """`then()` now if module `name` is loaded (a rank forked from a zygote that imported it), else
    once its import has run."""
    if name in sys.modules:
        then()
    elif name in _waiting:
        _waiting[name].then.append(then)
    else:
        _waiting[name] = finder = _AfterImport(name, [then])
        sys.meta_path.insert(0, finder)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then` once module `name` has been imported (its loader's exec_module returned)."""

    def __init__(self, name: str, then: list[Callable[[], None]]):
        self.name = name
        self.then = then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the finders below find the module itself
        del _waiting[fullname]
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            exec_module(module)
            if module.__name__ == fullname:  # a loader shared by several modules (a zip) runs the rest as it was
                for each in then:
                    each()

        spec.loader.exec_module = exec_then  # this import's loader (a file's is made for it)
        return spec
