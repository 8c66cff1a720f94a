# The worker's image: `remote-dspark worker` drafting with a transformers model read from
# a volume at /models/draft, as an unprivileged user (10001), with the native library built
# here once (the image that runs has no C compiler). From the repository's root:
#
#   docker build --build-arg VARIANT=cuda -t remote-dspark-worker:0.1.0-cuda .
#   docker build --build-arg VARIANT=cpu -t remote-dspark-worker:0.1.0-cpu .
#
# VARIANT picks torch's build (cuda: the GPU wheel, which brings its CUDA libraries; the
# host gives the driver); TORCH_INDEX names another index for it (another CUDA version,
# a mirror). How to run it, and deploy/kubernetes/ which names it: docs/deploy.md.
# tests/deploy/test_image.py checks this file and runs its steps outside a builder.

ARG BASE=python:3.12-slim-bookworm
ARG PREFIX=/opt/remote-dspark

FROM ${BASE} AS build
ARG PREFIX
ARG VARIANT=cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=
ARG EXTRAS=worker,hf
ARG SRC=/usr/src/remote-dspark
# The compiler the native library needs: in this stage only.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv "$PREFIX"
ENV PATH=${PREFIX}/bin:${PATH}
RUN case "$VARIANT" in \
        cpu) index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" ;; \
        cuda) index="${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}" ;; \
        *) echo "VARIANT=$VARIANT: must be cpu or cuda" >&2; exit 2 ;; \
    esac \
    && pip install --no-cache-dir --index-url "$index" "torch==$TORCH_VERSION"
COPY pyproject.toml README.md ${SRC}/
COPY remote_dspark ${SRC}/remote_dspark
RUN pip install --no-cache-dir "${SRC}[${EXTRAS}]"
# The library the worker's rounds run in, compiled from the installed package's sources
# (as at a first start) and kept where VLLM_DSPARK_REMOTE_HOSTFLAG_LIB names it below.
RUN lib="$(XDG_CACHE_HOME="$SRC/.cache" python -c 'from remote_dspark import native; print(native.locate())')" \
    && install -D -m 0755 "$lib" "$PREFIX/lib/remote-dspark/libremote_dspark_native.so"

FROM ${BASE}
ARG PREFIX
COPY --from=build ${PREFIX} ${PREFIX}
# HOME=/tmp: the pod's root filesystem is read-only and /tmp its one writable volume.
# HF_HUB_OFFLINE: --hf-model is a local directory, never a download.
ENV PATH=${PREFIX}/bin:${PATH} \
    VLLM_DSPARK_REMOTE_HOSTFLAG_LIB=${PREFIX}/lib/remote-dspark/libremote_dspark_native.so \
    HOME=/tmp \
    HF_HUB_OFFLINE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN groupadd --gid 10001 remote-dspark \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin remote-dspark
USER 10001:10001
# As the worker's user, with no compiler: the library loads as built (a worker that
# could not load it would serve every round by the slower Python path) and the flags parse.
RUN python -c 'from remote_dspark import native; print(native.load().path)' \
    && remote-dspark worker --help > /dev/null
# The draft model: a transformers directory (safetensors) of root's or 10001's that
# nobody else may write, mounted read-only.
VOLUME ["/models/draft"]
EXPOSE 18620 9465
ENTRYPOINT ["remote-dspark", "worker"]
CMD ["--hf-model=/models/draft", "--listen=0.0.0.0:18620", "--metrics-host=0.0.0.0", "--metrics-port=9465"]
