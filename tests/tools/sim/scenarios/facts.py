"""What the real broker and TQ showed for each scenario, checked on any run of it (real or model).

The differential tests compare the two runs whole; these facts, observed on Kafka 4.1.1 with
librdkafka 2.16 and on TQ 0.1.11, make each claim fail on its own when both runs drift together,
and let the model's unit tests check it without a broker.
"""

from __future__ import annotations

from tests.tools.sim.scenarios import kafka_admin, kafka_broker, kafka_groups, kafka_txn, tq

FENCED = ("_FENCED", True, False, False)


def offsets_and_visibility(seen) -> None:
    assert seen["open"]["rc"]["high"] == 7 and seen["open"]["ru"]["high"] == 9
    assert [o for o, _, _ in seen["open"]["ru"]["records"]] == [0, 1, 2, 3, 5, 7, 8]  # markers at 4 and 6
    assert seen["cached_before_fetch"] == (-1001, -1001) and seen["cached_after_fetch"] == (0, 9)
    assert seen["committed"]["rc"]["high"] == 10 and seen["committed"]["rc"]["position"] == 10


def fencing(seen) -> None:
    assert seen["commit_then_abort"]["calls"] == [("commit", FENCED), ("abort", FENCED)]
    assert seen["produce_poll_commit"]["calls"] == [
        ("produce", "ok"),
        ("poll", FENCED),
        ("poll", "ok"),
        ("commit", FENCED),
    ]
    assert seen["produce_poll_commit"]["reports"] == [("INVALID_PRODUCER_EPOCH", False, False, False)]
    assert seen["begin"]["calls"] == [("begin", ("_STATE", False, False, False))]
    assert seen["visible"] == []


def state_errors(seen) -> None:
    assert all(result == ("_STATE", False, False, False) for result in seen.values()), seen


def txn_timeout(seen) -> None:
    assert seen["aborted_within"] and seen["commit_after"] == FENCED and seen["begin_after"] == FENCED
    assert seen["successor_commit"] == ("ok", None) and seen["idle_commit"] == ("ok", None)
    assert seen["visible"] == [b"again", b"idle"]


def offsets_in_transactions(seen) -> None:
    assert seen["committed_after"] == (1, "meta-1") and seen["commit_current"] == ("ok", None)
    assert seen["generation_moved"]
    assert seen["send_old_generation"] == ("ILLEGAL_GENERATION", False, False, True)
    assert seen["after_abortable"]["produce"] == ("_STATE", False, False, False)
    assert seen["after_abortable"]["abort"] == ("ok", None) and seen["after_abort_commit"] == ("ok", None)
    assert seen["send_member_gone"] == ("UNKNOWN_MEMBER_ID", False, False, True)
    # No member id, no generation, no instance id: taken in a live group's transaction unchecked.
    assert seen["non_member_metadata_differs"] and seen["send_non_member"] == ("ok", None)
    assert seen["send_non_member_static"] == ("UNKNOWN_MEMBER_ID", False, False, True)
    assert seen["send_replaced_static"] == ("FENCED_INSTANCE_ID", False, False, True)
    assert seen["commit_static_current"] == ("ok", None)


def committed_waits(seen) -> None:
    assert seen["rc_during"] == ("_TIMED_OUT", False, False, False) and seen["rc_waited"]
    assert seen["ru_during"] == ("ok", (-1001, None)) and seen["ru_at_once"]
    assert seen["rc_after"] == ("ok", (1, "pending"))


def commit_metadata(seen) -> None:
    assert seen["metadata_4095"] == ("ok", (3, 4095))
    assert seen["metadata_4096"] == ("OFFSET_METADATA_TOO_LARGE", False, False, False)
    assert seen["non_member_in_live_group"] == ("UNKNOWN_MEMBER_ID", False, False, False)
    assert seen["member_commit"] == ("ok", [6]) and seen["committed"] == (6, None)


def cooperative_join_leave(seen) -> None:
    assert all(all(step.values()) for step in seen.values()), seen


def eager_join(seen) -> None:
    assert seen["a_events"] == [("+", 4), ("-", 4), ("+", 2)] and seen["b_events"] == [("+", 2)]
    assert seen["balanced"] and seen["contiguous"]


def static_rejoin(seen) -> None:
    assert seen["closing_revokes"] and seen["same_partitions"] and seen["same_generation"]
    assert seen["other_untouched"] and seen["a2_events"] == [("+", True)]
    twin = seen["twin"]
    assert twin["error"] == (("_FATAL", False, False, False), True)
    assert twin["fenced_assignment"] == [] and twin["fenced_callbacks"] == [] and twin["other_untouched"]


def static_session_timeout(seen) -> None:
    assert seen["after_session_timeout"]


def max_poll_exceeded(seen) -> None:
    assert seen["left_at_once"] and seen["lost_first"] and seen["rejoined_balanced"]
    assert seen["errors"] == [("_MAX_POLL_EXCEEDED", False, False, False)]


def positions(seen) -> None:
    assert seen["before_any"] == -1001 and seen["after_two"] == 2 and seen["after_seek"] == -1001
    assert seen["from_seek"] == [4] and seen["seek_unassigned"] == ("_STATE", False, False, False)
    assert seen["paused_after_reassign"] == [] and seen["resumed"] == [0, 1, 2, 3, 4]
    assert seen["past_end_reset"] == [0, 1, 2, 3, 4]


