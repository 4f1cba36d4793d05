"""Launch an already compiled Triton kernel without the JIT's per-call work.

`kernel[grid](...)` binds every argument again, recomputes the specialization key, looks the
compiled kernel up, builds launch metadata and encodes a fresh CUtensorMap for every TMA
descriptor on every call: ~28 us of host time per GEMM launch on an H200 host, more than the
kernel itself at small M. A `DirectKernel` keeps the compiled kernel that one `kernel[grid]`
call returned and afterwards calls Triton's generated C launcher itself, with the arguments
already expanded the way Triton's own wrapper expands them (a descriptor becomes its
CUtensorMap, shape and strides). Same compiled binary, same arguments: the bits cannot differ.

The caller is responsible for the one thing this skips: the specialization. A DirectKernel is
only valid for calls that Triton would have sent to the same compiled kernel, so the caller keys
it on everything Triton specializes on (every constexpr, the dtype and block shape of each
descriptor, integer arguments equal to 1 or divisible by 16 unless marked do_not_specialize,
pointer alignment to 16 bytes).

CUtensorMaps are cached by (address, dtype, shape, strides, block, swizzle): a map encodes
nothing else, so a cache hit is byte for byte the map Triton would have encoded (the CUDA
caching allocator hands the same addresses out again, so activations hit too).

A kernel without descriptor arguments (the split-K sum) reaches its C launcher unwrapped, and
Triton 3.6 gives it an empty descriptor list; only a wrapped launcher needs every descriptor
lowered to a CUtensorMap.

This reads Triton internals (the CUDA launcher's argument layout of Triton 3.4-3.6); where they
are not as expected, `DirectKernel.make` returns None with the reason in `direct_launch_status()`
and the caller keeps launching through `kernel[grid]` (same results, the old host cost).
"""
from __future__ import annotations

import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from zmrl.batch_invariant.triton._common import INTERPRET

# ZMRL_DIRECT_LAUNCH=0 keeps every launch on kernel[grid] (an A/B switch for benchmarks)
ENABLED = os.environ.get("ZMRL_DIRECT_LAUNCH", "1").strip() != "0"
_STATUS: dict[str, str] = {}
_TMAPS: dict[tuple, object] = {}
_TMAP_CACHE_MAX = 4096


def direct_launch_status() -> dict[str, str]:
    """Per kernel name: "direct" or why it launches through kernel[grid]."""
    return dict(_STATUS)


def hooks_installed() -> bool:
    """A profiler's launch hooks (e.g. proton) need Triton's own launch path."""
    rt = triton.knobs.runtime
    # a HookChain (Triton 3.5+) is installed when it holds a call; older Tritons hold a callable or None
    return bool(getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook)
                or getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook))


def _raw_launcher(compiled) -> tuple[object, list | None, bool]:
    """(Triton's C `launch`, the per-descriptor metadata, whether Triton wrapped the C launcher
    to expand descriptor arguments) for a compiled CUDA kernel. A kernel without descriptor
    arguments is not wrapped, and its metadata is an empty list (Triton 3.6) or None."""
    launcher = compiled.run
    wrapped = launcher.launch
    meta = getattr(compiled.metadata, "tensordesc_meta", None)
    code = getattr(wrapped, "__code__", None)
    if code is None:
        return wrapped, meta, False  # no descriptor argument: Triton did not wrap its C launcher
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in wrapped.__closure__ or ())))
    if "launcher" not in cells:
        raise RuntimeError(f"unexpected launcher wrapper (free variables {code.co_freevars})")
    return cells["launcher"], meta, True


