# rlvla3 with ManiSkill 3 (SAPIEN, Vulkan rendering). Runs every role. Build from the
# repository root:
#
#   docker build -f deploy/docker/maniskill.Dockerfile -t rlvla3-maniskill:0.1.0 .
#
# Rendering needs Vulkan. On NVIDIA nodes the driver's ICD (declared below, as ManiSkill's own
# image does) is used when the container runtime mounts the driver with graphics capability
# (NVIDIA_DRIVER_CAPABILITIES=all). Without a GPU, Mesa >= 25's lavapipe renders on the CPU:
# Debian bookworm has it in bookworm-backports, added by copying the image's own Debian source
# stanza, as .ci/install_sims.sh does. pip config for a CPU-only torch: see metaworld.Dockerfile.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=all

RUN set -eu; . /etc/os-release; \
    awk -v rel="$VERSION_CODENAME" -v bp="$VERSION_CODENAME-backports" \
      'BEGIN { RS = ""; ORS = "\n\n" } $0 ~ ("Suites: " rel "[ \n]") && !done { sub(/Suites:[^\n]*/, "Suites: " bp); print; done = 1 }' \
      /etc/apt/sources.list.d/debian.sources > /etc/apt/sources.list.d/backports.sources; \
    test -s /etc/apt/sources.list.d/backports.sources; \
    apt-get update; \
    apt-get install -y --no-install-recommends -t "$VERSION_CODENAME-backports" \
      mesa-vulkan-drivers libvulkan1 libegl1 libegl-mesa0 libgl1 libgl1-mesa-dri libglx-mesa0 libgles2; \
    rm -rf /var/lib/apt/lists/*; \
    mkdir -p /usr/share/vulkan/icd.d /usr/share/glvnd/egl_vendor.d; \
    printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "libGLX_nvidia.so.0", "api_version": "1.2.155"}}\n' \
      > /usr/share/vulkan/icd.d/nvidia_icd.json; \
    printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "libEGL_nvidia.so.0"}}\n' \
      > /usr/share/glvnd/egl_vendor.d/10_nvidia.json

ARG TORCH_VERSION=2.13.0
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf pip install "torch==${TORCH_VERSION}"

WORKDIR /opt/rlvla3
COPY pyproject.toml README.md ./
COPY rlvla3 ./rlvla3
COPY brokers ./brokers
COPY workers ./workers
COPY configs ./configs
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf pip install ".[maniskill]" "torch==${TORCH_VERSION}"
RUN python -c "import mani_skill, brokers.broker, workers.envs.maniskill"

EXPOSE 5555 5556
ENTRYPOINT ["rlvla3"]
CMD ["--help"]
