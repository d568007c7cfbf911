"""The TQ client against real TransferQueue on a local Ray instance."""

import pytest
import torch
from tensordict import TensorDict

from streams.errors import MissingKeysError
from streams.tq import STAGING


def test_jagged_rows_round_trip_with_tags_field_selection_list_and_clear(tq_store, unique):
    lengths = [3, 1, 7, 4]
    ids = [torch.randint(0, 50_000, (n,), dtype=torch.int64) for n in lengths]
    lps = [torch.randn(n, dtype=torch.float32) for n in lengths]
    fields = TensorDict(
        {
            "token_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
            "generation_logprobs": torch.nested.nested_tensor(lps, layout=torch.jagged),
            "reward": torch.tensor([0.5, -1.0, 2.0, 0.0]),
        },
        batch_size=[4],
    )
    keys = [f"{unique}/call{i}" for i in range(4)]
    tags = [{"rollout_id": unique, "call": i, "weight_version": 7} for i in range(4)]
    tq_store.put(STAGING, keys, fields, tags)

    order = [2, 0, 3, 1]
    got = tq_store.get(STAGING, [keys[i] for i in order], select=["token_ids", "reward"])
    assert set(got.keys()) == {"token_ids", "reward"}
    for row, i in zip(got["token_ids"].unbind(), order):
        assert torch.equal(row, ids[i])
    assert torch.equal(got["reward"], fields["reward"][order])
    full = tq_store.get(STAGING, keys)
    for row, lp in zip(full["generation_logprobs"].unbind(), lps):
        assert torch.equal(row, lp)

    listed = tq_store.list(STAGING)
    for k, t in zip(keys, tags):
        assert listed[k] == t

    tq_store.clear(STAGING, keys)
    assert tq_store.present(STAGING, keys) == set()
    with pytest.raises(MissingKeysError) as err:
        tq_store.get(STAGING, keys[:1])
    assert keys[0] in str(err.value)


def test_get_names_the_missing_key_instead_of_returning_fewer_rows(tq_store, unique):
    fields = TensorDict({"x": torch.arange(2).reshape(2, 1)}, batch_size=[2])
    tq_store.put(STAGING, [f"{unique}/a", f"{unique}/b"], fields, [{}, {}])
    with pytest.raises(MissingKeysError) as err:
        tq_store.get(STAGING, [f"{unique}/a", f"{unique}/nope", f"{unique}/b"])
    assert err.value.missing == [f"{unique}/nope"]
    tq_store.clear(STAGING, [f"{unique}/a", f"{unique}/b"])


class _ClearAndReuseBeforeRead:
    """Drives a TQStore get into the race of TQ's shared index pool, on the real TQ client.

    Before the get's first storage read, and only once every lookup already sent has been answered
    (a lookup sent alongside the read, as a check, has then seen the old locations), another client
    clears `victim` and then takes keys until TQ hands it `victim`'s freed storage index (TQ
    reuses freed indexes first in first out, for any partition) and puts a different row there.
    The read then goes to the victim's old location and finds the newcomer's row: exactly a
    lookup answered, then a clear, then a put reusing the index, then the read served (as when a
    storage get timed out and is re-sent later).
    """

    def __init__(self, tq_store, partition: str, victim: str, newcomer: TensorDict, unique: str):
        import transfer_queue as tq

        self.tq, self.client, self.store = tq, tq.get_client(), tq_store
        self.partition, self.victim, self.newcomer, self.unique = partition, victim, newcomer, unique
        self.real_lookup, self.real_read = self.client.async_kv_retrieve_meta, self.client.async_get_data
        self.in_flight, self.raced, self.fillers, self.reused_by = 0, False, [], None

    async def lookup(self, *args, **kwargs):
        self.in_flight += 1
        try:
            return await self.real_lookup(*args, **kwargs)
        finally:
            self.in_flight -= 1

    async def read(self, meta):
        import asyncio
        import time

        if not self.raced:
            self.raced = True
            deadline = time.monotonic() + 30
            while self.in_flight:  # the lookups sent with this read are answered first
                assert time.monotonic() < deadline, "a lookup sent with the read never answered"
                await asyncio.sleep(0.001)
            await asyncio.get_running_loop().run_in_executor(None, self._clear_and_reuse)
        return await self.real_read(meta)

    def _clear_and_reuse(self) -> None:
        index = self.client.kv_retrieve_meta(keys=[self.victim], partition_id=self.partition).global_indexes[0]
        self.tq.kv_clear([self.victim], self.partition)
        self.reused_by = _hand_index_to(
            self.client, self.store, index, self.partition, self.newcomer, self.fillers, self.unique
        )

    def __enter__(self):
        self.client.async_kv_retrieve_meta, self.client.async_get_data = self.lookup, self.read
        return self

    def __exit__(self, *exc):
        self.client.async_kv_retrieve_meta, self.client.async_get_data = self.real_lookup, self.real_read
        if self.fillers:
            self.tq.kv_clear(self.fillers, self.partition)


