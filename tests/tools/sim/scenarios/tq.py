"""TQ scenarios (claims T1-T8), run on the real TQ and on the model: each returns what its client saw.

Global indexes are written relative to `w.base`, the counter where the scenario's allocations begin
(the real TQ's pool is drained first, so both start from an empty pool). Partitions are fresh per
run, so a partition's creation takes its pre-allocated index in both.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch
from tensordict import TensorDict


def fresh(name: str) -> str:
    """A partition no run used before, named `name` in what a scenario records (`short`)."""
    return f"sim.{uuid.uuid4().hex[:8]}.{name}"


def short(partition_id: str) -> str:
    return partition_id.rsplit(".", 1)[-1]


def rows(keys: list[str], field: str = "x", width: int = 2) -> TensorDict:
    """One row per key whose values name the key (so a row read back says whose it is)."""
    data = torch.stack([torch.tensor([sum(k.encode()) + i for i in range(width)], dtype=torch.int64) for k in keys])
    return TensorDict({field: data}, batch_size=[len(keys)])


def put(w, partition: str, keys: list[str], tags: list[dict] | None = None, field: str = "x") -> None:
    tags = tags if tags is not None else [{"key": k} for k in keys]
    w.run(w.tq.async_kv_batch_put(keys=keys, partition_id=partition, fields=rows(keys, field), tags=tags))


def meta(w, partition: str, keys: list[str]):
    return w.run(w.tq.get_client().async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False))


def describe(w, m) -> dict[str, Any]:
    """A BatchMeta as a client reads it, indexes relative to the scenario's base."""
    return {
        "size": m.size,
        "indexes": [i - w.base for i in m.global_indexes],
        "fields": list(m.field_names),
        "ready": bool(m.is_ready),
        "status": [int(s) for s in m.production_status],
        "tags": [dict(t) for t in m.custom_meta],
        "partitions": [short(p) for p in m.partition_ids],
    }


def look(w, partition: str, keys: list[str]) -> dict[str, Any]:
    return describe(w, meta(w, partition, keys))


def get(w, partition: str, keys: list[str]) -> Any:
    """A lookup then a read by its meta: the rows as lists, or the error's type."""
    try:
        m = meta(w, partition, keys)
        data = w.run(w.tq.get_client().async_get_data(m))
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        return ("error", type(exc).__name__)
    return ("rows", {name: _as_lists(data.get(name)) for name in sorted(data.keys())}, list(data.batch_size))  # noqa: SIM118


def _as_lists(value) -> list:
    if isinstance(value, torch.Tensor) and value.is_nested:
        return [t.tolist() for t in value.unbind()]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return list(value)


def listing(w, partition: str) -> dict[str, dict]:
    return {short(p): keys for p, keys in w.run(w.tq.async_kv_list(partition_id=partition)).items()}


def clear(w, partition: str, keys: list[str]) -> None:
    w.run(w.tq.async_kv_clear(keys=keys, partition_id=partition))


def index_pool(w) -> dict[str, Any]:
    """T1, T3, T6: indexes across two partitions, reused FIFO; a key put again; lists and tags."""
    a, b = fresh("A"), fresh("B")
    obs: dict[str, Any] = {}
    put(w, a, ["a1", "a2"])
    put(w, b, ["b1"])
    obs["first"] = {"a": look(w, a, ["a1", "a2"]), "b": look(w, b, ["b1"])}
    clear(w, a, ["a1"])
    clear(w, b, ["b1"])
    put(w, b, ["b2", "b3"])
    put(w, a, ["a3"])
    obs["reused"] = {"b": look(w, b, ["b2", "b3"]), "a": look(w, a, ["a3"])}
    put(w, a, ["a2"], tags=[{"second": True}])
    obs["put_again"] = look(w, a, ["a2"])
    obs["absent_left_out"] = look(w, a, ["nope", "a3", "a1"])
    obs["unknown_partition"] = look(w, fresh("none"), ["x"])
    obs["lists"] = {"a": listing(w, a), "b": listing(w, b), "unknown": listing(w, fresh("none"))}
    clear(w, a, ["a2", "a3", "nope"])
    clear(w, b, ["b2", "b3"])
    put(w, b, ["b4", "b5", "b6", "b7"])
    obs["after_full_clear"] = look(w, b, ["b4", "b5", "b6", "b7"])
    clear(w, b, ["b4", "b5", "b6", "b7"])
    return obs


