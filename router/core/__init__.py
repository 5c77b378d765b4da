"""The router's sans-I/O core: the prefix index, the routing policies and RouterCore.

Nothing in this package imports asyncio, grpc, aiohttp, redis, the generated protobuf
modules or a clock (tests/test_import_rules.py checks it): the service shells in
:mod:`router.service` feed it events and ask it for routes, and the fleet simulator runs
the same objects under a virtual clock.
"""
