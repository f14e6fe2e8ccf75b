# kvbridge control plane: registry, router, gateway and the CLI (pure Python; no compiler).
FROM python:3.11-slim
WORKDIR /opt/kvbridge
COPY pyproject.toml README.md ./
COPY kvbridge kvbridge
COPY services services
COPY clients clients
COPY connector connector
COPY benchmarks benchmarks
COPY protos protos
RUN pip install --no-cache-dir ".[redis]"
USER nobody
ENTRYPOINT ["kvbridge"]
