# redis-server for the offline compose override: Debian's package on the local
# Debian base (redis-cli comes with it, for the healthcheck).
# Built by `scripts/images.sh --local`.
ARG BASE_IMAGE=localhost/inferbus-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir /data && chown redis:redis /data
# As in the official image: redis writes its snapshot here on SIGTERM, and
# refuses to shut down when it cannot.
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
