# Prometheus for the offline compose override: Debian's package on the local
# Debian base (the same flags as prom/prometheus; compose passes the config).
# Built by `scripts/images.sh --local`.
ARG BASE_IMAGE=localhost/inferbus-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown prometheus /prometheus
USER prometheus
EXPOSE 9090
ENTRYPOINT ["prometheus"]
