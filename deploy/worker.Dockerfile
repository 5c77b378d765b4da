# The worker image: CUDA PyTorch base plus kvroute's worker extra.
#   docker build -f deploy/worker.Dockerfile -t kvroute-worker .
# For a CPU-only image use python:3.11-slim and `pip install torch==2.13.0` first.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
WORKDIR /app
COPY pyproject.toml README.md kvroute_cli.py ./
COPY proto ./proto
COPY router ./router
COPY worker ./worker
COPY edge ./edge
COPY fleetsim ./fleetsim
RUN pip install --no-cache-dir '.[worker]'
EXPOSE 50061
ENTRYPOINT ["kvroute", "worker"]
CMD ["--host", "0.0.0.0", "--port", "50061", "--executor", "torch"]
