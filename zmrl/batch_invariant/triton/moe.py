"""MoE expert execution grouped over experts: two launches for all experts' GEMMs, one combine.

Rows are grouped by expert (expert ascending, tokens ascending within an expert) and every
row-tile of every expert is one program of a grouped GEMM whose weight tile is picked by the
tile's expert. A row's arithmetic is that of the invariant matmul (full-K loop in BLOCK_K
steps, tile configuration from (out, in, dtype) only), so it does not depend on how many
tokens its expert received or where in the group the row sits. The schedule is built on
the device (no host sync). The combine adds weight * expert output per token in fp32 in
slot order, i.e. ascending expert id, and the shared expert's output last.

Bit for bit the composed path: the expert GEMMs are the invariant matmul's arithmetic, the
gated epilogue is linear -> silu -> multiply with zmrl's one Triton sigmoid (elementwise.py),
and both kernels run without FMA contraction, so every product and sum is rounded as torch's
separate elementwise kernels round it (zmrl.model.mlp composes the same MoE from `linear`,
`silu` and torch adds when an expert adapter is active; a host with a zero adapter must give
the bits of a host with none).

Backward: deterministic per-expert GEMMs through the same Triton matmul (invariant=False: the
ladder's rung without its self-check), no atomics; frozen experts skip their weight GEMMs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import INTERPRET, check_runnable, make_desc
from zmrl.batch_invariant.triton.elementwise import NO_FP_FUSION, round_as_torch, sigmoid, sigmoid_f32
from zmrl.batch_invariant.triton.matmul import MMConfig, _prep_a, config_for, gemm


@triton.jit
def _grouped_kernel(a_desc, b_desc, b2_desc, c_ptr, tile_expert, tile_row, expert_end,
                    N, K, num_experts, stride_c,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """c[rows of tile] = a[rows] @ W[e]^T, W flattened [E*N, K]; GATED: silu(a W_g^T) * (a W_u^T)."""
    pid = tl.program_id(0)
    e = tl.load(tile_expert + pid)
    if e < num_experts:
        row0 = tl.load(tile_row + pid)
        row_end = tl.load(expert_end + e)
        off_n = tl.program_id(1) * BN
        w_row = e * N + off_n
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            a = a_desc.load([row0, ki * BK])
            b = b_desc.load([w_row, ki * BK]).T
            if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns as integers
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            if GATED:
                b2 = b2_desc.load([w_row, ki * BK]).T
                if UPCAST:
                    b2 = b2.to(tl.float32)
                if IEEE:
                    acc2 = tl.dot(a, b2, acc2, input_precision="ieee")
                else:
                    acc2 = tl.dot(a, b2, acc2)
        out_ty = c_ptr.dtype.element_ty
        if GATED:
            # as linear -> silu -> multiply: both GEMM outputs rounded to the activation dtype first
            g = acc.to(out_ty).to(tl.float32)
            u = acc2.to(out_ty).to(tl.float32)
            # zmrl.batch_invariant.silu's sigmoid, the very function (elementwise.py says why)
            res = round_as_torch(g * sigmoid_f32(g) * u, out_ty, UPCAST)
        else:
            res = acc.to(out_ty)
        offs_m = row0 + tl.arange(0, BM)
        offs_n = off_n + tl.arange(0, BN)
        ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_c + offs_n[None, :]
        tl.store(ptrs, res, mask=(offs_m[:, None] < row_end) & (offs_n[None, :] < N))


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, shared_ptr, out_ptr, D, TOPK, stride_y, stride_out,
                    BLOCK_D: tl.constexpr, HAS_SHARED: tl.constexpr, EMULATE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    p = tl.load(pos_ptr + n * TOPK)
    acc = tl.load(w_ptr + n * TOPK) * tl.load(y_ptr + p * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
    for j in range(1, TOPK):
        p = tl.load(pos_ptr + n * TOPK + j)
        y = tl.load(y_ptr + p * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
        acc = acc + tl.load(w_ptr + n * TOPK + j) * y
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + n * stride_out + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * stride_out + offs, round_as_torch(acc, out_ptr.dtype.element_ty, EMULATE), mask=ok)


class Groups:
    """Rows grouped by expert and the tile schedule of the grouped GEMMs, built on device."""

    def __init__(self, expert_ids: torch.Tensor, num_experts: int, block_m: int, real_experts: int | None = None):
        """real_experts: ids at or past it (a sentinel for slots this host does not compute) are
        grouped last and get no tile that runs."""
        n, k = expert_ids.shape
        self.num_real = num_experts if real_experts is None else real_experts
        dev = expert_ids.device
        self.block_m = block_m
        flat = expert_ids.reshape(-1)
        self.order = torch.argsort(flat, stable=True)  # expert ascending, then token ascending
        self.src_rows = self.order // k
        self.pos = torch.empty_like(self.order)
        self.pos[self.order] = torch.arange(n * k, device=dev)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # integer adds: exact in any order
        self.counts = counts
        self.end = torch.cumsum(counts, 0)
        start = self.end - counts
        tiles = (counts + block_m - 1) // block_m
        tiles_end = torch.cumsum(tiles, 0)
        self.max_tiles = max(1, triton.cdiv(n * k, block_m) + num_experts)  # bound known without a sync
        p = torch.arange(self.max_tiles, device=dev)
        e = torch.searchsorted(tiles_end, p, right=True)  # == num_experts past the last tile
        e_safe = e.clamp(max=num_experts - 1)
        first_tile = tiles_end[e_safe] - tiles[e_safe]
        self.tile_expert = e.to(torch.int32).contiguous()
        self.tile_row = (start[e_safe] + (p - first_tile) * block_m).to(torch.int32).contiguous()
        self.end32 = self.end.to(torch.int32).contiguous()


def _grouped(a: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None, groups: Groups) -> torch.Tensor:
    """a [rows, K] grouped by expert, w (and w2) [E, N, K] -> [rows, N] in a's dtype."""
    rows = a.shape[0]
    num_experts, n, k = w.shape
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    if rows == 0 or n == 0:
        return out
    base = config_for(n, k, a.dtype)
    # the schedule fixes BLOCK_M; the epilogue stores through a [BLOCK_M, BLOCK_N] pointer
    # tile (rows end at the expert's last row, which a TMA store cannot clip), so N <= 128
    block_n = min(base.block_n, 128)
    cfg = MMConfig(groups.block_m, block_n, base.block_k, num_warps=base.num_warps, num_stages=base.num_stages)
    a2 = _prep_a(a)
    b_desc = make_desc(_prep_a(w.reshape(num_experts * n, k)), [cfg.block_n, cfg.block_k])
    b2_desc = make_desc(_prep_a(w2.reshape(num_experts * n, k)), [cfg.block_n, cfg.block_k]) if w2 is not None else b_desc
    grid = (groups.max_tiles, triton.cdiv(n, cfg.block_n))
    _grouped_kernel[grid](
        make_desc(a2, [cfg.block_m, cfg.block_k]), b_desc, b2_desc, out, groups.tile_expert, groups.tile_row,
        groups.end32, n, k, num_experts, out.stride(0),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GATED=w2 is not None,
        IEEE=a.dtype == torch.float32, UPCAST=INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **NO_FP_FUSION,
    )
    return out


