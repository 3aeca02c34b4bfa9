"""Make the README's screenshots: the real UI on recorded runs.

    python screenshots/make.py              # writes screenshots/*.svg
    python screenshots/make.py fleet-16384  # only the scenes named

The small jobs are real jobs recorded in tests/fixtures (see ``tests/fixtures/record.py``);
the fleets of 1,024 and 16,384 ranks are simulated (``screenshots/fleets.py``: their
recordings are made once and cached, the 16,384-rank one in about ten minutes). Each
screenshot is the app on the snapshot of one moment of one recording, with the keys a
user would press.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from textual._doc import take_svg_screenshot  # noqa: E402

from screenshots.fleets import FLEET_SCENES  # noqa: E402
from tests.fixtures.scenes import SCENES  # noqa: E402


def main(argv: list[str]) -> None:
    """Write one SVG per scene (those named, if any)."""
    out = Path(__file__).parent
    for scene in (*SCENES, *FLEET_SCENES):
        if argv and scene.name not in argv:
            continue
        svg = take_svg_screenshot(app=scene.app(), terminal_size=scene.size,
                                  run_before=scene.run_before())
        path = out / f"{scene.name}.svg"
        path.write_text(svg)
        print(f"{path.relative_to(ROOT)}  {scene.caption}")


if __name__ == "__main__":
    main(sys.argv[1:])
