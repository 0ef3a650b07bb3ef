"""The chapters read in dependency order: a module of dflash_nb/ imports, when it is imported, only modules of earlier
chapters (nbs/*.ipynb in name order; each notebook's `#| default_exp` names its module). Imports inside functions run
when called and may reach later chapters. And no chapter imports another chapter's (or kernels/') private names."""
import ast, re
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "nbs").glob("*.ipynb"))


def chapter_of_module() -> dict[str, int]:
    "module name (e.g. 'model') -> position of the notebook that exports it."
    out = {}
    for i, nb in enumerate(NOTEBOOKS):
        m = re.search(r"#\|\s*default_exp\s+([\w.]+)", nb.read_text())
        if m: out[m.group(1)] = i
    return out


def _dflash_module(node: ast.ImportFrom | ast.Import, alias: ast.alias | None = None) -> str | None:
    "The dflash_nb submodule an import names ('model' for `from .model import x`, `from dflash_nb import model`, ...)."
    if isinstance(node, ast.Import):
        parts = alias.name.split(".")
        return parts[1] if parts[0] == "dflash_nb" and len(parts) > 1 else None
    if node.level:                                     # relative: the package is dflash_nb
        return node.module.split(".")[0] if node.module else alias.name
    parts = (node.module or "").split(".")
    if parts[0] != "dflash_nb": return None
    return parts[1] if len(parts) > 1 else alias.name


def import_time_imports(tree: ast.AST) -> list[tuple[int, str]]:
    "(line, dflash_nb submodule) of every import that runs at import time: not inside a function (class bodies do run)."
    out = []
    def walk(node):
        for c in ast.iter_child_nodes(node):
            if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)): continue
            if isinstance(c, (ast.Import, ast.ImportFrom)):
                out.extend((c.lineno, m) for a in c.names if (m := _dflash_module(c, a)))
            walk(c)
    walk(tree)
    return out


def private_imports(tree: ast.AST) -> list[tuple[int, str, str]]:
    "(line, module, name, level) of every `from <dflash_nb or kernels module> import _name` in `tree` (functions included)."
    out = []
    for c in ast.walk(tree):
        if not isinstance(c, ast.ImportFrom): continue
        mod = c.module or ""
        if not (c.level or mod.split(".")[0] in ("dflash_nb", "kernels")): continue
        out.extend((c.lineno, mod, a.name, c.level) for a in c.names if a.name.startswith("_") and a.name != "__future__")
    return out


def notebook_code(nb: Path) -> str:
    "The code cells of a notebook as one module (IPython magics and shell lines commented out)."
    cells = [c.source for c in nbformat.read(nb, as_version=4).cells if c.cell_type == "code"]
    return "\n".join(re.sub(r"(?m)^(\s*)([%!])", r"\1#\2", s) for s in cells)


def test_the_chapter_map_is_complete():
    chapters = chapter_of_module()
    modules = {p.stem for p in (REPO / "dflash_nb").glob("*.py")} - {"__init__", "_modidx"}
    assert modules <= set(chapters), f"modules without a notebook: {sorted(modules - set(chapters))}"
    assert chapters["config"] < chapters["data"] < chapters["model"] < chapters["target"] < chapters["trainer"]


def test_modules_import_only_earlier_chapters_at_import_time():
    chapters, bad = chapter_of_module(), []
    for mod, pos in chapters.items():
        path = REPO / "dflash_nb" / f"{mod}.py"
        for line, dep in import_time_imports(ast.parse(path.read_text())):
            if dep in chapters and chapters[dep] >= pos and dep != mod:
                bad.append(f"dflash_nb/{mod}.py:{line} imports {dep} ({NOTEBOOKS[chapters[dep]].name}) at import time, "
                           f"a later chapter than {NOTEBOOKS[pos].name}")
    assert not bad, "\n".join(bad)


def test_the_order_check_sees_a_late_import():
    "The check itself: a module-level import of a later chapter is found, one inside a function is not."
    tree = ast.parse("from .target import x\nimport dflash_nb.trainer\nclass A:\n    from dflash_nb import loss\n"
                     "def f():\n    from dflash_nb.export import y\n")
    assert import_time_imports(tree) == [(1, "target"), (2, "trainer"), (4, "loss")]


