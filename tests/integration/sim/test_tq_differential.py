"""The TQ model held to the real TQ 0.1.11: the same operations on both, what the client saw compared.

Each scenario (tests/tools/sim/scenarios/tq.py) runs on the session's TQ, its pool of released
indexes drained first so that allocations come from its counter, and on a fresh model whose
counter starts there: global indexes then compare exactly, FIFO reuse and set orders included.
Claims: tests/tools/sim/tq/__init__.py (T1-T8).

`put_phases` drives a put one phase at a time from the test (TQ's own client calls, in the order
`async_kv_batch_put` makes them), with what other clients do between the phases: what a reader
sees of a row in the middle of its put is what the explorer's readers (the checkpoint's spill, the
sweeper, the staging read) meet when the scheduler runs them there.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tools.sim.scenarios import facts
from tests.tools.sim.scenarios import tq as scenarios
from tests.tools.sim.worlds import ModelTQ, RealTQ


@pytest.fixture(scope="module")
def real(tq_session):
    world = RealTQ()
    yield world
    world.cleanup()


def both(real: RealTQ, scenario, *args):
    real.drain()
    return scenario(real, *args), scenario(ModelTQ(first_index=real.base), *args)


@pytest.mark.parametrize("scenario", list(facts.TQ), ids=lambda fn: fn.__name__)
def test_the_model_sees_what_tq_shows(real, scenario):
    seen, model = both(real, scenario)
    assert seen == model
    facts.TQ[scenario](seen)


def kv_get(w, partition: str, keys: list[str]):
    """A get through the KV API (`kv_batch_get`: a lookup, readiness checked, then the read)."""
    try:
        data = w.run(w.tq.async_kv_batch_get(keys=keys, partition_id=partition))
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        return ("error", type(exc).__name__, str(exc).split(":")[0][:60])
    return ("rows", {name: scenarios._as_lists(data.get(name)) for name in sorted(data.keys())})  # noqa: SIM118


def put_phases(w) -> dict:
    """A put's phases one at a time: keys allocated (listed, no tags, nothing readable), fields written
    (readable, still no tags), tags set; a put again of a key mid-put (its old tags listed until the
    new land); a clear between a put's allocation and its write (the write and tags land on an index
    given back, and the next key to take it)."""
    p = scenarios.fresh("M")
    client = w.tq.get_client()
    obs: dict = {}

    def seen(label: str, keys: list[str]) -> None:
        obs[label] = {
            "list": scenarios.listing(w, p),
            "meta": scenarios.look(w, p, keys),
            "kv_get": kv_get(w, p, keys),
            "get": scenarios.get(w, p, keys),
        }

    scenarios.put(w, p, ["m0"])  # the partition exists: its pre-allocated index is taken
    keys = ["m1", "m2"]
    m = w.run(client.async_kv_retrieve_meta(keys=keys, partition_id=p, create=True))
    obs["allocated"] = scenarios.describe(w, m)
    seen("after_alloc", keys)
    m.update_custom_meta([{"key": k, "put": 1} for k in keys])
    w.run(client.storage_manager.put_data(scenarios.rows(keys), m))
    seen("after_write", keys)
    w.run(client.async_set_custom_meta(m))
    seen("after_tags", keys)

    # m1 put again with other values and tags: mid-put, a reader sees the old tags with the new values.
    again = w.run(client.async_kv_retrieve_meta(keys=["m1"], partition_id=p, create=True))
    obs["again_allocated"] = scenarios.describe(w, again)
    seen("again_after_alloc", ["m1"])
    again.update_custom_meta([{"put": 2}])
    w.run(client.storage_manager.put_data(scenarios.rows(["m1"], width=3), again))
    seen("again_after_write", ["m1"])
    w.run(client.async_set_custom_meta(again))
    seen("again_after_tags", ["m1"])

    # m3 allocated, then cleared by another caller before its write: the write and the tags land on
    # an index the pool has back, and m4 takes it next.
    m3 = w.run(client.async_kv_retrieve_meta(keys=["m3"], partition_id=p, create=True))
    scenarios.clear(w, p, ["m3"])
    seen("cleared_mid_put", ["m3"])
    m3.update_custom_meta([{"key": "m3"}])
    w.run(client.storage_manager.put_data(scenarios.rows(["m3"]), m3))
    w.run(client.async_set_custom_meta(m3))
    seen("after_cleared_put_landed", ["m3"])
    m4 = w.run(client.async_kv_retrieve_meta(keys=["m4"], partition_id=p, create=True))
    obs["m4_takes_m3s_index"] = m4.global_indexes == m3.global_indexes
    seen("m4_allocated", ["m4"])
    m4.update_custom_meta([{"key": "m4"}])
    w.run(client.storage_manager.put_data(scenarios.rows(["m4"], field="y"), m4))
    w.run(client.async_set_custom_meta(m4))
    seen("m4_put", ["m4"])
    scenarios.clear(w, p, ["m0", "m1", "m2", "m3", "m4"])
    obs["end"] = scenarios.listing(w, p)
    return obs


def test_a_put_phase_by_phase_with_readers_between(real):
    seen, model = both(real, put_phases)
    assert seen == model
    # What the spill and the staging read rely on (workers/trainer/spill.py `_tags_after_read`):
    alloc, write, tags = seen["after_alloc"], seen["after_write"], seen["after_tags"]
    assert alloc["list"]["M"]["m1"] == {} and alloc["kv_get"][0] == "error" and alloc["get"] == ("rows", {}, [0])
    assert write["list"]["M"] == {"m0": {"key": "m0"}, "m1": {}, "m2": {}} and write["kv_get"][0] == "rows"
    assert tags["list"]["M"]["m1"] == {"key": "m1", "put": 1}
    assert seen["again_after_write"]["list"]["M"]["m1"] == {"key": "m1", "put": 1}
    assert seen["again_after_tags"]["list"]["M"]["m1"] == {"key": "m1", "put": 2}


_part = st.integers(0, 1)
_keys = st.lists(st.sampled_from(scenarios.KEYS), min_size=1, max_size=3, unique=True)
_slot = st.integers(0, 1)
_op = st.one_of(
    st.tuples(st.just("put"), _part, _keys),
    st.tuples(st.just("clear"), _part, _keys),
    st.tuples(st.just("get"), _part, _keys),
    st.tuples(st.just("list"), _part),
    st.tuples(st.just("lookup"), _part, _keys, _slot),
    st.tuples(st.just("stale_clear"), _slot),
    st.tuples(st.just("stale_storage"), _slot),
    st.tuples(st.just("held"), _part, _slot),
    st.tuples(st.just("begin"), _part, _keys, _slot),
    st.tuples(st.just("write"), _slot),
    st.tuples(st.just("tag"), _slot),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=14))
def test_sequences_of_puts_clears_gets_lists_and_stale_clears(real, ops):
    """T1-T8 over generated sequences, puts among them phase by phase with other calls between the phases:
    the model's client sees what TQ's does after every step."""
    seen, model = both(real, scenarios.sequence, ops)
    assert seen == model


# The long run, for `make drills`.
@pytest.mark.drill
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=30))
def test_sequences_long(real, ops):
    seen, model = both(real, scenarios.sequence, ops)
    assert seen == model
