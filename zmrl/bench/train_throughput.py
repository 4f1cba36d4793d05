"""Trainer throughput: zmrl's Megatron trainer (invariance on and off) vs transformers + PEFT, one run.

    zmrl bench train [--preset tiny|small|k31-layer] [--layers N] [--num-seqs 32] [--prompt-len 290]
                     [--completion-len 170] [--lora-rank R] [--warmup W] [--iters N] [--device auto|cpu|cuda]
                     [--dtype auto|float32|bfloat16] [--peak-tflops X] [--systems baseline,on,off]
                     [--vary-batches] [--interleave]

One process builds, on one device, with random weights of the preset's dims:
1. zmrl's MegatronTrainer (zmrl.trainer.megatron) with LoRA of rank R on every target zmrl adapts
   (its default targets: every attention projection, every routed and shared expert), timed with batch
   invariance on and then off (the trainer's own switch: off = torch's default kernels, the
   negative control, not a tuned trainer: its sparse MLA gathers every selected row, so on an H200
   a small-preset train step takes about 90 s off; `--systems baseline,on` leaves it out);
2. the baseline a user would pick: transformers' DeepseekV3ForCausalLM with the same dims (MLA,
   MoE experts/top-k/groups, shared experts, first dense layers; no DSA indexer: dense causal
   attention), SDPA attention, PEFT LoRA of rank R on the five attention projections, AdamW.
Both see the same batch: num_seqs sequences of prompt_len and completion_len tokens on average
(lengths drawn uniformly within +-25%, seeded). Per system it times
- a train step: 2 minibatches, each a forward with gradient, a PPO-clip loss on the completion
  tokens' log-probs, backward, gradient clipping and an AdamW step;
- a log-prob pass: one no-grad forward over the whole batch and the completion tokens' log-probs;
warm-up iterations first (compilation, autotuning, allocator), then the timed ones (median).
With --vary-batches every call (warm-up included) leaves out one sequence, a different one each
call, the same for every system: no call repeats another's token counts, as in RL, where every
step brings a new batch (one batch repeated lets anything cached per shape hit every time). Each
call's time is then scaled to the whole batch's tokens (time * tokens / the call's tokens).
With --interleave every system is built first and call i of each runs back to back (train steps,
then log-prob passes), so a drift of the host's speed within the run falls on all of them; each
call's ratio to the baseline's call i is printed besides the medians. On one H200 the same code's
train step moved 20-30% between processes minutes apart, more than a change under test.
Tokens/s counts every real token of the batch (prompt + completion; padding excluded).
On CUDA zmrl's train step pads each minibatch to a bucketed shape and replays a CUDA graph per
shape (the Megatron trainer's `cuda_graphs` option): a call whose minibatch shape an earlier call
(warm-up included) brought replays its graph, a new shape runs eagerly and is captured. The run
prints how many were captured and replayed; the timed calls include the captures.
On CUDA it also prints achieved TFLOP/s (zmrl.bench.train_flops states the formula) and their
fraction of the bf16 peak: an 8192^3 bf16 torch.matmul timed in this run, or --peak-tflops, and the
CUDA allocator's peak memory after building each system and after each timed mode.

Memory of `--preset k31-layer` on one H200 (140 GiB), estimated at about 113 GiB at peak:
base weights 78.3 GiB (one copy: the trainer's stacked experts, filled on the device from one
expanded matrix), LoRA with fp32 AdamW 12.1 GiB, activations up to about 23 GiB (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import statistics
import sys
import time

from zmrl.bench import BenchInputError

ATTENTION_MODULES = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
DEFAULT_RANK = {"tiny": 8, "small": 8, "k31-layer": 32}
SHARED_EXPERT_BYTES = 2 << 30
"""Above this size the routed experts of the benchmark model share one random matrix per
projection, made on the benchmark's device and expanded (not copied) over the experts: a k31-layer
has 79 GB of experts, which only the trainer's own stacked expert parameters hold (the trainer copies
the matrix into each expert's slot on the device), and the weights' values do not change the work a
GEMM does."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from zmrl.model.presets import PRESETS

    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=290, help="mean prompt tokens (+-25%%)")
    p.add_argument("--completion-len", type=int, default=170, help="mean completion tokens (+-25%%)")
    p.add_argument("--lora-rank", type=int, help="default: 8 (tiny, small), 32 (k31-layer)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per system first")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per system (median reported)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--peak-tflops", type=float, help="bf16 peak to divide by (default: measured here)")
    p.add_argument("--systems", default="baseline,on,off",
                   help="which systems to time, in this order (comma-separated: baseline = transformers "
                        "DeepseekV3 + PEFT, on / off = zmrl with batch invariance on / off); each one's "
                        "figures are printed as soon as it finishes")
    p.add_argument("--skip-baseline", action="store_true", help="same as leaving baseline out of --systems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interleave", action="store_true",
                   help="build every system at once and run call i of each in turn (train steps, then "
                        "log-prob passes), so a drift of the host's speed falls on all alike; prints each "
                        "call's ratio to the baseline's (needs the memory of all systems at once)")
    p.add_argument("--vary-batches", action="store_true",
                   help="each call leaves out another sequence (new token counts every call, as in RL); "
                        "times are scaled to the whole batch")


