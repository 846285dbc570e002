# syntax=docker/dockerfile:1
# One image for every role of a pstrain job:
#   psserver --host 0.0.0.0 --port 2222 --checkpoint-dir /checkpoints   a parameter server
#   psworker --host 0.0.0.0 --port 2222                    a worker
#   (every task needs PSTRAIN_AUTH_TOKEN to listen on 0.0.0.0: docs/configuration.md#security)
#   coordinator run examples/digits.py --cluster tf_config  the chief (a training script)
#   coordinator task --type ps|worker                      a task of a Kubernetes StatefulSet
#   coordinator health HOST:PORT                           the gRPC health check (probes)
#
#   docker build -t pstrain:0.1.0 .
#   docker build --build-arg BASE_IMAGE=python:3.12-slim -t pstrain:0.1.0 .
#
# BASE_IMAGE must be a Debian-based official Python image (3.11 or newer): both
# stages use it, so the virtual environment finds the same interpreter.
ARG BASE_IMAGE=python:3.11-slim

# -- builder: the pstrain wheel and every dependency, in a virtual environment ---------------
FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY psserver ./psserver
COPY psworker ./psworker
COPY coordinator ./coordinator
# The "examples" extra brings scikit-learn (the digits data ships with it).
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && pip install "$(ls /wheels/pstrain-*.whl)[examples]"

# -- final: the venv and the examples; no compilers, no pip cache, not root ------------------
FROM ${BASE_IMAGE}
ARG UID=10001
RUN groupadd --system --gid "${UID}" pstrain \
 && useradd --system --uid "${UID}" --gid pstrain --home-dir /app --no-create-home \
        --shell /usr/sbin/nologin pstrain \
 && mkdir -p /checkpoints && chown pstrain:pstrain /checkpoints
COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
COPY examples ./examples
# PYTHONPATH=/app: workers import examples.nn for the steps the coordinator sends
# them by reference, as the coordinator does.
# MALLOC_*: keep freed buffers for reuse instead of returning each to the OS
# (psserver/process.py MALLOC_ENV says why and what it measured).
ENV PATH=/opt/venv/bin:$PATH \
    MALLOC_MMAP_THRESHOLD_=268435456 \
    MALLOC_TRIM_THRESHOLD_=1073741824 \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# /checkpoints: a named volume mounted there starts out owned by the pstrain user.
USER ${UID}:${UID}
EXPOSE 2222
CMD ["coordinator", "--help"]
