"""Where do two hosts of the zmrl model part ways? Layer-by-layer, bit-for-bit comparison.

    python benchmarks/compare_hosts.py --model runs/models/small-bf16 --device cuda
    python benchmarks/compare_hosts.py --model DIR --adapter random --prompt-lengths 3,300,600 --json out.json

Runs the same sequences (random token ids; prompts of --prompt-lengths tokens, each followed by
--completion tokens) through
  - "packed":   zmrl.model.packed.forward_packed, all sequences in one call (what the reference
                rollout engine and the reference trainer run),
  - "hf":       the transformers host (AutoModelForCausalLM), one sequence per call,
  - "megatron": the Megatron trainer's GPTModel (needs megatron-core), all sequences packed,
with the same adapter on each (--adapter none | zero | random: no adapter, a fresh one with B = 0,
or random nonzero factors), and prints, for every traced stage (embedding, each layer's attention
output, MLP input and output, layer output, logits) and for the completion tokens' log-probs, how
many elements differ from "packed" and by how much at most. The first stage that differs is where
the hosts part ways. For every MoE layer it also runs zmrl's two MoE paths (the fused kernel and
the per-expert composed path that an expert adapter selects) on the packed host's own MLP input:
they must agree bit for bit, since a host holding a zero adapter and one holding none pick
different paths. Exit status 0 when every comparison is bitwise equal, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zmrl.lora import LoraAdapter, LoraConfig  # noqa: E402
from zmrl.model.checkpoint import DTYPES, load_checkpoint  # noqa: E402
from zmrl.model.device import resolve_device  # noqa: E402
from zmrl.model.logprobs import completion_logprobs  # noqa: E402
from zmrl.model.mlp import _experts_composed, moe_mlp, route  # noqa: E402
from zmrl.model.packed import forward_packed, split_layer_weights  # noqa: E402
from zmrl.model.projections import BASE  # noqa: E402


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.detach(), b.detach().to(a.device)
    if a.shape != b.shape:
        return {"shape": f"{tuple(a.shape)} vs {tuple(b.shape)}", "differing": -1, "max_abs": float("nan")}
    ne = a != b
    d = (a.double() - b.double()).abs()
    return {"differing": int(ne.sum()), "of": a.numel(), "max_abs": float(d.max()) if d.numel() else 0.0}


class Recorder:
    def __init__(self):
        self.stages: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, stage: str, layer: int, t: torch.Tensor) -> None:
        self.stages[(stage, layer)] = t.detach().reshape(-1, t.shape[-1]).clone()


def make_adapter(cfg, lcfg: LoraConfig, mode: str, dtype, device, seed: int) -> LoraAdapter | None:
    if mode == "none":
        return None
    adapter = LoraAdapter(cfg, lcfg, seed=seed, dtype=dtype)
    if mode == "random":
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in adapter.factors.values():
                p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(dtype))
    return adapter.requires_grad_(False).to(device)


def megatron_host(model_dir, cfg, lcfg, adapter, device):
    from zmrl.trainer.megatron import MegatronTrainer

    trainer = MegatronTrainer.from_dir(model_dir, lcfg, seed=0, device=device)
    if adapter is not None:
        trainer.load_adapter_tensors({k: v.detach().cpu() for k, v in adapter.factors.items()})
    rec = Recorder()
    model = trainer.model

    def hook(stage, layer, pick=lambda out: out[0] if isinstance(out, tuple) else out):
        return lambda _m, _i, out: rec(stage, layer, pick(out))

    model.embedding.register_forward_hook(hook("embed", -1))
    for i, layer in enumerate(model.decoder.layers):
        layer.self_attention.register_forward_hook(hook("attn", i))
        layer.pre_mlp_layernorm.register_forward_hook(hook("mlp_in", i))
        layer.mlp.register_forward_hook(hook("mlp", i))
        layer.register_forward_hook(hook("layer", i))
    model.output_layer.register_forward_hook(hook("logits", -1))
    return trainer, rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt-lengths", default="3,21,40,300")
    p.add_argument("--completion", type=int, default=24)
    p.add_argument("--adapter", choices=["none", "zero", "random"], default="zero")
    p.add_argument("--hosts", default="hf,megatron", help="compared with 'packed': any of hf, megatron")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)

    device = resolve_device(args.device)
    cfg, weights = load_checkpoint(args.model, device=str(device))
    dtype = DTYPES[cfg.torch_dtype]
    gen = torch.Generator().manual_seed(args.seed)
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    completions = [torch.randint(3, cfg.vocab_size, (args.completion,), generator=gen).tolist() for _ in lengths]
    seqs = [torch.tensor(a + b) for a, b in zip(prompts, completions)]
    lcfg = LoraConfig(r=8, lora_alpha=16.0)
    adapter = make_adapter(cfg, lcfg, args.adapter, dtype, device, args.seed)
    projections = adapter.projections if adapter is not None else None
    hosts = [h for h in args.hosts.split(",") if h]
    report = {"model": args.model, "device": str(device), "dtype": cfg.torch_dtype, "adapter": args.adapter,
              "prompt_lengths": lengths, "completion": args.completion, "index_topk": cfg.index_topk, "hosts": {}}
    print(f"# {args.model} ({cfg.torch_dtype}) on {device}, adapter {args.adapter}, prompts {lengths} "
          f"+ {args.completion} tokens, index_topk {cfg.index_topk}")

    w_layers = split_layer_weights(cfg, weights)
    ref = Recorder()
    with torch.no_grad():
        ref_logits = forward_packed(cfg, weights, w_layers, seqs, None, projections, trace=ref)
    ref_lp = completion_logprobs(ref_logits, prompts, seqs, args.temperature)
    all_equal = True

    # the two MoE paths on the packed host's own MLP inputs
    moe = {}
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(layer):
            continue
        x = ref.stages[("mlp_in", layer)]
        with torch.no_grad():
            fused = moe_mlp(cfg, w_layers[layer], x, BASE)
            weights_, ids = route(cfg, w_layers[layer], x)
            composed = _experts_composed(cfg, w_layers[layer], x, ids, weights_, BASE)
        moe[layer] = diff(fused, composed)
        all_equal &= moe[layer]["differing"] == 0
    report["moe_fused_vs_composed"] = moe
    print("moe fused vs composed (zero adapter), per layer: "
          + ", ".join(f"L{k}: {v['differing']}/{v['of']}" for k, v in moe.items()))

    for host in hosts:
        out = {"stages": {}}
        if host == "hf":
            from transformers import AutoModelForCausalLM  # zmrl's import hook registers the zmrl model

            model = AutoModelForCausalLM.from_pretrained(args.model).to(device).eval()
            model.set_adapter(adapter)
            with torch.no_grad():
                logits = [model(s[None].to(device)).logits[0] for s in seqs]
            out["stages"]["logits"] = diff(torch.cat(logits), ref.stages[("logits", -1)])
        elif host == "megatron":
            trainer, rec = megatron_host(args.model, cfg, lcfg, adapter, device)
            with torch.no_grad():
                logits = trainer.logits(seqs, adapter=adapter is not None)
            for key, want in ref.stages.items():
                if key in rec.stages:
                    out["stages"][f"{key[0]}[{key[1]}]" if key[1] >= 0 else key[0]] = diff(rec.stages[key], want)
        else:
            raise SystemExit(f"unknown host {host!r}")
        lp = completion_logprobs(logits, prompts, seqs, args.temperature)
        out["logprobs"] = diff(torch.cat(lp), torch.cat(ref_lp))
        first = next((k for k, v in out["stages"].items() if v["differing"]), None)
        out["first_differing_stage"] = first
        all_equal &= out["logprobs"]["differing"] == 0 and first is None
        report["hosts"][host] = out
        print(f"\n{host} vs packed: log-probs {out['logprobs']['differing']}/{out['logprobs']['of']} differ "
              f"(max |diff| {out['logprobs']['max_abs']:.3e}); first differing stage: {first}")
        for stage, d in out["stages"].items():
            print(f"  {stage:14s} {d['differing']:>9d} / {d.get('of', 0):<9d} max|diff| {d['max_abs']:.3e}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print("\nall bitwise equal" if all_equal else "\nDIFFERENCES FOUND")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
