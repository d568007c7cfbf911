"""The pipeline's name for `streams.runtime`: the clocks, sleeps and background threads a component is given.

The protocol and the process's own implementation live in `streams/runtime.py` (the Kafka helpers
of `streams` wait through it too); the workers import them from here or from there alike.
"""

from streams.runtime import REAL_RUNTIME, Periodic, RealRuntime, Runtime

__all__ = ["REAL_RUNTIME", "Periodic", "RealRuntime", "Runtime"]
