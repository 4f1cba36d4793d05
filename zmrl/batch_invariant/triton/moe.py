"""MoE expert execution grouped over experts: two launches for all experts' GEMMs, one combine.

Rows are grouped by expert (expert ascending, tokens ascending within an expert) and every
row-tile of every expert is one program of a grouped GEMM whose weight tile is picked by the
tile's expert (the kernels are in grouped.py, shared with the LoRA expert path of moe_lora.py).
A row's arithmetic is that of the invariant matmul (full-K loop in BLOCK_K
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

Backward: the grouped kernels of grouped.py over all experts at once (a row's input gradient
never depends on the other rows; each weight gradient sums its expert's rows in ascending order,
no atomics), no host sync; frozen experts skip their weight GEMMs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import INTERPRET, cdiv, check_runnable, next_power_of_2
from zmrl.batch_invariant.triton._launch import keyed
from zmrl.batch_invariant.triton.elementwise import NO_FP_FUSION, round_as_torch
from zmrl.batch_invariant.triton.grouped import expert_wgrad, rows_backward, rows_forward
from zmrl.batch_invariant.triton.matmul import config_for


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, shared_ptr, out_ptr, D, TOPK, stride_y, stride_out,
                    BLOCK_D: tl.constexpr, HAS_SHARED: tl.constexpr, EMULATE: tl.constexpr,
                    SLOT_MAJOR: tl.constexpr):
    """out[n] = sum_j w[n, j] * y[row of (n, j)] (+ shared[n]): y's rows grouped by expert (the row
    of slot (n, j) read from pos) or, SLOT_MAJOR, y [N * TOPK, D] in slot order (row n * TOPK + j)."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    p = n * TOPK if SLOT_MAJOR else tl.load(pos_ptr + n * TOPK)
    acc = tl.load(w_ptr + n * TOPK) * tl.load(y_ptr + p * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
    for j in range(1, TOPK):
        p = n * TOPK + j if SLOT_MAJOR else tl.load(pos_ptr + n * TOPK + j)
        y = tl.load(y_ptr + p * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
        acc = acc + tl.load(w_ptr + n * TOPK + j) * y
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + n * stride_out + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * stride_out + offs, round_as_torch(acc, out_ptr.dtype.element_ty, EMULATE), mask=ok)


@triton.jit
def _schedule_kernel(counts_ptr, end_ptr, end32_ptr, tile_expert_ptr, tile_row_ptr, E, MAX_TILES,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """Per expert (counts [E]): end = the running row count (program 0 stores it, int64 and
    int32); per tile p of this program's BLOCK_P: its expert e (the number of experts whose tiles
    all lie before p; E past the last tile) and its first row. A tile past the last one gets the
    row the torch formulation gives it (expert E - 1's start + its tile offset), though no kernel
    reads it. Integers throughout: exact, in any order."""
    ids = tl.arange(0, BLOCK_E)
    valid = ids < E
    counts = tl.load(counts_ptr + ids, mask=valid, other=0).to(tl.int32)  # rows < 2^31: checked by the caller
    end = tl.cumsum(counts, 0)
    if tl.program_id(0) == 0:
        tl.store(end_ptr + ids, end.to(tl.int64), mask=valid)
        tl.store(end32_ptr + ids, end, mask=valid)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    done = (tiles_end[None, :] <= p[:, None]) & valid[None, :]  # [P, E]: experts before tile p
    expert = tl.sum(done.to(tl.int32), 1)
    # the tile's rows are counted from min(expert, E - 1): the experts strictly before that one
    before = done & (ids < E - 1)[None, :]
    first_tile = tl.sum(tl.where(before, tiles[None, :], 0), 1)
    start = tl.sum(tl.where(before, counts[None, :], 0), 1)
    ok = p < MAX_TILES
    tl.store(tile_expert_ptr + p, expert, mask=ok)
    tl.store(tile_row_ptr + p, start + (p - first_tile) * BLOCK_M, mask=ok)


class Groups:
    """Rows grouped by expert and the tile schedule of the grouped GEMMs, built on device."""

    def __init__(self, expert_ids: torch.Tensor, num_experts: int, block_m: int, real_experts: int | None = None):
        """real_experts: ids at or past it (a sentinel for slots this host does not compute) are
        grouped last and get no tile that runs."""
        n, k = expert_ids.shape
        if n * k >= 1 << 31:
            raise ValueError(f"{n} tokens x {k} slots: the grouped schedule counts rows in int32 (< 2^31)")
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
        self.max_tiles = max(1, cdiv(n * k, block_m) + num_experts)  # bound known without a sync
        self.end = torch.empty(num_experts, dtype=torch.int64, device=dev)
        self.end32 = torch.empty(num_experts, dtype=torch.int32, device=dev)
        self.tile_expert = torch.empty(self.max_tiles, dtype=torch.int32, device=dev)
        self.tile_row = torch.empty(self.max_tiles, dtype=torch.int32, device=dev)
        block_e = next_power_of_2(num_experts)
        block_p = max(1, min(32, 8192 // block_e))  # [P, E] int32 tiles of at most 8K elements
        keyed(_schedule_kernel, "moe_schedule", num_warps=4)(
            (cdiv(self.max_tiles, block_p), 1),
            (counts, self.end, self.end32, self.tile_expert, self.tile_row, num_experts, self.max_tiles),
            dict(BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p))


def _mlp(x, w_gate, w_up, w_down, groups):
    h = rows_forward(x, w_gate, groups, w2=w_up)
    return h, rows_forward(h, w_down, groups)


def _combine(y, pos, weights, shared_out, n_tokens, d, dtype, k=None):
    """pos None: y is [n_tokens * k, D] in slot order (slot_sum); else y's rows are grouped by
    expert and pos [n_tokens * k] says where each slot's row is."""
    out = torch.empty(n_tokens, d, dtype=dtype, device=y.device)
    if n_tokens == 0 or d == 0:
        return out
    block_d = 128 if INTERPRET else 1024
    k = pos.numel() // max(n_tokens, 1) if pos is not None else k
    _combine_kernel[(n_tokens, cdiv(d, block_d))](
        y, pos if pos is not None else weights, weights, shared_out if shared_out is not None else out, out, d, k,
        y.stride(0), out.stride(0), BLOCK_D=block_d, HAS_SHARED=shared_out is not None, EMULATE=INTERPRET,
        SLOT_MAJOR=pos is None, num_warps=4,
        **NO_FP_FUSION,  # w * y rounded, then added: zmrl.batch_invariant.moe.slot_sum_composed's arithmetic
    )
    return out


def slot_sum(slot_out: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
             dtype: torch.dtype) -> torch.Tensor:
    """zmrl.batch_invariant.moe.slot_sum in one launch: slot outputs [T, k, D] fp32, weights [T, k]
    fp32, shared [T, D] | None -> [T, D] in dtype, with slot_sum_composed's bits."""
    check_runnable("slot_out", slot_out)
    n, k, d = slot_out.shape
    if weights.shape != (n, k) or weights.dtype != torch.float32 or slot_out.dtype != torch.float32:
        raise ValueError(f"slot_sum takes fp32 slot outputs [T, k, D] and fp32 weights [T, k], got "
                         f"{slot_out.dtype} {tuple(slot_out.shape)} and {weights.dtype} {tuple(weights.shape)}")
    if shared is not None and shared.shape != (n, d):
        raise ValueError(f"shared must be [{n}, {d}], got {tuple(shared.shape)}")
    y = slot_out.reshape(n * k, d)
    if y.stride(1) != 1:
        y = y.contiguous()
    # the kernel reads the shared rows with the output's row stride
    return _combine(y, None, weights.contiguous(), None if shared is None else shared.contiguous(), n, d, dtype, k)


def _expert_backward(xs, w_gate, w_up, w_down, dy, groups, weight_grads=(True, True, True)):
    """Grouped GEMMs over all experts (grouped.py: fixed order, no atomics, no host sync) ->
    (dxs fp32, dWg, dWu, dWd fp32); a weight's gradient is None (its GEMM skipped) where
    `weight_grads` says it is not needed (frozen experts)."""
    inter = w_gate.shape[1]
    need_g, need_u, need_d = weight_grads
    # the forward's g, u and h, recomputed bit for bit by the same grouped kernel
    h, gu = rows_forward(xs, w_gate, groups, w2=w_up, store_gu=True)
    dgu = rows_backward(dy, w_down, groups, gu=gu)  # dh = dy W_d[e], then silu's backward: [dg, du]
    dg, du = dgu[:, :inter], dgu[:, inter:]
    dxs = rows_backward(dg, w_gate, groups, a2=du, w2=w_up, out_dtype=torch.float32)
    num = w_gate.shape[0]
    wgrad = lambda p, q: expert_wgrad(p, q, groups, num, out_dtype=torch.float32)  # noqa: E731
    return dxs, wgrad(dg, xs) if need_g else None, wgrad(du, xs) if need_u else None, wgrad(dy, h) if need_d else None


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
            one = Groups(torch.zeros(n, 1, dtype=torch.int64, device=x.device), 1,
                         config_for(sg.shape[0], sg.shape[1], x.dtype).block_m)
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