def _mlp(x, w_gate, w_up, w_down, groups):
    h = _grouped(x, w_gate, w_up, groups)
    return h, _grouped(h, w_down, None, groups)


def _combine(y, pos, weights, shared_out, n_tokens, d, dtype):
    out = torch.empty(n_tokens, d, dtype=dtype, device=y.device)
    if n_tokens == 0 or d == 0:
        return out
    block_d = 128 if INTERPRET else 1024
    k = pos.numel() // max(n_tokens, 1)
    _combine_kernel[(n_tokens, triton.cdiv(d, block_d))](
        y, pos, weights, shared_out if shared_out is not None else out, out, d, k, y.stride(0), out.stride(0),
        BLOCK_D=block_d, HAS_SHARED=shared_out is not None, EMULATE=INTERPRET, num_warps=4,
        **NO_FP_FUSION,  # w * y rounded, then added: zmrl.model.mlp.combine_slots' torch arithmetic
    )
    return out


def _silu_grads(g, u, dh):
    """h = silu(g) * u with g, u as rounded GEMM outputs -> (dg, du) in fp32."""
    gf, uf = g.float(), u.float()
    sig = sigmoid(gf)
    du = dh * gf * sig
    dg = dh * uf * sig * (1.0 + gf * (1.0 - sig))
    return dg, du


