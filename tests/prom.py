"""Scraping a Prometheus endpoint in tests: ``scrape(url)`` parses it with prometheus_client's own parser into
``{(sample name, sorted label pairs): value}`` (``(("run", "r1"),)`` for ``{run="r1"}``)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def fetch(url: str, timeout_s: float = 5.0) -> str:
    """GET ``url``; asserts a 200 in the Prometheus text content type."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def scrape(url: str, timeout_s: float = 5.0) -> Samples:
    return samples(fetch(url, timeout_s))
