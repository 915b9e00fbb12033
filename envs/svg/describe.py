"""What an SVG drawing shows, in words: its elements with shape, colour, place and size.

Reads a root that :func:`worldloop.envs.svg.render.validate_svg` has accepted (nothing here parses
untrusted text on its own) and describes it for the SVG env's state and prompts.

Public API::

    describe_svg(root, max_elements=64) -> dict  # {"viewbox": [x,y,w,h], "elements": [...]}
    element_sentence(e, viewbox) -> str          # "a red circle centered at (25, 25) with radius 15 ..."
    color_name(value) -> str | None              # nearest colour word of a CSS colour
    parse_color(value) -> (r, g, b) | None       # CSS colour (#rgb, #rrggbb, rgb(), common names)
"""

from __future__ import annotations

import math
import re
from xml.etree import ElementTree as ET

import numpy as np

# the validator's number pattern and tag-name helper: a description reads numbers as it checks them
from worldloop.envs.svg.render import _NUM_RE, _local

_CSS_COLORS = {
    "black": "#000000", "white": "#ffffff", "gray": "#808080", "grey": "#808080", "silver": "#c0c0c0",
    "red": "#ff0000", "maroon": "#800000", "orange": "#ffa500", "gold": "#ffd700", "yellow": "#ffff00",
    "green": "#008000", "lime": "#00ff00", "olive": "#808000", "teal": "#008080", "cyan": "#00ffff",
    "aqua": "#00ffff", "blue": "#0000ff", "navy": "#000080", "purple": "#800080", "magenta": "#ff00ff",
    "fuchsia": "#ff00ff", "pink": "#ffc0cb", "brown": "#a52a2a", "darkgray": "#a9a9a9",
    "lightgray": "#d3d3d3", "darkgreen": "#006400", "darkblue": "#00008b", "darkred": "#8b0000",
    "skyblue": "#87ceeb", "violet": "#ee82ee", "indigo": "#4b0082", "crimson": "#dc143c",
    "tomato": "#ff6347", "coral": "#ff7f50", "salmon": "#fa8072", "khaki": "#f0e68c",
    "beige": "#f5f5dc", "tan": "#d2b48c", "chocolate": "#d2691e", "turquoise": "#40e0d0",
}


def parse_color(value: str | None) -> tuple[int, int, int] | None:
    """RGB of a CSS colour (#rgb, #rrggbb, rgb(), common names); None for none/unknown."""
    if not value:
        return None
    v = value.strip().lower()
    if v in ("none", "transparent"):
        return None
    v = _CSS_COLORS.get(v, v)
    if v.startswith("#"):
        h = v[1:]
        if len(h) == 3 and all(c in "0123456789abcdef" for c in h):
            return tuple(int(c * 2, 16) for c in h)
        if len(h) == 6 and all(c in "0123456789abcdef" for c in h):
            return tuple(int(h[i:i + 2], 16) for i in (0, 2, 4))
        return None
    m = re.match(r"rgba?\(([^)]*)\)", v)
    if m:
        parts = [p.strip() for p in m.group(1).split(",")][:3]
        try:
            vals = [float(p[:-1]) * 2.55 if p.endswith("%") else float(p) for p in parts]
        except ValueError:
            return None
        if len(vals) == 3:
            return tuple(int(max(0, min(255, x))) for x in vals)
    return None


def color_name(value: str | None) -> str | None:
    """A colour word for a CSS colour value by hue/saturation/value (None for none/unparsable).

    Achromatic (saturation < 0.1): black, gray, white; else a hue bucket (red, orange, yellow, green,
    cyan, blue, purple, pink; dark orange/red is brown) with "light "/"dark " for pale/dim shades.
    """
    rgb = parse_color(value)
    if rgb is None:
        return None
    r, g, b = (c / 255.0 for c in rgb)
    mx, mn = max(r, g, b), min(r, g, b)
    v, s = mx, (0.0 if mx == 0 else (mx - mn) / mx)
    if s < 0.1 or mx - mn < 0.04:
        return "black" if v < 0.25 else "white" if v > 0.9 else "gray"
    if mx == r:
        h = (60 * (g - b) / (mx - mn)) % 360
    elif mx == g:
        h = 60 * (b - r) / (mx - mn) + 120
    else:
        h = 60 * (r - g) / (mx - mn) + 240
    bounds = ((15, "red"), (40, "orange"), (70, "yellow"), (165, "green"), (195, "cyan"), (255, "blue"),
              (290, "purple"), (345, "pink"), (361, "red"))
    name = next(n for lim, n in bounds if h < lim)
    if name in ("orange", "red") and v < 0.6 and s > 0.3 and not (name == "red" and v > 0.45):
        return "brown"
    if v > 0.85 and s < 0.4:
        return "light " + name
    if v < 0.35:
        return "dark " + name
    return name


def _style_props(el: ET.Element) -> dict[str, str]:
    props = {}
    for part in (el.attrib.get("style") or "").split(";"):
        if ":" in part:
            k, v = part.split(":", 1)
            props[k.strip().lower()] = v.strip()
    for k in ("fill", "stroke", "stroke-width", "opacity", "display"):
        if k in el.attrib and k not in props:
            props[k] = el.attrib[k]
    return props