def _hand_index_to(
    client, store, index: int, partition: str, newcomer: TensorDict, fillers: list[str], unique: str
) -> str:
    """Keys of `partition` are registered until TQ hands out `index` again (it reuses freed indexes first
    in first out, for any partition); the key given it gets `newcomer`'s row. Returns that key; every
    key registered is added to `fillers`, for the caller to clear."""
    for batch in range(400):
        keys = [f"{unique}/filler{batch}-{i}" for i in range(256)]
        meta = client.kv_retrieve_meta(keys=keys, partition_id=partition, create=True)
        fillers += keys
        if index in meta.global_indexes:
            taker = keys[meta.global_indexes.index(index)]
            store.put(partition, [taker], newcomer, [{}])
            return taker
    raise AssertionError(f"TQ never handed out the freed index {index} again")


def _token_rows(*rows: list[int]) -> TensorDict:
    ids = [torch.tensor(r, dtype=torch.int64) for r in rows]
    return TensorDict(
        {"token_ids": torch.nested.nested_tensor(ids, layout=torch.jagged), "reward": torch.ones(len(rows))},
        batch_size=[len(rows)],
    )


@pytest.mark.parametrize("packed", [True, False], ids=["packed-layout", "per-field-layout"])
@pytest.mark.parametrize("after_tags", [True, False], ids=["located-by-tags", "looked-up-by-get"])
def test_a_row_cleared_and_its_index_reused_between_lookup_and_read_is_never_returned_as_the_key(
    tq_store, unique, packed, after_tags
):
    # STAGING is one of rlstream's packed partitions; a partition of another name keeps one TQ
    # field per tensor field (a framework's own, or rows of the previous layout).
    partition = STAGING if packed else f"test.{unique}"
    victim = f"{unique}/victim"
    tq_store.put(partition, [victim], _token_rows([1, 2, 3]), [{"group_id": unique}])
    if after_tags:
        assert tq_store.tags(partition, [victim]) == {victim: {"group_id": unique}}
    with _ClearAndReuseBeforeRead(tq_store, partition, victim, _token_rows([666, 666, 666]), unique) as race:
        try:
            got = tq_store.get(partition, [victim])
        except MissingKeysError as err:
            assert err.missing == [victim]  # the truth: the victim was cleared
        else:
            assert got["token_ids"].unbind()[0].tolist() == [1, 2, 3], "another key's row came back as the victim's"
            pytest.fail("the victim was cleared before the read, yet the get returned a row for it")
    assert race.raced and race.reused_by is not None


def test_rows_of_the_previous_layout_are_still_read_alone_or_mixed_with_packed_ones(tq_store, unique):
    import transfer_queue as tq

    old, new = [f"{unique}/old{i}" for i in range(2)], [f"{unique}/new{i}" for i in range(2)]
    # Rows a previous rlstream put: TQ's own layout, one TQ field per tensor field.
    tq.kv_batch_put(old, STAGING, _token_rows([1, 2], [3]), [{"v": 0}, {"v": 0}])
    tq_store.put(STAGING, new, _token_rows([4, 5, 6], [7]), [{"v": 1}, {"v": 1}])
    try:
        assert [r.tolist() for r in tq_store.get(STAGING, old)["token_ids"].unbind()] == [[1, 2], [3]]
        mixed = tq_store.get(STAGING, [new[0], old[1], old[0], new[1]], select=["token_ids", "reward"])
        assert [r.tolist() for r in mixed["token_ids"].unbind()] == [[4, 5, 6], [3], [1, 2], [7]]
        assert mixed["reward"].tolist() == [1.0, 1.0, 1.0, 1.0]
        assert tq_store.tags(STAGING, old + new) == {**{k: {"v": 0} for k in old}, **{k: {"v": 1} for k in new}}
    finally:
        tq_store.clear(STAGING, old + new)


