"""The router's I/O shell: gRPC server and servicer, worker connections, membership, tenancy.

Thin asyncio/grpc.aio code around the sans-I/O :class:`router.core.router_core.RouterCore`.
Importing this package imports nothing else (no torch, no worker package).
"""
