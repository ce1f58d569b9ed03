"""Import directions of DESIGN.md: tree/ and drafter/ are pure torch and independent."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "vllm_dartree"
FORBIDDEN = {
    "tree": ("vllm.", "transformers", "vllm_dartree.drafter", "vllm_dartree.engine",
             "vllm_dartree.reference", "triton"),
    "drafter": ("vllm.", "vllm_dartree.tree.", "vllm_dartree.engine", "vllm_dartree.reference",
                "triton"),
    "reference": ("vllm.", "vllm_dartree.engine", "triton"),
    "attention": ("vllm.", "transformers", "vllm_dartree.engine", "vllm_dartree.drafter", "triton"),
    "bench": ("vllm.", "vllm_dartree.engine"),
    "zoo": ("vllm.", "vllm_dartree.engine"),
}


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("sub", sorted(FORBIDDEN))
def test_pure_packages_import_nothing_forbidden(sub):
    files = sorted((PKG / sub).rglob("*.py"))
    assert files
    for f in files:
        for name in _imports(f):
            dotted = name + "."
            bad = [p for p in FORBIDDEN[sub] if dotted.startswith(p) or dotted.startswith(p + ".")]
            assert not bad, f"{f.relative_to(PKG.parent)} imports {name}"


def test_only_the_dispatch_module_reaches_the_kernels():
    for f in sorted(PKG.rglob("*.py")):
        if f.name == "ops.py":
            continue
        assert not any(n.startswith("vllm_dartree.csrc_triton") for n in _imports(f)), f


def test_every_module_declares_all():
    for f in sorted(PKG.rglob("*.py")) + sorted((PKG.parent / "csrc_triton").glob("*.py")):
        tree = ast.parse(f.read_text())
        targets = [t.id for n in tree.body if isinstance(n, ast.Assign)
                   for t in n.targets if isinstance(t, ast.Name)]
        targets += [n.target.id for n in tree.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        assert "__all__" in targets, f"{f} has no __all__"


@pytest.mark.parametrize("module", ["vllm_dartree.attention", "vllm_dartree.ops",
                                    "vllm_dartree.tree", "vllm_dartree.drafter",
                                    "vllm_dartree.reference", "vllm_dartree.testing",
                                    "vllm_dartree.config"])
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    """No import cycle depends on which subpackage a user imports first."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
