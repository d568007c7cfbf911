"""A subscribed consumer's side of its consumer group: joining, rebalance events, max.poll.interval, fencing.

What librdkafka's background thread does (join, rejoin, heartbeat) happens here at once when the
process is alive; what the application sees (assign, revoke and lost callbacks, error events) is
queued and served by its next consume or poll, in librdkafka's order:

- cooperative-sticky: after each round, the revocation (if any) then the assignment of what was
  added (called even when nothing was); a revocation served makes the member rejoin, so what it gave
  up moves on in the next round.
- eager (range, roundrobin): at a round's start the revocation of everything held (the member
  rejoins once it is served), then the whole new assignment.
- lost: the member was removed (its session expired while its process was frozen, or the round
  timed out without it): the partitions held are lost (`on_lost`, else `on_revoke`) and, once the
  application has served that, it joins again as a new member. Until its heartbeat learns of the
  removal it sends its old id; from then until the rejoin, no id and its last generation
  (`consumer_group_metadata`; a real consumer frozen past its session shows both,
  tests/integration/sim/test_kafka_frozen_member.py).
- max.poll.interval.ms without a poll: a dynamic member leaves the group at once, a static one only
  stops heartbeating (removed after its session timeout); the next consume serves the loss, then a
  `_MAX_POLL_EXCEEDED` error, and joins again.
- another consumer joined under this one's group.instance.id: the next consume returns a `_FATAL`
  error and the assignment is gone, with no callback; the consumer never joins again.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from tests.tools.sim.env import Request
from tests.tools.sim.kafka import errors
from tests.tools.sim.kafka.assignors import COOPERATIVE, TP
from tests.tools.sim.kafka.group import GroupRefused, Member

if TYPE_CHECKING:
    from tests.tools.sim.kafka.consumer import Consumer


class Membership:
    def __init__(self, consumer: Consumer, topics: list[str], conf: dict[str, Any]):
        self.c = consumer
        self.cluster = consumer._cluster
        self.env = consumer._env
        self.group_id = consumer.group_id
        self.topics = tuple(topics)
        self.instance_id: str | None = conf.get("group.instance.id")
        strategies = str(conf.get("partition.assignment.strategy", "range,roundrobin"))
        self.strategies = tuple(s.strip() for s in strategies.split(",") if s.strip())
        self.session_timeout_ms = int(conf.get("session.timeout.ms", 45000))
        self.heartbeat_s = int(conf.get("heartbeat.interval.ms", 3000)) / 1000
        self.max_poll_ms = int(conf.get("max.poll.interval.ms", 300000))
        self.member: Member | None = None
        self.events: deque[tuple] = deque()
        self.dead = False  # fenced as a static member: never joins again
        self._exceeded_at: float | None = None
        self._last_poll = self.env.now()
        self._poll_timer = False
        self._joining = False
        # Removed by the coordinator and not told yet (its next heartbeat will be).
        self._removed = False
        # That removed member until it is told: the client still sends its id and generation.
        self.gone: Member | None = None
        # librdkafka resets a removed or departed member's id but keeps its generation (only an
        # ILLEGAL_GENERATION answer resets that), so its metadata then is ("", last generation).
        self.last_generation = -1

    @property
    def client_id(self) -> str:
        """The consumer's client.id, as DescribeGroups lists the member."""
        return self.c.name

    @property
    def process(self) -> str:
        return self.c._process

    @property
    def cooperative(self) -> bool:
        return self.strategies[:1] == (COOPERATIVE,)

    @property
    def generation(self) -> int:
        return self.member.generation if self.member is not None else -1

    # ----- requests to the coordinator ------------------------------------------------------------------

    def _send(self, name: str, apply, **details: Any) -> Request:
        request = Request(name, apply, client=self.c.name, process=self.c._process, group=self.group_id, **details)
        self.cluster.send(request)
        return request

    def join(self) -> None:
        if self._joining or self.dead or self.c._closed:
            return
        self._joining = True

        def apply() -> Member:
            with self.cluster.lock:
                return self.cluster.groups.join(
                    self.group_id,
                    self,
                    instance_id=self.instance_id,
                    topics=self.topics,
                    strategies=self.strategies,
                    session_timeout_ms=self.session_timeout_ms,
                    rebalance_timeout_ms=self.max_poll_ms,
                )

        request = self._send("kafka.broker.join_group", apply, instance=self.instance_id)
        request.on_landed(self._joined)

    def _joined(self, request: Request) -> None:
        self._joining = False
        if isinstance(request.error, GroupRefused):
            self.events.append(("error", errors.inconsistent_protocol()))
            return
        self.member, self.gone = request.reply(), None
        if self.c._frozen:
            self.cluster.groups.silent(self.group_id, self.member.member_id)

    def leave(self) -> None:
        member, self.member = self.member, None
        if member is not None:
            self.last_generation = member.generation
            self._send("kafka.broker.leave_group", lambda: self._locked(self.cluster.groups.leave, member.member_id))

    def _locked(self, fn, *args):
        with self.cluster.lock:
            return fn(self.group_id, *args)

    # ----- what the coordinator tells the member (MemberClient) --------------------------------------------

    def alive(self) -> bool:
        return not self.c._frozen and not self.c._closed

    def rebalance_started(self, generation: int) -> bool:
        if not self.alive() or self._exceeded_at is not None:
            return False
        if self.cooperative or self.member is None or not self.member.owned:
            return True
        self.events.append(("revoke_all",))
        return False

    def synced(self, generation: int, added: set[TP], revoke: set[TP]) -> None:
        self.events.append(("sync", generation, set(added), set(revoke)))

    def fenced(self) -> None:
        self.dead = True
        self.member = None
        self.events.append(("fenced",))

    def removed(self) -> None:
        self._forget_member()
        self._removed = True
        if self.alive():
            # Its next heartbeat is refused: the assignment is lost and it joins again.
            self.env.call_at(self.env.now() + self.heartbeat_s, self._learn_removed)

    def _forget_member(self) -> None:
        """The coordinator dropped this member; the client goes on sending its old id until told."""
        if self.member is not None:
            self.gone, self.last_generation = self.member, self.member.generation
        self.member = None

    def _learn_removed(self) -> None:
        if self._removed and self.member is None and not self.dead and self.alive() and self._exceeded_at is None:
            self._removed, self.gone = False, None
            # As librdkafka with rebalance callbacks: it joins again only once the application has
            # served the loss, its id reset and its generation kept until then.
            self.events.append(("lost",))
            self.events.append(("rejoin",))

    # ----- served by the application's consume ---------------------------------------------------------------

    def polled(self) -> None:
        """The application polled: restart the max.poll.interval clock; serve an expiry since the last poll."""
        now = self.env.now()
        if self._exceeded_at is not None:
            over_ms = int((now - self._exceeded_at) * 1000)
            self._exceeded_at = None
            self.events.append(("lost",))
            self.events.append(("error", errors.max_poll_exceeded(self.max_poll_ms, over_ms)))
            self.events.append(("rejoin",))
        self._last_poll = now
        if not self._poll_timer:
            self._poll_timer = True
            self.env.call_at(now + self.max_poll_ms / 1000, self._check_poll)

    def _check_poll(self) -> None:
        self._poll_timer = False
        if self.c._closed or self.dead:
            return
        due = self._last_poll + self.max_poll_ms / 1000
        if self.env.now() < due:
            self._poll_timer = True
            self.env.call_at(due, self._check_poll)
            return
        if self.c._frozen:
            return  # its timer thread is stopped too: checked again when it thaws
        self._exceed(due)

    def _exceed(self, due: float) -> None:
        if self._exceeded_at is not None or self.member is None:
            return
        self._exceeded_at = due
        if self.instance_id is None:
            self.leave()
        else:
            member = self.member
            self.member, self.last_generation = None, member.generation
            self._send(
                "kafka.broker.heartbeats_stop", lambda: self._locked(self.cluster.groups.silent, member.member_id)
            )

    def frozen(self) -> None:
        if self.member is not None:
            member_id = self.member.member_id
            with self.cluster.lock:
                self.cluster.groups.silent(self.group_id, member_id)

    def thawed(self) -> None:
        if self._removed:
            self.env.call_at(self.env.now() + self.heartbeat_s, self._learn_removed)
        due = self._last_poll + self.max_poll_ms / 1000
        if self.env.now() >= due and self.member is not None:
            self._exceed(due)
            return
        if self.member is not None:
            with self.cluster.lock:
                still = self.cluster.groups.heard(self.group_id, self.member.member_id)
                if (
                    still
                    and self.member.rejoined is False
                    and self.cluster.groups.group(self.group_id).state != "Stable"
                ):
                    self.cluster.groups.rejoin(self.group_id, self.member.member_id, self.member.owned)
            if not still:
                self._forget_member()
                self._removed = True
                self.env.call_at(self.env.now() + self.heartbeat_s, self._learn_removed)
        if not self._poll_timer:
            self._poll_timer = True
            self.env.call_at(self.env.now(), self._check_poll)

    def revoked_all(self) -> None:
        """Eager: the application gave everything up; the member rejoins the round."""
        member = self.member
        if member is not None:
            self._send(
                "kafka.broker.join_group", lambda: self._locked(self.cluster.groups.rejoin, member.member_id, set())
            )

    def revoked(self, tps: set[TP]) -> None:
        member = self.member
        if member is not None and tps:
            self._send(
                "kafka.broker.join_group", lambda: self._locked(self.cluster.groups.revoked, member.member_id, tps)
            )
