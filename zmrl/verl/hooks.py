"""Register zmrl's trainer-side pieces with verl when verl imports the registry they go into
(and patch verl's resource-pool check for the CPU platform when verl imports it).

The engine (zmrl.verl.engine) registers with `verl.workers.engine.EngineRegistry` and the strict
trainer (zmrl.verl.strict) with verl's v1 trainer registry; importing either registry module
imports most of verl's training stack (about 20 s on a busy 2-core machine). verl loads its
plugins in every process that imports verl (driver, Ray workers, vLLM servers), so registering
eagerly would charge that to processes that never train. Instead, `install()` registers each
at once when its registry module is already imported and otherwise puts a one-shot finder on
sys.meta_path that imports the zmrl module and calls its `register()` right after verl's module
finishes executing (registering is idempotent; a zmrl module that is itself the importer of
verl's module, and so still half-defined, registers on its own last line instead). verl's worker imports `verl.workers.engine` before it
asks EngineRegistry for an engine, and TaskRunnerV1 imports `verl.trainer.ppo.v1` before it asks
for a trainer, so the registrations are in place whenever verl looks.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

# verl's module -> the zmrl module that registers into it
HOOKS = {
    "verl.single_controller.ray": "zmrl.verl.cpu_pools",
    "verl.workers.engine": "zmrl.verl.engine",
    "verl.trainer.ppo.v1": "zmrl.verl.strict",
}


def _register(name: str) -> None:
    # never `from zmrl.verl.x import register`: zmrl.verl.x may be the importer, mid-import
    register = getattr(importlib.import_module(name), "register", None)
    if register is not None:
        register()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, then: str):
        self.inner, self.then = inner, then

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _register(self.then)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, then: str):
        self.target, self.then = target, then

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.then)
        return spec


def install() -> None:
    for target, then in HOOKS.items():
        if target in sys.modules:
            _register(then)
        elif not any(isinstance(f, _Finder) and f.target == target for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder(target, then))


install()
