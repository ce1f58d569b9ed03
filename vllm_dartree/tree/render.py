"""Text pictures of draft trees (host side, for demos, logs and debugging)."""

from __future__ import annotations

from collections.abc import Callable

from vllm_dartree.tree.structure import TreeBatch

__all__ = ["format_tree"]


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
