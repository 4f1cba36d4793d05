"""Register zmrl with transformers' Auto classes lazily, without importing transformers.

`install()` (called from `zmrl/__init__.py`) registers right away if transformers is already
imported, and otherwise puts a finder on sys.meta_path that imports `zmrl.model.hf` (whose last
statement registers) just after `import transformers` completes. So `import zmrl` stays light
(no torch, no transformers) and `AutoModelForCausalLM.from_pretrained(dir)` still knows
model_type "zmrl".

When `zmrl.model.hf` is itself the first importer of transformers, the hook fires while that
module is half initialized; importing it then returns the partial module without touching its
names, and the module registers when its own import finishes.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys


def _register() -> None:
    # never `from zmrl.model.hf import register`: that fails while zmrl.model.hf is mid-import
    importlib.import_module("zmrl.model.hf")


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _register()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if "transformers" in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
