# kvbridge control plane: registry, router, gateway and the CLI.
# The wheel is built in a stage with a C compiler, so that the registry's compiled read path
# (services/registry/_fastread.pyx) is in the image; the image itself carries no compiler.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvbridge kvbridge
COPY services services
COPY clients clients
COPY connector connector
COPY benchmarks benchmarks
COPY protos protos
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/kvbridge-*.whl)[redis]" && rm -rf /wheels \
    && python -c "import kvbridge.services.registry._fastread"
USER nobody
ENTRYPOINT ["kvbridge"]
