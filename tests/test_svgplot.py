from __future__ import annotations

import xml.etree.ElementTree as ET

from router.svgplot import bar_chart

NS = "{http://www.w3.org/2000/svg}"


def test_one_bar_per_label_and_group_scaled_to_the_group_peak() -> None:
    svg = bar_chart("t", {"a": {"x": 2.0, "y": 10.0}, "b": {"x": 4.0}}, "unit")
    root = ET.fromstring(svg)
    bars = [r for r in root.iter(f"{NS}rect") if float(r.get("height", "0")) > 10]
    heights = sorted(float(r.get("height", "0")) for r in bars)
    assert heights == [90.0, 180.0, 180.0]  # x: 2 of 4 is half height; y alone is full
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "t" in texts and "unit" in texts and "4" in texts
