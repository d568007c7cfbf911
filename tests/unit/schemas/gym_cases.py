"""Random NeMo Gym receipts and staged calls for the differential tests, valid or corrupted on purpose.

`make_case(rng, kind)` draws a call tree (text roots, token_in children, several roots and branches
at times), stages every call the way NeMo Gym's capture does (deltas, chain and cumulative hashes,
extras digests, staging digests, all with `schemas.gym_digest`), builds the receipt naming a terminal,
then applies the corruption `kind` names. A case is plain data (dicts and lists); each side of a
differential test builds its own objects from it.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

from schemas import gym_digest as gd

_COMPARED = (
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)
_SNAPSHOT_KEYS = (
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "rollout_id",
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "token_ids_delta",
    "token_mask_delta",
    "generation_log_probs_delta",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)


@dataclass
class Case:
    kind: str
    receipt: dict[str, Any]
    snapshots: list[dict[str, Any]]


def _digest_of(s: dict[str, Any]) -> str:
    return gd.compute_staging_digest(**{k: s[k] for k in _SNAPSHOT_KEYS if k != "digest"})


def _hex(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(64))


def _flip(rng: random.Random, digest: str) -> str:
    i = rng.randrange(64)
    return digest[:i] + ("0" if digest[i] != "0" else "1") + digest[i + 1 :]


def _tokens(rng: random.Random, n: int, top: int) -> list[int]:
    return [rng.choice((rng.randrange(50_000), rng.randrange(2**20), top)) for _ in range(n)]


def _delta(rng: random.Random, carry: int, generated: int, top: int) -> tuple[list[int], list[float], list[float]]:
    ids = _tokens(rng, carry + generated, top)
    mask = [0.0] * carry + [1.0] * generated
    logprobs = [0.0] * carry + [-round(rng.random() * 5, rng.choice((2, 6, 12))) for _ in range(generated)]
    return ids, mask, logprobs


# Rollout and call ids beyond ASCII names: unicode, a slash (the key's separator), NUL, long ones.
ROLLOUT_IDS = ("r0", "ρολ/é", "r\x00x", "g_g0/c0", "🙂" * 30, "a" * 300)
CALL_PREFIXES = ("c", "调用-", "🙂" * 20, "x" * 200 + "-", "k/")


def valid_case(
    rng: random.Random,
    rollout_id: str = "r0",
    *,
    top_token: int = 2**64 - 1,
    calls: tuple[int, int] = (1, 6),
    call_prefix: str = "c",
    shuffle: bool = False,
) -> tuple[dict, list[dict], dict[str, list[int]]]:
    """A receipt dict, its snapshots (in manifest order) and each call's cumulative tokens; token ids
    go up to `top_token` (NeMo Gym's u64 by default; a TQ row holds int64). `calls` bounds the tree's
    size, `call_prefix` names its calls, and `shuffle` puts the manifest out of tree order (its
    snapshots with it)."""
    n = rng.randint(*calls)
    records, snapshots, cumulative, chain = [], [], {}, {}
    for i in range(n):
        call_id = f"{call_prefix}{i}"
        parent = None if i == 0 or rng.random() < 0.15 else f"{call_prefix}{rng.randrange(i)}"
        carry = rng.randint(0, 8)
        ids, mask, logprobs = _delta(rng, carry, rng.randint(1, 8), top_token)
        prev = len(cumulative[parent]) if parent else 0
        cumulative[call_id] = (cumulative[parent] if parent else []) + ids
        chain[call_id] = gd.compute_chain_hash(chain[parent] if parent else None, ids)
        extras = None if rng.random() < 0.5 else {"routed_experts": [[[rng.randrange(64)]] for _ in ids]}
        snap = {
            "schema_version": 2,
            "digest_version": 2,
            "extras_digest_version": 1,
            "rollout_id": rollout_id,
            "model_call_id": call_id,
            "parent_call_id": parent,
            "mode": "token_in" if parent else "text",
            "prev_len": prev,
            "delta_len": len(ids),
            "cum_len": prev + len(ids),
            "weight_version": rng.randrange(20),
            "token_ids_delta": ids,
            "token_mask_delta": mask,
            "generation_log_probs_delta": logprobs,
            "extras_digest": gd.compute_extras_digest(extras),
            "chain_hash": chain[call_id],
            "cumulative_hash": gd.hash_token_ids(cumulative[call_id]),
        }
        snap["digest"] = _digest_of(snap)
        snapshots.append(snap)
        records.append(
            {
                "model_call_id": call_id,
                **{k: snap[k] for k in _COMPARED},
                "staging_key": f"{rollout_id}/{call_id}",
                "response_id": f"resp-{call_id}",
                "admitted_at": float(i) if rng.random() < 0.5 else None,
                "fingerprint_version": rng.choice((0, 1)),
            }
        )
    # Usually a leaf, so the chain is long; sometimes an inner call (the rest then lies off the chain).
    parents = {r["parent_call_id"] for r in records}
    leaves = [r["model_call_id"] for r in records if r["model_call_id"] not in parents]
    terminal = rng.choice(leaves) if rng.random() < 0.8 else rng.choice(records)["model_call_id"]
    if shuffle:
        order = list(range(n))
        rng.shuffle(order)
        records, snapshots = [records[i] for i in order], [snapshots[i] for i in order]
    receipt = {
        "rollout_id": rollout_id,
        "reward": rng.choice((None, 0.5, -1.0)),
        "terminal_model_call_id": terminal,
        "manifest": records,
        "terminal_selection": rng.choice(("declared", "response_id", "content", "heuristic")),
    }
    return receipt, snapshots, cumulative


def _restage(snapshots: list[dict], records: list[dict], i: int) -> None:
    """Recompute snapshot i's digest and copy its custody fields to its manifest row: a forgery that
    passes every per-call check, left for the chain checks to catch."""
    snapshots[i]["digest"] = _digest_of(snapshots[i])
    for k in _COMPARED:
        records[i][k] = snapshots[i][k]


def _on_chain(receipt: dict) -> list[int]:
    by_id = {r["model_call_id"]: (i, r) for i, r in enumerate(receipt["manifest"])}
    out, cursor = [], by_id.get(receipt["terminal_model_call_id"])
    while cursor is not None and cursor[0] not in out:  # a first corruption may have made a cycle
        out.append(cursor[0])
        parent = cursor[1]["parent_call_id"]
        cursor = by_id.get(parent) if parent is not None else None
    return out[::-1]


def _corrupt(rng: random.Random, kind: str, receipt: dict, snaps: list[dict]) -> None:  # noqa: C901 - a catalogue
    records = receipt["manifest"]
    n = len(records)
    i = rng.randrange(n)
    chain = _on_chain(receipt)
    if kind == "failed":
        receipt.update(capture_poisoned=True, failure_reason=rng.choice(("env_crashed", "worker_capture_failed", "")))
    elif kind == "poisoned":
        receipt.update(capture_poisoned=True)
    elif kind == "poisoned_unattributed":
        receipt.update(capture_poisoned=True, failure_reason="no_records", terminal_model_call_id=None)
        receipt["terminal_selection"] = None
    elif kind == "empty_manifest":
        receipt["manifest"], snaps[:] = [], []
        receipt["terminal_model_call_id"] = None
    elif kind == "duplicate_row":
        records.append(copy.deepcopy(records[i]))
        snaps.append(copy.deepcopy(snaps[i]))
    elif kind == "duplicate_staging_key":
        other = copy.deepcopy(records[i])
        other["model_call_id"] = "c-dup"
        records.append(other)
        snaps.append(copy.deepcopy(snaps[i]))
    elif kind == "missing_snapshot":
        del snaps[i]
    elif kind == "extra_snapshot":
        snaps.append(copy.deepcopy(snaps[i]))
    elif kind == "reordered":
        if n > 1:
            j = (i + rng.randrange(1, n)) % n
            snaps[i], snaps[j] = snaps[j], snaps[i]
    elif kind == "duplicate_snapshot":
        if n > 1:
            j = (i + rng.randrange(1, n)) % n
            snaps[j] = copy.deepcopy(snaps[i])
    elif kind == "foreign_snapshot":
        snaps[i]["model_call_id"] = "c-foreign"
    elif kind == "wrong_rollout":
        snaps[i]["rollout_id"] = "r-other"
    elif kind == "field_mismatch":
        name = rng.choice(_COMPARED + ("schema_version", "digest_version", "extras_digest_version"))
        value = records[i].get(name, snaps[i].get(name))
        side = rng.choice((records[i], snaps[i]))
        if isinstance(value, int) and not isinstance(value, bool):
            side[name] = value + 1
        elif isinstance(value, str) and len(value) == 64:
            side[name] = _flip(rng, value)
        elif name == "mode":
            side[name] = "text" if value == "token_in" else "token_in"
        else:
            side[name] = "c-elsewhere"
    elif kind == "receipt_version":
        receipt[rng.choice(("schema_version", "digest_version", "extras_digest_version"))] = 3
    elif kind == "corrupt_digest":
        flipped = _flip(rng, snaps[i]["digest"])
        snaps[i]["digest"] = flipped
        if rng.random() < 0.7:
            records[i]["digest"] = flipped
    elif kind == "corrupt_token":
        ids = snaps[i]["token_ids_delta"]
        ids[rng.randrange(len(ids))] ^= 1
    elif kind == "forged_token":
        ids = snaps[i]["token_ids_delta"]
        ids[rng.randrange(len(ids))] ^= 1
        _restage(snaps, records, i)
    elif kind == "forged_chain_hash":
        snaps[i]["chain_hash"] = _hex(rng)
        _restage(snaps, records, i)
    elif kind == "forged_cumulative_hash":
        j = chain[-1] if chain and rng.random() < 0.8 else i
        snaps[j]["cumulative_hash"] = _hex(rng)
        _restage(snaps, records, j)
    elif kind == "forged_mask_order":
        s = snaps[i]
        length = len(s["token_ids_delta"])
        mask = [rng.choice((0.0, 1.0)) for _ in range(length)]
        s["token_mask_delta"] = mask
        s["generation_log_probs_delta"] = [-0.5 if m else 0.0 for m in mask]
        _restage(snaps, records, i)
    elif kind == "forged_no_generation":
        s = snaps[i]
        s["token_mask_delta"] = [0.0] * len(s["token_ids_delta"])
        s["generation_log_probs_delta"] = [0.0] * len(s["token_ids_delta"])
        _restage(snaps, records, i)
    elif kind == "missing_parent":
        children = [k for k, r in enumerate(records) if r["parent_call_id"] is not None]
        if children:
            k = rng.choice(children)
            snaps[k]["parent_call_id"] = "c-gone"
            _restage(snaps, records, k)
    elif kind == "parent_length":
        children = [k for k, r in enumerate(records) if r["parent_call_id"] is not None]
        if children:
            k = rng.choice(children)
            snaps[k]["prev_len"] += 1
            snaps[k]["cum_len"] += 1
            _restage(snaps, records, k)
    elif kind == "cycle":
        if n > 1:
            # b under a, then a under b where b ends: lengths agree, so only the walk finds the cycle.
            a, b = records[0]["model_call_id"], records[1]["model_call_id"]
            for k, parent in ((1, a), (0, b)):
                s = snaps[k]
                s["parent_call_id"], s["mode"] = parent, "token_in"
                s["prev_len"] = records[1]["cum_len"] if k == 0 else max(1, s["prev_len"])
                s["cum_len"] = s["prev_len"] + s["delta_len"]
                _restage(snaps, records, k)
    elif kind == "missing_terminal":
        receipt["terminal_model_call_id"] = rng.choice((None, "c-absent"))
    elif kind == "invalid_snapshot":
        s = snaps[i]
        choice = rng.randrange(5)
        if choice == 0:
            s["token_ids_delta"][0] = -1
        elif choice == 1:
            s["generation_log_probs_delta"][-1] = float("nan")
        elif choice == 2:
            s["token_mask_delta"][-1] = 0.5
        elif choice == 3:
            s["token_ids_delta"][0] = float(s["token_ids_delta"][0])
        else:
            s["extras_digest"] = records[i]["extras_digest"] = "not-hex"
    elif kind != "valid":
        raise ValueError(f"unknown corruption {kind!r}")


KINDS = (
    "valid",
    "failed",
    "poisoned",
    "poisoned_unattributed",
    "empty_manifest",
    "duplicate_row",
    "duplicate_staging_key",
    "missing_snapshot",
    "extra_snapshot",
    "reordered",
    "duplicate_snapshot",
    "foreign_snapshot",
    "wrong_rollout",
    "field_mismatch",
    "receipt_version",
    "corrupt_digest",
    "corrupt_token",
    "forged_token",
    "forged_chain_hash",
    "forged_cumulative_hash",
    "forged_mask_order",
    "forged_no_generation",
    "missing_parent",
    "parent_length",
    "cycle",
    "missing_terminal",
    "invalid_snapshot",
)


def make_case(
    rng: random.Random, kind: str, *, rollout_id: str | None = None, top_token: int = 2**64 - 1, varied: bool = True
) -> Case:
    """A case of corruption `kind` ("a+b": both, in turn). `varied` draws the ids (`ROLLOUT_IDS`,
    `CALL_PREFIXES`; `rollout_id` fixes the rollout's), trees of up to 24 calls at times, and
    manifests out of tree order; without it, `r0`'s calls `c0..c5` in tree order."""
    shape = {}
    if varied:
        shape = {
            "calls": (1, 6) if rng.random() < 0.85 else (7, 24),
            "call_prefix": rng.choice(CALL_PREFIXES),
            "shuffle": rng.random() < 0.4,
        }
        rollout_id = rollout_id if rollout_id is not None else rng.choice(ROLLOUT_IDS)
    receipt, snaps, _ = valid_case(rng, rollout_id or "r0", top_token=top_token, **shape)
    # Those that change how many snapshots there are go last; once they differ from the manifest's
    # rows, no corruption by position follows. A later corruption the earlier one left no room for
    # (a restaging of a snapshot made undigestable, say) is not applied.
    for n, one in enumerate(sorted(kind.split("+"), key=lambda k: k in _RECOUNT)):
        if receipt["manifest"] and len(snaps) == len(receipt["manifest"]):
            before = copy.deepcopy((receipt, snaps))
            try:
                _corrupt(rng, one, receipt, snaps)
            except ValueError:
                if n == 0:
                    raise
                receipt, snaps = before
    return Case(kind, receipt, snaps)


_RECOUNT = frozenset({"empty_manifest", "duplicate_row", "duplicate_staging_key", "missing_snapshot", "extra_snapshot"})


def mixed_kind(rng: random.Random) -> str:
    """One corruption kind, or two applied in turn (a third of the time)."""
    first = rng.choice(KINDS)
    return first if rng.random() < 2 / 3 else f"{first}+{rng.choice(KINDS)}"