class _TakenOver:
    """The rest of the job, while a clear of `victim` (staging) is frozen: its next owner clears it, and
    TQ hands its freed index to a row of `partition` (another partition, as a train row would be)."""

    def __init__(self, store, victim: str, partition: str, unique: str):
        import transfer_queue as tq

        self.tq, self.client, self.store = tq, tq.get_client(), store
        self.victim, self.partition, self.unique = victim, partition, unique
        self.newcomer, self.fillers, self.taker = _token_rows([7, 7, 7]), [], None

    def __call__(self) -> None:
        index = self.client.kv_retrieve_meta(keys=[self.victim], partition_id=STAGING).global_indexes[0]
        self.tq.kv_clear([self.victim], STAGING)
        self.taker = _hand_index_to(
            self.client, self.store, index, self.partition, self.newcomer, self.fillers, self.unique
        )

    async def meanwhile(self) -> None:
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self)

    def row(self) -> list[int]:
        assert self.taker is not None, "the clear never reached the point it was to be frozen at"
        return self.store.get(self.partition, [self.taker])["token_ids"].unbind()[0].tolist()

    def close(self) -> None:
        if self.fillers:
            self.tq.kv_clear(self.fillers, self.partition)


@pytest.mark.parametrize("packed", [True, False], ids=["packed-layout", "per-field-layout"])
def test_a_row_whose_storage_a_stale_clear_deleted_reads_as_missing_and_its_owners_clear_releases_it(
    tq_store, unique, packed
):
    import transfer_queue as tq

    from streams.tq import TQStore

    partition = f"test.{unique}"
    store = TQStore(packed=(STAGING, partition)) if packed else tq_store
    client = tq.get_client()
    victim = f"{unique}/victim"
    store.put(STAGING, [victim], _token_rows([1, 2, 3]), [{}])
    stale = client.kv_retrieve_meta(keys=[victim], partition_id=STAGING)  # a clear's lookup ...
    tq.kv_clear([victim], STAGING)  # ... then the key's next owner clears it, and its index is reused
    fillers: list[str] = []
    taker = _hand_index_to(client, store, stale.global_indexes[0], partition, _token_rows([7, 7]), fillers, unique)
    try:
        client._run_coroutine(client.async_clear_samples(stale))  # the stale clear goes on, in TQ's own steps
        assert taker in store.list(partition)  # the controller still maps the row, ready
        with pytest.raises(MissingKeysError) as err:
            store.get(partition, [taker])
        assert err.value.missing == [taker]
        store.clear(partition, [taker])  # what its owner does with a row it lost
        assert taker not in store.list(partition)
    finally:
        tq.kv_clear(fillers, partition)


def test_a_clear_whose_lookup_went_stale_never_deletes_the_row_that_took_its_index(tq_store, unique):
    import transfer_queue as tq

    client = tq.get_client()
    victim = f"{unique}/victim"
    tq_store.put(STAGING, [victim], _token_rows([1, 2, 3]), [{}])
    taken = _TakenOver(tq_store, victim, f"test.{unique}", unique)
    real_lookup = client.async_kv_retrieve_meta

    async def lookup_then_frozen(*args, **kwargs):
        meta = await real_lookup(*args, **kwargs)
        client.async_kv_retrieve_meta = real_lookup
        await taken.meanwhile()  # frozen after the lookup while the job went on
        return meta

    client.async_kv_retrieve_meta = lookup_then_frozen
    try:
        tq_store.clear(STAGING, [victim])
        assert taken.row() == [7, 7, 7]
    finally:
        client.async_kv_retrieve_meta = real_lookup
        taken.close()


def test_a_clear_frozen_after_its_check_gives_up_when_its_guard_saw_the_freeze(tq_store, unique):
    import transfer_queue as tq

    from streams.errors import ClearRefused

    client = tq.get_client()
    victim = f"{unique}/victim"
    tq_store.put(STAGING, [victim], _token_rows([1, 2, 3]), [{}])
    taken = _TakenOver(tq_store, victim, f"test.{unique}", unique)
    real_check = client.async_kv_retrieve_keys

    async def check_then_frozen(*args, **kwargs):
        held = await real_check(*args, **kwargs)
        client.async_kv_retrieve_keys = real_check
        await taken.meanwhile()
        return held

    def lease() -> str | None:
        return "the process was frozen past its session timeout" if taken.taker else None

    client.async_kv_retrieve_keys = check_then_frozen
    try:
        with pytest.raises(ClearRefused, match="frozen past its session timeout"):
            tq_store.clear(STAGING, [victim], guard=lease)
        assert taken.row() == [7, 7, 7]
    finally:
        client.async_kv_retrieve_keys = real_check
        taken.close()


