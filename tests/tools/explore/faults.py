"""The explorer's faults: what can go wrong where a component waits, as a plan a seed draws and a shrink cuts.

A `Fault` is armed `at` seconds into the run and fires once:

- at the first point named `point` (a prefix) that an actor of its role's current process passes:
  `crash` (the process dies there, mid-call; the harness restarts the role as a pool's spare would),
  `freeze` (the process stops for `seconds`: no actor runs, no tick, no heartbeat; then it goes on
  where it stopped), `slow` (that call takes `seconds` more, the process alive), `error` (that Kafka
  call fails as a coordinator failover makes it fail: `committed()`, a commit, a transactional call;
  with `seconds`, every such call of the role fails for that long, as a failover lasts);
- at the first request named `point` that its role's process sends: `hold` (the request lands
  `seconds` later: its caller may have timed out and moved on meanwhile);
- at its time: `down` (the broker is down for `seconds`), `job` (the whole job is killed: every
  process and TQ; Kafka keeps its data; then `resume` and a restart).

`draw_plan` makes a plan from a seed and a mix (which kinds it may use). Plans are plain data: a seed
file keeps them, a shrink removes faults from them, a replay runs them again.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from confluent_kafka import KafkaError, KafkaException

from tests.tools.sim.kafka import errors

POINT_KINDS = ("crash", "freeze", "slow", "error")
TIMED_KINDS = ("down", "job")
KINDS = POINT_KINDS + ("hold",) + TIMED_KINDS

# Where each role waits: the points a fault of a point kind may fire at.
_REASSEMBLER = (
    "kafka.consumer.consume.begin",
    "kafka.consumer.committed.begin",
    "kafka.producer.init_transactions.begin",
    "kafka.producer.produce.begin",
    "kafka.producer.send_offsets_to_transaction.begin",
    "kafka.producer.commit_transaction.begin",
    "kafka.producer.commit_transaction.end",
    "kafka.producer.abort_transaction.begin",
    "tq.kv_batch_put.begin",
    "tq.storage.put_data.send",
    "tq.controller.notify_data_update.send",
    "tq.kv_batch_put.end",
    "tq.controller.kv_retrieve_meta.reply",
    "tq.storage.get_data.send",
    "tq.controller.mark_clearing.send",
    "tq.storage.clear_data.send",
    "tq.controller.clear_meta.send",
    "tq.controller.kv_list.send",
)
_TRAINER = (
    "kafka.consumer.consume.begin",
    "kafka.consumer.committed.begin",
    "kafka.consumer.commit.begin",
    "kafka.consumer.commit.end",
    "kafka.producer.flush.begin",
    "tq.controller.kv_retrieve_meta.reply",
    "tq.storage.get_data.send",
    "tq.controller.mark_clearing.send",
    "tq.storage.clear_data.send",
    "tq.controller.kv_list.send",
)
_ROLLOUT = (
    "tq.kv_batch_put.begin",
    "tq.storage.put_data.send",
    "tq.kv_batch_put.end",
    "kafka.producer.produce.begin",
    "kafka.producer.flush.begin",
    "kafka.consumer.consume.begin",
    "kafka.consumer.commit.begin",
)
_RESUME = (
    "kafka.consumer.consume.begin",
    "kafka.consumer.committed.begin",
    "tq.kv_batch_put.begin",
    "tq.storage.put_data.send",
)
# The calls an `error` fault may fail, and how (what librdkafka raises when the coordinator moves).
_ERRORS = {
    "kafka.consumer.committed.begin": errors.committed_timed_out,
    "kafka.consumer.commit.begin": lambda: errors.error(KafkaError._TIMED_OUT, "Commit failed: Local: Timed out"),
    "kafka.producer.send_offsets_to_transaction.begin": errors.txn_timed_out,
    "kafka.producer.commit_transaction.begin": errors.txn_timed_out,
    "kafka.producer.init_transactions.begin": errors.txn_timed_out,
}
# Requests a `hold` fault may delay, by the role's kind.
_REQUESTS = {
    "reassembler": (
        "kafka.broker.end_txn",
        "kafka.broker.txn_offset_commit",
        "kafka.broker.produce",
        "kafka.broker.add_partitions_to_txn",
        "kafka.broker.join_group",
        "tq.controller.kv_retrieve_meta",
        "tq.storage.put_data",
        "tq.storage.clear_data",
        "tq.controller.clear_meta",
        "tq.controller.set_custom_meta",
    ),
    "trainer": (
        "kafka.broker.offset_commit",
        "kafka.broker.produce",
        "kafka.broker.join_group",
        "tq.controller.kv_retrieve_meta",
        "tq.storage.get_data",
        "tq.storage.clear_data",
    ),
    "rollout": ("kafka.broker.produce", "tq.storage.put_data", "tq.controller.set_custom_meta"),
}


@dataclass(frozen=True)
class Mix:
    """The fault kinds a plan may use, the kinds of role its faults may target (None: any) and the points
    they may fire at (None: any of the role's)."""

    kinds: tuple[str, ...]
    roles: tuple[str, ...] | None = None
    points: tuple[str, ...] | None = None
    job_after: bool = False  # and the whole job killed soon after the first fault (while it still holds)
    job_after_s: tuple[float, float] = (0.2, 3.0)  # how long after it, drawn uniformly


# Where a clear has looked its keys up and not yet deleted: a process frozen there past its session
# timeout wakes as a zombie whose indexes may have changed hands (issue 30 item 1).
_CLEARING = ("tq.controller.mark_clearing.send", "tq.storage.clear_data.send", "tq.controller.clear_meta.send")

# Where a reassembler's transaction is open: a job killed while one holds there leaves it open on the
# broker until its timeout, hiding what other workers committed after it (issue 30 item 6).
_IN_TXN = (
    "kafka.producer.produce.begin",
    "kafka.producer.send_offsets_to_transaction.begin",
    "kafka.producer.commit_transaction.begin",
)

# Where a rollout's put has written its rows and not yet tagged them (TQ registers a put's keys, writes
# their fields, then sets their tags): a checkpoint that spills staging then lists rows no receipt owns yet.
_MID_PUT = ("tq.controller.set_custom_meta.send",)

MIXES: dict[str, Mix] = {
    "crash": Mix(("crash",)),
    "freeze": Mix(("freeze", "slow")),
    "kafka": Mix(("hold", "error", "down")),
    "job": Mix(("job", "crash")),
    "trainer": Mix(("crash", "error", "freeze", "hold"), roles=("trainer",)),
    "zombie": Mix(("freeze",), roles=("reassembler",), points=_CLEARING),
    "txnjob": Mix(("freeze", "slow"), roles=("reassembler",), points=_IN_TXN, job_after=True),
    # A rollout stopped mid-put while the trainer checkpoints, its group then held in a reassembler's open
    # step, and the job killed: resume puts back what that checkpoint spilled of the group's staging.
    "stagejob": Mix(
        ("freeze",),
        roles=("rollout", "reassembler"),
        points=_MID_PUT + _IN_TXN,
        job_after=True,
        job_after_s=(2.0, 45.0),
    ),
    "all": Mix(KINDS),
}


@dataclass(frozen=True)
class Fault:
    kind: str
    role: str = ""
    at: float = 0.0
    point: str = ""
    seconds: float = 0.0

    def __str__(self) -> str:
        where = f" at {self.point}" if self.point else ""
        lasting = f" for {self.seconds:g}s" if self.seconds else ""
        who = f" {self.role}" if self.role else ""
        return f"t>={self.at:g}s {self.kind}{who}{where}{lasting}"

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> Fault:
        return Fault(**d)

    def error(self) -> KafkaException:
        return KafkaException(_ERRORS[self.point]())


def role_kind(role: str) -> str:
    return "reassembler" if role.startswith("w") else role


def points_of(role: str) -> tuple[str, ...]:
    return {"reassembler": _REASSEMBLER, "trainer": _TRAINER, "rollout": _ROLLOUT, "resume": _RESUME}[role_kind(role)]


def draw_plan(rng: random.Random, roles: list[str], mix: str, *, horizon_s: float) -> list[Fault]:
    """1 to 4 faults of the mix's kinds on its roles, armed within `horizon_s` of the start. An error
    often follows a crash of its role (it then meets the restarted process's first such calls)."""
    m = MIXES[mix]
    kinds = m.kinds
    roles = [r for r in roles if m.roles is None or role_kind(r) in m.roles]
    plan: list[Fault] = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        at = round(rng.uniform(0, horizon_s), 1)
        if kind == "down":
            plan.append(Fault("down", at=at, seconds=round(rng.choice((rng.uniform(1, 8), rng.uniform(10, 70))), 1)))
            continue
        if kind == "job":
            plan.append(Fault("job", at=at))
            continue
        role = rng.choice(roles)
        if kind == "hold":
            point = rng.choice(_REQUESTS[role_kind(role)])
            seconds = round(rng.choice((rng.uniform(1, 10), rng.uniform(20, 120))), 1)
            plan.append(Fault("hold", role, at, point, seconds))
            continue
        if kind == "error":
            choices = [p for p in points_of(role) if p in _ERRORS]
            if not choices:
                continue
            crashes = [f for f in plan if f.kind == "crash" and f.role == role]
            if crashes and rng.random() < 0.6:
                at = rng.choice(crashes).at
            seconds = rng.choice((0.0, 0.0, round(rng.uniform(1, 20), 1)))
            plan.append(Fault("error", role, at, rng.choice(choices), seconds))
            continue
        # A mix naming its points may name one past a role's usual ones (a rollout's put mid-way): drawn
        # only there, so the other mixes' seeds draw the plans they always did.
        usual = points_of(role)
        point = rng.choice(usual if m.points is None else [p for p in (*usual, *_MID_PUT) if p in m.points])
        seconds = 0.0
        if kind == "freeze":
            # Short, or past the session timeout (6 s); in a mix of chosen points (a zombie's) always past it.
            long = rng.uniform(7, 40) if m.points is not None else rng.choice((rng.uniform(1, 4), rng.uniform(7, 40)))
            seconds = round(long, 1)
        elif kind == "slow":
            seconds = round(rng.uniform(0.5, 15), 1)
        plan.append(Fault(kind, role, at, point, seconds))
    if m.job_after and plan:
        plan.append(Fault("job", at=round(plan[0].at + rng.uniform(*m.job_after_s), 1)))
    return sorted(plan, key=lambda f: f.at)
