"""The chaos drill's audit: an invariant whose fault ran must have been seen to hold, never passed by default."""

from __future__ import annotations

from tests.tools.chaos.check import Accounting, DrillEvents, _problems, trainer_version_floor


def test_a_coordinator_freeze_that_ran_must_show_a_transaction_timeout_ridden_out():
    acc = Accounting()
    froze = DrillEvents(coordinator_freeze_s=15.0)
    assert any("transaction timeout" in p for p in _problems(acc, froze))
    froze.timeouts_ridden_out = 1
    assert _problems(acc, froze) == []
    assert _problems(acc, DrillEvents()) == [], "no freeze scheduled, nothing to ride out"


def test_with_groups_lost_the_trainer_version_must_keep_moving():
    events = DrillEvents(lost_share=0.1, batch_groups=8)
    # 72 groups trained at 8 a version: version 9, or 8 if the drill stopped the trainer before it
    # published its last one.
    assert trainer_version_floor(72, 8) == 8
    stalled = Accounting(trainings=72, trainer_version=1)
    assert any("version" in p for p in _problems(stalled, events))
    assert _problems(Accounting(trainings=72, trainer_version=8), events) == []
    never = Accounting(trainings=72, trainer_version=None)
    assert any("version" in p for p in _problems(never, events))
    assert _problems(stalled, DrillEvents(lost_share=0.0, batch_groups=8)) == [], "asserted with losses only"
