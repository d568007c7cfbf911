"""Before `resume` acts: the job it restarts is dead (issue 30 review, items 3 and 10).

`resume` commits for the rollout workers' feed, aborts the reassemblers' transactions under their
ids and reads the trainer's and the reassemblers' commits as final: each wrong while one of them
still runs (Kafka's classic group coordinator takes a transactional offset commit with no member id
and generation -1 even while the group has members, so a running feed's next commit would overwrite
the one resume made). So resume first waits for the reassemblers', the trainer's and the feed's
consumer groups to be empty. A process killed a moment ago stays a member until its session times
out (rlstream's session timeouts are at most 300 s, librdkafka's default 45 s), so the wait is at
most `MEMBERS_WAIT_S`, within resume's one deadline, with a line at once and every 10 s naming the
groups and their members; past it resume refuses with one line naming them. `force` skips the
wait for members an operator knows are gone for good.

The reassemblers listed at the start are also where resume learns the transactional ids of the dead
workers (their `client.id` is their transactional id, `<consumer group>.<worker id>`), so it aborts
their open transactions without being told the ids; a worker that left its group before resume
began is not listed, and a transaction it left open is waited out.

Its admin client and producers come from the `KafkaApi` it is given and its waits are on the `Runtime`
(the real ones by default), so the explorer runs it on its models under a virtual clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from streams.admin import GroupMember, group_members
from streams.config import KafkaConfig
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.runtime import REAL_RUNTIME, Runtime
from workers.deadline import Deadline
from workers.trainer.errors import OldJobAlive
from workers.trainer.open_transactions import abort_transactions, describe, open_now, wait_for_stable

# Past the longest session timeout rlstream's settings allow (300 s), with a margin.
MEMBERS_WAIT_S = 310.0
PROGRESS_EVERY_S = 10.0


def _listed(members: dict[str, list[GroupMember]]) -> str:
    return "; ".join(
        f"{group!r}: {', '.join(str(m) for m in ms[:4])}{' ...' if len(ms) > 4 else ''}"
        for group, ms in members.items()
        if ms
    )


def wait_until_gone(
    kafka: KafkaConfig,
    groups: Sequence[str],
    deadline: Deadline,
    log: Callable[[str], None],
    *,
    force: bool = False,
    poll_s: float = 1.0,
    most_s: float = MEMBERS_WAIT_S,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> dict[str, list[GroupMember]]:
    """Wait until every group in `groups` has no member; returns the members listed when it began.

    Raises OldJobAlive naming the groups and members still there once `most_s` (or `deadline`) passed.
    """
    first = group_members(kafka, list(groups), api=api, runtime=runtime)
    if force:
        if any(first.values()):
            log(f"resume: not waiting for members to leave (--force): {_listed(first)}")
        return first
    bound = deadline.within(most_s)
    members, said = first, None
    while any(members.values()):
        if bound.passed():
            raise OldJobAlive(
                f"consumer groups still have members after {bound.elapsed():.0f} s: {_listed(members)}; the job"
                " is still running (stop it first), or pass --force if these are gone for good"
            )
        if said is None or runtime.monotonic() - said >= PROGRESS_EVERY_S:
            said = runtime.monotonic()
            log(
                f"resume: waiting for the old job's members to leave their groups (a killed one goes at its"
                f" session timeout), {bound.elapsed():.0f} s of at most {bound.seconds:.0f} s: {_listed(members)}"
            )
        runtime.sleep(poll_s)
        members = group_members(kafka, list(groups), api=api, runtime=runtime)
    if said is not None:
        log(f"resume: the old job's consumer groups are empty after {bound.elapsed():.0f} s")
    return first


def transactional_ids(members: dict[str, list[GroupMember]], reassembler_group: str) -> list[str]:
    """The transactional ids of the reassemblers `members` listed (their client id; `<group>.<worker id>`)."""
    prefix = f"{reassembler_group}."
    return sorted({m.client_id for m in members.get(reassembler_group, []) if m.client_id.startswith(prefix)})


@dataclass
class Quiet:
    """What `make_quiet` found and did: partitions a transaction held when it began ((topic, partition) ->
    (stable, end)), the transactional ids it aborted, and how long it then waited for the rest to end."""

    open_at_start: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    waited_s: float = 0.0


def make_quiet(
    kafka: KafkaConfig,
    topics: Sequence[str],
    groups: Sequence[str],
    reassembler_group: str,
    worker_ids: Sequence[str],
    deadline: Deadline,
    log: Callable[[str], None],
    *,
    force: bool = False,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> Quiet:
    """No member left in `groups` and no transaction of the dead job open on `topics`, within `deadline`.

    Notes which partitions a transaction holds now; waits for the groups to empty (`wait_until_gone`);
    aborts the transactions of the reassemblers named (`worker_ids`) or listed in their group when it
    began; then waits for any other to end (`wait_for_stable`).
    """
    quiet = Quiet(open_at_start=open_now(kafka, topics, api=api))
    if quiet.open_at_start:
        log(f"resume: transactions open now on {describe(quiet.open_at_start)}")
    seen = wait_until_gone(kafka, groups, deadline, log, force=force, api=api, runtime=runtime)
    named = [f"{reassembler_group}.{w}" for w in worker_ids]
    quiet.aborted = sorted({*named, *transactional_ids(seen, reassembler_group)})
    abort_transactions(kafka, quiet.aborted, log, api=api)
    quiet.waited_s = wait_for_stable(kafka, topics, deadline=deadline, log=log, api=api, runtime=runtime)
    return quiet


__all__ = ["MEMBERS_WAIT_S", "Quiet", "make_quiet", "transactional_ids", "wait_until_gone"]