# ----------------------------------------------------------------------------- model and batch
def bench_config(preset: str, layers: int | None, dtype: str):
    from zmrl.model.config import ModelConfig
    from zmrl.model.presets import PRESETS

    fields = dict(PRESETS[preset], torch_dtype=dtype)
    if layers is not None:
        if layers < 1:
            raise BenchInputError(f"--layers must be >= 1, got {layers}")
        fields["num_hidden_layers"] = layers
        fields["first_k_dense_replace"] = min(fields["first_k_dense_replace"], layers)
    return ModelConfig(**fields)


def random_weights(cfg, dtype, seed: int, device=None) -> tuple[dict, bool]:
    """normal(0, initializer_range) matrices (drawn on the CPU, seeded), ones for norms, zeros for
    the router bias. -> (weights, whether the experts share one matrix per projection: see
    SHARED_EXPERT_BYTES; that matrix is put on `device`, the others stay on the CPU)."""
    import torch

    from zmrl.model.layers import param_shapes

    gen = torch.Generator().manual_seed(seed)
    elem = torch.finfo(dtype).bits // 8
    out, shared = {}, False
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith("e_score_correction_bias"):
            out[name] = torch.zeros(shape, dtype=dtype)
        elif len(shape) == 3 and cfg.n_routed_experts * shape[1] * shape[2] * elem * 3 > SHARED_EXPERT_BYTES:
            one = torch.randn(shape[1:], generator=gen) * cfg.initializer_range
            out[name], shared = one.to(dtype=dtype, device=device).expand(shape), True
        else:
            out[name] = (torch.randn(shape, generator=gen) * cfg.initializer_range).to(dtype)
    return out, shared


def make_batch(cfg, num_seqs: int, prompt_len: int, completion_len: int, seed: int):
    """-> (prompts, completions): token-id lists, lengths uniform in [0.75, 1.25] x the mean."""
    import torch

    if num_seqs < 2 or prompt_len < 1 or completion_len < 1:
        raise BenchInputError(f"need --num-seqs >= 2 (2 minibatches), --prompt-len >= 1 and --completion-len "
                              f">= 1, got {num_seqs}, {prompt_len}, {completion_len}")
    longest = int(prompt_len * 1.25) + int(completion_len * 1.25) + 2
    if longest > cfg.max_position_embeddings:
        raise BenchInputError(f"sequences up to {longest} tokens exceed max_position_embeddings="
                              f"{cfg.max_position_embeddings}")
    gen = torch.Generator().manual_seed(seed)

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * 0.75)), max(1, int(mean * 1.25))
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    prompts, completions = [], []
    for _ in range(num_seqs):
        prompts.append(torch.randint(2, cfg.vocab_size, (length(prompt_len),), generator=gen).tolist())
        completions.append(torch.randint(2, cfg.vocab_size, (length(completion_len),), generator=gen).tolist())
    return prompts, completions


