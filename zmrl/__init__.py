"""zmrl: reinforcement learning on LLMs with zero rollout/trainer mismatch."""
__version__ = "0.1.0"

# model_type "zmrl" for transformers' Auto classes, registered when transformers is imported
from zmrl.model import autoregister as _autoregister  # noqa: E402

_autoregister.install()
