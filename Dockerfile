# kvroute's container image: the router (`kvroute serve`) as a non-root user on a slim base.
# Build: docker build -t kvroute:0.1.0 .    Run: docker run -p 8000:8000 -v $PWD/kvroute.yaml:/etc/kvroute/kvroute.yaml kvroute:0.1.0
# CI checks what the image does without a container daemon (deploy/image/smoke.py): the
# wheel built here, installed into a fresh virtualenv, run with this ENTRYPOINT.

# python:3.11-slim-bookworm, pinned by digest (multi-arch index)
FROM python:3.11-slim-bookworm@sha256:b18992999dbe963a45a8a4da40ac2b1975be1a776d939d098c647482bcad5cba AS build
# a C compiler for the prefix index's compiled core (a wheel without it falls back to Python)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY indexer ./indexer
COPY router ./router
COPY engines ./engines
COPY conformance ./conformance
# the router with its ext_proc endpoint picker (the grpc extra): one image for every mode
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[grpc]"

FROM python:3.11-slim-bookworm@sha256:b18992999dbe963a45a8a4da40ac2b1975be1a776d939d098c647482bcad5cba
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin kvroute
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "kvroute[grpc]==0.1.0" \
    && rm -rf /wheels
COPY deploy/image/kvroute.yaml /etc/kvroute/kvroute.yaml
USER 10001:10001
# HTTP; 5570: placements shared between replicas (--peer-publish), when configured
EXPOSE 8000 5570
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["kvroute", "serve"]
CMD ["--config", "/etc/kvroute/kvroute.yaml"]
