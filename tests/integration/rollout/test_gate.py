"""The admission gate against a real broker: closed while the trainer's version stays, open on a new one."""

import threading

from streams.consumer import wait_until
from workers.rollout.gate import AdmissionGate
from workers.trainer.version_topic import VersionPublisher


def test_the_gate_blocks_while_the_version_stays_and_opens_when_a_new_one_is_published(kafka, make_topic):
    topic = make_topic("trainer.version", 1, **{"cleanup.policy": "compact"})
    trainer = VersionPublisher(kafka, topic, trainer_id="t1", consumer_group="cg", batch_groups=2)
    other = VersionPublisher(kafka, topic, trainer_id="t2", consumer_group="cg2", batch_groups=2)
    gate = AdmissionGate(kafka, topic, max_staleness=0, trainer_id="t1")
    try:
        assert gate.capacity() == 0  # no version read yet: nothing may start
        assert trainer.publish(0) and not trainer.publish(0)  # sent on change only
        assert gate.wait_for_version(timeout=30) == 0
        assert gate.capacity() == 2  # (eta 0 + v 0 + 1) * 2
        assert gate.acquire(2, timeout=0)
        gate.on_finished(accepted=True)
        gate.on_finished(accepted=True)
        # The trainer has not moved: the third group would be trained a version late.
        assert not gate.acquire(1, timeout=1.0)
        other.publish(7)  # another trainer's version is not this gate's business
        got: list[bool] = []
        waiter = threading.Thread(target=lambda: got.append(gate.acquire(1, timeout=60)))
        waiter.start()
        waiter.join(timeout=1.5)
        assert waiter.is_alive() and not got
        trainer.publish(1)
        waiter.join(timeout=60)
        assert got == [True]
        assert gate.version == 1 and gate.capacity() == 1  # (0 + 1 + 1) * 2 - 2 accepted - 1 running
        # A gate started late reads the latest record from the compacted topic.
        late = AdmissionGate(kafka, topic, max_staleness=0, trainer_id="t1")
        try:
            assert late.wait_for_version(timeout=30) == 1
            wait_until(lambda: late.capacity() == 2, timeout_s=10, what="a fresh gate's capacity")
        finally:
            late.close()
    finally:
        gate.close()
        trainer.close()
        other.close()
