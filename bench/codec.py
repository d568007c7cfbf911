"""Throughput of the schemas layer on one core: receipt codec round trips, and pack + unpack of a
16 x 4096-token group beside `torch.cat` of the same tensors (the memory-copy bound).

Run by hand: `python -m bench.codec`; it prints its figures and whether targets are met.
"""

from __future__ import annotations

import ctypes
import time
from statistics import median

import torch

from schemas.digest import token_digest
from schemas.jagged import native_row_copier
from schemas.payload import (
    Completion,
    PromptGroupRecord,
    pack_payload,
    record_to_train_batch,
    unpack_payload,
)
from schemas.receipt import CallRecord, Receipt

RECEIPT_TARGET = 100_000  # round trips per second
PACK_RATIO_TARGET = 0.25  # pack + unpack throughput over torch.cat throughput
GROUP_SIZE, SEQ_LEN, PROMPT_LEN, EXPERTS_K = 16, 4096, 512, 8


def steady_allocator() -> bool:
    """Stop glibc returning freed heap to the OS between calls; True if it took.

    Unpacking allocates about 2 MB of outputs per call. Whether glibc trims that memory after
    each free depends on where small allocations landed, so some processes fault every page of
    every output (about 100 us a call here) and others never do. Fixing the thresholds measures
    the code rather than that heuristic, for the copy bound and the code alike.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 32 << 20))


def _rate(fn, items: float, min_seconds: float) -> float:
    """`fn` run as often as fits in min_seconds, in items/second."""
    count, start = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return items * count / elapsed


def _best_rate(fn, items: float, *, repeat: int = 5, min_seconds: float = 0.2) -> float:
    """Best of `repeat` timings of `fn`, in items/second."""
    return max(_rate(fn, items, min_seconds) for _ in range(repeat))


def _paired_seconds(fns: dict, *, repeat: int = 9, min_seconds: float = 0.1) -> dict[str, list]:
    """Seconds per call of each of `fns`, measured in turn `repeat` times so that every
    function sees the same machine states: {name: [seconds of each round]}."""
    rounds: dict[str, list] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            rounds[name].append(1 / _rate(fn, 1, min_seconds))
    return rounds


def _receipt() -> Receipt:
    calls, prev = [], 0
    for i in range(4):
        delta = torch.randint(0, 150_000, (300,))
        calls.append(
            CallRecord(
                staging_key=f"rollout-0001/call-{i}",
                call_id=f"call-{i}",
                parent_call_id=None if i == 0 else f"call-{i - 1}",
                prev_len=prev,
                delta_len=300,
                cum_len=prev + 300,
                weight_version=12,
                digest=token_digest(delta),
            )
        )
        prev += 300
    return Receipt(
        rollout_id="rollout-0001",
        group_id="group-000042",
        prompt_idx=42,
        rollout_index=3,
        group_size=16,
        reward=0.75,
        mask_sample=True,
        loss_multiplier=1.0,
        environment="math",
        failure_reason=None,
        manifest=tuple(calls),
    )


def bench_receipts() -> float:
    receipt = _receipt()
    batch = 1000  # round trips per timed call, so the loop overhead is not what is measured
    return _best_rate(lambda: [Receipt.from_bytes(receipt.to_bytes()) for _ in range(batch)], batch)


def _train_batch(lengths: list[int]) -> dict:
    torch.manual_seed(0)
    prompt = torch.randint(0, 150_000, (PROMPT_LEN,))
    completions = []
    for length in lengths:
        gen = length - PROMPT_LEN
        log = [
            {
                "role": "user",
                "token_ids": prompt,
                "routed_experts": torch.randint(0, 64, (PROMPT_LEN, EXPERTS_K), dtype=torch.int16),
            },
            {
                "role": "assistant",
                "token_ids": torch.randint(0, 150_000, (gen,)),
                "generation_logprobs": -torch.rand(gen),
                "routed_experts": torch.randint(0, 64, (gen, EXPERTS_K), dtype=torch.int16),
            },
        ]
        completions.append(Completion(log, 1.0, False, True))
    record = PromptGroupRecord(prompt, tuple(completions))
    return record_to_train_batch(record, pad_value_dict={"input_ids": 0}, include_message_violation_fields=True)


def bench_pack(lengths: list[int], label: str) -> float:
    batch = _train_batch(lengths)
    pad = {"input_ids": 0}
    token_fields = [
        k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and k != "prompt_ids_for_adv"
    ]
    rows = {k: [batch[k][i, : lengths[i]] for i in range(len(lengths))] for k in token_fields}
    nbytes = sum(r.numel() * r.element_size() for parts in rows.values() for r in parts)

    def pack_unpack():
        _, fields, tags = pack_payload(batch, weight_version=1, group_id="g", prompt_idx=0)
        unpack_payload(fields, tags, pad_value_dict=pad)

    def cat():
        for parts in rows.values():
            torch.cat(parts)

    def pack():
        return pack_payload(batch, weight_version=1, group_id="g", prompt_idx=0)

    _, fields, tags = pack()
    mb = nbytes / 1e6
    seconds = _paired_seconds(
        {
            "cat": cat,
            "pack": pack,
            "unpack": lambda: unpack_payload(fields, tags, pad_value_dict=pad),
            "round trip": pack_unpack,
        }
    )
    cat_s = seconds["cat"]
    # In the pipeline pack runs in a reassembler and unpack in the trainer, each in its own
    # process: hence their summed times. A back-to-back round trip on one core also pays for
    # each half evicting the other's caches. The target is judged on the worse of the two.
    separate = [c / (p + u) for c, p, u in zip(cat_s, seconds["pack"], seconds["unpack"])]
    back_to_back = [c / r for c, r in zip(cat_s, seconds["round trip"])]
    us = {name: median(values) * 1e6 for name, values in seconds.items()}
    print(
        f"  {label}: {mb:.2f} MB in {len(rows)} token fields; medians of 9 rounds: "
        f"torch.cat {us['cat']:.0f} us ({mb / us['cat'] * 1e6:,.0f} MB/s), "
        f"pack {us['pack']:.0f} us, "
        f"unpack {us['unpack']:.0f} us, back to back {us['round trip']:.0f} us"
    )
    print(
        f"    pack + unpack {mb / (us['pack'] + us['unpack']) * 1e6:,.0f} MB/s: "
        f"{median(separate):.1%} of the copy bound ({min(separate):.1%}..{max(separate):.1%}); "
        f"back to back {median(back_to_back):.1%} "
        f"({min(back_to_back):.1%}..{max(back_to_back):.1%})"
    )
    return min(median(separate), median(back_to_back))


def main() -> None:
    torch.set_num_threads(1)
    print(f"glibc heap kept between calls: {'yes' if steady_allocator() else 'no (not glibc)'}")
    rate = bench_receipts()
    print(
        f"receipt (4-call manifest) encode+decode: {rate:,.0f} round trips/s "
        f"(target {RECEIPT_TARGET:,}: {'met' if rate >= RECEIPT_TARGET else 'NOT met'})"
    )
    print(f"pack + unpack of {GROUP_SIZE} rollouts x {SEQ_LEN} tokens (routed experts k={EXPERTS_K}):")
    full = [SEQ_LEN] * GROUP_SIZE
    ragged = [SEQ_LEN - 97 * i for i in range(GROUP_SIZE)]
    print(f"  rows padded back by: {'native row copier' if native_row_copier() else 'numpy'}")
    worst = min(
        bench_pack(lengths, label) for lengths, label in ((full, "all rows 4096"), (ragged, "ragged rows 2641..4096"))
    )
    print(
        f"worst median ratio {worst:.1%} (target {PACK_RATIO_TARGET:.0%}: "
        f"{'met' if worst >= PACK_RATIO_TARGET else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
