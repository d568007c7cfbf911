"""Deterministic in-memory models of the two systems rlstream talks to, for a seeded explorer.

- `env.py`: the one interface the models call for time, scheduling and faults (`Environment`), and
  the default for tests (`ManualEnv`: a manual clock, points that do nothing, waits that advance it).
- `kafka/`: Kafka at the level of confluent-kafka's own classes (`SimKafka(cluster).Consumer(conf)`, ...).
- `tq/`: TransferQueue 0.1.11 at the level `streams.tq.TQStore` calls it (`SimTQ(env)` in place of the
  `transfer_queue` module).

Each model's docstring lists the behaviours it claims; tests/integration/sim/ holds each claim to
the real broker and the real TQ. A model is a test tool, never evidence that the pipeline works.
"""