def _expert_backward(xs, w_gate, w_up, w_down, dy, groups, weight_grads=(True, True, True)):
    """Per-expert GEMMs (fixed order, no atomics) -> (dxs, dWg, dWu, dWd); a weight's gradient
    is None (its GEMMs skipped) where `weight_grads` says it is not needed (frozen experts)."""
    counts = groups.counts.tolist()
    dxs = torch.zeros_like(xs, dtype=torch.float32)
    dwg, dwu, dwd = (torch.zeros_like(w, dtype=torch.float32) if need else None
                     for w, need in zip((w_gate, w_up, w_down), weight_grads))
    start = 0
    for e, cnt in enumerate(counts):
        if cnt == 0:
            continue
        sl = slice(start, start + cnt)
        start += cnt
        xe = xs[sl]
        g = gemm(xe[None], w_gate[e].t()[None], invariant=False)[0]
        u = gemm(xe[None], w_up[e].t()[None], invariant=False)[0]
        gf = g.float()
        h = (gf * sigmoid(gf) * u.float()).to(xs.dtype)  # the forward's h, bit for bit
        dye = dy[sl]
        dh = gemm(dye[None], w_down[e][None], invariant=False)[0].float()
        if dwd is not None:
            dwd[e] = gemm(dye.t()[None], h[None], invariant=False)[0].float()
        dg, du = _silu_grads(g, u, dh)
        dg, du = dg.to(xs.dtype), du.to(xs.dtype)
        dxs[sl] = (gemm(dg[None], w_gate[e][None], invariant=False)[0].float()
                   + gemm(du[None], w_up[e][None], invariant=False)[0].float())
        if dwg is not None:
            dwg[e] = gemm(dg.t()[None], xe[None], invariant=False)[0].float()
        if dwu is not None:
            dwu[e] = gemm(du.t()[None], xe[None], invariant=False)[0].float()
    return dxs, dwg, dwu, dwd


