"""A screenshot of a report page (a run's or a sweep's report.html) in headless Chromium.

    .venv/bin/python scripts/report_screenshot.py OUTPUT_DIR/report.html docs/report-fail.png --height 1450

The page is rendered 1280 CSS pixels wide, as in the browser tests (tests/browser.py: the
system's chromium and chromedriver, selenium from the test extra), cut to --height pixels from
the top, and stored with a reduced palette so that it stays small in the repository.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import browser  # noqa: E402  (the checkout's own tests package)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("page", type=Path)
    ap.add_argument("png", type=Path)
    ap.add_argument("--height", type=int, default=1450, help="CSS pixels from the top of the page")
    ap.add_argument("--colours", type=int, default=128, help="palette size of the stored PNG")
    args = ap.parse_args()
    missing = browser.missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    from PIL import Image

    with browser.chromium() as driver:
        page = browser.open_page(driver, args.page)
        if page.console_errors:
            print(f"error: the page logged errors: {page.console_errors}", file=sys.stderr)
            return 1
        shot = Image.open(io.BytesIO(browser.full_screenshot(driver))).convert("RGB")
    shot = shot.crop((0, 0, shot.width, min(args.height, shot.height)))
    shot.quantize(colors=args.colours, method=Image.Quantize.MEDIANCUT).save(args.png, optimize=True)
    print(f"{args.png}: {shot.width}x{shot.height}, {args.png.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
