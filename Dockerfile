# One image for both sides: the driver (controller) and the workers.
#   colobus keygen colobus.key
#   docker compose up --build --scale worker=3 --abort-on-container-exit --exit-code-from driver
# See docs/containers.md.
#
# BASE: any Debian-like image with python3 (3.11+) and its venv module. The
# default is the public python image; where no image registry can be reached
# (CI here), docker/build-base makes one from Debian's packages:
#   docker build --build-arg BASE=colobus-base:bookworm -t colobus:local .
ARG BASE=python:3.11-slim

# Stage 1: the dependencies in a venv. With wheels in docker/wheels/ (put there
# by docker/fetch-wheels) it needs no network; without, pip fetches from PyPI.
# Its own stage, so the wheels never end up in a layer of the image.
FROM ${BASE} AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/colobus
COPY pyproject.toml /tmp/build/
COPY docker/wheels/ /tmp/build/wheels/
RUN cd /tmp/build \
 && python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > requirements.txt \
 && if ls wheels/*.whl >/dev/null 2>&1; then set -- --no-index --find-links wheels; fi \
 && /opt/colobus/bin/pip install "$@" -r requirements.txt "setuptools>=68"

# Stage 2: the image. The dependencies come first, in a layer of their own, so
# a change to colobus's code does not reinstall JAX.
FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/colobus/bin:$PATH
COPY --from=deps /opt/colobus /opt/colobus
WORKDIR /app
COPY pyproject.toml README.md ./
COPY colobus ./colobus
RUN pip install --no-deps --no-build-isolation . && rm -rf build colobus.egg-info
# The examples are not part of the package; the driver service runs one of them.
COPY examples ./examples

# Without a command: the demo on an embedded 2-host cluster inside this container.
CMD ["colobus", "demo"]
