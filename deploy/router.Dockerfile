# The router image: no torch, no GPU libraries.
#   docker build -f deploy/router.Dockerfile -t kvroute-router .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md kvroute_cli.py ./
COPY proto ./proto
COPY router ./router
COPY worker ./worker
COPY bench ./bench
RUN pip install --no-cache-dir .
USER 65534:65534
EXPOSE 50051
ENTRYPOINT ["kvroute", "router"]
CMD ["--host", "0.0.0.0", "--port", "50051"]
