"""Aliases and the serving lifecycle of versions: alias, archive, delete, unload.

Part of `ModelRepository` (`inferbus_registry.repository`), which reads
the state these methods change.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from inferbus_common.catalog import Route
from inferbus_common.errors import FailedPrecondition, NotFound
from inferbus_registry import naming
from inferbus_registry.layout import (
    ALIASES_FILE,
    ARCHIVED_FILE,
    MANIFEST_FILE,
    ROOT,
    UNLOADED_FILE,
    version_prefix,
)
from inferbus_registry.records import ModelState, VersionRecord
from inferbus_registry.store import Store


class ModelLifecycle:
    """Alias and lifecycle operations of `ModelRepository` (its base class)."""

    store: Store

    if TYPE_CHECKING:

        def _lock(self, model: str) -> asyncio.Lock: ...

        async def state(self, model: str) -> ModelState: ...

        async def resolve(self, model: str, version_or_alias: str) -> str: ...

        async def get_version(self, model: str, version_or_alias: str = "") -> VersionRecord: ...

    # --- aliases -------------------------------------------------------------
    async def _write_aliases(self, model: str, aliases: dict[str, str]) -> None:
        doc = {"model": model, "aliases": dict(sorted(aliases.items()))}
        await self.store.write_bytes(
            f"{ROOT}/{model}/{ALIASES_FILE}", (json.dumps(doc, indent=2) + "\n").encode()
        )

    async def set_alias(self, model: str, alias: str, version: str) -> ModelState:
        """Point `alias` at an existing `version`.

        Raises:
            InvalidArgument: malformed alias or version, or a managed alias.
            NotFound: unknown model or version.
        """
        naming.check_model_name(model)
        naming.check_alias(alias)
        naming.check_version(version)
        async with self._lock(model):
            state = await self._state_with(model, version)
            if version in state.archived:
                raise FailedPrecondition(
                    f"model {model!r} version {version!r} is archived; run "
                    f"`inferbus models unarchive {model} {version}` before aliasing it"
                )
            state.aliases[alias] = version
            await self._write_aliases(model, state.aliases)
            return state

    # --- archive, delete, serving (lifecycle) ----------------------------------
    async def _archived(self, model: str) -> set[str]:
        return {
            key.split("/")[2]
            for key in await self.store.list(f"{ROOT}/{model}/")
            if len(key.split("/")) == 4 and key.split("/")[3] == ARCHIVED_FILE
        }

    async def _check_not_serving(
        self, state: ModelState, version: str, action: str, live: Route | None
    ) -> None:
        """Refuse `action` while anything routes to `version`.

        ``latest`` is not a reason: the registry moves it by itself (to the
        highest remaining active version). The route's canary and shadow live
        only in NATS KV, so the caller passes the `live` route read there.

        Raises:
            FailedPrecondition: naming the alias or route field that points at it.
        """
        holders = sorted(a for a, v in state.aliases.items() if v == version and a != "latest")
        routed = live
        if routed is not None:
            for field_name in ("canary", "shadow"):
                if getattr(routed, field_name, "") == version:
                    holders.append(f"route.{field_name}")
        if holders:
            what = ", ".join(h if h.startswith("route.") else f"alias {h!r}" for h in holders)
            raise FailedPrecondition(
                f"cannot {action} model {state.name!r} version {version!r}: it is in use "
                f"({what}); point those at another version first (`inferbus models alias`)"
            )

    async def _state_with(self, model: str, version: str) -> ModelState:
        """The model's state, which must hold `version`.

        Raises:
            NotFound: unknown model or version.
        """
        state = await self.state(model)
        if version not in state.versions:
            raise NotFound(
                f"model {model!r} has no version {version!r}; versions: {state.versions}"
            )
        return state

    def _relatest(self, state: ModelState) -> dict[str, str]:
        aliases = dict(state.aliases)
        active = state.active_versions()
        if active:
            aliases["latest"] = naming.highest_version(active)
        else:
            aliases.pop("latest", None)
        return aliases

    async def archive(
        self, model: str, version: str, requested_by: str = "", *, live: Route | None = None
    ) -> ModelState:
        """Take `version` out of serving, keeping its files (idempotent).

        `live` is the model's route as published (its canary and shadow count).

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: the version is stable, an alias target, the
                route's canary or shadow.
        """
        naming.check_model_name(model)
        naming.check_version(version)
        async with self._lock(model):
            state = await self._state_with(model, version)
            if version in state.archived:
                return state
            await self._check_not_serving(state, version, "archive", live)
            doc = {
                "model": model,
                "version": version,
                "archived_unix_ms": time.time_ns() // 1_000_000,
                "requested_by": requested_by,
            }
            await self.store.write_bytes(
                f"{version_prefix(model, version)}/{ARCHIVED_FILE}",
                (json.dumps(doc, indent=2) + "\n").encode(),
            )
            state.archived = naming.sort_versions([*state.archived, version])
            return await self._store_aliases(state)

    async def unarchive(self, model: str, version: str) -> ModelState:
        """Make an archived `version` usable again (idempotent).

        Raises:
            NotFound: unknown model or version.
        """
        naming.check_model_name(model)
        naming.check_version(version)
        async with self._lock(model):
            state = await self._state_with(model, version)
            if version not in state.archived:
                return state
            await self.store.delete(f"{version_prefix(model, version)}/{ARCHIVED_FILE}")
            state.archived = [v for v in state.archived if v != version]
            return await self._store_aliases(state)

    async def delete_version(
        self, model: str, version: str, *, live: Route | None = None
    ) -> tuple[ModelState, int]:
        """Remove a version's files from the store; returns the new state and bytes freed.

        The manifest goes first, so an interrupted delete leaves files that
        are no version (a later push of the same number overwrites them).
        When the last version goes, the model's aliases go too and the
        returned state has no versions.

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: the version is in use (see `archive`).
        """
        naming.check_model_name(model)
        naming.check_version(version)
        async with self._lock(model):
            state = await self._state_with(model, version)
            await self._check_not_serving(state, version, "delete", live)
            prefix = version_prefix(model, version)
            try:
                freed = sum(
                    info.size for info in (await self.get_version(model, version)).files.values()
                )
            except (NotFound, ValueError, KeyError):
                freed = 0
            await self.store.delete(f"{prefix}/{MANIFEST_FILE}")
            for key in await self.store.list(f"{prefix}/"):
                await self.store.delete(key)
            state.versions = [v for v in state.versions if v != version]
            state.archived = [v for v in state.archived if v != version]
            if not state.versions:
                for name in (ALIASES_FILE, UNLOADED_FILE):
                    if await self.store.exists(f"{ROOT}/{model}/{name}"):
                        await self.store.delete(f"{ROOT}/{model}/{name}")
                state.aliases = {}
                return state, freed
            return await self._store_aliases(state), freed

    async def set_serving(
        self, model: str, serving: bool, version: str = "", requested_by: str = ""
    ) -> ModelState:
        """Withdraw a model's route (``serving=False``) or publish it again.

        With ``serving=True`` and a `version` (number or alias), ``stable``
        moves to that version first. Aliases survive an unload, so a load
        brings back exactly what served before.

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: the version is archived.
        """
        naming.check_model_name(model)
        target = await self.resolve(model, version) if serving and version else ""
        async with self._lock(model):
            state = await self.state(model)
            marker = f"{ROOT}/{model}/{UNLOADED_FILE}"
            if target:
                if target not in state.versions:
                    raise NotFound(
                        f"model {model!r} has no version {target!r}; versions: {state.versions}"
                    )
                if target in state.archived:
                    raise FailedPrecondition(
                        f"model {model!r} version {target!r} is archived; unarchive it first"
                    )
                if state.aliases.get("stable") != target:
                    state.aliases["stable"] = target
                    await self._write_aliases(model, state.aliases)
            if serving and state.unloaded:
                await self.store.delete(marker)
            elif not serving and not state.unloaded:
                doc = {"model": model, "unloaded_unix_ms": time.time_ns() // 1_000_000}
                doc["requested_by"] = requested_by
                await self.store.write_bytes(marker, (json.dumps(doc) + "\n").encode())
            state.unloaded = not serving
            return state

    async def _store_aliases(self, state: ModelState) -> ModelState:
        aliases = self._relatest(state)
        if aliases != state.aliases:
            await self._write_aliases(state.name, aliases)
            state.aliases = aliases
        return state
