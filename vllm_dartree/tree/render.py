"""Pictures of draft trees (host side, for demos, logs and debugging): text (`format_tree`)
and SVG (`render_svg`: trees side by side, tokens as text, each node shaded by its path
probability, the accepted path highlighted; no plotting library needed)."""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass

from vllm_dartree.tree.structure import TreeBatch

__all__ = ["format_tree", "Panel", "layout", "render_svg"]


def format_tree(
    tree: TreeBatch,
    r: int = 0,
    token_name: Callable[[int], str] = str,
    accepted: set[int] | None = None,
    root_name: str = "root",
) -> str:
    """Request r's tree, one node per line, children under their parent, best first.

    Nodes in `accepted` are marked with `*`; each line shows the token, the depth and the
    path score (log-probability under the drafter).
    """
    n = int(tree.num_nodes[r])
    parents = tree.parents[r, :n].tolist()
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    accepted = accepted or set()
    lines = [root_name]

    def visit(node: int, prefix: str) -> None:
        kids = children.get(node, [])
        for j, c in enumerate(kids):
            last = j == len(kids) - 1
            mark = "*" if c in accepted else " "
            name = token_name(int(tree.tokens[r, c]))
            lines.append(f"{prefix}{'└─' if last else '├─'}{mark}{name}"
                         f"  (d{int(tree.depths[r, c])}, {float(tree.scores[r, c]):.2f})")
            visit(c, prefix + ("   " if last else "│  "))

    visit(-1, "")
    return "\n".join(lines)


NODE_W, NODE_H, GAP_X, GAP_Y, MARGIN, TITLE_H = 62, 26, 8, 22, 16, 40


@dataclass
class Panel:
    """One tree to draw: request 0 of `tree`, its accepted node indices, labels."""
    title: str
    tree: TreeBatch
    accepted: list[int]
    token_text: dict[int, str]     # token id -> what to print
    root_text: str


