# The image of deploy/node-installer.yaml. Build it from the repository's root
# after a release build, on (or for) the nodes' architecture:
#
#   ./scripts/build-release
#   docker build -f deploy/node-installer.Dockerfile -t registry.example.com/gpushare-node-installer:0.1.0 .
#   docker push registry.example.com/gpushare-node-installer:0.1.0
#
# It copies target/release as it is: gpushare-runtime is static-pie only as
# scripts/build-release links it (a later `cargo build --release` relinks it dynamically,
# which works the same but slower per call, and then needs the node's glibc too).
# gpushare links only the C library (glibc >= 2.34: Debian 12, Ubuntu 22.04, RHEL 9 and
# newer nodes), so a slim Debian base runs both the installer here and the copies on the
# host. .dockerignore keeps the rest of target/ and .git out of the build context.
FROM debian:bookworm-slim
COPY target/release/gpushare target/release/gpushare-runtime /opt/gpushare/
COPY config/runtime.toml /opt/gpushare/runtime.toml
COPY deploy/node-installer.sh /opt/gpushare/entrypoint.sh
ENTRYPOINT ["/opt/gpushare/entrypoint.sh"]