class DirectKernel:
    """One compiled kernel launched through Triton's C launcher (see the module docstring)."""

    __slots__ = ("name", "raw", "function", "packed", "coop", "pdl", "desc_meta", "desc_keys")

    @classmethod
    def make(cls, compiled, name: str) -> DirectKernel | None:
        if not ENABLED:
            _STATUS[name] = "kernel[grid]: ZMRL_DIRECT_LAUNCH=0"
            return None
        try:
            launcher = compiled.run
            if launcher.global_scratch_size or launcher.profile_scratch_size:
                _STATUS[name] = "kernel[grid]: the kernel needs scratch memory per launch"
                return None
            self = cls()
            self.name = name
            self.raw, self.desc_meta, wrapped = _raw_launcher(compiled)
            if wrapped and not has_tma_meta(compiled):
                _STATUS[name] = "kernel[grid]: a descriptor was not lowered to a CUtensorMap"
                return None
            if not wrapped and self.desc_meta:
                _STATUS[name] = "kernel[grid]: descriptor metadata on a kernel without descriptor arguments"
                return None
            self.desc_keys = [(m["elem_type"], tuple(m["block_size"]), m["swizzle"], m["elem_size"])
                              for m in self.desc_meta or ()]
            self.function = compiled.function
            self.packed = compiled.packed_metadata
            self.coop = launcher.launch_cooperative_grid
            self.pdl = launcher.launch_pdl
        except Exception as e:  # noqa: BLE001 - another Triton's internals: keep its own launch path
            _STATUS[name] = f"kernel[grid]: {type(e).__name__}: {e}"
            return None
        _STATUS[name] = "direct"
        return self

    def tensor_map(self, index: int, ptr: int, shape: tuple, strides: tuple) -> list:
        """Descriptor argument `index` (counted among descriptors) expanded as Triton expands it:
        [CUtensorMap, *shape, *strides]."""
        key = (ptr, shape, strides, self.desc_keys[index])
        tmap = _TMAPS.get(key)
        if tmap is None:
            meta = self.desc_meta[index]
            if len(_TMAPS) >= _TMAP_CACHE_MAX:
                _TMAPS.clear()
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

            tmap = triton.runtime.driver.active.utils.fill_tma_descriptor(
                ptr, meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                meta["block_size"], list(shape), list(strides), 0)
            _TMAPS[key] = tmap
        return [tmap, *shape, *strides]

    def launch(self, grid: int, stream: int, args: list, grid_y: int = 1) -> None:
        # Triton's C launch: grid x/y/z, stream, function, cooperative, PDL, global and profile
        # scratch (none: make() checked), packed metadata, launch metadata and the enter / exit
        # hooks (none: callers check hooks_installed()), then the kernel's expanded arguments
        self.raw(grid, grid_y, 1, stream, self.function, self.coop, self.pdl, None, None, self.packed,
                 None, None, None, *args)


def has_tma_meta(compiled) -> bool:
    """Whether every descriptor argument was lowered to a CUtensorMap (what DirectKernel expands)."""
    meta = getattr(compiled.metadata, "tensordesc_meta", None)
    return bool(meta) and all(m is not None and "fp4_padded" in m and not m["fp4_padded"] for m in meta)


def current_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


def clear_tensor_maps() -> None:
    _TMAPS.clear()


def _spec(arg) -> tuple:
    """What Triton's specialization reads from one non-constexpr argument (its signature type and
    the alignment / divisibility it may assume), never the value itself."""
    if isinstance(arg, torch.Tensor):
        return _tensor_spec(arg, arg.data_ptr(), arg.get_device())
    if isinstance(arg, TensorDescriptor):  # its type: dtype and block shape (its ints keyed too, to be safe)
        return ("desc", arg.base.dtype, tuple(arg.block_shape), arg.base.data_ptr() % 16 == 0, arg.base.get_device(),
                tuple(_int_spec(v) for v in (*arg.shape, *arg.strides)))
    if isinstance(arg, bool):
        return bool, arg
    if isinstance(arg, int):
        return _int_spec(arg)
    return type(arg)


def _tensor_spec(t: torch.Tensor, ptr: int, device: int) -> tuple:
    return t.dtype, ptr % 16 == 0, device


def _int_spec(v: int) -> tuple:
    return int, v == 1, v % 16 == 0, -(1 << 31) <= v < (1 << 31), v < (1 << 63)


_MISSING = object()