def layout(parents: list[int]) -> tuple[list[float], list[int]]:
    """(x slot, depth) of every node of a parent list (-1 = the root): leaves take
    consecutive slots in depth-first order (children in index order = best first), parents
    sit over the middle of their children; the root is not included."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    x = [0.0] * len(parents)
    depth = [0] * len(parents)
    slot = 0

    def visit(node: int, d: int) -> float:
        nonlocal slot
        kids = children.get(node, [])
        if node >= 0:
            depth[node] = d
        if not kids:
            here = float(slot)
            slot += 1
        else:
            xs = [visit(c, d + 1) for c in kids]
            here = (xs[0] + xs[-1]) / 2
        if node >= 0:
            x[node] = here
        return here

    visit(-1, 0)
    return x, depth


def _shade(p: float) -> str:
    """White (p = 0) to blue (p = 1), with a square root so that small p stay visible."""
    t = math.sqrt(max(0.0, min(1.0, p)))
    r, g, b = (int(255 + (c - 255) * t) for c in (33, 102, 172))
    return f"#{r:02x}{g:02x}{b:02x}"


def _xml(text: str) -> str:
    """Escaped for XML, with the characters XML 1.0 forbids (control bytes a tokenizer may
    decode to) written as \\xNN."""
    clean = "".join(c if c in "\t\n\r" or 0x20 <= ord(c) < 0xD800 or 0xE000 <= ord(c) < 0xFFFE
                    or ord(c) > 0xFFFF else f"\\x{ord(c):02x}" for c in text)
    return html.escape(clean)


def _label(text: str, limit: int = 9) -> str:
    text = text.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "␣")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _panel_svg(panel: Panel, ox: float) -> tuple[list[str], float, float]:
    n = int(panel.tree.num_nodes[0])
    parents = panel.tree.parents[0, :n].tolist()
    tokens = panel.tree.tokens[0, :n].tolist()
    scores = panel.tree.scores[0, :n].tolist()
    xs, depths = layout(parents)
    slots = max([int(v) for v in xs] + [0]) + 1
    width = slots * (NODE_W + GAP_X) - GAP_X
    height = (max(depths + [0]) + 1) * (NODE_H + GAP_Y) - GAP_Y
    root_x = (min(xs) + max(xs)) / 2 if n else 0.0

    def pos(slot_x: float, d: int) -> tuple[float, float]:
        return (ox + slot_x * (NODE_W + GAP_X) + NODE_W / 2,
                MARGIN + TITLE_H + d * (NODE_H + GAP_Y) + NODE_H / 2)

    on_path = set(panel.accepted)
    out = [f'<text class="title" x="{ox:.1f}" y="{MARGIN + 16}">{_xml(panel.title)}'
           f"</text>"]
    for i, p in enumerate(parents):                                   # edges first
        x1, y1 = pos(root_x, 0) if p < 0 else pos(xs[p], depths[p])
        x2, y2 = pos(xs[i], depths[i])
        cls = "edge accepted" if i in on_path and (p < 0 or p in on_path) else "edge"
        out.append(f'<line class="{cls}" x1="{x1:.1f}" y1="{y1 + NODE_H / 2:.1f}" '
                   f'x2="{x2:.1f}" y2="{y2 - NODE_H / 2:.1f}"/>')
    nodes = [(-1, root_x, 0, panel.root_text, 1.0)] + [
        (i, xs[i], depths[i], panel.token_text.get(tokens[i], str(tokens[i])),
         math.exp(scores[i]) if math.isfinite(scores[i]) else 0.0) for i in range(n)]
    for i, sx, d, text, prob in nodes:
        cx, cy = pos(sx, d)
        cls = "node root" if i < 0 else ("node accepted" if i in on_path else "node")
        tip = "root" if i < 0 else f"node {i}, depth {d}, path probability {prob:.3f}"
        out.append(f'<g class="{cls}"><title>{_xml(tip)}</title>'
                   f'<rect x="{cx - NODE_W / 2:.1f}" y="{cy - NODE_H / 2:.1f}" '
                   f'width="{NODE_W}" height="{NODE_H}" rx="5" '
                   f'fill="{"#f0f0f0" if i < 0 else _shade(prob)}"/>'
                   f'<text x="{cx:.1f}" y="{cy + 4:.1f}" '
                   f'fill="{"#fff" if i >= 0 and prob > 0.45 else "#000"}">'
                   f'{_xml(_label(text))}</text></g>')
    return out, width, height


def render_svg(panels: list[Panel], caption: str = "") -> str:
    """The panels side by side as one SVG document."""
    parts, ox, top = [], float(MARGIN), 0.0
    for panel in panels:
        body, width, height = _panel_svg(panel, ox)
        parts += body
        ox += max(width, 8 * len(panel.title)) + 3 * MARGIN
        top = max(top, height)
    total_w, total_h = ox, MARGIN + TITLE_H + top + MARGIN + (24 if caption else 0)
    style = ("text{font-family:DejaVu Sans Mono,monospace;font-size:11px;text-anchor:middle}"
             ".title{font-size:14px;font-weight:bold;text-anchor:start}"
             ".caption{font-size:11px;text-anchor:start;fill:#444}"
             ".node rect{stroke:#777;stroke-width:1}"
             ".node.accepted rect{stroke:#e66101;stroke-width:3}"
             ".node.accepted text{font-weight:bold}"
             ".node.root rect{stroke:#000;stroke-width:1.5}"
             ".edge{stroke:#bbb;stroke-width:1}.edge.accepted{stroke:#e66101;stroke-width:3}")
    cap = (f'<text class="caption" x="{MARGIN}" y="{total_h - MARGIN:.1f}">'
           f"{_xml(caption)}</text>" if caption else "")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0f}" '
            f'height="{total_h:.0f}" viewBox="0 0 {total_w:.0f} {total_h:.0f}">'
            f'<style>{style}</style><rect width="100%" height="100%" fill="white"/>'
            + "".join(parts) + cap + "</svg>\n")
