"""kvroute's shared contract (imported as ``kvroute_proto``; the folder is ``proto/``).

What both the worker and the router must compute identically: block hashing
(:mod:`kvroute_proto.hashing`), the KV event value types (:mod:`kvroute_proto.events`) and
their wire codec (:mod:`kvroute_proto.codec`), plus the generated gRPC stubs
(``kvroute_pb2``, ``kvroute_pb2_grpc``). Importing this package imports neither torch nor the
worker or router.
"""
