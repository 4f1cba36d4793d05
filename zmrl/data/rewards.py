"""Reward functions by import path: "module:function", called as fn(completion, example, **kwargs)."""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable


class RewardError(RuntimeError):
    """A reward function that cannot be loaded, raises, or returns something that is not a number."""


def resolve(path: str) -> Callable:
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise RewardError(f'reward function must be "module:function", got {path!r}')
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward function {path}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"reward function {path}: {module_name} has no callable {name!r}")
    return fn


class RewardFn:
    def __init__(self, path: str, kwargs: dict | None = None):
        self.path, self.fn, self.kwargs = path, resolve(path), dict(kwargs or {})

    def __call__(self, completion: str, example: dict) -> float:
        try:
            value = self.fn(completion, example, **self.kwargs)
        except SystemExit as e:  # would otherwise end the whole run as if it had finished
            raise RewardError(f"reward function {self.path} called sys.exit({e.code!r}) "
                              f"(on completion {completion[:80]!r})") from None
        except Exception as e:
            raise RewardError(f"reward function {self.path} raised {type(e).__name__}: {e} "
                              f"(on completion {completion[:80]!r}, prompt {str(example.get('prompt'))[:80]!r})") from e
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(f"reward function {self.path} returned {value!r}; expected a finite number")
        return float(value)
