"""The train step's minibatches and the log-prob pass as CUDA graphs: padded to bucketed shapes,
captured once per shape, replayed after.

An eager minibatch costs a few thousand kernel launches, an eager log-prob pass about a thousand,
each with its Python around it: on a GPU the host, not the device, sets the pace. A batch packed
end to end and padded to a bucketed shape (zmrl.trainer.padding.PackedShape) has one of a few
shapes, and its forward, loss, backward and gradient clipping (the log-prob pass: its forward)
read only device buffers and the packing's device tensors, with no host sync. So the first run of
a shape runs eagerly (its own results; it also compiles and plans every kernel for that shape),
then the same work is captured into a CUDA graph; a later run of that shape copies its inputs into
the graph's buffers, refills the packing in place with its own lengths, and replays the graph, one
launch from the host. The kernels plan for the shape's longest sequence L (Packing.width), not
the batch's, which gives the same bits.

What a replay gives is what the eager run of the same padded buffers gives, bit for bit (the same
kernels on the same buffers). The log-probs are the unpadded batch's bits (padding is invisible to
batch-invariant kernels); the loss is a weighted sum over the log-prob rows, so the gradient's
rounding differs from an unpadded step's. The optimizer step stays eager (a few fused launches).
A shape whose graph would leave too little device memory (HEADROOM) is not padded at all: its
runs, and those of larger shapes, take the caller's unpadded eager run, as if there were no graphs.

    graphs = MinibatchGraphs(trainer)             # capture=False: the padded minibatch, eager
    row, ratio_dev = graphs.run(batch, idx, settings, first=True, eager=eager_run)
    scores = LogprobGraphs(trainer)               # its own stream and pool
    lps = scores.run(prompts, completions, temperature)   # None: run the unpadded pass instead
"""
from __future__ import annotations

import gc
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from zmrl.batch_invariant import batch_invariant_mode, defers_checks
from zmrl.batch_invariant.graph_refs import holding_for_graph
from zmrl.model.logprobs import token_logprobs
from zmrl.trainer.base import TrainBatch, UpdateSettings
from zmrl.trainer.megatron.attention import refill_packing
from zmrl.trainer.padding import PackedBatch, PackedShape, packed_shape, pad_packed
from zmrl.trainer.ppo import EagerRun, clip_onto_masters, padded_minibatch_terms

log = logging.getLogger(__name__)
GIB = 2 ** 30
CAPACITY = 16
"""Graphs of one kind kept (least recently used dropped first). A shape has four bucketed
dimensions (sequences, rows, longest sequence, log-prob rows; a pass adds its temperature and
adapter switch), so a run whose lengths spread wide meets a few dozen (docs/benchmarks.md counts
them for one such run), and a shape evicted and met again costs an eager run and a capture. A
kind's graphs share one memory pool, so what a graph costs beyond the largest one's activations is
its buffers and its launch record."""
HEADROOM = 2
"""A captured graph is kept only if the device still has this many times the graphs' memory free:
their pool stays reserved while they live, and eager work goes on beside them (a log-prob pass
scores a whole batch, several minibatches' tokens; a new shape's first minibatch runs eagerly).
Otherwise the graph is dropped, and that shape's minibatches, and those of every shape at least
as large, run eagerly and unpadded (padding buys nothing without a graph), as each line of
`eager_for_memory` says."""


@dataclass(kw_only=True)
class _Captured:
    """A shape's graph once captured, what it returns, and what a replay needs kept or unchanged."""

    graph: "torch.cuda.CUDAGraph | None" = None
    outputs: tuple[torch.Tensor, ...] | None = None
    pointers: tuple[int, ...] = ()
    held: list[torch.Tensor] = field(default_factory=list)
    """Cached tensors made before the capture that the graph reads (zmrl.batch_invariant.graph_refs)."""


@dataclass
class _Buffers(_Captured):
    """One packed shape's device buffers and packing, refilled for every run, and (once captured)
    its graph and outputs."""

    ids: torch.Tensor
    rows: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    ref: torch.Tensor
    packed: object

    def fill(self, pad: PackedBatch, old: torch.Tensor | None = None, adv: torch.Tensor | None = None,
             ref: torch.Tensor | None = None) -> None:
        """The padded batch's ids, rows and packing, and the per-row values given (a log-prob pass
        has none)."""
        for dst, src in ((self.ids, pad.ids), (self.rows, pad.rows), (self.tokens, pad.tokens),
                         (self.mask, pad.mask), (self.weights, pad.weights), (self.old, old), (self.adv, adv),
                         (self.ref, ref)):
            if src is not None:
                dst.copy_(src, non_blocking=True)
        refill_packing(self.packed, list(pad.bounds))


