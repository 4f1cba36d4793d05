"""zmrl doctor [--shapes 1000x96,4096x4096] [--json]

What this machine gives zmrl's batch-invariant kernels: the CPU (model, vector flags, and any
vector-ISA caps set in the environment), the BLAS build torch was compiled with (MKL / oneDNN /
OpenBLAS versions), torch and thread counts, whether exp, log and rsqrt give an element the same
bits wherever it sits in a tensor (lanes.py: the CPU row ops rely on it), and, for each probed GEMM
shape, the path matmul/linear/bmm take (the BLAS tiles where their
row-invariance self-check passed here, else the exact GEMM) in fp32 and bf16, with the exact GEMM
itself verified on the same probes; then Triton and the GPU when there is one (the GPU matmul's
tile-ladder self-check). Run it first on a new machine. Needs torch only (Triton/CUDA optional).
Exit codes: 0 every probed shape has a row-invariant path and exp/log/rsqrt keep their bits in
every place, 1 otherwise (do not train here).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys

DEFAULT_SHAPES = ((64, 48), (256, 320), (1000, 96), (1024, 1024))  # (K, N); the CPU tests' shapes and one model-like
# Environment variables that cap the vector ISA torch, oneDNN and MKL use (and so their kernels and
# bits), or MKL's reproducibility mode: shown when set, since they change what the checks measure.
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")
_CPU_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile",
              "asimd", "sve", "sve2", "bf16")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="this machine's CPU/BLAS/GPU and which batch-invariant path each op takes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in DEFAULT_SHAPES),
                   help="comma-separated KxN GEMM shapes to probe (K = in features, N = out features)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if not m or min(int(m[1]), int(m[2])) < 1:
            raise ValueError(f"--shapes: {item!r} is not KxN with positive integers (e.g. 1024x4096)")
        shapes.append((int(m[1]), int(m[2])))
    return shapes


def cpu_info() -> dict:
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:  # x86, ARM
                    flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    import torch

    return {"model": model, "machine": platform.machine(), "logical_cpus": os.cpu_count(),
            "flags": [f for f in _CPU_FLAGS if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_env": {k: os.environ[k] for k in ISA_ENV if k in os.environ}}


def blas_info() -> dict:
    import torch

    config = torch.__config__.show()
    keep = [line.strip(" -") for line in config.splitlines()
            if re.search(r"Math Kernel Library|MKL|oneDNN|OpenBLAS|BLIS|Accelerate|OpenMP|CPU capability", line)
            and "Build settings" not in line]
    settings = dict(re.findall(r"(BLAS_INFO|LAPACK_INFO|USE_MKL|USE_MKLDNN|USE_OPENMP)=(\w+)", config))
    return {"libraries": keep, "settings": settings}


def cpu_paths(shapes: list[tuple[int, int]]) -> list[dict]:
    """Run each op's self-check at each shape (fresh, this process) and verify the exact GEMM on
    the same probes; one row per (op, dtype, K, N)."""
    import torch

    from zmrl.batch_invariant import cpu_gemm
    from zmrl.batch_invariant._tiles import LARGE_ROW_TILES
    from zmrl.batch_invariant.exact_gemm import exact_bmm, exact_mm

    rows = []
    g = torch.Generator().manual_seed(0)
    with cpu_gemm.use_cpu_gemm("auto"):
        cpu_gemm.reset_decisions()
        for k, n in shapes:
            weight = torch.randn(n, k, generator=g) / k**0.5
            for dtype in (torch.float32, torch.bfloat16):
                w = weight.to(dtype)
                for op, b in (("linear", w.t()), ("matmul", w.t().contiguous()), ("bmm", w.t().contiguous()[None])):
                    gemm_op = "bmm" if op == "bmm" else "mm"
                    path = cpu_gemm.path_for(gemm_op, b, dtype)
                    if gemm_op == "mm":  # the large tiles are checked at a call's first fit: fit them all
                        cpu_gemm.large_tiles_for(b, dtype, max(LARGE_ROW_TILES))
                    dec = next(d for d in cpu_gemm.decisions() if (d["op"], d["k"], d["n"], d["dtype"], d["b_layout"])
                               == (gemm_op, k, n, str(dtype)[6:], cpu_gemm.b_layout(b)))
                    if gemm_op == "mm":
                        exact_ok, exact_detail, _ = cpu_gemm.check_rows(exact_mm, b, dtype)
                    else:
                        exact_ok, exact_detail, _ = cpu_gemm.check_bmm_rows(exact_bmm, b[0], dtype)
                    rows.append({"op": op, "dtype": str(dtype)[6:], "k": k, "n": n, "b_layout": dec["b_layout"],
                                 "threads": dec["threads"], "path": path, "tiles_check_passed": path == "tiles",
                                 "min_tiles": dec["min_tiles"], "large_tiles": list(dec["large_tiles"]),
                                 "reason": dec["reason"], "check_seconds": round(dec["seconds"], 4),
                                 "exact_check_passed": exact_ok, "exact_detail": exact_detail})
    return rows


def gpu_info(shapes: list[tuple[int, int]]) -> dict:
    import importlib.util

    import torch

    info: dict = {"triton": None, "cuda": torch.cuda.is_available(), "gpus": []}
    if importlib.util.find_spec("triton") is not None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            info["triton"] = version("triton")
        except PackageNotFoundError:
            info["triton"] = "installed (version unknown)"
    if not info["cuda"]:
        return info
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info["cuda_version"] = torch.version.cuda
    try:
        import importlib

        import zmrl.batch_invariant as bi

        # the module, not the package's `matmul` function of the same name
        tmm = importlib.import_module("zmrl.batch_invariant.triton.matmul")

        for k, n in shapes:
            w = torch.randn(n, k, device="cuda").bfloat16()
            for m in (1, 17, 64):
                bi.linear(torch.randn(m, k, device="cuda").bfloat16(), w)  # runs the ladder's self-check if needed
        info["ladder_mode"] = tmm.ladder_mode()
        info["ladder_decisions"] = tmm.ladder_decisions()
    except Exception as e:  # noqa: BLE001 - report, do not hide: the GPU path is unusable here
        info["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return info


def diagnose(shapes: list[tuple[int, int]]) -> dict:
    import torch

    from zmrl.batch_invariant import cpu_gemm, lanes

    report = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
              "cpu_gemm_env": os.environ.get(cpu_gemm.ENV, "(unset: auto)"),
              "cpu": cpu_info(), "blas": blas_info(), "lanes": lanes.lane_report(), "lanes_values": lanes.PROBE_VALUES,
              "cpu_paths": cpu_paths(shapes), "gpu": gpu_info(shapes)}
    paths = report["cpu_paths"]
    report["all_tiles_checks_passed"] = all(r["tiles_check_passed"] for r in paths)
    report["all_exact_checks_passed"] = all(r["exact_check_passed"] for r in paths)
    gpu_decisions = report["gpu"].get("ladder_decisions", [])
    report["gpu_ladder_fallbacks"] = sum(not d["use_ladder"] and "differs" in d["reason"] for d in gpu_decisions)
    return report


def _print(report: dict) -> None:
    cpu, blas = report["cpu"], report["blas"]
    print(f"zmrl doctor | python {report['python']} | {report['platform']}")
    print(f"CPU      {cpu['model']} ({cpu['machine']}, {cpu['logical_cpus']} logical CPUs)")
    print(f"         flags: {' '.join(cpu['flags']) or '(none of interest)'}; torch CPU capability: "
          f"{cpu['torch_cpu_capability']}")
    if cpu["isa_env"]:
        print(f"         capped by the environment: {' '.join(f'{k}={v}' for k, v in cpu['isa_env'].items())}")
    print(f"torch    {report['torch']}, {report['threads']} threads ({report['interop_threads']} inter-op)")
    for line in blas["libraries"]:
        print(f"BLAS     {line}")
    print(f"         {' '.join(f'{k}={v}' for k, v in blas['settings'].items())}")
    print(f"ZMRL_CPU_GEMM {report['cpu_gemm_env']}")
    varying = {op: n for op, n in report["lanes"].items() if n}
    if varying:
        print(f"\nCPU exp/log/rsqrt: an element's bits depend on its place in the tensor here ("
              + ", ".join(f"{op}: {n:,} of {report['lanes_values']:,} values" for op, n in varying.items())
              + "): the CPU row ops are not batch-invariant on this machine; do not train on it")
    else:
        print(f"\nCPU exp/log/rsqrt: the same bits in vector lanes and scalar tails ({report['lanes_values']:,} "
              "values each): the CPU row ops may rely on it")
    print("\nCPU matmul/linear/bmm: the path each takes here (self-check of the BLAS tiles on first use)")
    print("(tiles xN: every call padded to at least N tiles, one per thread: the plain tiles failed the check;")
    print(" large: the tiles of more than 32 rows whose check passed, which calls of as many rows may use)")
    print(f"{'op':7} {'dtype':8} {'K':>6} {'N':>6} {'B layout':9} {'path':9} {'large':8} {'check s':>8}  "
          "exact verified")
    for r in report["cpu_paths"]:
        path = r["path"] + (f" x{r['min_tiles']}" if r["min_tiles"] > 1 else "")
        large = ",".join(map(str, r["large_tiles"])) or "-"
        print(f"{r['op']:7} {r['dtype']:8} {r['k']:>6} {r['n']:>6} {r['b_layout']:9} {path:9} {large:8} "
              f"{r['check_seconds']:>8.3f}  {'yes' if r['exact_check_passed'] else 'NO: ' + r['exact_detail']}")
    for r in report["cpu_paths"]:
        if not r["tiles_check_passed"] or r["min_tiles"] > 1:
            print(f"  {r['op']} {r['dtype']} {r['k']}x{r['n']}: {r['reason']}")
    gpu = report["gpu"]
    print(f"\nTriton   {gpu['triton'] or 'not installed'}; CUDA {'available' if gpu['cuda'] else 'not available'}"
          + (f" ({', '.join(gpu['gpus'])}, CUDA {gpu.get('cuda_version')})" if gpu["gpus"] else ""))
    if "error" in gpu:
        print(f"GPU      the Triton path failed: {gpu['error']}")
    for d in gpu.get("ladder_decisions", []):
        print(f"GPU GEMM N={d['n']} K={d['k']} {d['dtype']} {d['b_layout']}: "
              f"{'ladder' if d['use_ladder'] else 'fixed config'} ({d['reason']})")
    n = len(report["cpu_paths"])
    exact = sum(not r["tiles_check_passed"] for r in report["cpu_paths"])
    print()
    if report["all_tiles_checks_passed"]:
        padded = sum(r["min_tiles"] > 1 for r in report["cpu_paths"])
        print(f"every self-check passed: all {n} probed CPU GEMMs take the BLAS tiles"
              + (f" ({padded} of them padded to a tile per thread)" if padded else ""))
    else:
        print(f"{exact} of {n} probed CPU GEMMs failed the tile self-check and take the exact GEMM (invariant, slower)")
    if not report["all_exact_checks_passed"]:
        print("the exact GEMM FAILED its check here: this machine has no row-invariant CPU GEMM; do not train on it")


def run(args: argparse.Namespace) -> int:
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        print(f"zmrl doctor: {e}", file=sys.stderr)
        return 2
    report = diagnose(shapes)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    ok = report["all_exact_checks_passed"] and not any(report["lanes"].values()) and "error" not in report["gpu"]
    return 0 if ok else 1
