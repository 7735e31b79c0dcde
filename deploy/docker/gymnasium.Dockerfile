# rlvla3 with Gymnasium and its MuJoCo envs (env.name: gymnasium). Runs every role: broker, simulator, generator
# and trainer. Build from the repository root:
#
#   docker build -f deploy/docker/gymnasium.Dockerfile -t rlvla3-gymnasium:0.1.0 .
#
# torch is installed first and pinned, so no later install picks another build. The default
# package index's Linux wheel is the CUDA build; for a CPU-only image, or a mirror, give pip a
# config: `--secret id=pip.conf,src=$HOME/.config/pip/pip.conf` (read at build time, not kept).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MUJOCO_GL=egl PYOPENGL_PLATFORM=egl NVIDIA_DRIVER_CAPABILITIES=all

RUN apt-get update \
 && apt-get install -y --no-install-recommends libegl1 libgl1 libglx-mesa0 libgles2 libosmesa6 \
 && rm -rf /var/lib/apt/lists/*

ARG TORCH_VERSION=2.13.0
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf pip install "torch==${TORCH_VERSION}"

WORKDIR /opt/rlvla3
COPY pyproject.toml README.md ./
COPY rlvla3 ./rlvla3
COPY brokers ./brokers
COPY workers ./workers
COPY configs ./configs
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf pip install ".[gymnasium-mujoco]" "torch==${TORCH_VERSION}"
RUN python -c "import brokers.broker, workers.envs.gymnasium; from rlvla3.gym_config import check_gymnasium; check_gymnasium({'id': 'Hopper-v4'})"

EXPOSE 5555 5556
ENTRYPOINT ["rlvla3"]
CMD ["--help"]
