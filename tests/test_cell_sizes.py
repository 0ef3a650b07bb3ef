"""Exported cells stay the size a reader takes in at once: the median exported cell of all notebooks is at most 15 lines,
and a cell over 60 lines is named below with the reason it stays whole (split the others: one definition per cell,
a class method by method with the package's own `patch`, dflash_nb.config). `make lint` prints the same report
(`python tests/test_cell_sizes.py`); a cell's lines are its source without the `#|` directives."""
import ast, json, re, statistics, sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
MAX_MEDIAN, LONG, MAX_LINES = 15, 40, 60
EXPORT = re.compile(r"^#\|\s*export[is]?\b")

# (notebook, the cell's first definition) -> why the cell is longer than MAX_LINES
EXCEPTIONS = {
    ("06_loss", "_ChunkedLinearCE"): "one autograd.Function: its backward mirrors its forward chunk by chunk, read together",
    ("09a_decoding", "speculative_generate"): "the decoding loop, one cycle's draft, verify, accept and cache rollback in order",
    ("11_train", "run"): "the project's top-level phases in order (target, data, tau before, train, tau after, export), "
                         "one set of devices, target and report shared by all",
}


class Cell(NamedTuple):
    notebook: str   # file stem, e.g. "05_model"
    name: str       # the first definition (def/class/assignment) in the cell, else its first line
    lines: int      # lines of source, directives and trailing blank lines left out


def cell_name(body: str) -> str:
    "The first name a cell defines: a def, a class or an assigned name; else its first non-blank line."
    try: tree = ast.parse(re.sub(r"(?m)^(\s*)([%!])", r"\1#\2", body))
    except SyntaxError: tree = None
    for node in (tree.body if tree else []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): return node.name
    for node in (tree.body if tree else []):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            t = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(t, ast.Tuple): t = t.elts[0]
            if isinstance(t, ast.Name): return t.id
    return next((l.strip() for l in body.splitlines() if l.strip()), "")


def exported_cells(nb_path: Path) -> list[Cell]:
    "Every exported code cell of one notebook with its size."
    out = []
    for c in json.loads(nb_path.read_text())["cells"]:   # plain JSON: nbformat's validation costs seconds here
        if c["cell_type"] != "code": continue
        src = c["source"]
        lines = ("".join(src) if isinstance(src, list) else src).splitlines()
        if not any(EXPORT.match(l) for l in lines if l.startswith("#|")): continue
        body = [l for l in lines if not l.startswith("#|")]
        while body and not body[-1].strip(): body.pop()
        out.append(Cell(nb_path.stem, cell_name("\n".join(body)), len(body)))
    return out


def all_cells(nbs: Path = REPO / "nbs") -> list[Cell]:
    return [c for p in sorted(nbs.glob("*.ipynb")) for c in exported_cells(p)]


def problems(cells: list[Cell], exceptions: dict = EXCEPTIONS) -> list[str]:
    "What breaks the rule: a median over MAX_MEDIAN, a long cell not named, an exception that no longer applies."
    out = []
    med = statistics.median(c.lines for c in cells) if cells else 0
    if med > MAX_MEDIAN: out.append(f"the median exported cell is {med:g} lines, more than {MAX_MEDIAN}")
    long = {(c.notebook, c.name): c for c in cells if c.lines > MAX_LINES}
    for key, c in long.items():
        if key not in exceptions:
            out.append(f"nbs/{c.notebook}.ipynb: the cell of `{c.name}` is {c.lines} lines (over {MAX_LINES}): split it "
                       f"or name it in EXCEPTIONS with its reason")
    for key in exceptions:
        if key not in long: out.append(f"EXCEPTIONS names {key}, which is no longer over {MAX_LINES} lines: remove it")
    return out


def report(cells: list[Cell]) -> str:
    ns = [c.lines for c in cells]
    longest = max(cells, key=lambda c: c.lines)
    return (f"exported cells: {len(ns)}, median {statistics.median(ns):g} lines (at most {MAX_MEDIAN}), "
            f"{sum(n > LONG for n in ns)} over {LONG}, {sum(n > MAX_LINES for n in ns)} over {MAX_LINES} "
            f"({len(EXCEPTIONS)} named exceptions), longest {longest.lines} (nbs/{longest.notebook}.ipynb `{longest.name}`)")


def test_exported_cells_are_short():
    cells = all_cells()
    assert len(cells) > 100, cells
    bad = problems(cells)
    assert not bad, report(cells) + "\n" + "\n".join(bad)


def test_exceptions_say_why():
    assert all(len(reason.split()) >= 5 for reason in EXCEPTIONS.values())


def test_the_counter_sees_long_cells_and_directives(tmp_path):
    "The check itself, on a notebook made here: directives are not counted, a long unnamed cell is reported."
    sources = ["#| export\n#| hide\nX = 1\n\ndef f():\n    return X\n\n", "#| export\nclass Big:\n" + "    a = 1\n" * 70,
               "f()  # not exported\n" * 80]
    cells = [{"cell_type": "code", "source": s.splitlines(keepends=True)} for s in sources]
    (tmp_path / "01_x.ipynb").write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": "# x"}, *cells]}))
    cells = exported_cells(tmp_path / "01_x.ipynb")
    assert cells == [Cell("01_x", "f", 4), Cell("01_x", "Big", 71)]
    assert problems(cells, exceptions={}) == [
        "the median exported cell is 37.5 lines, more than 15",
        "nbs/01_x.ipynb: the cell of `Big` is 71 lines (over 60): split it or name it in EXCEPTIONS with its reason"]
    assert problems(cells, exceptions={("01_x", "Big"): "why", ("01_x", "gone"): "why"})[1:] == [
        "EXCEPTIONS names ('01_x', 'gone'), which is no longer over 60 lines: remove it"]


if __name__ == "__main__":
    cells = all_cells()
    print(report(cells))
    bad = problems(cells)
    for line in bad: print(line)
    sys.exit(1 if bad else 0)
