"""Grouped bar charts as standalone SVG: benchmarks write one next to their JSON, with no
plotting library to install."""

from __future__ import annotations

from html import escape

COLORS = ("#2f6fb0", "#e07b39", "#5a9e4b", "#9467bd", "#8c564b")


def bar_chart(title: str, series: dict[str, dict[str, float]], unit: str) -> str:
    """`series`: bar label -> {group: value}. Each group (a metric) gets one bar per label,
    scaled to that group's largest value, with the value printed above the bar."""
    labels = list(series)
    groups = list(dict.fromkeys(g for values in series.values() for g in values))
    bar_w, gap, top, height = 26, 50, 50, 180
    group_w = len(labels) * bar_w + gap
    width = max(420, 60 + len(groups) * group_w + 160)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + height + 60}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for gi, group in enumerate(groups):
        peak = max((series[lab].get(group, 0.0) for lab in labels), default=0.0) or 1.0
        x0 = 50 + gi * group_w
        for li, lab in enumerate(labels):
            value = series[lab].get(group)
            if value is None:
                continue
            h = height * value / peak
            x, y = x0 + li * bar_w, top + height - h
            out.append(
                f'<rect x="{x}" y="{y:.1f}" width="{bar_w - 4}" height="{h:.1f}" '
                f'fill="{COLORS[li % len(COLORS)]}"/>'
            )
            out.append(
                f'<text x="{x + (bar_w - 4) / 2}" y="{y - 3:.1f}" text-anchor="middle" '
                f'font-size="9">{value:.4g}</text>'
            )
        out.append(
            f'<text x="{x0 + len(labels) * bar_w / 2}" y="{top + height + 16}" '
            f'text-anchor="middle">{escape(group)}</text>'
        )
    legend_x = 60 + len(groups) * group_w
    for li, lab in enumerate(labels):
        y = top + 14 * li
        out.append(
            f'<rect x="{legend_x}" y="{y}" width="10" height="10" '
            f'fill="{COLORS[li % len(COLORS)]}"/>'
        )
        out.append(f'<text x="{legend_x + 14}" y="{y + 9}">{escape(lab)}</text>')
    out.append(f'<text x="10" y="{top + height + 40}" fill="#555">{escape(unit)}</text>')
    out.append("</svg>")
    return "\n".join(out)
