"""Cross-service tests (``tests/e2e``, ``tests/deploy``).

Every test under ``tests/`` runs real servers or whole stacks, so each is
marked ``integration`` here (select or skip them with ``-m``). The shared
fixtures come from the root ``conftest.py`` (`inferbus_testing.fixtures`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests collected below this directory as ``integration``."""
    for item in items:
        if item.path.is_relative_to(_HERE):
            item.add_marker(pytest.mark.integration)
