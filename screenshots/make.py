"""Make the README's screenshots: the real UI on the recorded runs in tests/fixtures.

    python screenshots/make.py          # writes screenshots/*.svg

The recordings are real jobs (see ``tests/fixtures/record.py``); each screenshot is the
app on the snapshot of one moment of one recording, with the keys a user would press.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from textual._doc import take_svg_screenshot  # noqa: E402

from tests.fixtures.scenes import SCENES  # noqa: E402


def main() -> None:
    """Write one SVG per scene."""
    out = Path(__file__).parent
    for scene in SCENES:
        svg = take_svg_screenshot(app=scene.app(), terminal_size=scene.size,
                                  run_before=scene.run_before())
        path = out / f"{scene.name}.svg"
        path.write_text(svg)
        print(f"{path.relative_to(ROOT)}  {scene.caption}")


if __name__ == "__main__":
    main()
