"""The import graph keeps the architecture's boundaries (docs/architecture.md,
shared STYLE practice 2): `libs/` imports no service package, the CLI imports
no service package (it talks to them over their APIs and the shared libraries),
and no service's source imports another service. Imports inside functions count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = {
    "inferbus_gateway",
    "inferbus_router",
    "inferbus_batcher",
    "inferbus_worker",
    "inferbus_registry",
}


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports (absolute imports, anywhere in the file)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _sources(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).glob("**/src/**/*.py"))


def _violations(files: list[Path], forbidden: set[str], own: str = "") -> list[str]:
    found = []
    for path in files:
        for module in imported_modules(path):
            top = module.split(".", 1)[0]
            if top in forbidden and top != own:
                found.append(f"{path.relative_to(REPO)} imports {module}")
    return sorted(set(found))


def test_the_graph_is_read() -> None:
    """The walk finds the packages it judges (a moved tree must not pass vacuously)."""
    assert len(_sources("libs")) > 40 and len(_sources("cli")) > 20
    assert "inferbus_common.catalog" in imported_modules(
        REPO / "services/router/src/inferbus_router/router.py"
    )


def test_libs_import_no_service() -> None:
    assert _violations(_sources("libs"), SERVICES) == []


def test_the_cli_imports_no_service() -> None:
    assert _violations(_sources("cli"), SERVICES) == []


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_services_do_not_import_each_other(service: str) -> None:
    folder = {"inferbus_worker": "worker-gpu"}.get(service, service.removeprefix("inferbus_"))
    files = sorted((REPO / "services" / folder / "src").glob("**/*.py"))
    assert files
    assert _violations(files, SERVICES, own=service) == []


def test_no_production_module_is_over_600_lines() -> None:
    """Issue 25: a module a newcomer reads stays under 600 lines (split it by what it
    does, as dispatch/fastlane.py and dispatch/reply.py were split from the dispatcher).
    Generated protobuf stubs are not read by people and do not count."""
    root = Path(__file__).resolve().parents[2]
    sources = [*root.glob("services/*/src/**/*.py"), *root.glob("libs/*/src/**/*.py")]
    sources += list(root.glob("cli/src/**/*.py"))
    assert len(sources) > 100, "the production sources were not found"
    long = {
        str(p.relative_to(root)): n
        for p in sources
        if "_pb2" not in p.name and (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long
