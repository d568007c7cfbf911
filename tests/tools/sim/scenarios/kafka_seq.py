"""A generated Kafka scenario: two transactional producers and a plain one interleaved (K1, K2, K4, K5).

Every produce is flushed at once, so records land in call order on both the broker and the model.
"""

from __future__ import annotations

from tests.tools.sim.scenarios.observe import outcome, read


def transactions(w, steps: list[tuple]) -> dict:
    """("produce", who, partition) | ("plain", partition) | ("begin"|"commit"|"abort"|"fence", who)."""
    t = w.topic(2)
    ids = [w.name("q0"), w.name("q1")]
    producers = []
    for tid in ids:
        p = w.txn_producer(tid)
        p.init_transactions(30)
        producers.append(p)
    plain = w.producer()
    calls: list = []
    for n, step in enumerate(steps):
        kind = step[0]
        if kind == "produce":
            p = producers[step[1]]
            got = outcome(lambda p=p, part=step[2], n=n: p.produce(t, partition=part, value=b"t%d" % n))
            if got[0] == "ok":
                got = outcome(lambda p=p: p.flush(10))
        elif kind == "plain":
            plain.produce(t, partition=step[1], value=b"p%d" % n)
            got = outcome(lambda: plain.flush(10))
        elif kind == "begin":
            got = outcome(producers[step[1]].begin_transaction)
        elif kind == "commit":
            got = outcome(lambda p=producers[step[1]]: p.commit_transaction(30))
        elif kind == "abort":
            got = outcome(lambda p=producers[step[1]]: p.abort_transaction(30))
        elif kind == "fence":
            old = producers[step[1]]
            producers[step[1]] = w.txn_producer(ids[step[1]])
            producers[step[1]].init_transactions(30)
            got = ("fenced", outcome(lambda old=old: old.commit_transaction(10)))
        else:
            raise ValueError(f"unknown step {step!r}")
        calls.append((kind, got))
    return {
        "calls": calls,
        "reads": {
            (part, rc): {k: v for k, v in read(w, t, part, read_committed=rc).items()}
            for part in (0, 1)
            for rc in (True, False)
        },
    }
