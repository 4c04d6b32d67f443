"""Dependency-free SVG line charts for benchmark results (no matplotlib on the benchmark machines)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
WIDTH, HEIGHT, PAD = 420, 280, 48


def line_chart(
    series: Mapping[str, Sequence[tuple[float, float]]],
    title: str,
    x_label: str,
    y_label: str,
    y_range: tuple[float, float] | None = None,
) -> str:
    """One chart as an SVG ``<g>`` fragment of WIDTH x HEIGHT: a polyline with dots per series, axes with
    min / max ticks, and a legend."""
    points = [p for s in series.values() for p in s]
    x_max = max((x for x, _ in points), default=1.0) or 1.0
    y_lo, y_hi = y_range or (min(y for _, y in points), max(y for _, y in points))
    y_hi = y_hi if y_hi > y_lo else y_lo + 1.0

    def sx(x: float) -> float:
        return PAD + (WIDTH - 2 * PAD) * x / x_max

    def sy(y: float) -> float:
        return HEIGHT - PAD - (HEIGHT - 2 * PAD) * (y - y_lo) / (y_hi - y_lo)

    out = [
        f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="13">{escape(title)}</text>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="#444"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="#444"/>',
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 12}" text-anchor="middle" font-size="11">{escape(x_label)}</text>',
        f'<text x="14" y="{HEIGHT / 2}" font-size="11" transform="rotate(-90 14 {HEIGHT / 2})" '
        f'text-anchor="middle">{escape(y_label)}</text>',
        f'<text x="{PAD}" y="{HEIGHT - PAD + 14}" font-size="10" text-anchor="middle">0</text>',
        f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 14}" font-size="10" text-anchor="middle">{x_max:g}</text>',
        f'<text x="{PAD - 4}" y="{sy(y_lo) + 3}" font-size="10" text-anchor="end">{y_lo:.2f}</text>',
        f'<text x="{PAD - 4}" y="{sy(y_hi) + 3}" font-size="10" text-anchor="end">{y_hi:.2f}</text>',
    ]
    for i, (name, pts) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in pts]
        ly = PAD + 14 * i
        out.append(f'<rect x="{WIDTH - PAD - 110}" y="{ly - 8}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{WIDTH - PAD - 96}" y="{ly + 1}" font-size="11">{escape(name)}</text>')
    return "\n".join(out)


def figure(charts: Sequence[str]) -> str:
    """Charts side by side in one SVG document."""
    body = "\n".join(f'<g transform="translate({i * WIDTH},0)">{c}</g>' for i, c in enumerate(charts))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH * len(charts)}" height="{HEIGHT}" '
        f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>{body}</svg>\n'
    )
