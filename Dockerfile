# One image for every role of a pstrain job:
#   psserver --host 0.0.0.0 --port 2222 --checkpoint-dir /checkpoints   a parameter server
#   psworker --host 0.0.0.0 --port 2222                    a worker
#   (every task needs PSTRAIN_AUTH_TOKEN to listen on 0.0.0.0: docs/configuration.md#security)
#   coordinator run examples/digits.py --cluster tf_config  the chief (a training script)
#   coordinator task --type ps|worker                      a task of a Kubernetes StatefulSet
#   coordinator health HOST:PORT                           the gRPC health check (probes)
#
#   docker build -t pstrain:0.1.0 .                          from the package index
#   docker build --build-arg BASE_IMAGE=python:3.12-slim -t pstrain:0.1.0 .
#   deploy/build-image.sh [--local-base]                     offline: see that script
#
# BASE_IMAGE: any Debian-based image with Python 3.11 or newer as `python3` and
# its venv module (an official python:*-slim image, or a Debian base made with
# debootstrap: deploy/build-image.sh --local-base). Both stages use it, so the
# virtual environment finds the same interpreter.
#
# Offline builds (air-gapped sites, no registry, no index): put wheels of every
# dependency, and of the build backend (setuptools, wheel), in deploy/wheelhouse/
# (deploy/build-image.sh does). When that directory holds wheels, the build
# installs from it alone (pip --no-index): no network. pstrain itself is always
# built from the source copied below, never from a wheel, so an old wheelhouse
# cannot put old code in a new image (a dependency it lacks fails the build,
# naming it: run deploy/build-image.sh again).
ARG BASE_IMAGE=python:3.11-slim

# -- builder: pstrain and every dependency, in a virtual environment -------------------------
FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY psserver ./psserver
COPY psworker ./psworker
COPY coordinator ./coordinator
COPY deploy/wheelhouse ./wheelhouse
# The "examples" extra brings scikit-learn (the digits data ships with it).
RUN if ls wheelhouse/*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links wheelhouse ".[examples]"; \
    else \
        pip install ".[examples]"; \
    fi \
 && rm -rf /src/build

# -- final: the venv and the examples; no compilers, no pip cache, not root ------------------
FROM ${BASE_IMAGE}
ARG UID=10001
# (the account written directly: a minimal Debian base has no useradd)
RUN echo "pstrain:x:${UID}:${UID}:pstrain:/app:/usr/sbin/nologin" >> /etc/passwd \
 && echo "pstrain:x:${UID}:" >> /etc/group \
 && mkdir -p /checkpoints && chown "${UID}:${UID}" /checkpoints
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