def stale_clear(w) -> dict[str, Any]:
    """T4, T5: a clear whose lookup went stale deletes the new owner's data; its entry stays ready."""
    a, b = fresh("A"), fresh("B")
    client = w.tq.get_client()
    put(w, a, ["a0"])  # both partitions exist before the race, so no pre-allocation interferes
    put(w, b, ["b0"])
    put(w, b, ["b1"])
    stale = meta(w, b, ["b1"])
    clear(w, b, ["b1"])  # a successor clears it: its index goes back to the pool
    put(w, a, ["a1"])  # a put takes that index
    obs: dict[str, Any] = {
        "a1_before": look(w, a, ["a1"]),
        "same_index": meta(w, a, ["a1"]).global_indexes == stale.global_indexes,
    }
    w.run(client._mark_clearing_in_controller(stale))
    obs["after_mark"] = look(w, a, ["a1"])
    w.run(client.storage_manager.clear_data(stale))
    obs["after_storage_clear"] = look(w, a, ["a1"])
    obs["get_after_storage_clear"] = get(w, a, ["a1"])
    w.run(client._clear_meta_in_controller(stale))
    obs["after_clear_meta"] = look(w, a, ["a1"])
    obs["list_a"] = listing(w, a)
    obs["list_b"] = listing(w, b)
    put(w, b, ["b2"])
    obs["next_index"] = look(w, b, ["b2"])["indexes"]
    # The owner's own clear still works (its controller entry and index are intact).
    clear(w, a, ["a1"])
    obs["a1_gone"] = look(w, a, ["a1"])
    put(w, a, ["a2"])
    obs["a2_index"] = look(w, a, ["a2"])["indexes"]
    clear(w, a, ["a0", "a2"])
    clear(w, b, ["b0", "b2"])
    return obs


def gets(w) -> dict[str, Any]:
    """T5: gets by meta: rows in order, a subset of fields, mixed fields, a marked row, a missing key."""
    p = fresh("G")
    client = w.tq.get_client()
    put(w, p, ["k1", "k2", "k3"])
    put(w, p, ["y1"], field="y")
    obs: dict[str, Any] = {"rows": get(w, p, ["k3", "k1"]), "missing": get(w, p, ["k1", "nope"])}
    obs["mixed_meta"] = look(w, p, ["k1", "y1"])
    obs["mixed_get"] = get(w, p, ["k1", "y1"])
    obs["select"] = describe(w, meta(w, p, ["k1", "k2"]).select_fields(["x"]))
    obs["select_absent"] = describe(w, meta(w, p, ["k1"]).select_fields(["zz"]))
    marked = meta(w, p, ["k2"])
    w.run(client._mark_clearing_in_controller(marked))
    obs["marked"] = look(w, p, ["k2"])
    obs["marked_with_ready"] = look(w, p, ["k1", "k2"])
    obs["marked_get"] = get(w, p, ["k2"])
    obs["list_while_marked"] = sorted(listing(w, p).get(short(p), {}))
    w.run(client.async_clear_samples(marked))
    obs["after_clear_samples"] = look(w, p, ["k2"])
    clear(w, p, ["k1", "k3", "y1"])
    obs["list_after"] = listing(w, p)
    return obs


def put_steps(w) -> dict[str, Any]:
    """T2, T7: a put stopped after each of its requests (a caller gone), and its rest applied later."""
    p = fresh("S")
    client = w.tq.get_client()
    put(w, p, ["s0"])
    data = rows(["s1", "s2"])
    m = w.run(client.async_kv_retrieve_meta(keys=["s1", "s2"], partition_id=p, create=True))
    obs: dict[str, Any] = {"allocated": describe(w, m), "listed_after_alloc": listing(w, p)}
    obs["get_after_alloc"] = get(w, p, ["s1", "s2"])
    m.update_custom_meta([{"key": "s1"}, {"key": "s2"}])
    w.run(client.storage_manager.put_data(data, m))
    obs["after_write_and_notify"] = look(w, p, ["s1", "s2"])
    obs["get_before_tags"] = get(w, p, ["s1", "s2"])
    w.run(client.async_set_custom_meta(m))
    obs["after_tags"] = look(w, p, ["s1", "s2"])
    obs["listed"] = listing(w, p)
    clear(w, p, ["s0", "s1", "s2"])
    return obs


def held(w, partition: str, indexes: list[int]) -> Any:
    """T8: the keys `indexes` hold in `partition` now, or the error's type."""
    try:
        return ("keys", w.run(w.tq.get_client().async_kv_retrieve_keys(global_indexes=indexes, partition_id=partition)))
    except Exception as exc:  # noqa: BLE001 - what the client raised is the observation
        return ("error", type(exc).__name__)


