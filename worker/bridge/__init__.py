"""The engine bridge: kvroute's event contract for engines that are not kvroute workers.

vLLM and SGLang publish their KV events over ZMQ in their own vocabulary;
:mod:`worker.bridge.engine_wire` decodes those frames and :mod:`worker.bridge.translate`
maps them into kvroute's :class:`~kvroute_proto.events.EventBatch` stream (own block
hashes, epoch and seq); :mod:`worker.bridge.http_response` reads the engine's streamed
HTTP answers. All are sans-I/O: none imports asyncio, zmq, grpc, torch nor a clock.
"""
