"""TQ's sizing per deployment: the single-node profile on one node, cluster defaults elsewhere, and who wins.

Ray's node list and TQ's init are replaced by fakes, as in test_tq_placement.py.
"""

import pytest
import ray
import transfer_queue

import streams.tq_setup as tq_mod
from streams.errors import TQError
from streams.tq import CLUSTER, SINGLE_NODE, TQConfig, init_tq

SETTINGS = ("TQ_CLIENT_ZMQ_IO_THREADS", "TQ_NUM_THREADS")


def _nodes(n: int) -> list[dict]:
    return [{"NodeID": f"n{i}", "Alive": True, "Resources": {"CPU": 2.0}} for i in range(n)]


@pytest.fixture
def attached(monkeypatch):
    """init_tq attaching to an initialized Ray of `n` nodes with no TQ yet; returns the configs TQ got."""
    inits = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(tq_mod, "_controller_exists", lambda: False)
    monkeypatch.setattr(transfer_queue, "init", inits.append)

    def attach(n: int, config: TQConfig | None = None, env: dict[str, str] | None = None) -> tuple[int, dict]:
        for name in SETTINGS:  # as a fresh process would start (init_tq sets them for its children)
            monkeypatch.delenv(name, raising=False)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(ray, "nodes", lambda: _nodes(n))
        init_tq(config or TQConfig())
        units = inits[-1]["backend"]["SimpleStorage"]["num_data_storage_units"]
        return units, {name: tq_mod.os.environ[name] for name in SETTINGS}

    return attach


def test_one_node_gets_the_single_node_profile_and_a_cluster_the_cluster_defaults(attached):
    assert attached(1) == (SINGLE_NODE.num_storage_units, {"TQ_CLIENT_ZMQ_IO_THREADS": "1", "TQ_NUM_THREADS": "1"})
    units, env = attached(3)
    assert units == CLUSTER.num_storage_units == 2 and env["TQ_CLIENT_ZMQ_IO_THREADS"] == "8"


def test_a_profile_can_be_forced_either_way(attached):
    assert attached(3, TQConfig(profile="single_node"))[0] == 1
    assert attached(1, TQConfig(profile="cluster"))[0] == 2


def test_an_explicit_field_wins_over_the_environment_which_wins_over_the_profile(attached):
    config = TQConfig(num_threads=2, num_storage_units=4)
    units, env = attached(1, config, env={"TQ_CLIENT_ZMQ_IO_THREADS": "3", "TQ_NUM_THREADS": "5"})
    assert units == 4 and env == {"TQ_CLIENT_ZMQ_IO_THREADS": "3", "TQ_NUM_THREADS": "2"}


def test_the_client_module_imported_before_init_tq_takes_the_settings_too(attached):
    import transfer_queue.client as client

    attached(1)
    assert client.TQ_CLIENT_ZMQ_IO_THREADS == 1 and client.TQ_NUM_THREADS == 1


def test_a_setting_below_one_is_refused_naming_it(attached):
    with pytest.raises(TQError, match="TQ_CLIENT_ZMQ_IO_THREADS must be at least 1, got 0"):
        attached(1, TQConfig(client_io_threads=0))


def test_torch_threads_set_for_a_process_survive_tqs_own_put_and_get():
    """TQ sets torch's threads for each put and get and restores the count it saw at import: without
    its copy set too, the first TQ call would undo the process's setting."""
    import torch
    from transfer_queue.utils import common

    from streams.tq_setup import set_torch_threads

    before, default = torch.get_num_threads(), common.DEFAULT_TORCH_NUM_THREADS
    try:
        set_torch_threads(1)
        with common.limit_pytorch_auto_parallel_threads(target_num_threads=1):
            pass
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError):
            set_torch_threads(0)
    finally:
        torch.set_num_threads(before)
        common.DEFAULT_TORCH_NUM_THREADS = default
