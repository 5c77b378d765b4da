"""The edges both services share: what the router's and the worker's shells have in common.

Not the wire contract (that is :mod:`kvroute_proto`) and not a core: the HTTP front and the
OpenAI schema, the tokenizer, TLS and API-key plumbing, the metrics endpoint, the Redis
registry, the standard gRPC services, the event-loop runtime and the CLI help formatter.
Importing this package imports nothing else; each module pulls in only what it needs.
"""
