"""verl's trainer resource pools on the CPU platform (zmrl.verl.platform).

verl's `ResourcePoolManager` asks Ray for `trainer.nnodes x trainer.n_gpus_per_node` workers and
first checks that the cluster has that many *GPUs* ("Total available GPUs 0 is less than total
desired GPUs 1"). On the CPU platform a worker's bundle is one CPU (`RayResourcePool` sets the
platform's resource, "CPU", to 1, which also takes the place of verl's `max_colocate_count` CPUs),
so on this platform the check counts CPUs. Nothing changes on other platforms. Registered by
zmrl.verl.hooks when verl imports `verl.single_controller.ray`.
"""
from __future__ import annotations

import functools

from zmrl.verl.platform import _patch, is_cpu_platform


def _count_cpus(check):
    @functools.wraps(check)
    def check_resource_available(self):
        if not is_cpu_platform():
            return check(self)
        import ray

        available = sum(node.get("CPU", 0) for node in ray._private.state.available_resources_per_node().values())
        wanted = sum(n for nodes in self.resource_pool_spec.values() for n in nodes)
        if available < wanted:
            raise ValueError(f"the CPU platform gives each trainer worker one Ray CPU: {wanted} wanted "
                             f"(trainer.nnodes x trainer.n_gpus_per_node), {available:g} available")

    check_resource_available.zmrl_cpu_patch = True
    return check_resource_available


def register() -> None:
    from verl.single_controller.ray import base

    _patch(base.ResourcePoolManager, "_check_resource_available", _count_cpus)