class _MoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, expert_ids, expert_weights, w_gate, w_up, w_down, sg, su, sd):
        n, k = expert_ids.shape
        groups = Groups(expert_ids, w_gate.shape[0], config_for(w_gate.shape[1], w_gate.shape[2], x.dtype).block_m)
        xs = x[groups.src_rows]
        _, y = _mlp(xs, w_gate, w_up, w_down, groups)
        shared_out = None
        if sg is not None:
            one = Groups(torch.zeros(n, 1, dtype=torch.int64, device=x.device), 1,
                         config_for(sg.shape[0], sg.shape[1], x.dtype).block_m)
            _, shared_out = _mlp(x, sg[None], su[None], sd[None], one)
        w = expert_weights.float().contiguous()
        out = _combine(y, groups.pos.contiguous(), w, shared_out, n, x.shape[1], x.dtype)
        ctx.save_for_backward(x, expert_ids, w, w_gate, w_up, w_down, y, sg, su, sd)
        ctx.groups = groups
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, ids, w, w_gate, w_up, w_down, y, sg, su, sd = ctx.saved_tensors
        groups = ctx.groups
        n, k = ids.shape
        do = d_out.float()
        y_slots = y[groups.pos].view(n, k, -1).float()
        d_weights = (do[:, None, :] * y_slots).sum(-1)
        dy_slots = (w[..., None] * do[:, None, :]).to(x.dtype).reshape(n * k, -1)
        dy = dy_slots[groups.order]  # into grouped row order
        xs = x[groups.src_rows]
        needs = ctx.needs_input_grad
        dxs, dwg, dwu, dwd = _expert_backward(xs, w_gate, w_up, w_down, dy, groups, needs[3:6])
        dx = dxs[groups.pos].view(n, k, -1).sum(1)  # fixed slot order per token
        shared_grads = (None, None, None)
        if sg is not None:
            one = Groups(torch.zeros(n, 1, dtype=torch.int64, device=x.device), 1, 1)
            sdx, sdg, sdu, sdd = _expert_backward(x, sg[None], su[None], sd[None], d_out.to(x.dtype), one, needs[6:9])
            dx = dx + sdx
            shared_grads = tuple(g[0].to(t.dtype) if g is not None else None for g, t in zip((sdg, sdu, sdd), (sg, su, sd)))
        cast = lambda g, t: g.to(t.dtype) if g is not None else None  # noqa: E731
        return (dx.to(x.dtype), None, d_weights.to(w.dtype), cast(dwg, w_gate), cast(dwu, w_up), cast(dwd, w_down),
                *shared_grads)


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [N, D], expert_ids [N, k] int64, expert_weights [N, k], w_gate/w_up [E, I, D],
    w_down [E, D, I], shared = (gate [Is, D], up [Is, D], down [D, Is]) | None -> [N, D]."""
    named = {"x": x, "expert_ids": expert_ids, "expert_weights": expert_weights,
             "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_runnable(name, t)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x has dtype {x.dtype}; supported: float32, bfloat16, float16")
    for name in ("w_gate", "w_up", "w_down"):
        if named[name].dtype != x.dtype:
            raise TypeError(f"{name} has dtype {named[name].dtype}, x has {x.dtype}")
    if expert_ids.dtype not in (torch.int64, torch.int32) or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must be int [N={x.shape[0]}, k], got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    if expert_weights.shape != expert_ids.shape:
        raise ValueError(f"expert_weights must be {tuple(expert_ids.shape)}, got {tuple(expert_weights.shape)}")
    e, i, d = w_gate.shape if w_gate.dim() == 3 else (0, 0, -1)
    if x.dim() != 2 or d != x.shape[1] or w_up.shape != w_gate.shape or w_down.shape != (e, d, i):
        raise ValueError(f"need x [N, D], w_gate/w_up [E, I, D], w_down [E, D, I]; got {tuple(x.shape)}, "
                         f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}")
    sg = su = sd = None
    if shared is not None:
        sg, su, sd = shared
        if sg.dim() != 2 or sg.shape[1] != d or su.shape != sg.shape or sd.shape != (d, sg.shape[0]):
            raise ValueError("shared must be (gate [Is, D], up [Is, D], down [D, Is])")
        if {sg.dtype, su.dtype, sd.dtype} != {x.dtype}:
            raise TypeError(f"shared expert weights must have x's dtype {x.dtype}")
    if expert_ids.shape[1] == 0:
        raise ValueError("expert_ids must have at least one slot per token")
    ids = expert_ids.long()
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and ids.numel() and bool(((ids < 0) | (ids >= e)).any()):
        raise ValueError(f"expert_ids must lie in [0, {e})")
    if ids.shape[1] > 1:
        # the combine follows slot order; sorting makes that ascending expert id for any input
        ids, perm = torch.sort(ids, dim=1, stable=True)
        expert_weights = expert_weights.gather(1, perm)
    return _MoE.apply(x, ids, expert_weights, w_gate, w_up, w_down, sg, su, sd)
