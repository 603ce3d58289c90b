# The image of deploy/node-installer.yaml. Build it from the repository's root
# after a release build, on (or for) the nodes' architecture:
#
#   ./scripts/build-release
#   docker build -f deploy/node-installer.Dockerfile -t registry.example.com/gpushare-node-installer:0.1.0 .
#   docker push registry.example.com/gpushare-node-installer:0.1.0
#
# gpushare links only the C library (glibc >= 2.34: Debian 12, Ubuntu 22.04, RHEL 9 and
# newer nodes) and gpushare-runtime is static-pie, so a slim Debian base runs both the
# installer here and the copies on the host.
FROM debian:bookworm-slim
COPY target/release/gpushare target/release/gpushare-runtime /opt/gpushare/
COPY config/runtime.toml /opt/gpushare/runtime.toml
COPY deploy/node-installer.sh /opt/gpushare/entrypoint.sh
ENTRYPOINT ["/opt/gpushare/entrypoint.sh"]