def retrieve_keys(w) -> dict[str, Any]:
    """T8: which key an index holds now (a checked clear asks it between its mark and its delete)."""
    a, b = fresh("K"), fresh("L")
    put(w, a, ["a0", "a1"])
    put(w, b, ["b0"])
    ma, mb = meta(w, a, ["a0", "a1"]), meta(w, b, ["b0"])
    obs: dict[str, Any] = {
        "held": held(w, a, ma.global_indexes),
        "reversed": held(w, a, list(reversed(ma.global_indexes))),
        "other_partitions": held(w, a, [*ma.global_indexes, *mb.global_indexes]),
        "unknown_partition": held(w, fresh("none"), ma.global_indexes),
    }
    clear(w, a, ["a1"])
    obs["after_clear"] = held(w, a, ma.global_indexes)
    put(w, b, ["b1"])  # takes a1's index: the only one released
    obs["reused_elsewhere"] = held(w, a, ma.global_indexes)
    obs["reused_by"] = held(w, b, ma.global_indexes)
    obs["select"] = describe(w, ma.select_samples([1]))
    clear(w, a, ["a0"])
    clear(w, b, ["b0", "b1"])
    return obs


KEYS = [f"k{i}" for i in range(6)]


def sequence(w, ops: list[tuple]) -> list[Any]:
    """Run `ops` over two fresh partitions and record each one's outcome (generated by Hypothesis).

    ("put", p, keys) | ("clear", p, keys) | ("get", p, keys) | ("list", p) | ("lookup", p, keys, slot)
    keeps a lookup for later | ("stale_clear", slot) clears by a kept lookup (mark, storage, release) |
    ("stale_storage", slot) runs only a kept lookup's storage delete | ("held", p, slot) asks which keys
    a kept lookup's indexes hold in partition p now | ("begin", p, keys, slot) a put's first phase only
    (its keys allocated), kept in slot | ("write", slot) that put's fields written | ("tag", slot) its
    tags set, the put done (each phase as `async_kv_batch_put` makes it; other ops run between them).
    """
    parts = [fresh("P0"), fresh("P1")]
    client = w.tq.get_client()
    kept: dict[int, Any] = {}
    putting: dict[int, tuple[str, list[str], Any]] = {}
    out: list[Any] = []
    for op in ops:
        kind = op[0]
        if kind == "put":
            put(w, parts[op[1]], list(op[2]), tags=[{"key": k, "n": len(out)} for k in op[2]])
            out.append(look(w, parts[op[1]], list(op[2])))
        elif kind == "clear":
            clear(w, parts[op[1]], list(op[2]))
            out.append(look(w, parts[op[1]], KEYS))
        elif kind == "get":
            out.append(get(w, parts[op[1]], list(op[2])))
        elif kind == "list":
            out.append(listing(w, parts[op[1]]))
        elif kind == "lookup":
            kept[op[3]] = meta(w, parts[op[1]], list(op[2]))
            out.append(describe(w, kept[op[3]]))
        elif kind == "stale_clear" and op[1] in kept:
            w.run(client.async_clear_samples(kept.pop(op[1])))
            out.append([look(w, p, KEYS) for p in parts])
        elif kind == "held" and op[2] in kept and kept[op[2]].size:
            out.append(held(w, parts[op[1]], list(kept[op[2]].global_indexes)))
        elif kind == "stale_storage" and op[1] in kept:
            w.run(client.storage_manager.clear_data(kept.pop(op[1])))
            out.append([get(w, p, [k]) for p in parts for k in KEYS])
        elif kind == "begin":
            p, keys = parts[op[1]], list(op[2])
            m = w.run(client.async_kv_retrieve_meta(keys=keys, partition_id=p, create=True))
            m.update_custom_meta([{"key": k, "n": len(out)} for k in keys])
            putting[op[3]] = (p, keys, m)
            out.append([describe(w, m), listing(w, p)])
        elif kind == "write" and op[1] in putting:
            p, keys, m = putting[op[1]]
            w.run(client.storage_manager.put_data(rows(keys), m))
            out.append([look(w, p, keys), get(w, p, keys)])
        elif kind == "tag" and op[1] in putting:
            p, keys, m = putting.pop(op[1])
            w.run(client.async_set_custom_meta(m))
            out.append([look(w, p, keys), listing(w, p)])
    for p in parts:
        clear(w, p, KEYS)
    return out
