"""Which ready groups a step that took a prefetched read also finalizes (`prefetch.just_closed`), and
how the prefetched read and the step's own read of them become one (`prefetch.merged`)."""

from __future__ import annotations

from dataclasses import dataclass

from workers.reassembler.prefetch import just_closed, merged
from workers.reassembler.staging_read import Fetched, Owned, Staged


@dataclass(frozen=True)
class G:
    group_id: str
    keys: tuple[str, ...]

    def staging_keys(self) -> list[str]:
        return list(self.keys)


def _ids(groups) -> list[str]:
    return [g.group_id for g in groups]


def test_groups_ready_beside_the_prefetched_ones_join_the_step_in_order():
    a, b, c = G("a", ("a/0",)), G("b", ("b/0",)), G("c", ("c/0",))
    assert _ids(just_closed([a], [a, b, c], room=5)) == ["b", "c"]


def test_no_more_join_than_the_step_has_room_for():
    a, b, c = G("a", ("a/0",)), G("b", ("b/0",)), G("c", ("c/0",))
    assert _ids(just_closed([a], [a, b, c], room=1)) == ["b"]
    assert just_closed([a], [a, b, c], room=0) == []


def test_a_group_naming_a_key_a_prefetched_group_names_waits_for_a_later_read():
    a, b, c = G("a", ("a/0", "x")), G("b", ("x", "b/0")), G("c", ("c/0",))
    assert _ids(just_closed([a], [a, b, c], room=5)) == ["c"]


def test_of_two_late_groups_naming_one_key_the_second_waits():
    a, b, c = G("a", ("a/0",)), G("b", ("y",)), G("c", ("y", "c/0"))
    assert _ids(just_closed([a], [b, c], room=5)) == ["b"], "the key went to the first group that named it"


def _staged(owned: dict[str, set[str]], present: set[str], rows: dict[str, str], unread=frozenset()) -> Staged:
    return Staged(
        {g: Owned(frozenset(k)) for g, k in owned.items()},
        {k: {"group_id": "?"} for k in present},
        Fetched(dict(rows), {}, frozenset(unread)),
        1.0,
    )


def test_the_fresh_read_replaces_what_the_prefetch_saw_of_its_own_keys_present_or_not():
    # The prefetch read "a" and an earlier "b" (one receipt, key b/0 then present); "b" took a receipt
    # since and is read again: b/0 is gone by now, b/1 is there.
    prefetched = _staged({"a": {"a/0"}, "b": {"b/0"}}, {"a/0", "b/0"}, {"a/0": "A", "b/0": "B-old"}, {"z"})
    fresh = _staged({"b": {"b/1"}}, {"b/1"}, {"b/1": "B1"}, {"b/2"})
    out = merged(prefetched, fresh, {"b/0", "b/1", "b/2"})
    assert out.owned["a"].keys == {"a/0"} and out.owned["b"].keys == {"b/1"}
    assert set(out.tags) == {"a/0", "b/1"}, "b/0 is not present just because the prefetch saw it"
    assert out.fetched.segments == {"a/0": "A", "b/1": "B1"}
    assert out.fetched.unread == {"z", "b/2"}
