"""The fleet simulator: ``kvroute workload`` makes synthetic traces, ``kvroute replay`` plays
a trace against routing policies -- the real router core and radix caches under a virtual
clock (sim mode), or real gRPC servers on 127.0.0.1 (live mode)."""
