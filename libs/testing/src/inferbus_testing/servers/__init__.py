"""Real servers for tests: ``nats-server`` (JetStream), ``redis-server`` and an S3 endpoint.

Each class starts the real binary as a child process bound to 127.0.0.1, waits
until it really serves (never a fixed sleep), and stops it again. Use them as
context managers or call ``start()``/``close()`` yourself::

    from inferbus_testing.servers import NatsServer, RedisServer, S3Server

    with NatsServer() as nats_srv:          # JetStream on, file store in a temp dir
        nc = await nats.connect(nats_srv.url)
        ...
        nats_srv.kill()                      # SIGKILL: simulate a crash
        nats_srv.restart()                   # same port, same store dir

    with RedisServer() as redis_srv:
        client = redis.Redis.from_url(redis_srv.url)

    with S3Server() as s3:                   # SeaweedFS, signature-checked
        client = minio.Minio(s3.endpoint, s3.access_key, s3.secret_key, secure=False)

In pytest, prefer the fixtures ``nats_server``, ``redis_server`` and
``s3_server`` from :mod:`inferbus_testing.fixtures`.

Ports: nats-server picks its own port (``-p -1``) and we read it back from its
ports file. redis-server and SeaweedFS cannot, so we choose a random port below
the kernel's ephemeral range (so it never collides with ports the OS hands out
for port 0 or outgoing connections) and retry with another one when the server
fails to bind. Readiness of those two is proven by something only *our*
process can produce (redis's "Ready to accept connections" in its own log; S3
accepting our freshly generated credentials), so a foreign server that already
holds the port is never mistaken for ours.

The classes live in `base` (child process, ports, readiness), `natsserver`
(`NatsServer`, `NatsCluster`) and `stores` (`RedisServer`, `S3Server`); import
them from here.
"""

from __future__ import annotations

from inferbus_testing.servers.base import HOST, ServerError, find_binary
from inferbus_testing.servers.natsserver import NatsCluster, NatsServer
from inferbus_testing.servers.stores import RedisServer, S3Server

__all__ = [
    "HOST",
    "NatsCluster",
    "NatsServer",
    "RedisServer",
    "S3Server",
    "ServerError",
    "find_binary",
]
