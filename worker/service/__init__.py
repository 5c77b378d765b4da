"""The worker's gRPC service: server lifecycle, servicer, engine runner, event publisher.

Only :mod:`worker.service.convert` (with :mod:`kvroute_proto.codec`) touches protobuf classes;
:mod:`worker.service.publisher` is sans-I/O.
"""
