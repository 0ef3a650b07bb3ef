"""A module's head says what it needs (issue 45, "dependencies at the top"): its imports of the package's own modules
(`from .x import`, `from dflash_nb.x import`, `import dflash_nb.x`) sit at module level, in the chapter's exported
import cell. One inside a function stays only where the import order forces it (a later chapter, see
test_chapter_order.py) or a heavy optional dependency does (triton, vLLM, ...), and says which in a trailing comment on
its line. At most a quarter of them may sit inside functions."""
import ast
from pathlib import Path

from test_chapter_order import _dflash_module

REPO = Path(__file__).resolve().parents[1]
MAX_INSIDE = 0.25


def own_imports(source: str) -> tuple[list[int], list[int]]:
    "(lines of module-level own-package imports, lines of those inside a function) of one module's `source`."
    top, inside = [], []
    def walk(node, in_function):
        for c in ast.iter_child_nodes(node):
            if isinstance(c, (ast.Import, ast.ImportFrom)) and any(_dflash_module(c, a) for a in c.names):
                (inside if in_function else top).append(c.lineno)
            walk(c, in_function or isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    walk(ast.parse(source), False)
    return top, inside


def uncommented(source: str, lines: list[int]) -> list[int]:
    "The lines among `lines` with no trailing `# reason`."
    text = source.splitlines()
    return [n for n in lines if "#" not in text[n - 1].split("import", 1)[1]]


def scanned() -> list[Path]:
    return [p for p in sorted((REPO / "dflash_nb").glob("*.py")) if p.name != "_modidx.py"]


def test_own_imports_sit_at_module_heads():
    n_top, n_inside, bad = 0, 0, []
    for p in scanned():
        source = p.read_text()
        top, inside = own_imports(source)
        n_top, n_inside = n_top + len(top), n_inside + len(inside)
        bad += [f"dflash_nb/{p.name}:{n}" for n in uncommented(source, inside)]
    print(f"own-package imports: {n_top} at module level, {n_inside} inside functions "
          f"({n_inside / (n_top + n_inside):.0%})")
    assert n_inside <= MAX_INSIDE * (n_top + n_inside), f"{n_inside} of {n_top + n_inside} inside functions"
    assert not bad, ("an own-package import inside a function says why on its line (# later chapter ..., "
                     "# optional: ...), or moves to the module's head:\n" + "\n".join(bad))


def test_the_check_sees_an_uncommented_import_inside_a_function():
    source = ("from .config import opt\nimport dflash_nb.storage\nimport json\n"
              "def f():\n    from dflash_nb.target import load_target   # later chapter\n"
              "    from .model import DrafterConfig\n    import json\n"
              "class A:\n    def g(self):\n        from dflash_nb import records\n")
    top, inside = own_imports(source)
    assert (top, inside) == ([1, 2], [5, 6, 10])
    assert uncommented(source, inside) == [6, 10]
