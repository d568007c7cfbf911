"""What `resume` found and did (`ResumeReport`), and the lines `rlstream resume` prints of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.rollout.regenerate_settle import FeedSettled
from workers.trainer.open_transactions import describe
from workers.trainer.resume_reads import Expired


@dataclass
class ResumeReport:
    """What `resume` found and did, group by group (ids kept for the unaccounted only)."""

    trained: int = 0
    restored: int = 0
    restored_rows: int = 0
    hand_back_finalized: int = 0
    duplicates: int = 0
    open_restored: int = 0
    open_partial: int = 0
    open_hand_back: int = 0
    staging_rows: int = 0
    closed_without_record: int = 0
    unaccounted: list[str] = field(default_factory=list)
    checkpoint: str = "none"
    read_whole: bool = False  # the finalized topic read from its start (a checkpoint without resolved groups)
    finalized_read: int = 0
    state_read: int = 0
    receipts_read: int = 0  # from the reassemblers' offsets (or where their state says they stood)
    expired: Expired = field(default_factory=Expired)
    waited_s: float = 0.0
    # Partitions an open transaction held when resume began ((topic, partition) -> (stable, end)), and
    # the transactional ids aborted: what the dead job left open, and what resume did about it.
    open_at_start: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    # Commits resume needed and did not find (offsets the broker expired, or never made), and what it did.
    missing_commits: list[str] = field(default_factory=list)
    feed: FeedSettled | None = None
    # (group id, partition, offset) of originals resolved before the cut that have a duplicate past it,
    # found by reading from the start; written into the checkpoint for the restored trainer.
    resolved_originals: list[tuple[str, int, int]] = field(default_factory=list)
    # Every group id resume saw: finalized past the cut, remembered by the reassemblers, open, handed back.
    known_groups: set[str] = field(default_factory=set)
    took: dict[str, float] = field(default_factory=dict)  # seconds per part, after the wait for transactions

    def lines(self) -> list[str]:
        whence = "its start (the checkpoint has no resolved groups)" if self.read_whole else "the checkpoint's cut"
        out = [
            f"checkpoint: {self.checkpoint}",
            f"finalized records read from {whence}: {self.finalized_read}; state records from the restore points:"
            f" {self.state_read}; receipts from the reassemblers' offsets: {self.receipts_read}",
            (
                f"finalized groups resolved before the checkpoint (trained, evicted or handed back): {self.trained}"
                if self.read_whole
                else f"finalized groups past the cut resolved already (trained, evicted or handed back): {self.trained}"
                " (those before the cut are not read)"
            ),
            f"finalized groups restored ({self.restored_rows} train rows back in TQ): {self.restored}",
            f"finalized groups whose train rows are lost, to be handed back (or dead-lettered) by the trainer:"
            f" {self.hand_back_finalized}",
            f"duplicates past the checkpoint of groups resolved before it (resolved by the trainer): {self.duplicates}",
            f"open groups restored whole: {self.open_restored}, partly (completed with placeholders):"
            f" {self.open_partial}, lost (to be handed back by a reassembler): {self.open_hand_back}"
            f" ({self.staging_rows} staged rows back in TQ)",
            f"groups closed without a finalized record (dead-lettered or handed back): {self.closed_without_record}",
        ]
        held = (
            f"{len(self.open_at_start)} partition(s), {describe(self.open_at_start)}" if self.open_at_start else "none"
        )
        out.append(
            f"transactions open when resume began: {held}; aborted under {len(self.aborted)} id(s)"
            + (f" ({', '.join(self.aborted[:4])})" if self.aborted else "")
            + f", then waited {self.waited_s:.1f} s"
        )
        out += self.missing_commits
        if self.expired.ranges:
            out.append(f"records expired before they were read (lost to the topics' retention): {self.expired.where()}")
        if self.feed is not None:
            out.append(
                f"hand-backs owed to the rollout workers: {self.feed.owed} ({self.feed.generated} generated already,"
                f" settled; {self.feed.requeued} put again)"
            )
        if self.took:
            out.append("took: " + ", ".join(f"{what} {s:.1f} s" for what, s in self.took.items()))
        out.append(
            f"unaccounted for: {len(self.unaccounted)}"
            + (f" (e.g. {', '.join(self.unaccounted[:5])})" if self.unaccounted else "")
        )
        return out


__all__ = ["ResumeReport"]