class KeyedLaunch:
    """`kernel[grid](*args, **consts, **options)` for one call site, whose launches after the first
    of each specialization key go straight to Triton's C launcher (DirectKernel).

    A call site whose kernel takes TMA descriptors pays Triton's binding, specialization and a
    fresh CUtensorMap per descriptor on every call (~100 us of host time for a grouped expert
    GEMM with three descriptors); here a call with a key seen before costs the key, the argument
    expansion and the launch. The key is everything Triton's specialization reads (`_spec` of each
    argument: dtype, 16-byte alignment, an int's equality to 1, divisibility by 16 and width; a
    descriptor's dtype and block shape) plus the constexprs and compile options, so the launch
    goes to the compiled kernel Triton would have picked, with the same arguments: same bits.
    `args` are the kernel's leading non-constexpr parameters, in order; `consts` every constexpr
    after them (a call site that does not fit this gets no direct launch: Triton's own path)."""

    __slots__ = ("kernel", "name", "plans", "options")

    def __init__(self, kernel, name: str, **options):
        self.kernel, self.name, self.options, self.plans = kernel, name, options, {}

    def __call__(self, grid: tuple[int, int], args: tuple, consts: dict) -> None:
        if INTERPRET or not ENABLED or hooks_installed():
            self.kernel[grid](*args, **consts, **self.options)
            return
        # one pass builds the key (each argument's `_spec`; tensors and ints, most arguments, by
        # their own spec functions, each address read once) and the launcher's arguments;
        # descriptors are expanded below, once the kernel (whose metadata encodes them) is known
        specs, expanded, device, descs = [], [], None, False
        for a in args:
            kind = type(a)
            if kind is torch.Tensor or kind is torch.nn.Parameter:
                ptr, device = a.data_ptr(), a.get_device()
                specs.append(_tensor_spec(a, ptr, device))
                expanded.append(ptr)
            elif kind is int:
                specs.append(_int_spec(a))
                expanded.append(a)
            else:
                specs.append(_spec(a))
                if isinstance(a, TensorDescriptor):
                    device, descs = a.base.get_device(), True
                elif isinstance(a, torch.Tensor):
                    device = a.get_device()
                    a = a.data_ptr()
                expanded.append(a)
        key = (tuple(specs), tuple(consts.items()))
        direct = self.plans.get(key, _MISSING)
        if direct is _MISSING:
            compiled = self.kernel[grid](*args, **consts, **self.options)
            self.plans[key] = self._make(compiled, len(args), consts)
            return
        if direct is None:
            self.kernel[grid](*args, **consts, **self.options)
            return
        if descs:
            expanded = self._expand_descriptors(direct, expanded)
        expanded += consts.values()
        direct.launch(grid[0], current_stream(device), expanded, grid[1] if len(grid) > 1 else 1)

    @staticmethod
    def _expand_descriptors(direct: DirectKernel, args: list) -> list:
        out, index = [], 0
        for a in args:
            if isinstance(a, TensorDescriptor):
                out += direct.tensor_map(index, a.base.data_ptr(), tuple(a.shape), tuple(a.strides))
                index += 1
            else:
                out.append(a)
        return out

    def _make(self, compiled, positional: int, consts: dict) -> DirectKernel | None:
        names = list(self.kernel.arg_names)
        constexprs = {names[i] for i in self.kernel.constexprs}
        if any(n in constexprs for n in names[:positional]) or names[positional:] != list(consts):
            _STATUS[self.name] = "kernel[grid]: the call does not pass every constexpr by name after its arguments"
            return None
        return DirectKernel.make(compiled, self.name)


_KEYED: dict[tuple, KeyedLaunch] = {}


def keyed(kernel, name: str, **options) -> KeyedLaunch:
    """The KeyedLaunch of `kernel` with these compile options (num_warps, num_stages, ...), made once
    per (kernel object, name, options): a call site's launches share its direct launchers."""
    key = (id(kernel), name, *options.items())  # per kernel object (a test may stand another in); kept alive below
    launcher = _KEYED.get(key)
    if launcher is None:
        launcher = _KEYED[key] = KeyedLaunch(kernel, name, **options)
    return launcher


def clear_keyed() -> None:
    """Forget every KeyedLaunch (the next call of each goes through Triton's JIT again)."""
    _KEYED.clear()
