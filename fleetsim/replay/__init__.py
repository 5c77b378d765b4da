"""Trace replay: does cache-aware routing pay?

``kvroute replay`` plays a Mooncake-format trace against a fleet of workers under several
routing policies and reports hit rate, TTFT, end-to-end latency, throughput and load
imbalance per policy, next to two references: the pooled reference (one cache of N times the
capacity and N times the speed -- a reference, not a bound: a policy that delays requests can
beat it) and the infinite ceiling (no eviction). Two modes:

- ``sim`` (:mod:`fleetsim.replay.sim`): a discrete-event simulation under a virtual clock that
  runs the real :class:`router.core.router_core.RouterCore` and, per worker, the real engine
  (radix cache and scheduler) over the simulated executor. Deterministic for a seed.
- ``live`` (:mod:`fleetsim.replay.live`): real worker and router processes on loopback gRPC.

Modules: :mod:`~fleetsim.replay.trace` (parsing, token expansion), :mod:`~fleetsim.replay.report`
(metrics, table, JSON), :mod:`~fleetsim.replay.plot`, :mod:`~fleetsim.replay.cli`.
"""
