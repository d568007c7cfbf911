import pytest

from schemas.errors import SchemaError
from schemas.state import GroupState


def test_open_and_closed_states_round_trip():
    opened = GroupState("g", "open", 1, 10, 12, 1000)
    closed = GroupState("g", "closed", 1, 10, 12, 1000, outcome="dead_lettered", finalized_at_ms=9)
    for state in (opened, closed):
        assert GroupState.from_bytes(state.to_bytes()) == state
    assert opened.outcome is None and opened.finalized_at_ms == 0


@pytest.mark.parametrize(
    "args,kwargs,path",
    [
        (("g", "half-open", 1, 10, 12, 0), {}, "group_state.status"),
        (("g", "open", 1, 10, 12, 0), {"outcome": "finalized"}, "group_state.outcome"),
        (("g", "closed", 1, 10, 12, 0), {}, "group_state.outcome"),
        (("g", "closed", 1, 10, 12, 0), {"outcome": "lost"}, "group_state.outcome"),
        (("g", "open", 1, 12, 10, 0), {}, "group_state.last_offset"),
        (("", "open", 1, 10, 12, 0), {}, "group_state.group_id"),
    ],
)
def test_state_checks(args, kwargs, path):
    with pytest.raises(SchemaError) as info:
        GroupState(*args, **kwargs)
    assert info.value.path == path
