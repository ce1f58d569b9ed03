"""Tree pictures: the SVG layout puts every leaf in its own slot and every parent over its
children; the document is valid XML with one node per tree node (+ the root), the accepted
path marked, darker shades for likelier paths."""

import math
import xml.etree.ElementTree as ET

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dartree.tree.render import Panel, _shade, layout, render_svg
from vllm_dartree.tree.structure import TreeBatch

NS = "{http://www.w3.org/2000/svg}"


@st.composite
def parent_lists(draw):
    n = draw(st.integers(1, 40))
    return [draw(st.integers(-1, i - 1)) for i in range(n)]


@given(parent_lists())
@settings(max_examples=200, deadline=None)
def test_layout_slots_leaves_and_centres_parents(parents):
    x, depth = layout(parents)
    children = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    leaves = [i for i in range(len(parents)) if i not in children]
    assert sorted(x[i] for i in leaves) == list(map(float, range(len(leaves))))
    for node, kids in children.items():
        if node >= 0:   # depth = the row: the root's children are row 1
            assert x[node] == (x[kids[0]] + x[kids[-1]]) / 2
            assert all(depth[k] == depth[node] + 1 for k in kids)
        else:
            assert all(depth[k] == 1 for k in kids)


def _tree():
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    parents = torch.tensor([[-1, -1, 0, 0, 2]])
    depths = torch.tensor([[1, 1, 2, 2, 3]])
    scores = torch.log(torch.tensor([[0.6, 0.3, 0.4, 0.1, 0.2]]))
    return TreeBatch(tokens, parents, depths, scores, torch.tensor([5]))


def test_render_svg_marks_the_accepted_path():
    names = {5: " the", 6: "a", 7: "\n", 8: "x" * 20, 9: "<&>"}
    svg = render_svg([Panel("DARTree", _tree(), [0, 2, 4], names, "root"),
                      Panel("DDTree", _tree(), [], names, "root")], caption="c")
    root = ET.fromstring(svg)
    groups = [g for g in root.iter(f"{NS}g")]
    assert len(groups) == 2 * 6
    accepted = [g for g in groups if "accepted" in g.get("class")]
    assert len(accepted) == 3
    edges = [e for e in root.iter(f"{NS}line") if "accepted" in e.get("class")]
    assert len(edges) == 3
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "␣the" in texts and "⏎" in texts and "<&>" in texts and "xxxxxxxx…" in texts


def test_shade_darkens_with_probability():
    levels = [_shade(p) for p in (0.0, 0.1, 0.5, 1.0)]
    brightness = [sum(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in levels]
    assert brightness == sorted(brightness, reverse=True) and levels[0] == "#ffffff"
    assert not math.isnan(sum(brightness))