def _check_ids(pad, vocab_size: int) -> None:
    low, high = int(pad.ids.min()), int(pad.ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}), got [{low}, {high}]")


class _ShapeGraphs:
    """What the train step's and the log-prob pass's graphs share: a stream and a memory pool for
    every shape's graph, the shapes kept (least recently used dropped first), the capture that keeps
    a graph only while the device keeps HEADROOM, and the size past which shapes run unpadded."""

    what = "a padded pass"
    """What one run is, for messages: "capturing {what} ... failed"."""

    def __init__(self, trainer, capture: bool = True, capacity: int = CAPACITY):
        """trainer: a one-rank MegatronTrainer; capture: record and replay CUDA graphs (its device
        must be CUDA), else run every padded pass eagerly."""
        if capture and trainer.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the trainer is on {trainer.device}")
        if len(trainer.rank_layouts) != 1:
            raise ValueError("padded batch graphs serve one rank (tensor_parallel = expert_parallel = 1)")
        self.trainer, self.capture, self.capacity = trainer, capture, capacity
        self.buffers: OrderedDict[tuple, _Buffers] = OrderedDict()
        self.stream = torch.cuda.Stream(trainer.device) if capture else None
        # one memory pool for every shape's graph: memory is the largest graph's, not their sum.
        # Safe because replays never overlap (one stream) and nothing a replay leaves in the pool
        # outlives the next replay: its outputs are cloned at once, everything else is rewritten
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = self.replays = 0
        self.pool_bytes = 0
        """Device memory the graphs' pool took, as the captures measured it."""
        self.eager_for_memory: list[str] = []
        """One line per shape left eager because its graph would not leave HEADROOM."""
        self.unpadded_from: int | None = None
        """The fewest packed rows (PackedShape.tokens) of a shape whose graph did not leave
        HEADROOM: a run whose shape holds as many takes the caller's unpadded eager run instead
        (None: no such shape)."""

    # what a subclass says: the tensors its graphs read outside their pool, and what a capture leaves behind
    def _pointers(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _clean(self) -> None:
        """Undo what a run or a capture leaves on the trainer (nothing by default)."""

    def _unpadded(self, shape: PackedShape) -> bool:
        return self.unpadded_from is not None and shape.tokens >= self.unpadded_from

    def _buffers_for(self, key: tuple, shape: PackedShape):
        bufs = self.buffers.get(key)
        if bufs is None:
            bufs = self.buffers[key] = self._allocate(shape)
            while len(self.buffers) > self.capacity:
                self.buffers.popitem(last=False)
        self.buffers.move_to_end(key)
        return bufs

    def _run(self, bufs, shape: PackedShape, body) -> tuple[torch.Tensor, ...]:
        """body() over the filled buffers: replayed from their graph when it is valid, else run (and
        captured, when capturing and the checks it makes can wait for the device)."""
        if bufs.graph is not None and bufs.pointers == self._pointers():
            bufs.graph.replay()
            self.replays += 1
            return tuple(t.clone() for t in bufs.outputs)
        if not self.capture:
            return body()
        if not defers_checks(bufs.ids):
            # value checks made at once (ZMRL_DEFER_VALUE_CHECKS=0) read the host: no capture then
            return self._on_stream(body)
        return self._run_then_capture(bufs, shape, body)

    def _run_then_capture(self, bufs, shape: PackedShape, body) -> tuple[torch.Tensor, ...]:
        # the eager run on the capture stream gives this run's results and warms every kernel, plan
        # and allocator of this shape up; the capture then records without running
        device = self.trainer.device
        result = self._on_stream(body)
        # garbage in reference cycles (a dropped trainer and its graphs hold each other) collected
        # now, and no collection during the capture: a graph destroyed while another is being
        # captured breaks that capture (CUDA refuses the call), and Python collects whenever it
        # allocates enough
        gc.collect()
        torch.cuda.empty_cache()  # the eager run's cached blocks go back: the pool may take them
        free_before, _ = torch.cuda.mem_get_info(device)
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream(device)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with holding_for_graph() as held, torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                outputs = body()
        except RuntimeError as e:  # e.g. an op that reads the host, which a capture forbids, or no memory left
            # torch.cuda.graph leaves its stream current when the capture's end raises: every later
            # op of the process would run there, not on the caller's stream
            torch.cuda.set_stream(caller)
            self._clean()
            # the error that broke the capture, not capture_end's "a previous error during capture"
            first = e.__context__ if isinstance(e.__context__, RuntimeError) else e
            reason = (str(first).strip().splitlines() or [type(first).__name__])[0]
            raise RuntimeError(f"capturing {self.what} ({shape}) in a CUDA graph failed: {reason}; "
                               "trainer.options={cuda_graphs=false} runs it eagerly") from e
        finally:
            if collecting:
                gc.enable()
        free_after, _ = torch.cuda.mem_get_info(device)
        grown = max(0, free_before - free_after)
        if free_after < HEADROOM * (self.pool_bytes + grown):
            del graph, outputs, held
            self._run_unpadded(shape, f"{shape}: the graphs would hold {(self.pool_bytes + grown) / GIB:.1f} GiB, "
                                      f"leaving {free_after / GIB:.1f} GiB free, less than {HEADROOM}x that for eager "
                                      "work; this shape and larger ones run unpadded and eagerly")
            return result
        self.pool_bytes += grown
        bufs.graph, bufs.outputs, bufs.pointers, bufs.held = graph, outputs, self._pointers(), list(held)
        self.captures += 1
        self._clean()
        return result

    def _run_unpadded(self, shape: PackedShape, why: str) -> None:
        """Runs of this shape and of larger ones take the caller's eager run from now on (this
        shape's graph was dropped; a larger one would need at least as much memory)."""
        self._clean()
        self.unpadded_from = shape.tokens if self.unpadded_from is None else min(self.unpadded_from, shape.tokens)
        # the buffers (and any graphs) of the shapes past the threshold, under any settings, are unused now
        for key in [key for key in self.buffers if key[0].tokens >= self.unpadded_from]:
            del self.buffers[key]
        torch.cuda.empty_cache()
        self.eager_for_memory.append(why)
        log.warning("%s runs eagerly, without a CUDA graph: %s", self.what, why)

    def _allocate(self, shape: PackedShape) -> _Buffers:
        tr, device = self.trainer, self.trainer.device

        def empty(n, dtype):
            return torch.zeros(n, dtype=dtype, device=device)

        # any lengths that fit the shape do (every run refills them): here, as even as they come
        per, extra = divmod(shape.tokens, shape.seqs)
        bounds = [0, *itertools.accumulate(per + (i < extra) for i in range(shape.seqs))]
        r = shape.rows
        return _Buffers(ids=empty(shape.tokens, torch.int64), rows=empty(r, torch.int64), tokens=empty(r, torch.int64),
                        mask=empty(r, torch.bool), weights=empty(r, torch.float32), old=empty(r, torch.float32),
                        adv=empty(r, torch.float32), ref=empty(r, torch.float32),
                        packed=tr.model.packing(bounds, width=shape.max_len))

    def _logprobs(self, bufs: _Buffers, temperature: float) -> torch.Tensor:
        tr = self.trainer
        with tr._kernels():
            logits = tr.model.forward_ids(bufs.ids, bufs.packed)
            return token_logprobs(logits.index_select(0, bufs.rows), bufs.tokens, temperature)

    def _on_stream(self, work):
        """`work` run on the capture stream, ordered after what the current stream has queued and
        before what it queues next."""
        current = torch.cuda.current_stream(self.trainer.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = work()
        current.wait_stream(self.stream)
        return out


class MinibatchGraphs(_ShapeGraphs):
    what = "a train-step minibatch"

    def __init__(self, trainer, capture: bool = True, capacity: int = CAPACITY):
        super().__init__(trainer, capture, capacity)
        self.accumulators = self._accumulators_on_stream() if capture else []
        """Each LoRA parameter's AccumulateGrad node, made on the capture stream and held alive."""

    def run(self, batch: TrainBatch, idx: list[int], settings: UpdateSettings, first: bool,
            eager: EagerRun) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One minibatch's forward, loss, backward and clipping (zmrl.trainer.ppo.MinibatchRun):
        padded, from a graph where one is kept; `eager` (unpadded) for shapes too large for one."""
        tr = self.trainer
        prompts = [batch.prompts[i] for i in idx]
        completions = [batch.completions[i] for i in idx]
        shape = packed_shape([len(p) for p in prompts], [len(c) for c in completions],
                             tr.cfg.max_position_embeddings)
        if self._unpadded(shape):
            return self._on_stream(lambda: eager(idx, first)) if self.capture else eager(idx, first)
        pad = pad_packed(prompts, completions, shape, settings.loss_agg)
        _check_ids(pad, tr.cfg.vocab_size)
        old = pad.spread([batch.old_logprobs[i] for i in idx])
        adv = pad.broadcast(batch.advantages[idx])
        ref = pad.spread([batch.ref_logprobs[i] for i in idx]) if settings.kl_coef > 0 else None
        # what a graph bakes in besides its buffers: the shape and the settings its ops take as numbers
        key = (pad.shape, settings.temperature, settings.clip_eps, settings.clip_high, settings.kl_coef,
               settings.kl_estimator, settings.max_grad_norm)
        bufs = self._buffers_for(key, pad.shape)
        bufs.fill(pad, old, adv, ref)
        row, ratio_dev = self._run(bufs, pad.shape, lambda: self._body(bufs, settings))
        return row, (ratio_dev if first else None)

    def _body(self, bufs: _Buffers, settings: UpdateSettings) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss, backward and clipping over the buffers: fixed shapes, no host reads."""
        tr = self.trainer
        self._clean()
        lp = self._logprobs(bufs, settings.temperature)
        total, terms, ratio_dev = padded_minibatch_terms(lp, bufs.old, bufs.adv, bufs.ref, bufs.weights,
                                                         bufs.mask, settings)
        with batch_invariant_mode(False):  # as the eager minibatch: the backward on aten's kernels
            total.backward()
        norm = clip_onto_masters(tr.masters, tr._master_grads(), settings.max_grad_norm)
        return torch.cat([terms, norm.double().view(1)]), ratio_dev

    def _accumulators_on_stream(self) -> list:
        # autograd accumulates a leaf's gradient on the stream that was current when the leaf's
        # AccumulateGrad node was made, and the node lives as long as any autograd graph holds it.
        # A backward outside train_step whose graph the caller keeps (a loss, log-probs) would leave
        # nodes made on the default stream, and a captured backward reaching them would make the
        # legacy stream wait on the capturing one, which CUDA refuses. Made here and held, these
        # nodes are the ones every later graph reuses, outside train_step included.
        with torch.enable_grad(), torch.cuda.stream(self.stream):
            return [p.view_as(p).grad_fn.next_functions[0][0] for p in self.trainer.params.values()]

    def _clean(self) -> None:
        # a run leaves this step's gradients, a capture graph-pool tensors, as .grad
        for p in self.trainer.params.values():
            p.grad = None

    def _pointers(self) -> tuple[int, ...]:
        """Where the tensors a graph reads and writes outside its pool live: a replay is valid only
        while none has moved (a parameter or master replaced instead of written in place)."""
        tr = self.trainer
        return tuple(t.data_ptr() for t in (*tr.model.parameters(), *tr.masters,
                                              *(m.grad for m in tr.masters if m.grad is not None)))


class LogprobGraphs(_ShapeGraphs):
    """The log-prob pass (no gradient) packed end to end (zmrl.trainer.padding.PackedShape), one
    graph per shape, temperature and adapter switch: the unpadded pass's bits, and one launch from
    the host where the eager pass makes about a thousand. The padding lies on the sequences' tails,
    a few percent of the tokens (padding every sequence to the longest would add up to a third); a shape's
    packing is refilled in place with each pass's lengths, and its kernels plan for the shape's
    longest sequence, which gives the same bits."""

    what = "a log-prob pass"

    @torch.no_grad()
    def run(self, prompts: list[list[int]], completions: list[list[int]], temperature: float,
            adapter: bool = True) -> list[torch.Tensor] | None:
        """Each completion's log-probs (device tensors), or None where the caller's unpadded eager
        pass should run instead: a shape at or past one whose graph was dropped for memory."""
        tr = self.trainer
        shape = packed_shape([len(p) for p in prompts], [len(c) for c in completions],
                             tr.cfg.max_position_embeddings)
        if self._unpadded(shape):
            return None
        pad = pad_packed(prompts, completions, shape)
        _check_ids(pad, tr.cfg.vocab_size)
        bufs = self._buffers_for((shape, float(temperature), bool(adapter)), shape)
        bufs.fill(pad)
        tr.model.set_lora_enabled(adapter)  # read while the pass runs or is captured, not on replay
        try:
            lp = self._run(bufs, shape, lambda: (self._logprobs(bufs, temperature),))[0]
        finally:
            tr.model.set_lora_enabled(True)
        return list(lp[:pad.num_tokens].split(list(pad.completion_lens)))

    def _pointers(self) -> tuple[int, ...]:
        """The model's weights and adapter: a replay is valid only while none has moved."""
        model = self.trainer.model
        return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
