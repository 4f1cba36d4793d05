"""zmrl.model: the model family written once as functions of (activations, weights, cache view).

Stack: config (plain dataclass) -> projections (the adapter hook) -> attention (MLA absorbed
form + DSA indexer) and mlp (dense SwiGLU, MoE) -> layers (decoder layer, head, parameter
spec) -> packed (a per-sequence host loop) -> hf (the transformers host), checkpoint,
tokenizer, presets, factory (a fresh checkpoint from a preset: `zmrl init-model`). Submodules are imported on use so `import zmrl.model` stays light.
"""
