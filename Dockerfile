# The image the files in launch/ name by default (elastrain/platforms/image.py): elastrain with its T5 example and
# the etcd client, installed by tools/install.sh, the same install list `./dev setup` runs.
#
#   docker build -t ghcr.io/elastrain/elastrain:0.1.0-cpu .                              # CPU torch (the default)
#   docker build --build-arg VARIANT=cu128 -t ghcr.io/elastrain/elastrain:0.1.0-cu128 .  # CUDA 12.8 torch
#
# Push it where the cluster pulls from; under another name, give the launch builders --image.
FROM python:3.11-slim-bookworm

# torch's build: cpu, or a CUDA one (cu128). The CUDA wheels bring their own libraries; the node brings the driver.
ARG VARIANT=cpu
# elastrain's extras: t5 (the example: transformers, tokenizers...) and etcd (--rdzv-backend etcd-v3).
ARG EXTRAS=t5,etcd

LABEL org.opencontainers.image.title="elastrain" \
      org.opencontainers.image.description="Elastic training launcher for PyTorch, with its T5 example" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.ref.name="ghcr.io/elastrain/elastrain:0.1.0-${VARIANT}" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# The source checkout, minus .dockerignore: the launch specs run examples/t5/train.py relative to this folder.
WORKDIR /opt/elastrain
COPY . .
RUN TORCH_INDEX="https://download.pytorch.org/whl/${VARIANT}" tools/install.sh /opt/venv "${EXTRAS}"
