"""Spilling TQ's rows into a checkpoint and putting chosen ones back (issue 24), against the in-memory store."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from streams.errors import MissingKeysError
from streams.tq import STAGING, TRAIN, TQStore
from tests.unit.fake_tq import FakeTQ
from tests.unit.memory_store import InMemoryStore
from workers.trainer.errors import SpillError
from workers.trainer.spill import SPILL_FILE, spill_rows
from workers.trainer.spill_read import read_spill


def _stage(store: InMemoryStore) -> None:
    # Train rows of two lengths (jagged), staged calls of which one carries an extra field.
    for g, n in (("g0", 3), ("g1", 5)):
        ids = [f"{g}_g{i}" for i in range(2)]
        tokens = torch.nested.nested_tensor([torch.arange(n) + i for i in range(2)], layout=torch.jagged)
        fields = TensorDict({"input_ids": tokens, "total_reward": torch.tensor([0.5, 1.0])}, batch_size=[2])
        store.put(TRAIN, ids, fields, [{"group_id": g, "row": i} for i in range(2)])
    store.put(STAGING, ["g2-r0/c0"], TensorDict({"ids": torch.arange(4)[None]}, batch_size=[1]), [{"group_id": "g2"}])
    experts = TensorDict({"ids": torch.arange(2)[None], "routed": torch.ones(1, 2, 3, dtype=torch.uint8)}, [1])
    store.put(STAGING, ["g2-r1/c0"], experts, [{"group_id": "g2"}])


def _row(store, partition, key) -> dict:
    return {k: v[0] if v.is_nested else v[0] for k, v in store.get(partition, [key]).items()}


def test_spilled_rows_come_back_as_they_were_with_their_tags_and_only_those_asked_for(tmp_path):
    before = InMemoryStore()
    _stage(before)
    summary = spill_rows(before, tmp_path, binding="ckpt-3")
    assert summary.rows == {TRAIN: 4, STAGING: 2} and summary.gone == 0

    spill = read_spill(tmp_path, binding="ckpt-3")
    assert spill.keys(TRAIN) == {"g0_g0", "g0_g1", "g1_g0", "g1_g1"}
    after = InMemoryStore()
    assert spill.restore(after, TRAIN, ["g1_g1", "g0_g0", "nowhere"]) == 2
    assert spill.restore(after, STAGING, ["g2-r0/c0", "g2-r1/c0"]) == 2
    assert after.list(TRAIN).keys() == {"g1_g1", "g0_g0"}
    for partition, key in ((TRAIN, "g1_g1"), (TRAIN, "g0_g0"), (STAGING, "g2-r0/c0"), (STAGING, "g2-r1/c0")):
        want, got = _row(before, partition, key), _row(after, partition, key)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), (partition, key)
        assert after.tags(partition, [key]) == before.tags(partition, [key])


class _Vanishing(InMemoryStore):
    """Rows cleared between the list and the read, as a running pipeline clears them."""

    def __init__(self, gone: set[str]):
        super().__init__()
        self.gone = gone

    def get(self, partition, keys, select=None):
        missing = [k for k in keys if k in self.gone]
        if missing:
            raise MissingKeysError(partition, missing)
        return super().get(partition, keys, select)


def test_a_row_gone_while_the_spill_reads_is_left_out_not_guessed(tmp_path):
    store = _Vanishing({"g0_g1"})
    _stage(store)
    summary = spill_rows(store, tmp_path, binding="b")
    assert summary.rows[TRAIN] == 3 and summary.gone == 1
    assert "g0_g1" not in read_spill(tmp_path, binding="b").keys(TRAIN)


class _ListedMidPut(InMemoryStore):
    """Rows listed in the middle of their put: TQ registers a put's keys (listed, tags empty), writes
    their fields (a get finds them), then sets their tags. `untagged` still lacks its tags when read."""

    def __init__(self, mid_put: set[str], untagged: set[str] = frozenset()):
        super().__init__()
        self.mid_put, self.untagged = mid_put, untagged

    def list(self, partition):
        return {k: ({} if k in self.mid_put else tag) for k, tag in super().list(partition).items()}

    def tags(self, partition, keys):
        return {k: ({} if k in self.untagged else tag) for k, tag in super().tags(partition, keys).items()}


def test_a_row_listed_before_its_tags_landed_is_spilled_with_them_or_left_out_if_staged_untagged(tmp_path):
    # Seen in the job-restart drill: a checkpoint's listing caught two groups' staged rows mid-put, the
    # spill kept them with empty tags, resume put them back so, and the reassembler read rows without
    # an owner as hostile: both groups dead-lettered instead of trained. The tags are read after the
    # rows; a staged row still without them (no receipt can own it) is left out: its group is handed back.
    store = _ListedMidPut(mid_put={"g0_g1", "g2-r0/c0", "g2-r1/c0"}, untagged={"g2-r1/c0"})
    _stage(store)
    summary = spill_rows(store, tmp_path, binding="b")
    assert summary.rows == {TRAIN: 4, STAGING: 1} and summary.gone == 1
    spill = read_spill(tmp_path, binding="b")
    assert spill.keys(STAGING) == {"g2-r0/c0"}
    after = InMemoryStore()
    spill.restore(after, TRAIN, ["g0_g1"])
    spill.restore(after, STAGING, ["g2-r0/c0"])
    assert after.tags(TRAIN, ["g0_g1"]) == {"g0_g1": {"group_id": "g0", "row": 1}}
    assert after.tags(STAGING, ["g2-r0/c0"]) == {"g2-r0/c0": {"group_id": "g2"}}


def test_a_train_row_spilled_untagged_comes_back_tagged_so_no_sweep_takes_it_for_a_given_up_put(tmp_path):
    # A train row caught mid-put whose tags could not be read after it is kept (its record may be
    # committed: the trainer takes tags from the record). Put back with none, it would look like the
    # keys a put given up after its index lookup leaves, which the reassembler's sweep clears
    # (`sweeper._sweep_untagged_train`): the record's rows gone before the trainer reads them.
    store = _ListedMidPut(mid_put={"g0_g1"}, untagged={"g0_g1"})
    _stage(store)
    spill_rows(store, tmp_path, binding="b")
    after = InMemoryStore()
    assert read_spill(tmp_path, binding="b").restore(after, TRAIN, ["g0_g0", "g0_g1"]) == 2
    tags = after.tags(TRAIN, ["g0_g0", "g0_g1"])
    assert tags["g0_g0"] == {"group_id": "g0", "row": 0}
    assert tags["g0_g1"], "restored with no tags at all"


def test_a_spill_cut_short_missing_or_of_another_checkpoint_is_refused(tmp_path):
    store = InMemoryStore()
    _stage(store)
    spill_rows(store, tmp_path, binding="ckpt-3")
    with pytest.raises(SpillError, match="written for checkpoint 'ckpt-3', not 'ckpt-4'"):
        read_spill(tmp_path, binding="ckpt-4")
    path = tmp_path / SPILL_FILE
    whole = path.read_bytes()
    for cut in (len(whole) - 1, len(whole) - 30, 9):
        path.write_bytes(whole[:cut])
        with pytest.raises(SpillError, match="cut short"):
            read_spill(tmp_path, binding="ckpt-3")
    path.unlink()
    with pytest.raises(SpillError, match="cannot read"):
        read_spill(tmp_path, binding="ckpt-3")


def test_a_row_a_stale_clear_deleted_under_its_key_is_left_out_and_the_spill_completes(tmp_path):
    # TQ still maps g0_g1 (ready, tagged) but its storage was deleted by a clear whose lookup went
    # stale: the spill reads it as gone, as a row cleared meanwhile, instead of failing the checkpoint.
    tq = FakeTQ()
    store = TQStore()
    store._tq = tq
    _stage(store)
    tq.stale_clear(TRAIN, "g0_g1", looked_up_in=STAGING)
    summary = spill_rows(store, tmp_path, binding="ckpt-4", partitions=(TRAIN,))
    assert summary.rows == {TRAIN: 3} and summary.gone == 1
    assert read_spill(tmp_path, binding="ckpt-4").keys(TRAIN) == {"g0_g0", "g1_g0", "g1_g1"}


# ----- issue 30 item 5: a spill that was written reads back, whatever its rows' sizes ----------------

MiB = 1 << 20


def _big_rows(store: InMemoryStore, sizes: dict[str, int]) -> None:
    """Train rows of about `sizes[key]` bytes each (one int64 field), tagged with their size."""
    for key, size in sizes.items():
        n = max(1, size // 8)
        fields = TensorDict({"input_ids": (torch.arange(n, dtype=torch.int64) * 7 + len(key))[None]}, batch_size=[1])
        store.put(TRAIN, [key], fields, [{"size": size}])


def _frames(path) -> list[int]:
    """The length of every framed message of a spill file."""
    data = path.read_bytes()
    out, pos = [], 0
    while pos + 8 <= len(data):
        n = int.from_bytes(data[pos : pos + 8], "big")
        if pos + 8 + n > len(data):
            break  # a format-2 spill's trailing position of its end record
        out.append(n)
        pos += 8 + n
    return out


def _same(a: InMemoryStore, b: InMemoryStore, partition: str, keys) -> bool:
    return all(torch.equal(_row(a, partition, k)["input_ids"], _row(b, partition, k)["input_ids"]) for k in keys)


def test_no_spill_message_holds_more_than_64_mib_of_rows_however_large_the_rows(tmp_path):
    # Before: chunks of 16 rows whatever their size, so 16 long-context MoE rows of 64 MiB made a
    # message past the 1 GiB a reader accepts, and the checkpoint could never be read back. Here 17
    # rows of 4 MiB (one chunk of 16 was 64 MiB and more) and one row of 70 MiB (split into parts).
    sizes = {f"g{i:02d}_g0": 4 * MiB for i in range(17)} | {"huge_g0": 70 * MiB}
    before = InMemoryStore()
    _big_rows(before, sizes)
    summary = spill_rows(before, tmp_path, binding="b", partitions=(TRAIN,))
    assert summary.rows == {TRAIN: len(sizes)}
    assert max(_frames(tmp_path / SPILL_FILE)) <= 64 * MiB + 64 * 1024
    after = InMemoryStore()
    with read_spill(tmp_path, binding="b") as spill:
        assert spill.restore(after, TRAIN, list(sizes)) == len(sizes)
    assert _same(before, after, TRAIN, sizes)
    assert after.tags(TRAIN, ["huge_g0"]) == {"huge_g0": {"size": 70 * MiB}}


def test_rows_of_any_size_against_the_message_limit_read_back_whole(tmp_path, monkeypatch):
    # The limit a reader accepts shrunk to 1 MiB, so rows of a few hundred KiB stand for rows of tens
    # of MiB against the real 1 GiB: small rows, rows at a chunk's size, rows of several parts.
    monkeypatch.setattr("schemas.spill.MAX_SPILL_MESSAGE_BYTES", MiB)
    sizes = {f"s{i}_g0": 1000 + i for i in range(40)} | {"edge_g0": MiB // 16, "many_g0": 5 * MiB // 2}
    sizes |= {f"mid{i}_g0": 300_000 for i in range(7)}
    before = InMemoryStore()
    _big_rows(before, sizes)
    spill_rows(before, tmp_path, binding="b", partitions=(TRAIN,))
    assert max(_frames(tmp_path / SPILL_FILE)) <= MiB
    after = InMemoryStore()
    with read_spill(tmp_path, binding="b") as spill:
        assert spill.keys(TRAIN) == set(sizes)
        assert spill.restore(after, TRAIN, sorted(sizes)) == len(sizes)
    assert _same(before, after, TRAIN, sizes)


def test_restoring_chosen_rows_reads_only_the_messages_that_hold_them(tmp_path, monkeypatch):
    # Streaming: a reader that held the whole spill (about three times the file) would also decode
    # the rows nobody asked for. Spoil every chunk but the one holding the row asked for: still restored.
    monkeypatch.setattr("schemas.spill.MAX_SPILL_MESSAGE_BYTES", MiB)
    sizes = {f"r{i:02d}_g0": 40_000 for i in range(30)}
    before = InMemoryStore()
    _big_rows(before, sizes)
    spill_rows(before, tmp_path, binding="b", partitions=(TRAIN,))
    path = tmp_path / SPILL_FILE
    data = bytearray(path.read_bytes())
    frames, pos = [], 0
    for n in _frames(path):
        frames.append((pos, n))
        pos += 8 + n
    chunks = [(at, n) for at, n in frames if b"spill_chunk" in data[at + 8 : at + 8 + 64]]
    assert len(chunks) > 2
    keep_at = None
    with read_spill(tmp_path, binding="b") as spill:
        keep_at = spill._where[(TRAIN, "r29_g0")]
    for at, _ in chunks:
        if at != keep_at:
            data[at + 8] = 0xC1  # msgpack's never-used byte: the message cannot be decoded
    path.write_bytes(bytes(data))
    after = InMemoryStore()
    with read_spill(tmp_path, binding="b") as spill:
        assert spill.restore(after, TRAIN, ["r29_g0"]) == 1
        with pytest.raises(SpillError, match="at byte"):
            spill.restore(after, TRAIN, ["r00_g0"])
    assert _same(before, after, TRAIN, ["r29_g0"])


GOLDEN_V1 = Path(__file__).parent / "golden" / "format1.spill"


def test_a_spill_of_the_first_format_is_still_read(tmp_path):
    # Bytes written by issue 24's spill itself (`spill_rows` of commit 93d12d2, run on `_stage`'s rows
    # with binding "run-old:7"): its header without a format, its chunks of up to 16 whole rows, its
    # end record, as the encoder of the time laid them out; not today's schema classes writing them.
    shutil.copy(GOLDEN_V1, tmp_path / SPILL_FILE)
    store = InMemoryStore()
    _stage(store)
    after = InMemoryStore()
    with read_spill(tmp_path, binding="run-old:7") as spill:
        assert spill.header.format == 1
        assert spill.keys(TRAIN) == set(store.list(TRAIN)) and spill.keys(STAGING) == set(store.list(STAGING))
        assert spill.restore(after, TRAIN, sorted(store.list(TRAIN))) == 4
        assert spill.restore(after, STAGING, sorted(store.list(STAGING))) == 2
    for partition in (TRAIN, STAGING):
        assert after.list(partition) == store.list(partition)
        for key in store.list(partition):
            want, got = _row(store, partition, key), _row(after, partition, key)
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), (partition, key)


class _Measured(InMemoryStore):
    """Notes the bytes of rows each get returns: what the spill holds of TQ at once."""

    def __init__(self):
        super().__init__()
        self.gets: list[tuple[int, int]] = []

    def get(self, partition, keys, select=None):
        td = super().get(partition, keys, select)
        nbytes = sum(t.numel() * t.element_size() for t in td.values())
        self.gets.append((len(keys), nbytes))
        return td


def test_no_read_of_tq_holds_more_than_a_chunk_unless_it_is_one_row_when_long_rows_follow_short_ones(
    tmp_path, monkeypatch
):
    # The batch a get asked for came from the mean size of the rows before it: 300 short rows sorted
    # first made it 256 rows, and the next 256 rows were long (each near a chunk) in one get, 256
    # chunks at once (15 GiB with rows of 60 MiB). The limit shrunk to 1 MiB: a chunk is 64 KiB.
    monkeypatch.setattr("schemas.spill.MAX_SPILL_MESSAGE_BYTES", MiB)
    chunk = MiB // 16
    sizes = {f"a{i:04d}_g0": 100 for i in range(300)} | {f"b{i:04d}_g0": 60_000 for i in range(256)}
    sizes |= {"c_huge_g0": 3 * chunk}  # a row bigger than a chunk: read alone
    before = _Measured()
    _big_rows(before, sizes)
    before.gets.clear()
    summary = spill_rows(before, tmp_path, binding="b", partitions=(TRAIN,))
    assert summary.rows == {TRAIN: len(sizes)}
    assert all(nbytes <= chunk or n == 1 for n, nbytes in before.gets), max(before.gets, key=lambda g: g[1])
    assert max(n for n, _ in before.gets) == 300  # still batched: the short rows in one get
    after = InMemoryStore()
    with read_spill(tmp_path, binding="b") as spill:
        assert spill.restore(after, TRAIN, sorted(sizes)) == len(sizes)
    assert _same(before, after, TRAIN, sizes)


def test_a_row_in_parts_whose_part_is_out_of_place_or_cut_off_is_refused_not_put_back_wrong(tmp_path, monkeypatch):
    monkeypatch.setattr("schemas.spill.MAX_SPILL_MESSAGE_BYTES", MiB)
    sizes = {"big_g0": 5 * MiB // 32, "small_g0": 1000}  # the big row in 3 parts of 64 KiB at most
    before = InMemoryStore()
    _big_rows(before, sizes)
    spill_rows(before, tmp_path, binding="b", partitions=(TRAIN,))
    path = tmp_path / SPILL_FILE
    whole = path.read_bytes()
    frames, pos = [], 0
    for n in _frames(path):
        frames.append((pos, 8 + n))
        pos += 8 + n
    parts = [(at, n) for at, n in frames if b"spill_row_part" in whole[at + 8 : at + 8 + 64]]
    assert len(parts) == 3
    (a1, n1), (a2, n2) = parts[1], parts[2]
    # Parts 1 and 2 swapped: the file keeps its length, its index and its end record.
    path.write_bytes(whole[:a1] + whole[a2 : a2 + n2] + whole[a1 : a1 + n1] + whole[a2 + n2 :])
    after = InMemoryStore()
    with read_spill(tmp_path, binding="b") as spill:
        assert spill.restore(after, TRAIN, ["small_g0"]) == 1
        with pytest.raises(SpillError, match="big_g0.*part 1 of 3 is not next"):
            spill.restore(after, TRAIN, ["big_g0"])
    assert "big_g0" not in after.list(TRAIN)