# ----------------------------------------------------------------------------- timing
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, warmup: int, iters: int, device, share=None) -> float:
    """Median seconds of `iters` calls after `warmup` untimed ones; fn(i) is call i (warm-up ones
    first). share(i): the fraction of the whole batch's tokens call i runs (its time is divided by it)."""
    return statistics.median(interleaved_times({"": fn}, warmup, iters, device, share)[""])


def interleaved_times(fns: dict, warmup: int, iters: int, device, share=None) -> dict[str, list[float]]:
    """fns: system -> fn(i). Call i of every system in turn (the systems' order), warm-up calls
    first -> system -> its timed calls' seconds (each divided by share(i) where given). A drift of
    the host's speed (other load, clocks, a neighbour on the machine) then falls on every system
    alike."""
    for i in range(warmup):
        for fn in fns.values():
            fn(i)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup, warmup + iters):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn(i)
            _sync(device)
            times[name].append((time.perf_counter() - t0) / (share(i) if share is not None else 1.0))
    return times


@dataclasses.dataclass(frozen=True)
class Calls:
    """Which sequences each timed or warm-up call runs (--vary-batches: all but one, another each call)."""
    lengths: tuple[int, ...]  # every sequence's tokens (prompt + completion)
    vary: bool

    @staticmethod
    def whole(prompts, completions) -> "Calls":
        """Every call runs the whole batch."""
        return Calls(tuple(len(p) + len(c) for p, c in zip(prompts, completions)), False)

    def sequences(self, i: int) -> list[int]:
        n = len(self.lengths)
        return [j for j in range(n) if not self.vary or j != i % n]

    def share(self, i: int) -> float:
        return sum(self.lengths[j] for j in self.sequences(i)) / sum(self.lengths)


def measure_peak_tflops(device) -> float:
    """bf16 TFLOP/s of an 8192^3 torch.matmul (cuBLAS), best of 10 after warm-up."""
    import torch

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / best / 1e12


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def print_peak_memory(what: str, device) -> None:
    """The CUDA caching allocator's peak since the last _reset_peak: allocated (tensors) and
    reserved (what the process holds), against the device's total. Nothing on the CPU."""
    import torch

    if device.type != "cuda":
        return
    gib = 2 ** 30
    total = torch.cuda.get_device_properties(device).total_memory
    print(f"peak CUDA memory, {what}: {torch.cuda.max_memory_allocated(device) / gib:.1f} GiB allocated, "
          f"{torch.cuda.max_memory_reserved(device) / gib:.1f} GiB reserved, of {total / gib:.1f} GiB "
          f"(resident now {torch.cuda.memory_allocated(device) / gib:.1f} GiB)", flush=True)


