"""The Kafka model held to the real broker: the same client calls on both, what the clients saw compared.

Each scenario (tests/tools/sim/scenarios/kafka_*.py) runs on the session's broker and on a fresh
model cluster. Error codes and flags, offsets, records, positions and watermarks compare exactly;
where the broker's choice is nondeterministic (which partitions move in a rebalance, when a round
completes) the scenario records invariants both must satisfy. Claims: tests/tools/sim/kafka/__init__.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.tools.sim.scenarios import kafka_groups, kafka_seq, kafka_txn
from tests.tools.sim.worlds import ModelKafka, RealKafka


@pytest.fixture(scope="module")
def real(kafka) -> RealKafka:
    return RealKafka(kafka)


def both(real: RealKafka, scenario, *args):
    seen = scenario(real, *args)
    model = scenario(ModelKafka(), *args)
    assert seen == model, _diff(seen, model)
    return seen


def _diff(seen, model) -> str:
    if not (isinstance(seen, dict) and isinstance(model, dict)):
        return f"real {seen!r}\nmodel {model!r}"
    keys = sorted(set(seen) | set(model), key=str)
    return "\n".join(
        f"{k}:\n  real  {seen.get(k)!r}\n  model {model.get(k)!r}" for k in keys if seen.get(k) != model.get(k)
    )


def test_offsets_markers_and_what_each_isolation_level_reads(real):
    """K1-K3."""
    seen = both(real, kafka_txn.offsets_and_visibility)
    assert seen["open"]["rc"]["high"] == 7 and seen["open"]["ru"]["high"] == 9
    assert seen["cached_before_fetch"] == (-1001, -1001)


def test_a_second_producer_under_the_same_id_fences_the_first(real):
    """K4."""
    seen = both(real, kafka_txn.fencing)
    assert seen["commit_then_abort"]["calls"][0] == ("commit", ("_FENCED", True, False, False))
    assert seen["visible"] == []


def test_transactional_calls_out_of_turn(real):
    """K5."""
    seen = both(real, kafka_txn.state_errors)
    assert seen["commit_outside"][0] == "_STATE"


def test_the_coordinator_aborts_a_transaction_open_past_its_timeout(real):
    """K6 (the broker's cleanup pass runs every second: streams/kraft_dir.py)."""
    seen = both(real, kafka_txn.txn_timeout)
    assert seen["aborted_within"] and seen["commit_after"] == ("_FENCED", True, False, False)
    assert seen["visible"] == [b"again", b"idle"]


def test_offsets_sent_in_transactions_and_their_refusals(real):
    """K7."""
    seen = both(real, kafka_txn.offsets_in_transactions)
    assert seen["committed_after"] == (1, "meta-1")
    assert seen["send_old_generation"] == ("ILLEGAL_GENERATION", False, False, True)
    assert seen["send_replaced_static"] == ("FENCED_INSTANCE_ID", False, False, True)


def test_committed_waits_for_a_transaction_holding_offsets(real):
    """K8."""
    seen = both(real, kafka_txn.committed_waits)
    assert seen["rc_during"] == ("_TIMED_OUT", False, False, False) and seen["rc_waited"]
    assert seen["rc_after"] == ("ok", (1, "pending"))


def test_commits_their_metadata_limit_and_non_members(real):
    """K9."""
    seen = both(real, kafka_txn.commit_metadata)
    assert seen["metadata_4096"] == ("OFFSET_METADATA_TOO_LARGE", False, False, False)
    assert seen["non_member_in_live_group"] == ("UNKNOWN_MEMBER_ID", False, False, False)


def test_cooperative_rebalances_move_only_what_changes_owner(real):
    """K10: invariants after each join and a leave (the assignor's exact choice is not compared)."""
    seen = both(real, kafka_groups.cooperative_join_leave)
    assert all(all(step.values()) for step in seen.values()), seen


def test_an_eager_rebalance_revokes_everything_first(real):
    """K10, range."""
    seen = both(real, kafka_groups.eager_join)
    assert seen["a_events"] == [("+", 4), ("-", 4), ("+", 2)] and seen["balanced"]


def test_static_members_rejoin_without_a_rebalance_and_a_twin_fences(real):
    """K11."""
    seen = both(real, kafka_groups.static_rejoin)
    assert seen["same_partitions"] and seen["same_generation"] and seen["other_untouched"]
    assert seen["twin"]["error"] == (("_FATAL", False, False, False), True)
    assert seen["twin"]["fenced_assignment"] == [] and seen["twin"]["fenced_callbacks"] == []


def test_a_closed_static_member_keeps_its_partitions_for_its_session(real):
    """K12."""
    assert both(real, kafka_groups.static_session_timeout)["after_session_timeout"]


def test_a_member_that_stops_polling_leaves_and_rejoins(real):
    """K13."""
    seen = both(real, kafka_groups.max_poll_exceeded)
    assert seen["errors"] == [("_MAX_POLL_EXCEEDED", False, False, False)] and seen["lost_first"]


def test_positions_seeks_pauses_and_resets(real):
    """K14."""
    seen = both(real, kafka_groups.positions)
    assert seen["after_seek"] == -1001 and seen["paused_after_reassign"] == []


def test_metadata_and_unknown_topics(real):
    """K15, K19."""
    seen = both(real, kafka_groups.metadata)
    assert seen["report_missing_topic"] == [("_MSG_TIMED_OUT", False, False, False)]


_step = st.one_of(
    st.tuples(st.just("produce"), st.integers(0, 1), st.integers(0, 1)),
    st.tuples(st.just("plain"), st.integers(0, 1)),
    st.tuples(st.just("begin"), st.integers(0, 1)),
    st.tuples(st.just("commit"), st.integers(0, 1)),
    st.tuples(st.just("abort"), st.integers(0, 1)),
    st.tuples(st.just("fence"), st.integers(0, 1)),
)


# No shrinking against the broker (each example takes seconds there): a failing example is printed
# whole, and replays on the model alone in milliseconds.
@settings(
    max_examples=8,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=st.lists(_step, min_size=1, max_size=12))
def test_generated_transaction_sequences(real, steps):
    """K1, K2, K4, K5 over generated interleavings of two transactional producers and a plain one."""
    both(real, kafka_seq.transactions, steps)
