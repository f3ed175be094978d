"""Headless Chromium for the live page's tests (Debian's chromium + chromium-driver, driven by selenium).

CI installs both (README's test command), so a missing browser is a failure, not a silent skip; set
PROTOFL_ALLOW_NO_BROWSER=1 to skip those tests on a machine without them. The driver is named
explicitly: selenium would otherwise try to download one.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

ALLOW_MISSING = "PROTOFL_ALLOW_NO_BROWSER"
T = TypeVar("T")


def _require(what: str, found: object, install: str) -> None:
    if found:
        return
    msg = f"{what} is not installed: {install}"
    if os.environ.get(ALLOW_MISSING) == "1":
        pytest.skip(f"{msg} ({ALLOW_MISSING}=1)")
    pytest.fail(f"{msg}, or set {ALLOW_MISSING}=1 to skip the browser tests", pytrace=False)


def chromium() -> Iterator[object]:
    """A headless Chromium WebDriver, quit afterwards (use as a fixture body)."""
    chrome = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    _require("chromium", chrome, "apt-get install chromium")
    _require("chromedriver", driver_path, "apt-get install chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _require("selenium", None, "pip install -e '.[ci]'")
        raise
    options = webdriver.ChromeOptions()
    options.binary_location = chrome  # type: ignore[assignment]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def eventually(probe: Callable[[], T | None], timeout: float, what: str, every: float = 0.2) -> T:
    """Poll `probe` until it returns something truthy, or fail after `timeout` seconds naming `what` and
    the last value seen (or the last error raised)."""
    end = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            got = probe()
            if got:
                return got
            last = got
        except Exception as exc:  # noqa: BLE001 - a page still loading, a server starting: try again
            last = exc
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")
        time.sleep(every)
