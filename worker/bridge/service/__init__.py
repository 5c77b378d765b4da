"""The engine bridge's I/O shell: ``kvroute bridge``.

ZMQ in (the engine's KV events, :mod:`.events`), HTTP out (its OpenAI completions,
:mod:`.engine_http`, over the bridge's own connections, :mod:`.engine_stream`), kvroute's
Worker gRPC service served (:mod:`.servicer`, :mod:`.server`). The translation itself is
the sans-I/O core of :mod:`worker.bridge`. Never imports torch.
"""
