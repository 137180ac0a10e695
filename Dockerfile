# One image for both sides: the driver (controller) and the workers.
#   docker compose build && docker compose up --abort-on-container-exit --exit-code-from driver
# See docs/deployment.md.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY colobus ./colobus
RUN pip install .
# The examples are not part of the package; the driver service runs one of them.
COPY examples ./examples

# Without a command: the demo on an embedded 2-host cluster inside this container.
CMD ["colobus", "demo"]
