"""The cache-aware router.

- :mod:`router.core` -- sans-I/O: the prefix index, the policies, ``RouterCore``.
- :mod:`router.service` -- the I/O shells: gRPC/HTTP servers, worker connections, the
  registry and replica sync over Redis, metrics.
- :mod:`router.cli` -- the commands that start and talk to a router.
"""
