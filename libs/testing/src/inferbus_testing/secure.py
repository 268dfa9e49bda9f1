"""`SecureStack`: the local stack as it should run in production.

* nats-server requires a user per service, with the subject permissions of
  `inferbus_common.security` (the services read their password from a file);
* redis-server requires a password (the gateway reads it from a file);
* the gateway serves gRPC and HTTP over TLS with a self-signed certificate for
  127.0.0.1 and localhost (`ca_file` is what clients must trust);
* the registry API requires a token: `admin_token` (this stack's pushes, the
  gateway's repository extension) or `reader_token` (workers' downloads).

Everything secret lives under ``<base>/secrets`` with mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import time
from pathlib import Path
from typing import Any

from inferbus_common import security
from inferbus_common.subjects import Subjects
from inferbus_testing.processes import ServiceProcess
from inferbus_testing.servers import RedisServer
from inferbus_testing.stack import LocalStack

_ROLE_OF_MODULE = {
    "inferbus_gateway": "gateway",
    "inferbus_router": "router",
    "inferbus_batcher": "batcher",
    "inferbus_worker": "worker",
    "inferbus_registry": "registry",
}


def self_signed_cert(out: Path) -> tuple[Path, Path]:
    """Write ``cert.pem`` and ``key.pem`` for CN=localhost, SAN localhost + 127.0.0.1."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = out / "cert.pem", out / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


class SecureStack(LocalStack):
    """A `LocalStack` with NATS users and permissions, a Redis password and gateway TLS."""

    def __init__(self, base: Path, **kwargs: Any) -> None:
        super().__init__(base, **kwargs)
        self.secrets_dir = base / "secrets"
        self.secrets_dir.mkdir(parents=True, exist_ok=True)
        self.secrets_dir.chmod(0o700)
        self.passwords = security.generate(self.secrets_dir, Subjects())
        """NATS role → password."""
        self.redis_password = secrets.token_urlsafe(24)
        (self.secrets_dir / "redis.password").write_text(self.redis_password)
        if self.redis is not None:
            self.redis = RedisServer(
                base / "redis", extra_args=["--requirepass", self.redis_password]
            )
        self.admin_token = secrets.token_urlsafe(24)
        self.reader_token = secrets.token_urlsafe(24)
        for name in ("admin", "reader"):
            path = self.secrets_dir / f"registry-{name}.token"
            path.write_text(getattr(self, f"{name}_token"))
            path.chmod(0o600)
        self.ca_file, key_file = self_signed_cert(self.secrets_dir)
        self.env.update(
            {
                "INFERBUS_GATEWAY_TLS_CERT_FILE": str(self.ca_file),
                "INFERBUS_GATEWAY_TLS_KEY_FILE": str(key_file),
                "INFERBUS_GATEWAY_REDIS_PASSWORD_FILE": str(self.secrets_dir / "redis.password"),
                "INFERBUS_GATEWAY_REGISTRY_TOKEN_FILE": str(
                    self.secrets_dir / "registry-admin.token"
                ),
                "INFERBUS_REGISTRY_ADMIN_TOKEN_FILE": str(
                    self.secrets_dir / "registry-admin.token"
                ),
                "INFERBUS_REGISTRY_READER_TOKEN_FILE": str(
                    self.secrets_dir / "registry-reader.token"
                ),
                "INFERBUS_WORKER_REGISTRY_TOKEN_FILE": str(
                    self.secrets_dir / "registry-reader.token"
                ),
            }
        )

    def password_file(self, role: str) -> Path:
        """The file holding the NATS password of `role` (written by `security.generate`)."""
        return self.secrets_dir / f"{role}.nats-password"

    def _nats_args(self) -> list[str]:
        return ["-c", str(self.secrets_dir / "nats-auth.conf")]

    def _spawn(self, name: str, module: str, extra: dict[str, str]) -> ServiceProcess:
        role = _ROLE_OF_MODULE[module]
        prefix = security.SERVICE_ENV[role]
        auth = {
            f"{prefix}NATS_USER": role,
            f"{prefix}NATS_PASSWORD_FILE": str(self.password_file(role)),
        }
        return super()._spawn(name, module, {**auth, **extra})

    def push(self, model_dir: Path, name: str, version: str = "1") -> None:
        """Push with the registry's admin token and make the version ``stable``."""
        import asyncio

        from inferbus_client.registry import RegistryClient

        async def _push() -> None:
            async with RegistryClient(self.registry_url, token=self.admin_token) as client:
                await client.push(model_dir, name, version, aliases=["stable"])

        asyncio.run(_push())

    def wait_model_ready(self, model: str, timeout: float = 60.0) -> None:
        """Poll ModelReady over TLS."""
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(
            self.grpc_url, ssl=True, root_certificates=str(self.ca_file)
        )
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if client.is_model_ready(model):
                    return
                time.sleep(0.05)
        finally:
            client.close()
        raise TimeoutError(f"model {model} not ready after {timeout}s")
