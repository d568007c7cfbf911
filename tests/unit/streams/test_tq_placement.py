"""Placement across Ray nodes without a Ray cluster: which nodes offer a resource, what TQ is asked for,
and how reassembler actors are scheduled (Ray's node list and actor creation replaced by fakes).

The real thing, two Ray nodes with the demo attached, is tests/integration/test_multinode_ray.py (a drill).
"""

import pytest
import ray
import transfer_queue

import streams.tq_setup as tq_mod
from streams.errors import TQError
from streams.tq import TQConfig, init_tq, nodes_offering
from workers.actors.reassembler import (
    NODE_RESOURCE_SHARE,
    DataPlaneConfig,
    RolloutReassemblerActor,
    create_rollout_reassembler_actors,
)
from workers.reassembler.config import default_actor_config

NODES = [
    {"NodeID": "b2", "Alive": True, "Resources": {"CPU": 2.0, "data": 1.0}},
    {"NodeID": "a1", "Alive": True, "Resources": {"CPU": 2.0, "data": 1.0}},
    {"NodeID": "c3", "Alive": True, "Resources": {"CPU": 2.0}},
    {"NodeID": "d4", "Alive": False, "Resources": {"CPU": 2.0, "data": 1.0}},
]


@pytest.fixture
def ray_nodes(monkeypatch):
    monkeypatch.setattr(ray, "nodes", lambda: NODES)


def test_nodes_offering_lists_the_alive_nodes_with_the_resource_sorted(ray_nodes):
    assert nodes_offering("data") == ["a1", "b2"]
    assert nodes_offering("CPU") == ["a1", "b2", "c3"]


def test_nodes_offering_names_the_resource_and_how_to_offer_it_when_no_node_does(ray_nodes):
    with pytest.raises(TQError, match="""no alive Ray node offers custom resource 'gpu-free'.*"gpu-free": 1"""):
        nodes_offering("gpu-free")


@pytest.fixture
def fake_tq(monkeypatch, ray_nodes):
    """init_tq against an initialized Ray with no TQ controller yet; the config tq.init got."""
    inits = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(tq_mod, "_controller_exists", lambda: False)
    monkeypatch.setattr(transfer_queue, "init", inits.append)
    return inits


def test_init_tq_asks_tq_to_place_storage_units_on_the_nodes_with_the_resource(fake_tq):
    init_tq(TQConfig(num_storage_units=4, storage_node_resource="data"))
    assert fake_tq == [{"backend": {"SimpleStorage": {"num_data_storage_units": 4, "required_node_resource": "data"}}}]


def test_init_tq_leaves_storage_units_on_every_node_by_default(fake_tq):
    init_tq(TQConfig(num_storage_units=3))
    assert fake_tq == [{"backend": {"SimpleStorage": {"num_data_storage_units": 3}}}]


def test_init_tq_refuses_a_resource_no_node_offers_before_creating_the_controller(fake_tq):
    with pytest.raises(TQError, match="'nowhere'"):
        init_tq(TQConfig(storage_node_resource="nowhere"))
    assert fake_tq == []


class _FakeRemote:
    """What `ray.remote(**options)(cls)` returns: records the options and the actors created."""

    def __init__(self, options: dict):
        self.options_given = options
        self.created = []

    def options(self, **kw):
        return self

    def remote(self, *args):
        actor = type("Actor", (), {})()
        actor.check_dependencies = type("M", (), {"remote": staticmethod(lambda: None)})()
        self.created.append(actor)
        return actor


@pytest.fixture
def fake_remote(monkeypatch, ray_nodes):
    made = []

    def remote(**options):
        def wrap(cls):
            assert cls is RolloutReassemblerActor
            made.append(_FakeRemote(options))
            return made[-1]

        return wrap

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get", lambda refs, **kw: refs)
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: None)
    return made


def test_reassembler_actors_are_spread_over_the_nodes(fake_remote):
    actors = create_rollout_reassembler_actors(DataPlaneConfig(), default_actor_config(), num_workers=3)
    (remote,) = fake_remote
    assert len(actors) == 3 and remote.created == actors
    assert remote.options_given["scheduling_strategy"] == "SPREAD"
    assert remote.options_given["resources"] == {}
    assert remote.options_given["num_cpus"] == 1


def test_reassembler_actors_with_a_node_resource_ask_a_token_share_of_it(fake_remote):
    create_rollout_reassembler_actors(DataPlaneConfig(), default_actor_config(), num_workers=2, node_resource="data")
    (remote,) = fake_remote
    assert remote.options_given["scheduling_strategy"] == "SPREAD"
    assert remote.options_given["resources"] == {"data": NODE_RESOURCE_SHARE}
    assert 0 < NODE_RESOURCE_SHARE < 0.01


def test_reassembler_actors_with_a_resource_no_node_offers_are_refused_before_any_is_created(fake_remote):
    with pytest.raises(TQError, match="'nowhere'"):
        create_rollout_reassembler_actors(
            DataPlaneConfig(), default_actor_config(), num_workers=2, node_resource="nowhere"
        )
    assert fake_remote == []