def _matrix(transform: str | None) -> np.ndarray:
    m = np.eye(3)
    if not transform:
        return m
    for name, args in re.findall(r"(matrix|translate|scale|rotate|skewX|skewY)\s*\(([^)]*)\)", transform):
        a = [float(t) for t in _NUM_RE.findall(args)]
        t = np.eye(3)
        if name == "matrix" and len(a) == 6:
            t = np.array([[a[0], a[2], a[4]], [a[1], a[3], a[5]], [0, 0, 1]])
        elif name == "translate" and a:
            t[0, 2], t[1, 2] = a[0], a[1] if len(a) > 1 else 0.0
        elif name == "scale" and a:
            t[0, 0], t[1, 1] = a[0], a[1] if len(a) > 1 else a[0]
        elif name == "rotate" and a:
            c, s = math.cos(math.radians(a[0])), math.sin(math.radians(a[0]))
            cx, cy = (a[1], a[2]) if len(a) >= 3 else (0.0, 0.0)
            t = np.array([[c, -s, cx - c * cx + s * cy], [s, c, cy - s * cx - c * cy], [0, 0, 1]])
        elif name == "skewX" and a:
            t[0, 1] = math.tan(math.radians(a[0]))
        elif name == "skewY" and a:
            t[1, 0] = math.tan(math.radians(a[0]))
        m = m @ t
    return m


def _path_points(d: str) -> list[tuple[float, float]]:
    """End and control points of a path (absolute), enough for a bounding box."""
    toks = re.findall(r"[MmLlHhVvCcSsQqTtAaZz]|" + _NUM_RE.pattern, d)
    pts: list[tuple[float, float]] = []
    x = y = sx = sy = 0.0
    cmd = None
    i = 0
    arity = {"m": 2, "l": 2, "h": 1, "v": 1, "c": 6, "s": 4, "q": 4, "t": 2, "a": 7, "z": 0}
    while i < len(toks):
        t = toks[i]
        if t.isalpha():
            cmd = t
            i += 1
            if cmd in "Zz":
                x, y = sx, sy
                continue
        if cmd is None:
            break
        n = arity[cmd.lower()]
        nums = []
        for _ in range(n):
            if i >= len(toks) or toks[i].isalpha():
                return pts
            nums.append(float(toks[i]))
            i += 1
        rel = cmd.islower()
        lc = cmd.lower()
        if lc == "h":
            x = x + nums[0] if rel else nums[0]
        elif lc == "v":
            y = y + nums[0] if rel else nums[0]
        elif lc == "a":
            x, y = (x + nums[5], y + nums[6]) if rel else (nums[5], nums[6])
        else:
            pairs = [(nums[k], nums[k + 1]) for k in range(0, n, 2)]
            for px, py in pairs[:-1]:
                pts.append((x + px, y + py) if rel else (px, py))
            px, py = pairs[-1]
            x, y = (x + px, y + py) if rel else (px, py)
        pts.append((x, y))
        if lc == "m":
            sx, sy = x, y
            cmd = "l" if rel else "L"
    return pts


def _num(el: ET.Element, key: str, default: float = 0.0) -> float:
    v = el.attrib.get(key)
    if v is None:
        return default
    m = _NUM_RE.search(v)
    return float(m.group(0)) if m else default


def describe_svg(root: ET.Element, max_elements: int = 64) -> dict:
    """The drawable elements of an SVG with colour words and bounding boxes (viewBox units).

    Returns ``{"viewbox": [x, y, w, h], "elements": [{"shape", "fill", "stroke", "bbox",
    ... "cx","cy","r" for circles ...}]}``; transforms on groups and elements are applied to the
    boxes; ``defs``/``clipPath``/``mask``/``symbol`` content is skipped.
    """
    vb_attr = root.attrib.get("viewBox")
    if vb_attr:
        vb = [float(t) for t in _NUM_RE.findall(vb_attr)][:4]
    else:
        vb = [0.0, 0.0, _num(root, "width", 100.0) or 100.0, _num(root, "height", 100.0) or 100.0]
    out: list[dict] = []

    def walk(el: ET.Element, m: np.ndarray, fill: str | None, stroke: str | None) -> None:
        if len(out) >= max_elements or not isinstance(el.tag, str):
            return
        tag = _local(el.tag)
        if tag in ("defs", "clippath", "mask", "symbol", "pattern", "lineargradient", "radialgradient",
                   "style", "title", "desc", "metadata", "marker", "filter"):
            return
        props = _style_props(el)
        if props.get("display") == "none":
            return
        fill = props.get("fill", fill)
        stroke = props.get("stroke", stroke)
        m = m @ _matrix(el.attrib.get("transform"))
        info = _shape(el, tag)
        if info is not None:
            pts = np.array(info.pop("_pts"), dtype=float).reshape(-1, 2)
            if pts.size:
                hp = np.c_[pts, np.ones(len(pts))] @ m.T
                x0, y0 = hp[:, 0].min(), hp[:, 1].min()
                x1, y1 = hp[:, 0].max(), hp[:, 1].max()
                fill_name = None if tag in ("line", "polyline") and "fill" not in props else color_name(
                    fill if fill is not None else "black")
                info.update({"fill": fill_name, "stroke": color_name(stroke),
                             "bbox": [round(float(v), 1) for v in (x0, y0, x1, y1)]})
                if not np.allclose(m, np.eye(3)):
                    for k in ("cx", "cy", "r", "rx", "ry"):
                        info.pop(k, None)
                out.append(info)
        for child in el:
            walk(child, m, fill, stroke)

    walk(root, np.eye(3), None, None)
    return {"viewbox": [round(v, 2) for v in vb], "elements": out}