def metadata(seen) -> None:
    assert seen["partitions"] == [0, 1, 2]
    assert seen["missing"] == (("UNKNOWN_TOPIC_OR_PART", False, False, False), {})
    assert seen["watermarks_missing_partition"] == ("_UNKNOWN_PARTITION", False, False, False)
    assert seen["subscribe_missing"] == (("UNKNOWN_TOPIC_OR_PART", False, False, False), True)
    assert seen["report_missing_topic"] == [("_MSG_TIMED_OUT", False, False, False)]


def compaction(seen) -> None:
    assert seen["records"] == seen["expected"] and (10, b"k2", None) in seen["records"]


def retention(seen) -> None:
    assert seen["low"] == 3 and seen["high"] == 5 and seen["from_zero"] == [3, 4]


def broker_down(seen) -> None:
    assert seen["committed"] == ("_TIMED_OUT", False, False, False)
    assert seen["consume_errors"] == ("ok", [])
    assert seen["list_topics"] == ("_TRANSPORT", False, False, False)
    assert seen["commit"] == ("_WAIT_COORD", False, False, False)
    assert seen["flush_short"] == 1 and seen["flush_past_timeout"] == 0
    assert seen["reports"] == [("_MSG_TIMED_OUT", False, False, False)]
    assert seen["commit_txn"] == ("_TIMED_OUT", False, True, False) and seen["commit_txn_after"] == ("ok", None)
    assert seen["init_txn"] == ("_TIMED_OUT", False, True, False) and seen["init_txn_after"] == ("ok", None)
    assert seen["visible"] == [b"a", b"t"]


def index_pool(seen) -> None:
    assert seen["first"]["a"]["indexes"] == [0, 1] and seen["first"]["b"]["indexes"] == [2]
    assert seen["reused"]["b"]["indexes"] == [0, 2] and seen["reused"]["a"]["indexes"] == [3]
    assert seen["put_again"]["indexes"] == [1] and seen["put_again"]["tags"] == [{"key": "a2", "second": True}]
    assert seen["absent_left_out"]["indexes"] == [3] and seen["unknown_partition"]["size"] == 0
    assert seen["lists"]["unknown"] == {} and seen["after_full_clear"]["indexes"] == [1, 3, 0, 2]


def stale_clear(seen) -> None:
    assert seen["same_index"] and seen["after_clear_meta"]["ready"]
    assert seen["get_after_storage_clear"] == ("error", "StorageKeyNotFoundError")
    assert seen["list_a"] == {"A": {"a0": {"key": "a0"}, "a1": {"key": "a1"}}}
    assert seen["next_index"] == [3] and seen["a2_index"] == [2]


def gets(seen) -> None:
    assert seen["rows"][0] == "rows" and len(seen["rows"][1]["x"]) == 2 and seen["missing"][2] == [1]
    assert seen["mixed_meta"]["fields"] == [] and seen["mixed_get"] == ("rows", {}, [0])
    assert (
        seen["marked"]["ready"] is False
        and seen["marked"]["fields"] == []
        and seen["list_while_marked"] == ["k1", "k2", "k3", "y1"]
    )
    assert seen["after_clear_samples"]["size"] == 0 and seen["list_after"] == {"G": {}}


def put_steps(seen) -> None:
    assert seen["allocated"]["status"] == [0, 0] and seen["listed_after_alloc"]["S"]["s1"] == {}
    assert seen["get_after_alloc"] == ("rows", {}, [0])
    assert seen["after_write_and_notify"]["ready"] and seen["after_write_and_notify"]["tags"] == [{}, {}]
    assert seen["after_tags"]["tags"] == [{"key": "s1"}, {"key": "s2"}]


def retrieve_keys(seen) -> None:
    assert seen["held"] == ("keys", ["a0", "a1"]) and seen["reversed"] == ("keys", ["a1", "a0"])
    assert seen["other_partitions"] == ("keys", ["a0", "a1", None])
    assert seen["unknown_partition"] == ("error", "RuntimeError")
    assert seen["after_clear"] == ("keys", ["a0", None])
    assert seen["reused_elsewhere"] == ("keys", ["a0", None]) and seen["reused_by"] == ("keys", [None, "b1"])
    assert seen["select"]["size"] == 1 and seen["select"]["tags"] == [{"key": "a1"}]


def admin_groups(seen) -> None:
    assert seen["unknown_group"] == []
    assert seen["both"] == [("member-a", None), ("member-b", "ib")]
    assert seen["dynamic_closed"] == [("member-b", "ib")] and seen["static_closed"] == [("member-b", "ib")]
    assert seen["retention"] == ("604800000", "-1")


KAFKA = {
    fn: globals()[fn.__name__]
    for fn in (
        kafka_admin.admin_groups,
        kafka_txn.offsets_and_visibility,
        kafka_txn.fencing,
        kafka_txn.state_errors,
        kafka_txn.txn_timeout,
        kafka_txn.offsets_in_transactions,
        kafka_txn.committed_waits,
        kafka_txn.commit_metadata,
        kafka_groups.cooperative_join_leave,
        kafka_groups.eager_join,
        kafka_groups.static_rejoin,
        kafka_groups.static_session_timeout,
        kafka_groups.max_poll_exceeded,
        kafka_groups.positions,
        kafka_groups.metadata,
    )
}
KAFKA_OWN_BROKER = {
    fn: globals()[fn.__name__] for fn in (kafka_broker.compaction, kafka_broker.retention, kafka_broker.broker_down)
}
TQ = {fn: globals()[fn.__name__] for fn in (tq.index_pool, tq.stale_clear, tq.gets, tq.put_steps, tq.retrieve_keys)}
