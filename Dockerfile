# syntax=docker/dockerfile:1
# The gateway image the manifests name (manifests/kvroute, manifests/sidecar):
#
#   docker build -t kvroute:0.1.0 .
#
# Only the gateway crate is built: the simulator and the lab (kvroute-sim, kvroute-lab)
# are not in the image. The release profile strips symbols (see Cargo.toml); panics still
# name file and line.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# BuildKit caches the registry and the target directory between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kvroute \
    && install -m 0755 target/release/kvroute /usr/local/bin/kvroute

# glibc and libgcc, CA certificates, no shell; uid/gid 65532 as the manifests expect.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /usr/local/bin/kvroute /usr/local/bin/kvroute
USER 65532:65532
# ext_proc gRPC, gRPC health, admin API (loopback by default), metrics and debug HTTP.
EXPOSE 9002 9003 9004 9090
ENTRYPOINT ["/usr/local/bin/kvroute"]
CMD ["serve"]
