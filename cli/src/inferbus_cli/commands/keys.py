"""`inferbus keys`: API keys and model access lists of tenants (kept in Redis).

Keys are stored only as SHA-256 digests; `create` prints the key once. Every
gateway sees a revocation within a second, so rotation is: create, hand out,
revoke the old one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from inferbus_cli.commands.limits import redis_target


async def _run(args: argparse.Namespace) -> int:
    from inferbus_common.admission.apikeys import KeyStore
    from inferbus_common.admission.keys import AdmissionKeys, connect_redis

    redis = connect_redis(redis_target(args), timeout_s=5.0)
    store = KeyStore(redis, AdmissionKeys(args.prefix))
    try:
        if args.action == "create":
            record, secret = await store.create_key(args.tenant)
            if args.models:
                await store.allow_models(args.tenant, *args.models)
            print(f"key id {record.key_id} for tenant {record.tenant} (shown once):")
            print(secret)
            return 0
        if args.action == "revoke":
            if not await store.revoke_key(args.key_id):
                print(f"no valid key with id {args.key_id}", file=sys.stderr)
                return 1
            print(f"revoked {args.key_id}")
            return 0
        if args.action == "allow":
            await store.allow_models(args.tenant, *args.models)
        elif args.action == "disallow":
            await store.disallow_models(args.tenant, *args.models)
        if args.action in ("allow", "disallow"):
            models = sorted(await store.allowed_models(args.tenant))
            print(f"tenant {args.tenant} may call: {', '.join(models) or 'nothing'}")
            return 0
        records = await store.list_keys(args.tenant or "")
        if args.json:
            print(json.dumps([dataclasses.asdict(r) for r in records], indent=2))
            return 0
        if not records:
            print("no API keys")
        for r in records:
            state = f"revoked {r.revoked}" if r.revoked else "valid"
            print(f"{r.tenant:<20} {r.key_id:<24} created {r.created}  {state}")
        return 0
    finally:
        await redis.aclose()


def run(args: argparse.Namespace) -> int:
    """Entry of `inferbus keys ...`."""
    return asyncio.run(_run(args))
