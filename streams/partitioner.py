"""Which partition a keyed record lands in: Kafka's murmur2 partitioner, as the Java clients compute it.

rlstream's producers use librdkafka's `murmur2_random` (streams/config.py), which is the Java
clients' default for keyed records, so a prompt group's receipts land in `partition_of(group_id)`.
A reassembler uses it to know which staged rows belong to the partitions it owns.
"""

from __future__ import annotations

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's `Utils.murmur2`: a 32-bit hash, as an unsigned int."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    for i in range(0, length - length % 4, 4):
        k = data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = (h * _M) & _MASK
        h ^= k
    tail = length & ~3
    rest = length % 4
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def partition_of(key: bytes, partitions: int) -> int:
    """The partition of a record with this (non-empty) key in a topic of `partitions` partitions."""
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, got {partitions}")
    return (murmur2(key) & 0x7FFFFFFF) % partitions
