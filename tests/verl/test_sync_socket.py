"""The weight-sync socket of the rollout "zmrl": one path per Ray cluster on a host, the same on
both ends of one sync.

verl names the socket from the Ray job id, the replica and the rank. Two runs that each start a
local Ray cluster on one host both have job 01000000, so with verl's names they share one path;
each sender removes the file before binding it, and two such runs, started together, hung at
a weight sync. zmrl's sender (the adapter) and receiver (the vLLM worker extension) add
the host's raylet pid to verl's path."""
import pytest

from zmrl.verl.rollout import cluster_socket

pytestmark = pytest.mark.verl

VERL_NAME = "ipc:///tmp/rl-colocate-zmq-01000000-replica-0-rank-0.sock"  # both clusters' first job


def test_two_local_clusters_get_two_paths_where_verls_names_collide(monkeypatch):
    monkeypatch.setenv("RAY_RAYLET_PID", "4080")
    first = cluster_socket(VERL_NAME)
    monkeypatch.setenv("RAY_RAYLET_PID", "4188")
    second = cluster_socket(VERL_NAME)
    assert first != second
    assert first == "ipc:///tmp/rl-colocate-zmq-01000000-replica-0-rank-0-raylet-4080.sock"


def test_outside_ray_the_path_is_verls(monkeypatch):
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    assert cluster_socket(VERL_NAME) == VERL_NAME


def test_sender_and_receiver_name_the_same_socket(monkeypatch):
    """Both ends as zmrl builds them, over verl's own naming: the adapter's __init__ (verl's,
    stubbed to name its socket as verl does) and the worker extension's `_get_zmq_handle` (verl's
    own, then zmrl's), in one cluster."""
    from verl.workers.rollout.vllm_rollout import ServerAdapter

    from zmrl.verl.adapter import ZmrlServerAdapter
    from zmrl.verl.worker import ZmrlVerlWorkerExtension

    monkeypatch.setenv("RAY_RAYLET_PID", "4080")
    monkeypatch.setenv("VERL_RAY_JOB_ID", "01000000")
    monkeypatch.setenv("VERL_REPLICA_RANK", "0")
    monkeypatch.delenv("VERL_ZMQ_BASE_TRAINER_RANK", raising=False)

    def verl_init(self, *args, **kwargs):  # the line of verl's __init__ that names the socket
        self.zmq_handle = VERL_NAME

    monkeypatch.setattr(ServerAdapter, "__init__", verl_init)
    sender = ZmrlServerAdapter().zmq_handle
    worker = object.__new__(ZmrlVerlWorkerExtension)
    worker.local_rank, worker.model_runner = 0, None
    receiver = worker._get_zmq_handle()
    assert sender == receiver == cluster_socket(VERL_NAME)
    # verl's own receiver names the path without the cluster: the pair would not meet
    assert super(ZmrlVerlWorkerExtension, worker)._get_zmq_handle() == VERL_NAME != receiver
