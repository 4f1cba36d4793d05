"""zmrl as a verl plugin: verl (on Ray) orchestrates, zmrl's vLLM rollout and trainer compute.

verl loads `zmrl.verl.plugin` through the `verl.plugins` entry point (pyproject.toml) in every
process that imports verl; the plugin registers what this package adds to verl:

  platform      a CPU platform for verl (gloo, no accelerators), so the whole thing runs on a CPU
  rollout       the rollout name "zmrl", registered lazily (replica class, trainer-side adapter)
  vllm_server   verl's vLLM server and replica serving zmrl's model (options that would break
                rollout/trainer equality refused, zmrl's kernels on after start-up)
  worker        the vLLM worker extension (zmrl's and verl's methods in one class): weight and
                LoRA sync through verl's own path into zmrl's weights and zmrl's LoraAdapter

This is the top layer beside zmrl.rl and zmrl.commands: it may import zmrl.rollout and
zmrl.trainer, nothing below imports it, and `verl` / `ray` are imported only in here.
"""