def test_no_private_cross_chapter_imports():
    chapters, bad = chapter_of_module(), []
    for path in sorted((REPO / "dflash_nb").glob("*.py")) + sorted((REPO / "kernels").glob("*.py")):
        own = path.stem if path.parent.name == "dflash_nb" else "kernels"
        for line, mod, name, level in private_imports(ast.parse(path.read_text())):
            if own == "kernels" and level: continue            # kernels/ is one package: its files share privates
            if mod.split(".")[-1] != own: bad.append(f"{path.relative_to(REPO)}:{line} imports {name} from {mod or '.'}")
    for nb in NOTEBOOKS:
        own = {m for m, i in chapters.items() if NOTEBOOKS[i] == nb}
        for line, mod, name, _ in private_imports(ast.parse(notebook_code(nb))):
            if mod.split(".")[-1] not in own: bad.append(f"nbs/{nb.name}: imports {name} from {mod}")
    assert not bad, "private names are a chapter's own; give them a public name:\n" + "\n".join(bad)


def import_graph() -> dict[str, set[str]]:
    "module -> the dflash_nb modules it imports anywhere (at import time or inside a function)."
    chapters = chapter_of_module()
    graph = {}
    for mod in chapters:
        tree = ast.parse((REPO / "dflash_nb" / f"{mod}.py").read_text())
        deps = {m for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names if (m := _dflash_module(n, a)) in chapters and m != mod}
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    "Every import cycle of `graph`, each as a path that returns to its first module."
    found = []
    def walk(path):
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == path[0]: found.append(path + [nxt])
            elif nxt not in path and nxt > path[0]: walk(path + [nxt])   # each cycle once, from its smallest module
    for start in sorted(graph): walk([start])
    return found


def test_no_import_cycle_even_inside_functions():
    "A later chapter may be imported inside a function, but never by a module it imports: one direction per pair."
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_check_sees_a_cycle():
    test_graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(test_graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


INTRO = re.compile(r"\*\*Needs:\*\*(.*?)\.\s+\*\*Used by:\*\*(.*?)\.(?:\s|$)", re.S)
CHAPTER_NAME = re.compile(r"`(\d\d[a-z]?_\w+)`")


def chapter_needs() -> dict[str, set[str]]:
    "chapter -> the chapters it imports from: anywhere in its module, or in its code cells when it exports none."
    chapters, graph = chapter_of_module(), import_graph()
    out = {}
    for i, nb in enumerate(NOTEBOOKS):
        mods = [m for m, j in chapters.items() if j == i]
        if mods: deps = set().union(*(graph[m] for m in mods))
        else: deps = {m for n in ast.walk(ast.parse(notebook_code(nb))) if isinstance(n, (ast.Import, ast.ImportFrom))
                      for a in n.names if (m := _dflash_module(n, a)) in chapters}
        out[nb.stem] = {NOTEBOOKS[chapters[m]].stem for m in deps} - {nb.stem}
    return out


def intro_lists(text: str) -> tuple[set[str], set[str]] | None:
    "The chapters a first cell's `**Needs:** … **Used by:** …` line names, or None without one."
    m = INTRO.search(text)
    return (set(CHAPTER_NAME.findall(m[1])), set(CHAPTER_NAME.findall(m[2]))) if m else None


def test_each_chapter_says_what_it_needs_and_what_uses_it():
    "Each chapter's first cell names the chapters it imports from and the chapters that import it, as the code does."
    needs, bad = chapter_needs(), []
    used = {c: {u for u, n in needs.items() if c in n} for c in needs}
    for nb in NOTEBOOKS:
        if not nb.stem[:2].isdigit(): continue   # index.ipynb is the front page
        first = nbformat.read(nb, as_version=4).cells[0].source
        said = intro_lists(first)
        if said is None: bad.append(f"nbs/{nb.name}: the first cell has no '**Needs:** … **Used by:** …' line")
        elif said != (needs[nb.stem], used[nb.stem]):
            bad.append(f"nbs/{nb.name}: says needs {sorted(said[0])}, used by {sorted(said[1])}; the code: needs "
                       f"{sorted(needs[nb.stem])}, used by {sorted(used[nb.stem])}")
    assert not bad, "\n".join(bad)


def test_the_intro_line_is_read_as_written():
    text = "# X\n\n> what\n\n**Needs:** `00a_config`, `03_masks`. **Used by:** `08h_trainer` (`block_loss`, …). More."
    assert intro_lists(text) == ({"00a_config", "03_masks"}, {"08h_trainer"})
    assert intro_lists("**Needs:** no other chapter. **Used by:** no other chapter imports it.") == (set(), set())
    assert intro_lists("# X\n\n> what") is None
