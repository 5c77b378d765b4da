# The router image: no torch, no GPU libraries.
#   docker build -f deploy/router.Dockerfile -t kvroute-router .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md kvroute_cli.py ./
COPY proto ./proto
COPY router ./router
COPY worker ./worker
COPY edge ./edge
COPY fleetsim ./fleetsim
RUN pip install --no-cache-dir .
# The index and hashing kernels (numba) compile once here, into a cache the runtime user
# owns, so a router starts in under a second instead of compiling for ~15 s on every start.
ENV NUMBA_CACHE_DIR=/app/numba-cache
RUN mkdir -p "$NUMBA_CACHE_DIR" \
    && python -c "from router.core.index_nb import warm_up; from kvroute_proto.hashing import enable_compiled; warm_up(); enable_compiled()" \
    && chown -R 65534:65534 "$NUMBA_CACHE_DIR"
USER 65534:65534
EXPOSE 50051
ENTRYPOINT ["kvroute", "router"]
CMD ["--host", "0.0.0.0", "--port", "50051"]
