# rlvla3 with RoboCasa, in its own image: RoboCasa needs robosuite >= 1.5.2 while LIBERO pins
# robosuite 1.4.0, so the two never share an environment (the process boundary is the
# dependency boundary). Its simulator workers join the same broker as the other roles, which can
# run from any of the images. Build from the repository root:
#
#   docker build -f deploy/docker/robocasa.Dockerfile -t rlvla3-robocasa:0.1.0 \
#     --build-arg ROBOSUITE_GIT=<robosuite repository URL> --build-arg ROBOCASA_GIT=<robocasa repository URL> .
#
# Neither is on the package index: both are cloned from the URLs given (see INSTALL_HELP in
# workers/envs/robocasa.py for which repositories). The kitchen assets (several GB) are fetched
# by RoboCasa's own script at build time; KITCHEN_ASSETS=0 skips them (then mount them at run
# time under robocasa/models/assets). pip config for a CPU-only torch: see metaworld.Dockerfile.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MUJOCO_GL=egl PYOPENGL_PLATFORM=egl NVIDIA_DRIVER_CAPABILITIES=all

RUN apt-get update \
 && apt-get install -y --no-install-recommends git libegl1 libgl1 libglx-mesa0 libgles2 libosmesa6 \
 && rm -rf /var/lib/apt/lists/*

ARG TORCH_VERSION=2.13.0
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf pip install "torch==${TORCH_VERSION}"

ARG ROBOSUITE_GIT
ARG ROBOSUITE_REF=
ARG ROBOCASA_GIT
ARG ROBOCASA_REF=
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf set -eu; \
    if [ -z "${ROBOSUITE_GIT}" ] || [ -z "${ROBOCASA_GIT}" ]; then \
      echo "robocasa.Dockerfile: pass --build-arg ROBOSUITE_GIT=... and --build-arg ROBOCASA_GIT=..." >&2; exit 1; \
    fi; \
    git clone --depth 1 ${ROBOSUITE_REF:+--branch "$ROBOSUITE_REF"} "$ROBOSUITE_GIT" /opt/robosuite; \
    git clone --depth 1 ${ROBOCASA_REF:+--branch "$ROBOCASA_REF"} "$ROBOCASA_GIT" /opt/robocasa; \
    pip install -e /opt/robosuite -e /opt/robocasa "torch==${TORCH_VERSION}"

ARG KITCHEN_ASSETS=1
RUN set -eu; \
    if [ "${KITCHEN_ASSETS}" = "1" ]; then yes y | python -m robocasa.scripts.download_kitchen_assets; fi; \
    python -m robocasa.scripts.setup_macros

WORKDIR /opt/rlvla3
COPY pyproject.toml README.md ./
COPY rlvla3 ./rlvla3
COPY brokers ./brokers
COPY workers ./workers
COPY configs ./configs
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf pip install "." "torch==${TORCH_VERSION}"
RUN python -c "import robocasa, brokers.broker, workers.envs.robocasa as r; \
r.check_available() if '${KITCHEN_ASSETS}' == '1' else None"

EXPOSE 5555 5556
ENTRYPOINT ["rlvla3"]
CMD ["--help"]