def _drain_released(client, unique: str, fillers: list[str], partition: str) -> None:
    """Keys of `partition` are registered until TQ hands out only fresh indexes (consecutive, above all
    it gave before): its pool of released indexes is empty, so the next release is the next reuse."""
    highest = -1
    for n in range(400):
        keys = [f"{unique}/drain{n}-{i}" for i in range(1024)]
        got = client.kv_retrieve_meta(keys=keys, partition_id=partition, create=True).global_indexes
        fillers += keys
        if got == list(range(got[0], got[0] + len(got))) and got[0] > highest:
            return
        highest = max(highest, *got)
    raise AssertionError("TQ's pool of released indexes never ran dry")


def test_a_stale_clear_never_deletes_a_key_of_its_own_staged_again_at_another_keys_old_index(tq_store, unique):
    # The review's e2 interleaving on real TQ: a clear of [A, B] frozen after its lookup; the keys'
    # next owner clears A, then B; B is staged again (a publisher's retry) and TQ hands it A's old
    # index. Every index of the stale lookup still holds a key of the clear, but not the one it was
    # looked up for: the clear must leave B's new row alone.
    import transfer_queue as tq

    from schemas.rowpack import PACKED_FIELD, unpack_rows

    client = tq.get_client()
    a, b, scratch = f"{unique}/A", f"{unique}/B", f"test.{unique}"
    tq_store.put(STAGING, [a, b], _token_rows([1, 1, 1], [2, 2, 2]), [{}, {}])
    index_a = client.kv_retrieve_meta(keys=[a], partition_id=STAGING).global_indexes[0]
    fillers: list[str] = []
    new_b: dict = {}
    real_lookup = client.async_kv_retrieve_meta

    def meanwhile() -> None:
        _drain_released(client, unique, fillers, scratch)
        tq.kv_clear([a], STAGING)
        tq.kv_clear([b], STAGING)
        tq_store.put(STAGING, [b], _token_rows([22, 22, 22]), [{"again": True}])
        new_b["meta"] = client.kv_retrieve_meta(keys=[b], partition_id=STAGING)

    async def lookup_then_frozen(*args, **kwargs):
        import asyncio

        meta = await real_lookup(*args, **kwargs)
        client.async_kv_retrieve_meta = real_lookup
        await asyncio.get_running_loop().run_in_executor(None, meanwhile)
        return meta

    client.async_kv_retrieve_meta = lookup_then_frozen
    try:
        tq_store.clear(STAGING, [a, b])  # the stale clear
        assert new_b["meta"].global_indexes == [index_a], "B was not handed A's old index"
        assert b in tq_store.list(STAGING)  # not released: the controller still maps B
        stored = client._run_coroutine(client.async_get_data(new_b["meta"]))  # storage, by index
        row = unpack_rows(STAGING, [b], stored.get(PACKED_FIELD)).fields["token_ids"].unbind()[0]
        assert row.tolist() == [22, 22, 22]  # B's new row is whole
        tq_store.clear(STAGING, [b])  # its owner's clear (the stale mark left it being cleared)
        assert b not in tq_store.list(STAGING)
    finally:
        client.async_kv_retrieve_meta = real_lookup
        for i in range(0, len(fillers), 4096):
            tq.kv_clear(fillers[i : i + 4096], scratch)


def test_row_bytes_comes_from_tq_metadata_for_packed_and_plain_rows_and_leaves_absent_keys_out(tq_store, unique):
    # What the spill sizes its reads by (issue 30 review, item 2): a packed row is one uint8 field of its
    # bytes (its fields and a header); a plain partition's row is the sum of its fields' bytes.
    from schemas.rowpack import pack_rows
    from streams.tq import TRAIN

    lengths = [3, 1000, 70_000]
    ids = [torch.arange(n, dtype=torch.int64) for n in lengths]
    fields = TensorDict(
        {"input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged), "reward": torch.tensor([0.5, 1.0, 2.0])},
        batch_size=[3],
    )
    keys = [f"{unique}_g{i}" for i in range(3)]
    tq_store.put(TRAIN, keys, fields, [{}] * 3)
    plain = f"test.{unique}"
    tq_store.put(plain, keys, fields, [{}] * 3)
    try:
        packed = pack_rows(TRAIN, keys, fields)
        want = [len(r) for r in packed.unbind()]
        assert tq_store.row_bytes(TRAIN, [*keys, f"{unique}_absent"]) == dict(zip(keys, want))
        assert want[2] >= 70_000 * 8  # the row's own bytes at least
        assert tq_store.row_bytes(plain, keys) == {k: n * 8 + 4 for k, n in zip(keys, lengths)}
        tq_store.clear(TRAIN, keys[:1])
        assert tq_store.row_bytes(TRAIN, keys) == dict(zip(keys[1:], want[1:]))  # cleared since listed
    finally:
        tq_store.clear(TRAIN, keys)
        tq_store.clear(plain, keys)