def _shape(el: ET.Element, tag: str) -> dict | None:
    if tag == "circle":
        cx, cy, r = _num(el, "cx"), _num(el, "cy"), _num(el, "r")
        return {"shape": "circle", "cx": round(cx, 1), "cy": round(cy, 1), "r": round(r, 1),
                "_pts": [(cx - r, cy - r), (cx + r, cy + r)]}
    if tag == "ellipse":
        cx, cy, rx, ry = _num(el, "cx"), _num(el, "cy"), _num(el, "rx"), _num(el, "ry")
        return {"shape": "ellipse", "cx": round(cx, 1), "cy": round(cy, 1), "rx": round(rx, 1),
                "ry": round(ry, 1), "_pts": [(cx - rx, cy - ry), (cx + rx, cy + ry)]}
    if tag == "rect":
        x, y, w, h = _num(el, "x"), _num(el, "y"), _num(el, "width"), _num(el, "height")
        return {"shape": "rectangle", "_pts": [(x, y), (x + w, y), (x, y + h), (x + w, y + h)]}
    if tag == "line":
        pts = [(_num(el, "x1"), _num(el, "y1")), (_num(el, "x2"), _num(el, "y2"))]
        return {"shape": "line", "_pts": pts}
    if tag in ("polygon", "polyline"):
        nums = [float(t) for t in _NUM_RE.findall(el.attrib.get("points", ""))]
        pts = list(zip(nums[0::2], nums[1::2]))
        name = "polygon" if tag == "polygon" else "polyline"
        if tag == "polygon" and len(pts) == 3:
            name = "triangle"
        return {"shape": name, "_pts": pts}
    if tag == "path":
        return {"shape": "path", "_pts": _path_points(el.attrib.get("d", ""))}
    if tag == "text":
        txt = re.sub(r"[<>]", "", "".join(el.itertext())).strip()[:40]  # no markup in prompts
        x, y = _num(el, "x"), _num(el, "y")
        size = _num(el, "font-size", 16.0)
        return {"shape": "text", "text": txt,
                "_pts": [(x, y - size), (x + 0.6 * size * max(1, len(txt)), y)]}
    return None


def _area(cx: float, cy: float, vb: list[float]) -> str:
    fx = (cx - vb[0]) / vb[2] if vb[2] else 0.5
    fy = (cy - vb[1]) / vb[3] if vb[3] else 0.5
    v = "top" if fy < 1 / 3 else "bottom" if fy > 2 / 3 else "middle"
    h = "left" if fx < 1 / 3 else "right" if fx > 2 / 3 else "center"
    if v == "middle" and h == "center":
        return "in the center"
    if v == "middle":
        return f"on the {h}"
    if h == "center":
        return f"at the {v}"
    return f"at the {v}-{h}"


def _fmt(v: float) -> str:
    return str(int(round(v))) if abs(v - round(v)) < 0.05 else f"{v:.1f}"


def element_sentence(e: dict, viewbox: list[float]) -> str:
    """``"a red circle centered at (25, 25) with radius 15, at the top-left"`` and the like."""
    x0, y0, x1, y1 = e["bbox"]
    color = e.get("fill") or (f"{e['stroke']} outlined" if e.get("stroke") else "")
    if e.get("fill") and e.get("stroke") and e["stroke"] != e["fill"]:
        color += f" {e['stroke']}-outlined"
    shape = e["shape"]
    head = f"a {color} {shape}".replace("  ", " ") if color else f"a {shape}"
    if shape == "text":
        head += f" '{e.get('text', '')}'"
    if shape == "circle" and "r" in e:
        geo = f"centered at ({_fmt(e['cx'])}, {_fmt(e['cy'])}) with radius {_fmt(e['r'])}"
    elif shape == "ellipse" and "rx" in e:
        geo = f"centered at ({_fmt(e['cx'])}, {_fmt(e['cy'])}) with radii {_fmt(e['rx'])} and {_fmt(e['ry'])}"
    elif shape == "line":
        geo = f"from ({_fmt(x0)}, {_fmt(y0)}) to ({_fmt(x1)}, {_fmt(y1)})"
    else:
        geo = f"spanning ({_fmt(x0)}, {_fmt(y0)}) to ({_fmt(x1)}, {_fmt(y1)})"
    return f"{head} {geo}, {_area((x0 + x1) / 2, (y0 + y1) / 2, viewbox)}"
