"""verl plugin: what zmrl registers with verl.

Wired in pyproject.toml as

    [project.entry-points."verl.plugins"]
    zmrl = "zmrl.verl.plugin:register"

verl 0.9.1 only *loads* each entry point (`import verl` runs `entry_point.load()`, which imports
this module and looks the name up) and never calls it, so registering happens on import: each
module below registers itself at its end, and this module calls `register()` when imported.
Self-registration (rather than this module calling into them) keeps the order right when a
zmrl.verl module is imported before verl: its own `import verl` loads this plugin while it is
still half-defined, this plugin skips it, and it registers once its definitions exist.

verl swallows a load error at debug level: a broken plugin is silent, which is why the tests
check each registration itself. Registration stays cheap and idempotent: it runs in every
process that imports verl (driver, Ray workers, vLLM servers), so it records names and lazy
loaders and imports neither vllm nor the trainer.
"""
from __future__ import annotations


def register() -> None:
    import zmrl.verl.platform  # noqa: F401  (the CPU platform and its two fixes)
    import zmrl.verl.rollout  # noqa: F401  (the rollout name "zmrl")
    import zmrl.verl.hooks  # noqa: F401  (the engine and the strict trainer, when verl imports their registries)


register()
