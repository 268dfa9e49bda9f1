#!/bin/sh
# Start SeaweedFS with S3 on port 9000 and one identity (MINIO_ROOT_USER /
# MINIO_ROOT_PASSWORD, as the MinIO service of compose/docker-compose.yml takes
# them); every request must be signed with it. One node: a stop needs no
# graceful volume hand-over (-volume.preStopSeconds=0).
set -eu
: "${MINIO_ROOT_USER:?set MINIO_ROOT_USER}"
: "${MINIO_ROOT_PASSWORD:?set MINIO_ROOT_PASSWORD}"
mkdir -p /data /etc/seaweedfs
python3 - <<'PY'
import json, os
identity = {
    "name": "inferbus",
    "credentials": [
        {"accessKey": os.environ["MINIO_ROOT_USER"], "secretKey": os.environ["MINIO_ROOT_PASSWORD"]}
    ],
    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
}
with open("/etc/seaweedfs/s3.json", "w") as f:
    json.dump({"identities": [identity]}, f)
PY
exec weed server -dir=/data -ip.bind=0.0.0.0 -filer -s3 -s3.port=9000 \
    -s3.config=/etc/seaweedfs/s3.json -s3.port.iceberg=0 -s3.port.lance=0 \
    -master.volumeSizeLimitMB=256 -volume.max=100 \
    -volume.preStopSeconds=0 "$@"
