"""Run the Triton kernels here: compiled on a CUDA GPU, under Triton's interpreter otherwise.

Triton decides between compiling and interpreting when a kernel is *defined*, so
TRITON_INTERPRET=1 has to be in the environment before zmrl.batch_invariant.triton is
imported. This conftest is loaded before the test modules of this folder; if an earlier test
module already imported the kernels compiled-mode on a machine without a GPU, they are
re-imported here so the interpreter takes over.
"""
import importlib
import os
import sys

import pytest
import torch

COMPILED = torch.cuda.is_available()
if not COMPILED:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: F401  (scripts/setup.sh installs it: missing is an error, not a skip)

# every module that defines a kernel or imports one by name, each after the modules it imports
_MODULES = ("_common", "_splitk", "_gemm_config", "_gemm_kernel", "_gemm_ladder", "elementwise",
            "leaf_tree", "matmul", "rowwise", "rope", "route", "indexer", "topk", "route_select", "sparse_mla_backward",
            "sparse_mla", "moe", "grouped", "moe_lora")
_pkg = sys.modules.get("zmrl.batch_invariant.triton")
if _pkg is not None and _pkg.INTERPRET == COMPILED:
    for name in _MODULES:
        mod = sys.modules.get(f"zmrl.batch_invariant.triton.{name}")
        if mod is not None:
            importlib.reload(mod)
    importlib.reload(_pkg)

import zmrl.batch_invariant.triton as tri  # noqa: E402

assert tri.INTERPRET == (not COMPILED)


def pytest_collection_modifyitems(config, items):
    # the interpreter converts 1-element arrays to Python ints on every loop bound
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning"))


@pytest.fixture
def dev() -> str:
    """Where the small-shape tests put their tensors: the GPU when there is one."""
    return "cuda" if COMPILED else "cpu"
