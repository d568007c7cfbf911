"""Generated transaction sequences on the Kafka model alone, against bookkeeping of what each call did.

The differential tests hold a few such sequences to the broker; here many more run in virtual time
with shrinking, against an oracle independent of the model: a read_committed reader sees exactly
the plain records and those of transactions whose commit succeeded, in the order they were produced.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tools.sim.scenarios import kafka_seq
from tests.tools.sim.worlds import ModelKafka

_step = st.one_of(
    st.tuples(st.just("produce"), st.integers(0, 1), st.integers(0, 1)),
    st.tuples(st.just("plain"), st.integers(0, 1)),
    st.tuples(st.just("begin"), st.integers(0, 1)),
    st.tuples(st.just("commit"), st.integers(0, 1)),
    st.tuples(st.just("abort"), st.integers(0, 1)),
    st.tuples(st.just("fence"), st.integers(0, 1)),
)


def _expected(steps, calls) -> dict[int, list[bytes]]:
    """Per partition, the values a read_committed reader must see, from the calls' outcomes alone."""
    out: dict[int, list[tuple[int, bytes]]] = {0: [], 1: []}
    open_records: dict[int, list[tuple[int, int, bytes]]] = {0: [], 1: []}
    for n, (step, (kind, got)) in enumerate(zip(steps, calls)):
        if kind == "plain":
            out[step[1]].append((n, b"p%d" % n))
        elif kind == "produce" and got[0] == "ok":
            open_records[step[1]].append((step[2], n, b"t%d" % n))
        elif kind == "commit" and got == ("ok", None):
            for part, m, value in open_records[step[1]]:
                out[part].append((m, value))
            open_records[step[1]] = []
        elif kind in ("abort", "fence"):
            open_records[step[1]] = []
    # A transaction still open at the end holds the last stable offset at its first record: nothing
    # produced from there on is seen.
    stable = {p: min([m for rs in open_records.values() for q, m, _ in rs if q == p], default=len(steps)) for p in out}
    return {p: [v for m, v in sorted(vs) if m < stable[p]] for p, vs in out.items()}


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_step, min_size=1, max_size=30))
def test_read_committed_sees_plain_records_and_committed_transactions_only(steps):
    seen = kafka_seq.transactions(ModelKafka(), steps)
    want = _expected(steps, seen["calls"])
    for part in (0, 1):
        got = [v for _, _, v in seen["reads"][(part, True)]["records"]]
        assert got == want[part], (part, got, want[part])
        everything = [v for _, _, v in seen["reads"][(part, False)]["records"]]
        assert set(got) <= set(everything)
