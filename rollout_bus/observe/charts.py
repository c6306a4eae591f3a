"""Small inline-SVG charts for the run report: lines with min-max bands, and bars. Pure: strings out.

Contract:

* ``line_chart(series, ...)`` draws one ``<path class="line">`` per series with at least one
  point, a ``<polygon class="band">`` (shaded, the series' colour) per series that has ``low`` and
  ``high``, an optional dashed ``<path class="median">`` per series with ``mid``, a marker with a
  ``<title>`` tooltip per point, a legend (one entry per series), axis labels and ticks.
* ``bar_chart(bars, ...)`` draws stacked bars: one ``<rect class="bar">`` per part of a bar,
  coloured by the part's group (legend: one entry per group, in first-seen order).
* Every piece of text (titles, labels, tooltips, legend names) is XML-escaped, so an adapter
  called ``<b>&`` cannot break the document. Output is deterministic for the same input.
* X positions are plain numbers; the caller gives tick labels as ``(x, text)`` pairs
  (``time_ticks`` makes them for epoch-millisecond x values).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from html import escape
from typing import Sequence

# Okabe-Ito: distinguishable for the common forms of colour blindness.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
_LEFT, _RIGHT, _TOP, _BOTTOM = 72, 24, 44, 58
_FONT = 'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif"'


def color_for(index: int) -> str:
    """The palette colour of the index-th adapter (cycles)."""
    return PALETTE[index % len(PALETTE)]


@dataclass(frozen=True)
class Series:
    """One line: y over x, optionally a band (low..high) and a dashed middle line (e.g. the median)."""

    name: str
    color: str
    x: Sequence[float]
    y: Sequence[float]
    low: Sequence[float] | None = None
    high: Sequence[float] | None = None
    mid: Sequence[float] | None = None
    tips: Sequence[str] = field(default_factory=tuple)


@dataclass(frozen=True)
class Bar:
    """One bar: its x label and its stacked parts ``(group, colour, value)``, bottom first."""

    label: str
    parts: Sequence[tuple[str, str, float]]
    tip: str = ""

    @property
    def total(self) -> float:
        return sum(v for _, _, v in self.parts if math.isfinite(v))


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high] (1-2-5 steps)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [0.0, 1.0]
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    start = math.floor(low / step) * step
    ticks = []
    value = start
    while value < high + step * 0.5:
        ticks.append(round(value, 10))
        value += step
    return ticks


def format_number(value: float) -> str:
    """Compact axis / tooltip number: 1234 -> '1,234', 0.25 -> '0.25', 12000 -> '12k'."""
    if not math.isfinite(value):
        return "n/a"
    if abs(value) >= 10000:
        return f"{value / 1000:,.0f}k" if abs(value) < 1e6 else f"{value / 1e6:,.1f}M"
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:,.2f}".rstrip("0").rstrip(".") if abs(value) >= 1 else f"{value:.3g}"


def time_ticks(times_ms: Sequence[int], most: int = 8) -> list[tuple[float, str]]:
    """Up to ``most`` evenly spread ``(x, "HH:MM:SS")`` ticks (UTC) from sorted epoch-ms times."""
    if not times_ms:
        return []
    every = max(1, math.ceil(len(times_ms) / most))
    return [(float(t), time.strftime("%H:%M:%S", time.gmtime(t / 1000))) for t in times_ms[::every]]


class _Frame:
    """Maps data coordinates to pixels inside the plot area."""

    def __init__(self, width: int, height: int, x_range: tuple[float, float], y_range: tuple[float, float]):
        self.width, self.height = width, height
        self.x0, self.x1 = x_range
        self.y0, self.y1 = y_range
        if self.x1 <= self.x0:  # one x value: centre it
            self.x0, self.x1 = self.x0 - 1.0, self.x0 + 1.0
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1.0

    def px(self, x: float) -> float:
        span = self.width - _LEFT - _RIGHT
        return round(_LEFT + (x - self.x0) / (self.x1 - self.x0) * span, 1)

    def py(self, y: float) -> float:
        span = self.height - _TOP - _BOTTOM
        return round(self.height - _BOTTOM - (y - self.y0) / (self.y1 - self.y0) * span, 1)


def _text(x: float, y: float, body: str, *, anchor: str = "middle", size: int = 12, extra: str = "") -> str:
    return (f'<text x="{x}" y="{y}" text-anchor="{anchor}" font-size="{size}" fill="#333" {extra}>'
            f"{escape(body)}</text>")


def _axes(frame: _Frame, y_ticks: list[float], x_ticks: Sequence[tuple[float, str]], x_label: str,
          y_label: str) -> list[str]:
    """Grid lines, tick labels and axis titles."""
    out = []
    left, right = _LEFT, frame.width - _RIGHT
    bottom = frame.height - _BOTTOM
    for tick in y_ticks:
        y = frame.py(tick)
        out.append(f'<line x1="{left}" y1="{y}" x2="{right}" y2="{y}" stroke="#e6e6e6"/>')
        out.append(_text(left - 8, y + 4, format_number(tick), anchor="end", size=11))
    for x_value, label in x_ticks:
        x = frame.px(x_value)
        out.append(f'<line x1="{x}" y1="{bottom}" x2="{x}" y2="{bottom + 5}" stroke="#999"/>')
        out.append(_text(x, bottom + 18, label, size=11))
    out.append(f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#999"/>')
    out.append(f'<line x1="{left}" y1="{_TOP}" x2="{left}" y2="{bottom}" stroke="#999"/>')
    out.append(_text((left + right) / 2, frame.height - 12, x_label, size=12, extra='class="x-label"'))
    mid_y = (_TOP + bottom) / 2
    out.append(_text(18, mid_y, y_label, size=12, extra=f'class="y-label" transform="rotate(-90 18 {mid_y})"'))
    return out


def _legend(entries: Sequence[tuple[str, str]], width: int) -> list[str]:
    """Swatches and names along the top, right-aligned."""
    out, x = [], float(width - _RIGHT)
    for name, color in reversed(entries):
        text_width = 7.8 * len(name) + 10
        x -= text_width + 16
        out.append(f'<g class="legend-entry"><rect x="{x:.1f}" y="14" width="12" height="12" rx="2" '
                   f'fill="{color}"/>{_text(round(x + 17, 1), 24.5, name, anchor="start", size=12)}</g>')
    return out


def _svg(width: int, height: int, title: str, body: list[str]) -> str:
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} {height}" '
            f'width="100%" preserveAspectRatio="xMidYMid meet" role="img" aria-label="{escape(title)}" {_FONT}>')
    heading = _text(_LEFT, 24, title, anchor="start", size=14, extra='font-weight="600" class="chart-title"')
    return "\n".join([head, f"<title>{escape(title)}</title>", heading, *body, "</svg>"])


def _value_range(series: Sequence[Series], y_min: float | None, y_max: float | None) -> tuple[float, float]:
    values = [v for s in series for seq in (s.y, s.low or (), s.high or (), s.mid or ()) for v in seq
              if math.isfinite(v)]
    values += [v for v in (y_min, y_max) if v is not None]
    if not values:
        return 0.0, 1.0
    low, high = min(values), max(values)
    pad = (high - low) * 0.05 or abs(high) * 0.1 or 1.0
    return (low if y_min is not None else low - pad), (high if y_max is not None else high + pad)


def _path(points: list[tuple[float, float]], css: str, color: str, extra: str = "") -> str:
    d = " ".join(f"{'M' if i == 0 else 'L'}{x},{y}" for i, (x, y) in enumerate(points))
    return f'<path class="{css}" d="{d}" fill="none" stroke="{color}" {extra}/>'


def _series_shapes(s: Series, frame: _Frame, half_width: float) -> list[str]:
    """Band, lines and markers of one series."""
    xs = [frame.px(x) for x in s.x]
    out = []
    if s.low is not None and s.high is not None and xs:
        upper = [(x, frame.py(h)) for x, h in zip(xs, s.high)]
        lower = [(x, frame.py(lo)) for x, lo in zip(xs, s.low)]
        if len(xs) == 1:  # a band of one point: a short bar around it
            (x, top), (_, bottom) = upper[0], lower[0]
            upper, lower = [(x - half_width, top), (x + half_width, top)], [(x - half_width, bottom),
                                                                             (x + half_width, bottom)]
        ring = upper + list(reversed(lower))
        points = " ".join(f"{x},{y}" for x, y in ring)
        out.append(f'<polygon class="band" points="{points}" fill="{s.color}" fill-opacity="0.15" '
                   f'stroke="none"><title>{escape(s.name)}: min-max range</title></polygon>')
    if s.mid is not None and xs:
        out.append(_path([(x, frame.py(m)) for x, m in zip(xs, s.mid)], "median", s.color,
                         'stroke-width="1.5" stroke-dasharray="5 4" stroke-opacity="0.9"'))
    if xs:
        out.append(_path([(x, frame.py(y)) for x, y in zip(xs, s.y)], "line", s.color,
                         'stroke-width="2.5" stroke-linejoin="round"'))
    for i, (x, y) in enumerate(zip(xs, s.y)):
        tip = s.tips[i] if i < len(s.tips) else f"{s.name}: {format_number(y)}"
        out.append(f'<circle class="point" cx="{x}" cy="{frame.py(y)}" r="3.5" fill="#fff" stroke="{s.color}" '
                   f'stroke-width="2"><title>{escape(tip)}</title></circle>')
    return out


def line_chart(series: Sequence[Series], *, title: str, x_label: str, y_label: str,
               x_ticks: Sequence[tuple[float, str]] = (), y_min: float | None = None,
               y_max: float | None = None, width: int = 900, height: int = 320) -> str:
    """A line chart with optional min-max bands; ``y_min``/``y_max`` pin the value axis (shared scales)."""
    drawn = [s for s in series if len(s.x)]
    xs = [x for s in drawn for x in s.x]
    y_low, y_high = _value_range(drawn, y_min, y_max)
    y_ticks = nice_ticks(y_low, y_high)
    y_low = y_low if y_min is not None else min(y_ticks)
    y_high = y_high if y_max is not None else max(y_ticks)
    y_ticks = [t for t in y_ticks if y_low - 1e-9 <= t <= y_high + 1e-9] or y_ticks
    x_pad = (max(xs) - min(xs)) * 0.03 if xs else 0.0
    frame = _Frame(width, height, (min(xs) - x_pad, max(xs) + x_pad) if xs else (0.0, 1.0), (y_low, y_high))
    gaps = sorted({b - a for a, b in zip(sorted(set(xs)), sorted(set(xs))[1:])})
    half_width = max(4.0, (frame.px(frame.x0 + gaps[0]) - frame.px(frame.x0)) * 0.2) if gaps else 12.0
    body = _axes(frame, y_ticks, x_ticks, x_label, y_label)
    if not drawn:
        body.append(_text(width / 2, height / 2, "no data", size=14, extra='fill-opacity="0.6"'))
    for s in drawn:
        body.extend(_series_shapes(s, frame, half_width))
    body.extend(_legend([(s.name, s.color) for s in series], width))
    return _svg(width, height, title, body)


def bar_chart(bars: Sequence[Bar], *, title: str, x_label: str, y_label: str, width: int = 900,
              height: int = 280, max_labels: int = 24) -> str:
    """Stacked vertical bars from zero, one rect per part, coloured by group; see the module contract."""
    high = max((b.total for b in bars), default=1.0) or 1.0
    y_ticks = nice_ticks(0.0, high * 1.05)
    frame = _Frame(width, height, (0.0, float(max(len(bars), 1))), (0.0, max(y_ticks)))
    slot = (width - _LEFT - _RIGHT) / max(len(bars), 1)
    every = max(1, math.ceil(len(bars) / max_labels))
    body = _axes(frame, y_ticks, [(i + 0.5, b.label) for i, b in enumerate(bars) if i % every == 0], x_label,
                 y_label)
    if not bars:
        body.append(_text(width / 2, height / 2, "no data", size=14, extra='fill-opacity="0.6"'))
    bar_width = max(1.0, round(min(slot * 0.72, 56.0), 1))
    groups: dict[str, str] = {}
    for i, b in enumerate(bars):
        x = round(frame.px(i + 0.5) - bar_width / 2, 1)
        base = 0.0
        for group, color, value in b.parts:
            groups.setdefault(group, color)
            value = value if math.isfinite(value) else 0.0
            top, bottom = frame.py(base + value), frame.py(base)
            base += value
            tip = b.tip or f"{b.label}: {format_number(b.total)}"
            body.append(f'<rect class="bar" x="{x}" y="{top}" width="{bar_width}" '
                        f'height="{round(bottom - top, 1)}" fill="{color}"><title>{escape(group)}: '
                        f'{escape(format_number(value))} ({escape(tip)})</title></rect>')
    body.extend(_legend(list(groups.items()), width))
    return _svg(width, height, title, body)
