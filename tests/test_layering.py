"""The house's layering, checked on the source: `engine/` and `reference/` do not import
`bench/`; the data pipeline and the trainer do not import each other; library code does not
raise SystemExit (only command-line `main`s and `__main__` modules end the process); the
console command is declared."""

import ast
from pathlib import Path

import vllm_dartree

ROOT = Path(vllm_dartree.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_engine_and_reference_do_not_import_bench():
    for folder in ("engine", "reference"):
        for path in (ROOT / folder).glob("*.py"):
            bad = {m for m in _imports(path) if m.startswith("vllm_dartree.bench")}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_zoo_data_and_train_do_not_import_each_other():
    assert "vllm_dartree.zoo.train" not in _imports(ROOT / "zoo" / "data.py")
    assert "vllm_dartree.zoo.data" not in _imports(ROOT / "zoo" / "train.py")


def test_library_code_does_not_raise_system_exit():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
                    func.name == "main":
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Raise) and node.exc is not None:
                    target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                    if isinstance(target, ast.Name) and target.id == "SystemExit":
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} "
                                         f"({func.name})")
    assert not offenders, offenders


def test_console_command_is_installed():
    from importlib.metadata import entry_points
    (command,) = entry_points(group="console_scripts", name="vllm-dartree")
    assert command.value == "vllm_dartree.engine.cli:main"
