"""Where a verl run resumes rlstream's consumer: state files, the step journal and verl's tracker."""

from __future__ import annotations

import os

import pytest

from schemas.errors import InvalidArgument
from workers.adapters.verl_checkpoint import (
    STATE_FILE,
    TRACKER,
    mark_trained,
    restore_point,
    resume_step,
    save_state,
    step_dir,
    write_journal,
)
from workers.trainer.checkpoint import STATE_VERSION

TOPIC, GROUP = "p.experience.finalized", "trainer"


def _state(partitions: dict, cut: int = 0) -> dict:
    return {
        "schema_version": STATE_VERSION,
        "topic": TOPIC,
        "consumer_group": GROUP,
        "version": 3,
        "cut": cut,
        "partitions": partitions,
        "run": "r1",
    }


def _tracker(root, step: int) -> None:
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(step))


def test_records_handed_out_in_a_step_count_as_trained_and_move_the_mark_past_a_contiguous_run():
    state = _state({0: {"offset": 5, "trained": [[8, 9]]}, 1: {"offset": 0, "trained": []}})
    out = mark_trained(state, [(0, 5), (0, 6), (0, 11), (1, 3), (0, 2)], topic=TOPIC, group=GROUP)
    # 5 and 6 join the mark; 8-9 stay a range; 11 is new; 2 was resolved before the state already.
    assert out["partitions"][0] == {"offset": 7, "trained": [(8, 9), (11, 11)]}
    assert out["partitions"][1] == {"offset": 0, "trained": [(3, 3)]}
    assert out["version"] == 3 and out["run"] == "r1"


def test_a_partition_without_a_mark_cannot_have_handed_out_a_group():
    with pytest.raises(InvalidArgument, match="partition 2"):
        mark_trained(_state({0: {"offset": 0, "trained": []}}), [(2, 4)], topic=TOPIC, group=GROUP)


def test_resume_step_follows_verls_resume_modes(tmp_path):
    root = str(tmp_path)
    assert resume_step(root, "auto", None) is None  # no tracker: verl trains from scratch
    _tracker(root, 4)
    assert resume_step(root, "auto", None) == 4
    assert resume_step(root, "disable", None) is None
    assert resume_step(root, "resume_path", f"{root}/global_step_2/") == 2
    with pytest.raises(InvalidArgument, match="global_step_"):
        resume_step(root, "resume_path", root)
    with pytest.raises(InvalidArgument, match="resume_mode"):
        resume_step(root, "latest", None)


def test_the_state_file_of_verls_step_wins_over_the_journal(tmp_path):
    root = str(tmp_path)
    _tracker(root, 2)
    saved = _state({0: {"offset": 9, "trained": []}})
    save_state(step_dir(root, 2), saved)
    write_journal(root, 2, _state({0: {"offset": 1, "trained": []}}), [(0, 1)])
    assert os.path.exists(os.path.join(step_dir(root, 2), STATE_FILE))
    assert restore_point(root, "auto", None, topic=TOPIC, group=GROUP) == (2, saved)


def test_a_crash_between_verls_tracker_and_on_save_resumes_from_the_journal(tmp_path):
    """verl writes latest_checkpointed_iteration.txt before it calls on_save; the journal covers the gap."""
    root = str(tmp_path)
    _tracker(root, 3)
    write_journal(root, 3, _state({0: {"offset": 4, "trained": []}}), [(0, 4), (0, 5)])
    step, state = restore_point(root, "auto", None, topic=TOPIC, group=GROUP)
    assert step == 3 and state["partitions"][0] == {"offset": 6, "trained": []}


def test_no_state_for_the_step_verl_resumes_from_is_refused(tmp_path):
    root = str(tmp_path)
    _tracker(root, 3)
    write_journal(root, 4, _state({0: {"offset": 4, "trained": []}}), [(0, 4)])
    with pytest.raises(InvalidArgument, match="no consumer state for it"):
        restore_point(root, "auto", None, topic=TOPIC, group=GROUP)
    assert restore_point(root, "disable", None, topic=TOPIC, group=GROUP) is None
