"""A real headless Chromium for the report's pages, driven through selenium and the system's
chromedriver (Debian: `apt-get install chromium chromium-driver`).

`chromium()` starts one browser with a fresh profile and every background connection off (on a
closed network Chromium's own update, sync and component requests would otherwise fail, and
show up as errors); `open_page` loads a file and returns what a person would see: the verdict,
the text, the images and whether each decoded, the links, and the console's errors.
`page_problems` lists what is wrong with a loaded page, so that the tests and their own
negative checks share one definition of a good page.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = os.environ.get("DSV4_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("DSV4_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1000", "--hide-scrollbars")


def missing() -> str | None:
    """Why no browser test can run here (None: they can)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return f"{path} is not installed (apt-get install -y chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install '.[test]')"
    return None


@contextlib.contextmanager
def chromium():
    """A headless Chromium with a fresh user-data-dir, quit and removed at the end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="dsv4-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


_READ = """
const imgs = Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, width: i.naturalWidth,
                                                    height: i.naturalHeight}));
const links = Array.from(document.querySelectorAll('a[href]')).map(a => ({text: a.textContent, href: a.href,
                                                                          raw: a.getAttribute('href')}));
const badge = document.querySelector('h1 .verdict');
return {title: document.title, text: document.body.innerText, verdict: badge ? badge.dataset.verdict : null,
        images: imgs, links: links, ready: document.readyState};
"""


@dataclass
class Page:
    url: str
    title: str
    verdict: str | None  # the page's verdict badge
    text: str  # what it shows, as text
    images: list[dict]  # alt, complete, width, height (natural, so 0 when it did not decode)
    links: list[dict]  # text, href (resolved), raw (as written)
    console_errors: list[str] = field(default_factory=list)


def console_errors(driver) -> list[str]:
    """The console's errors since the last call (a failed resource load is one too)."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def open_page(driver, path: str | Path) -> Page:
    """Load a page from disk and read it once it is complete (inline images decoded)."""
    from selenium.webdriver.support.ui import WebDriverWait

    console_errors(driver)  # drop what an earlier page left
    url = Path(path).resolve().as_uri()
    driver.get(url)
    WebDriverWait(driver, 20).until(lambda d: d.execute_script(
        "return document.readyState === 'complete' && Array.from(document.images).every(i => i.complete)"))
    return read(driver, url)


def read(driver, url: str | None = None) -> Page:
    got = driver.execute_script(_READ)
    return Page(url=url or driver.current_url, title=got["title"], verdict=got["verdict"], text=got["text"],
                images=got["images"], links=got["links"], console_errors=console_errors(driver))


def page_problems(page: Page, *, verdict: str, texts: list[str] = (), min_images: int = 0) -> list[str]:
    """Everything wrong with a loaded page: console errors, another verdict than the expected
    one (or the word of another verdict in the badge), expected text missing, too few images,
    an image that did not decode."""
    problems = [f"console error: {m}" for m in page.console_errors]
    if page.verdict != verdict:
        problems.append(f"verdict badge says {page.verdict!r}, expected {verdict!r}")
    problems += [f"text {t!r} not on the page" for t in texts if t not in page.text]
    if len(page.images) < min_images:
        problems.append(f"{len(page.images)} images, expected at least {min_images}")
    problems += [f"image {i['alt']!r} did not decode" for i in page.images if not (i["complete"] and i["width"] > 0)]
    return problems


def full_screenshot(driver, max_height: int = 6000) -> bytes:
    """A PNG of the whole page (up to max_height CSS pixels), as it renders at 1280 wide."""
    height = min(max_height, driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(1280, max(height, 400))
    try:
        return driver.get_screenshot_as_png()
    finally:
        driver.set_window_size(1280, 1000)


def colours(png: bytes) -> tuple[int, float]:
    """(distinct colours, share of pixels that are not white) of a screenshot: a blank or
    unstyled page has a handful of colours and almost nothing but white."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    counts = img.getcolors(maxcolors=img.width * img.height)  # [(pixels, colour)], every colour
    white = sum(n for n, c in counts if c == (255, 255, 255))
    return len(counts), 1 - white / (img.width * img.height)
