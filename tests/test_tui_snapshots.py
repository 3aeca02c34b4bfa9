"""SVG snapshots of the main screens on recorded runs (pytest-textual-snapshot).

After a deliberate UI change: ``pytest tests/test_tui_snapshots.py --snapshot-update``,
then look at the new SVGs under ``tests/__snapshots__`` before committing them.
"""

from __future__ import annotations

import pytest

from tests.fixtures.scenes import SCENES


@pytest.mark.parametrize("scene", SCENES, ids=[s.name for s in SCENES])
def test_screen(scene, snap_compare):
    assert snap_compare(scene.app(), terminal_size=scene.size, run_before=scene.run_before())