# ----------------------------------------------------------------------------- the two systems
def zmrl_system(cfg, weights, rank: int, prompts, completions, args, device, calls: Calls | None = None):
    """-> (trainer, train(i), score(i), base parameter count): zmrl's trainer built, its calls ready
    (the trainer's `invariant` switch picks the mode)."""
    import torch

    from zmrl.lora import LoraConfig
    from zmrl.trainer.base import TrainBatch, UpdateSettings
    from zmrl.trainer.megatron import MegatronTrainer

    _reset_peak(device)
    trainer = MegatronTrainer(cfg, weights, LoraConfig(r=rank, lora_alpha=2.0 * rank), seed=args.seed)
    weights.clear()  # the trainer holds its own copy
    print_peak_memory("zmrl trainer built (weights, LoRA, fp32 masters)", device)
    base_params = sum(p.numel() for n, p in trainer.model.named_parameters() if ".lora_" not in n)
    calls = calls or Calls.whole(prompts, completions)
    old = trainer.logprobs(prompts, completions, temperature=1.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    advantages = torch.randn(len(prompts), generator=gen)
    settings = UpdateSettings(lr=1e-6, num_minibatches=2, temperature=1.0)
    step = [0]

    def train(i):
        idx = calls.sequences(i)
        batch = TrainBatch(prompts=[prompts[j] for j in idx], completions=[completions[j] for j in idx],
                           old_logprobs=[old[j] for j in idx], advantages=advantages[idx])
        trainer.train_step(batch, settings, step[0])
        step[0] += 1

    def score(i):
        idx = calls.sequences(i)
        trainer.logprobs([prompts[j] for j in idx], [completions[j] for j in idx], temperature=1.0)

    return trainer, train, score, base_params


def time_zmrl(cfg, weights, rank: int, prompts, completions, args, device, modes=("on", "off"),
              on_done=None, calls: Calls | None = None) -> tuple[dict, int]:
    """-> ({"on": (train_s, logprob_s), "off": ...} for `modes`, base parameter count)."""
    calls = calls or Calls.whole(prompts, completions)
    trainer, train, score, base_params = zmrl_system(cfg, weights, rank, prompts, completions, args, device, calls)
    out = {}
    for mode in modes:
        trainer.invariant = mode == "on"
        _reset_peak(device)
        train_s = time_calls(train, args.warmup, args.iters, device, calls.share)
        lp_s = time_calls(score, args.warmup, args.iters, device, calls.share)
        out[mode] = (train_s, lp_s)
        print_peak_memory(f"zmrl invariance {mode}, train steps and log-prob passes", device)
        if on_done is not None:
            on_done(mode, train_s, lp_s)
    describe_graphs(trainer)
    trainer.invariant = True
    del trainer, train, score
    _free(device)
    return out, base_params


def describe_graphs(trainer) -> None:
    for name, runs, graphs in (("train step", "minibatches", trainer.minibatch_graphs),
                               ("log-prob pass", "passes", trainer.logprob_graphs)):
        if graphs is None:
            print(f"zmrl {name}: eager {runs} (no CUDA graphs)")
            continue
        shapes = sorted({f"{key[0]} ({key[0].tokens:,} rows through the model)" for key in graphs.buffers})
        print(f"zmrl {name}: {runs} padded to bucketed shapes, {graphs.captures} CUDA graph(s) captured, "
              f"{graphs.replays} replayed (warm-up and timed calls, invariance on); shapes kept: "
              f"{'; '.join(shapes) or 'none'}")
        for line in graphs.eager_for_memory:
            print(f"zmrl {name}: eager {runs} of {line}")


def hf_config(cfg):
    """transformers' DeepseekV3Config with zmrl's dims (rotate-half RoPE, no YaRN)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.n_routed_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, n_group=cfg.n_group, topk_group=cfg.topk_group,
        num_experts_per_tok=cfg.num_experts_per_tok, first_k_dense_replace=cfg.first_k_dense_replace,
        norm_topk_prob=True, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings, initializer_range=cfg.initializer_range,
        pad_token_id=0, bos_token_id=None, eos_token_id=None, use_cache=False,
    )


def check_hf_config(cfg, hf) -> None:
    """The baseline's config carries zmrl's dims (each name that both spell alike, and the MoE ones)."""
    names = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "n_shared_experts", "n_routed_experts", "kv_lora_rank", "q_lora_rank",
             "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
             "num_experts_per_tok", "first_k_dense_replace", "routed_scaling_factor"]
    bad = [f"{n}: zmrl {getattr(cfg, n)} vs transformers {getattr(hf, n, None)}" for n in names
           if getattr(hf, n, None) != getattr(cfg, n)]
    if bad:
        raise ValueError("the transformers baseline's config differs from zmrl's: " + "; ".join(bad))


def baseline_system(cfg, rank: int, prompts, completions, args, device, dtype, calls: Calls | None = None):
    """-> (train(i), score(i), describe(), base parameter count): transformers + PEFT built, its
    calls ready; describe() prints what was built."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import DeepseekV3ForCausalLM

    from zmrl.trainer.losses import ppo_clip_loss

    hf = hf_config(cfg)
    check_hf_config(cfg, hf)
    hf._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    _reset_peak(device)
    with torch.device(device):
        model = DeepseekV3ForCausalLM._from_config(hf, dtype=dtype, attn_implementation="sdpa")
    if cfg.qk_rope_head_dim == 0:
        # NoPE: transformers' rotary module assumes a rope dim; zmrl's NoPE rotates nothing
        class NoRope(torch.nn.Module):
            def forward(self, x, position_ids):
                empty = x.new_zeros(*position_ids.shape, 0)
                return empty, empty

        model.model.rotary_emb = NoRope()
    base_params = sum(p.numel() for p in model.parameters())
    model = get_peft_model(model, PeftLoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                 target_modules=ATTENTION_MODULES))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6)

    def padded(idx):
        seqs = [prompts[i] + completions[i] for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        rows, cols, targets = [], [], []
        for b, (i, s) in enumerate(zip(idx, seqs)):
            ids[b, :len(s)] = torch.tensor(s)
            mask[b, :len(s)] = 1
            p = len(prompts[i])
            for j in range(len(completions[i])):  # position p - 1 + j predicts completion token j
                rows.append(b)
                cols.append(p - 1 + j)
                targets.append(completions[i][j])
        return [torch.tensor(x, device=device) for x in (rows, cols, targets)] + [ids.to(device), mask.to(device)]

    def logprobs(idx):
        rows, cols, targets, ids, mask = padded(idx)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        lp = torch.log_softmax(logits[rows, cols].float(), -1)
        return lp.gather(-1, targets[:, None])[:, 0]

    calls = calls or Calls.whole(prompts, completions)
    everyone = list(range(len(prompts)))
    with torch.no_grad():  # per sequence: each call takes its sequences' own
        old = list(logprobs(everyone).split([len(c) for c in completions]))
    gen = torch.Generator().manual_seed(args.seed + 1)
    adv_seq = torch.randn(len(prompts), generator=gen)

    def train(i):
        idx = calls.sequences(i)
        model.train()
        for h in (idx[: len(idx) // 2], idx[len(idx) // 2:]):  # 2 minibatches, as zmrl's trainer splits
            o = torch.cat([old[j] for j in h])
            a = torch.cat([adv_seq[j].expand(len(completions[j])) for j in h]).to(device)
            optimizer.zero_grad(set_to_none=True)
            loss, _, _ = ppo_clip_loss(logprobs(h), o, a, 0.2, 0.2)
            loss.mean().backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
        model.eval()

    def score(i):
        with torch.no_grad():
            logprobs(calls.sequences(i))

    def describe():
        print(f"baseline: transformers experts implementation "
              f"{getattr(model.config, '_experts_implementation', None) or 'default'}, attention "
              f"{getattr(model.config, '_attn_implementation', None)}, LoRA adapter dtype "
              f"{trainable[0].dtype if trainable else '-'}")

    return train, score, describe, base_params


def time_baseline(cfg, rank: int, prompts, completions, args, device, dtype,
                  calls: Calls | None = None) -> tuple[tuple[float, float], int]:
    """-> ((train_s, logprob_s), base parameter count)."""
    calls = calls or Calls.whole(prompts, completions)
    train, score, describe, base_params = baseline_system(cfg, rank, prompts, completions, args, device, dtype,
                                                          calls)
    train_s = time_calls(train, args.warmup, args.iters, device, calls.share)
    lp_s = time_calls(score, args.warmup, args.iters, device, calls.share)
    print_peak_memory("transformers + PEFT, built and timed", device)
    describe()
    print(f"  transformers + PEFT: train step {train_s:.3f} s, log-probs {lp_s:.3f} s", file=sys.stderr, flush=True)
    del train, score, describe
    _free(device)
    return (train_s, lp_s), base_params


def run_interleaved(cfg, rank, prompts, completions, args, device, dtype, systems, calls, print_row):
    """--interleave: every system built at once (zmrl's modes share one trainer), then the train
    steps of call i of every system in turn, then their log-prob passes; medians printed as rows,
    and each timed call's ratio to the baseline's call i (the pair ran back to back)."""
    fns, trainer, zmrl_params, base_params, describe = {}, None, None, None, None
    if "baseline" in systems:
        b_train, b_score, describe, base_params = baseline_system(cfg, rank, prompts, completions, args, device,
                                                                  dtype, calls)
        fns["baseline"] = (b_train, b_score)
    modes = [m for m in systems if m != "baseline"]
    if modes:
        weights, _ = random_weights(cfg, dtype, args.seed, device)
        trainer, z_train, z_score, zmrl_params = zmrl_system(cfg, weights, rank, prompts, completions, args, device,
                                                             calls)

        def in_mode(mode, fn):
            def call(i):
                trainer.invariant = mode == "on"
                fn(i)
            return call

        for mode in modes:
            fns[mode] = (in_mode(mode, z_train), in_mode(mode, z_score))
    order = [s for s in systems if s in fns]
    train = interleaved_times({s: fns[s][0] for s in order}, args.warmup, args.iters, device, calls.share)
    score = interleaved_times({s: fns[s][1] for s in order}, args.warmup, args.iters, device, calls.share)
    if describe is not None:
        describe()
    if trainer is not None:
        describe_graphs(trainer)
    print_peak_memory("every system built, then interleaved", device)
    times = {s: (statistics.median(train[s]), statistics.median(score[s])) for s in order}
    for s in order:
        print_row(s, *times[s])
    if "baseline" in times:
        for s in order:
            if s == "baseline":
                continue
            pairs = [[b / z for b, z in zip(t["baseline"], t[s])] for t in (train, score)]
            print(f"paired ratio {SYSTEM_NAMES[s]} / baseline, call by call (throughput): train "
                  f"{', '.join(f'{r:.3f}' for r in pairs[0])} (median {statistics.median(pairs[0]):.3f}); "
                  f"log-probs {', '.join(f'{r:.3f}' for r in pairs[1])} (median {statistics.median(pairs[1]):.3f})")
    if trainer is not None:
        trainer.invariant = True
    fns.clear()
    _free(device)
    return times, zmrl_params, base_params


# ----------------------------------------------------------------------------- the report
SYSTEM_NAMES = {"baseline": "transformers DeepseekV3 + PEFT", "on": "zmrl, invariance on",
                "off": "zmrl, invariance off"}


def parse_systems(text: str, skip_baseline: bool = False) -> list[str]:
    """--systems "baseline,on,off" -> ["baseline", "on", "off"] (checked, order kept)."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEM_NAMES]
    if unknown or not systems or len(set(systems)) != len(systems):
        raise BenchInputError(f"--systems must list some of {', '.join(SYSTEM_NAMES)} once each, got {text!r}")
    systems = [s for s in systems if not (skip_baseline and s == "baseline")]
    if not systems:
        raise BenchInputError("--skip-baseline leaves nothing to time: --systems named only the baseline")
    return systems


def weight_bytes(cfg, dtype) -> int:
    """Bytes of one copy of the model's weights (every expert: the trainer holds them all)."""
    import math

    import torch

    from zmrl.model.layers import param_shapes

    return sum(math.prod(shape) for shape in param_shapes(cfg).values()) * (torch.finfo(dtype).bits // 8)


def available_bytes(device) -> int | None:
    """Free memory where the weights will live: the GPU's free memory, or the host's MemAvailable
    (None where it cannot be read)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(cfg, dtype, device, what: str) -> None:
    """Refuse a model whose weights alone do not fit, before anything is built (the process would
    be killed for memory partway through, with no message)."""
    need, free = weight_bytes(cfg, dtype), available_bytes(device)
    if free is not None and need > free:
        where = "GPU memory free" if device.type == "cuda" else "host memory available"
        gib = 1 << 30
        raise BenchInputError(f"{what} ({cfg.num_hidden_layers} layer(s), {str(dtype)[6:]}) needs "
                              f"{need / gib:.1f} GiB for one copy of the weights, and {device.type} has "
                              f"{free / gib:.1f} GiB {where} (try fewer --layers or another --device)")


def _pick_device(choice: str):
    import torch

    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise BenchInputError("--device cuda: no CUDA device is visible")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run(args: argparse.Namespace) -> None:
    if args.device == "cpu":
        # the Megatron trainer (and its process group) take the GPU whenever one is visible:
        # hide it before anything initializes CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    device = _pick_device(args.device)
    if args.device == "cpu" and torch.cuda.is_available():
        raise BenchInputError("--device cpu: CUDA was initialized before the benchmark could hide it; "
                              "run with CUDA_VISIBLE_DEVICES= instead")
    if args.warmup < 0 or args.iters < 1:
        raise BenchInputError(f"--warmup must be >= 0 and --iters >= 1, got {args.warmup}, {args.iters}")
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    rank = args.lora_rank or DEFAULT_RANK.get(args.preset, 8)
    cfg = bench_config(args.preset, args.layers, dtype_name)
    prompts, completions = make_batch(cfg, args.num_seqs, args.prompt_len, args.completion_len, args.seed)
    systems = parse_systems(args.systems, args.skip_baseline)
    check_memory(cfg, dtype, device, f"--preset {args.preset}")
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    tokens, completion_tokens = sum(lengths), sum(len(c) for c in completions)

    from zmrl.bench.train_flops import count_flops

    zmrl_flops = count_flops(cfg, lengths, lora_r=rank, lora_on_experts=True, absorbed_sparse=True)
    base_flops = count_flops(cfg, lengths, lora_r=rank, lora_on_experts=False, absorbed_sparse=False)
    peak = args.peak_tflops
    peak_how = "given (--peak-tflops)"
    if device.type == "cuda" and peak is None:
        peak, peak_how = measure_peak_tflops(device), "measured: 8192^3 bf16 torch.matmul, best of 10"

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor()
                                                                                   or platform.machine())
    print(f"# zmrl bench train: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | "
          f"{device_name} | torch {torch.__version__} | {torch.get_num_threads()} CPU threads | load average "
          f"(1 min) at start {os.getloadavg()[0]:.2f}")
    print(f"command: zmrl bench train {' '.join(sys.argv[3:]) if sys.argv[1:3] == ['bench', 'train'] else ''}")
    print(f"model: preset {args.preset}, {cfg.num_hidden_layers} layer(s), {dtype_name}, hidden "
          f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, {cfg.n_routed_experts} experts top-"
          f"{cfg.num_experts_per_tok} + {cfg.n_shared_experts} shared, first {cfg.first_k_dense_replace} dense, "
          f"index_topk {cfg.index_topk}")
    print(f"batch: {args.num_seqs} sequences, {tokens} tokens ({completion_tokens} completion), lengths "
          f"{min(lengths)}..{max(lengths)}; train step = 2 minibatches (forward, PPO-clip loss, backward, "
          f"clip, AdamW); log-probs = one no-grad forward over the batch")
    print(f"LoRA rank {rank}: zmrl on every attention projection and every routed/shared expert; "
          f"baseline (PEFT) on {', '.join(ATTENTION_MODULES)}")
    print(f"timing: {args.warmup} warm-up + {args.iters} timed iteration(s) per system and pass, median"
          + ("; --interleave: call i of every system back to back" if args.interleave else "")
          + ("; --vary-batches: each call leaves out another sequence (new token counts every call), its time "
             "scaled to the whole batch" if args.vary_batches else "; the same batch every call"))
    if peak:
        print(f"bf16 peak: {peak:.1f} TFLOP/s ({peak_how})")

    flops_of = {"baseline": base_flops, "on": zmrl_flops, "off": zmrl_flops}
    print()
    print("| system | train step (s) | trained tok/s | log-probs (s) | log-prob tok/s | train TFLOP/s | "
          "log-prob TFLOP/s | train % peak | log-prob % peak |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)

    def print_row(system: str, train_s: float, lp_s: float) -> None:
        flops = flops_of[system]
        tf_train, tf_lp = flops.train / train_s / 1e12, flops.forward / lp_s / 1e12
        pct = (f"{100 * tf_train / peak:.1f} | {100 * tf_lp / peak:.1f}" if peak else "- | -")
        print(f"| {SYSTEM_NAMES[system]} | {train_s:.3f} | {tokens / train_s:,.0f} | {lp_s:.3f} | "
              f"{tokens / lp_s:,.0f} | {tf_train:.3g} | {tf_lp:.3g} | {pct} |", flush=True)

    calls = Calls(tuple(lengths), args.vary_batches)
    times, zmrl_params, base_params = {}, None, None
    if args.interleave:
        times, zmrl_params, base_params = run_interleaved(cfg, rank, prompts, completions, args, device, dtype,
                                                          systems, calls, print_row)
    for system in systems:
        if system in times:
            continue
        if system == "baseline":
            times["baseline"], base_params = time_baseline(cfg, rank, prompts, completions, args, device, dtype,
                                                           calls)
            print_row("baseline", *times["baseline"])
            continue
        modes = [m for m in systems if m != "baseline" and m not in times]  # zmrl's modes share one trainer
        weights, shared = random_weights(cfg, dtype, args.seed, device)
        if shared:
            print(f"note: the {cfg.n_routed_experts} routed experts share one random matrix per projection "
                  f"(memory); the work per GEMM is unchanged", file=sys.stderr)
        zmrl_times, zmrl_params = time_zmrl(cfg, weights, rank, prompts, completions, args, device, modes,
                                            on_done=print_row, calls=calls)
        times.update(zmrl_times)
    print()
    indexer = sum(cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + cfg.hidden_size * cfg.index_head_dim
                  + cfg.index_head_dim + cfg.hidden_size * cfg.index_n_heads for _ in range(cfg.num_hidden_layers))
    if zmrl_params is not None:
        print(f"base parameters: zmrl {zmrl_params:,} (of which DSA indexer {indexer:,})"
              + (f", transformers {base_params:,}; zmrl without the indexer "
                 f"{'equals' if zmrl_params - indexer == base_params else 'DIFFERS FROM'} transformers"
                 if base_params is not None else ""))
    for a, b, label in (("on", "off", "invariance on / off"), ("on", "baseline", "zmrl on / baseline"),
                        ("off", "baseline", "zmrl off / baseline")):
        if a in times and b in times:
            print(f"ratio {label} (throughput): train {times[b][0] / times[a][0]:.3f}, "
                  f"log-probs {times[b][1] / times[a][1]:.3f}")
    print(f"load average (1 min) at end {os.getloadavg()[0]:.2f}")
    print(f"GEMM FLOPs per pass (zmrl.bench.train_flops): zmrl forward {zmrl_flops.forward / 1e12:.3g} T, "
          f"train {zmrl_flops.train / 1e12:.3g} T; baseline forward {base_flops.forward / 1e12:.3g} T, "
          f"train {base_flops.train / 1e12:.3g} T")
