"""Whether a group with no valid row lost its staging (handed back) or was refused (dead-lettered).

After a whole-job restart TQ comes back empty while Kafka keeps the receipts: a group whose rows went
with TQ can only be trained by generating its prompt again. The same holds for a row destroyed under
its own key: TQ still maps the key, with the group's own tags, but the row reads as missing, because
another worker's clear by index (frozen past its checks, DESIGN "Zombies") or a late put landed on the
index the row took meanwhile. A group whose keys exist under another group is hostile input, a group
whose own rows were read but are not rows it can use is its publisher's fault, and a group of failed
rollouts alone is no loss: all three are dead-lettered.
"""

from __future__ import annotations

from collections.abc import Collection

from schemas.group_build import GroupBuild
from workers.reassembler.groups import OpenGroup

MISSING_STAGING_ROW = "missing_staging_row"  # schemas.linearize's rejection of a receipt whose row is gone
MISSING_RECEIPT = "missing_receipt"  # a rollout the group closed without (at its timeout)
ROLLOUT_FAILED = "rollout_failed"

# A group with no valid row whose rows were lost with TQ (every other reason is the group's own): handed back.
_LOST_WITH_TQ = {MISSING_STAGING_ROW, ROLLOUT_FAILED, MISSING_RECEIPT}


def staging_lost(
    group: OpenGroup,
    build: GroupBuild,
    present: Collection[str],
    mine: Collection[str],
    unread: Collection[str] = (),
) -> bool:
    """Whether the group's missing rows were lost rather than refused: every rollout is either missing
    its staged rows, failed, or never sent a receipt (a group cut short by the crash), at least one is
    missing rows, and each of those has a staging key that is lost (not in TQ at all, or `present`
    and its own but `unread`: the store reported its row missing) and none in TQ under another owner.

    `present`: the keys the lookup found (under any owner); `mine`: those staged by the group and
    rollout that claim them; `unread`: those whose read the store answered with the row missing.

    Only the rollouts missing rows are looked at: a failed rollout stages nothing, or rows of its own
    (which a spill may have put back), and says nothing about whether the others' staging survived. A
    rollout whose keys a spill put back in part (one call of several staged before the spill listed
    staging) is lost all the same. A key present under another owner is hostile input, never a loss;
    a rollout whose keys were all present and read is missing rows the store gave but its build could
    not use (not this pipeline's rows): its own fault. A group of failed rollouts alone is no loss: it
    is dead-lettered as before.
    """
    reasons = build.rejection_reasons
    if not set(reasons) <= _LOST_WITH_TQ or MISSING_STAGING_ROW not in reasons:
        return False
    receipts = group.by_index()
    missing = [receipts[i] for i, reason in enumerate(reasons) if reason == MISSING_STAGING_ROW]
    for r in missing:
        keys = [c.staging_key for c in r.manifest] if r is not None else []
        if any(k in present and k not in mine for k in keys):
            return False
        if keys and all(k in present and k not in unread for k in keys):
            return False
    return True
