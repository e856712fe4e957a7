# syntax=docker/dockerfile:1
# The kiln gateway as a container image:
#
#   docker build -t kiln:latest .
#   docker run --rm -p 8080:8080 kiln:latest
#
# serves the shipped enterprise policy on the embedded GPU simulator at
# localhost:8080. In Kubernetes (deploy/kubernetes) the arguments are
# replaced: the policy and kiln.toml come from a ConfigMap and a Secret.
# The cache mounts need BuildKit (the default builder of Docker 23 and later).
#
# Base images. NOT YET PINNED BY DIGEST: the digests were not at hand where
# this file was last written (no registry access), and a made-up digest
# would be worse than none. To pin them, resolve each tag once and either
# edit the defaults below or pass them at build time:
#
#   docker buildx imagetools inspect rust:1-bookworm      # Digest: sha256:…
#   docker buildx imagetools inspect debian:bookworm-slim
#   docker build \
#     --build-arg RUST_IMAGE=rust:1-bookworm@sha256:<digest> \
#     --build-arg RUNTIME_IMAGE=debian:bookworm-slim@sha256:<digest> -t kiln .
#
# `.ci/run` says (without failing) when a default is not pinned.
ARG RUST_IMAGE=rust:1-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS builder
WORKDIR /src
COPY . .
# rusqlite is built `bundled`: SQLite compiles from C here (the rust image
# has gcc), so the runtime image needs no libsqlite. reqwest is built without
# TLS, so no OpenSSL either. The binary is copied out of the cached target
# directory in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin kiln \
    && install -D -m 0755 target/release/kiln /out/kiln

FROM ${RUNTIME_IMAGE}
# A fixed numeric UID, so Kubernetes can check runAsNonRoot without a
# passwd lookup. /var/lib/kiln is the working directory and the only place
# kiln writes (the batch store, `.kiln/batches.db` by default).
RUN groupadd --system --gid 10001 kiln \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/kiln \
        --no-create-home --shell /usr/sbin/nologin kiln \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/kiln
COPY --from=builder /out/kiln /usr/local/bin/kiln
# The shipped policies, as defaults: /etc/kiln/policies/enterprise, …
COPY policies/ /etc/kiln/policies/
USER 10001:10001
WORKDIR /var/lib/kiln
EXPOSE 8080
# Liveness (`/healthz`: the process answers HTTP), for `docker run` and
# Compose; Kubernetes ignores it and uses the Deployment's probes
# (`/healthz` and `/readyz`). The slim image has no curl: bash's /dev/tcp
# sends the request, on the default port (change it with `--listen`).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/8080 && printf 'GET /healthz HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]
# kiln finishes in-flight requests on SIGTERM (the signal `docker stop` and
# Kubernetes send).
ENTRYPOINT ["/usr/local/bin/kiln", "serve"]
CMD ["--policy", "/etc/kiln/policies/enterprise", "--listen", "0.0.0.0:8080"]
