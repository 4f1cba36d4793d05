"""zmrl: reinforcement learning on LLMs with zero rollout/trainer mismatch."""
__version__ = "0.1.0"
