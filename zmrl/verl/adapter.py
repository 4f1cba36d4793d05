"""The trainer side of the rollout "zmrl": verl's vLLM `ServerAdapter`, its weight-sync socket made
unique to this host's Ray cluster (see zmrl.verl.rollout.cluster_socket; the receiving end is
zmrl.verl.worker's `_get_zmq_handle`)."""
from __future__ import annotations

from verl.workers.rollout.vllm_rollout import ServerAdapter
from zmrl.verl.rollout import cluster_socket


class ZmrlServerAdapter(ServerAdapter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.zmq_handle = cluster_socket(self.zmq_handle)
