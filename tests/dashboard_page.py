"""Driving the dashboard page in headless Chromium (Debian's ``chromium`` + ``chromium-driver`` via Selenium),
shared by the dashboard's own tests and any end-to-end test that wants to look at a real run's page.

``with chromium() as driver: driver.get(url); state = wait_for(driver, lambda s: ..., "what")`` - ``state`` is
everything the page shows (:data:`READ_PAGE`); :func:`tile` reads one tile's exact value; :func:`screenshot`
keeps a PNG under test-artifacts/. A missing browser fails the test with the apt command, never skips it.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

# Everything the page shows, read from the DOM in one call. Tiles: id -> [exact value or null, text].
# Charts: id -> {points, lines: {series name: [points drawn, last value]}}.
READ_PAGE = """
const attrs = (sel, f) => [...document.querySelectorAll(sel)].map(f);
return {
  ready: document.body.dataset.ready || null,
  status: document.getElementById('status').textContent,
  run: document.getElementById('run-id').textContent,
  devices: document.getElementById('devices').textContent,
  tiles: Object.fromEntries(attrs('.tile .value', e => [e.id, [e.dataset.value ?? null, e.textContent]])),
  charts: Object.fromEntries(attrs('figure.chart', f => [f.id, {
    points: Number(f.dataset.points || 0),
    lines: Object.fromEntries([...f.querySelectorAll('path.line')].map(
      p => [p.dataset.name, [Number(p.dataset.count), Number(p.dataset.last)]])),
  }])),
  bars: attrs('#chart-staleness-hist rect.bar', r => [Number(r.dataset.bucket), Number(r.dataset.count)]),
  engines: attrs('#engines tbody tr', tr => [tr.dataset.engine || null, ...[...tr.cells].map(c => c.textContent)]),
  pills: attrs('#roles .pill', p => p.dataset.role || null),
  outcomes: Object.fromEntries(attrs('#outcomes tr[data-key]', tr => [tr.dataset.key, tr.cells[2].textContent])),
  samples: attrs('#samples .sample', d => ({
    group: d.dataset.group, index: Number(d.dataset.index), reward: Number(d.dataset.reward),
    meta: d.querySelector('.meta').textContent, prompt: d.querySelector('.prompt').textContent,
    tokens: [...d.querySelectorAll('.text .tok')].map(t => [t.textContent, Number(t.dataset.version),
      Number(t.dataset.lag), getComputedStyle(t).backgroundColor]),
  })),
  archive: document.getElementById('archive-status').textContent,
};
"""

FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,2600",
)


def require_chromium() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} missing: the browser test needs Debian's chromium and chromium-driver "
            "(apt-get install -y chromium chromium-driver; `make install` does it). Never a downloaded browser."
        )


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A Selenium driver for Debian's headless Chromium with a throw-away profile (no Selenium Manager: the
    driver path is given, so nothing is ever downloaded)."""
    require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="streamrl-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(
    driver: Any, ready: Callable[[dict[str, Any]], Any], what: str, timeout_s: float = 30.0
) -> dict[str, Any]:
    """Read the page every 0.2 s until ``ready(state)``; fails with the last state after ``timeout_s``."""
    from selenium.webdriver.support.ui import WebDriverWait

    state: dict[str, Any] = {}

    def check(d: Any) -> bool:
        state.update(d.execute_script(READ_PAGE))
        return bool(ready(state))

    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(check)
    except Exception as exc:
        raise AssertionError(f"page never showed {what}; last state: {state}") from exc
    return state


def tile(state: dict[str, Any], name: str) -> float | None:
    """The exact value behind tile ``stat-<name>`` (None when the page shows '-')."""
    raw = state["tiles"][f"stat-{name}"][0]
    return None if raw is None else float(raw)


def screenshot(driver: Any, name: str) -> Path:
    """Save a PNG of the page under test-artifacts/ and check it is one."""
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / name
    shot.unlink(missing_ok=True)
    assert driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    return shot
