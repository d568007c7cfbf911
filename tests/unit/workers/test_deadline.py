"""Deadline: one bound shared by a sequence of waits."""

from workers.deadline import Deadline


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_within_a_deadline_gets_what_is_left_of_it_never_more():
    clock = _Clock()
    whole = Deadline(30, clock=clock)
    clock.now += 25  # the first wait took 25 s of the 30
    member_wait = whole.within(310)
    assert member_wait.seconds == 5 and not whole.passed()
    clock.now += 6
    assert member_wait.passed() and whole.passed() and whole.left() == 0.0
    assert whole.within(310).seconds == 0


def test_within_a_shorter_bound_than_what_is_left():
    clock = _Clock()
    part = Deadline(960, clock=clock).within(310)
    clock.now += 300
    assert part.seconds == 310 and not part.passed() and round(part.left()) == 10
