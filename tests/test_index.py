"""The front page and the README cannot drift apart: the README's chapter table, the reading order in nbs/index.ipynb and
the chapters in nbs/ name the same notebooks in the same order (nbdev_readme would generate the README from the index,
but it needs quarto, which is not installed here)."""
import re
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
CHAPTER = re.compile(r"\b(\d\d[a-z]?_\w+)\.ipynb\b")


def readme_chapters() -> list[str]:
    "Notebook names in the README's chapter table (rows starting with | `nbs/...`), in order."
    rows = [l for l in (REPO / "README.md").read_text().splitlines() if l.startswith("| `nbs/")]
    return [m for l in rows for m in CHAPTER.findall(l)]


def index_chapters() -> list[str]:
    "Notebook names in the index's reading order (the markdown cell headed '## Reading order'), in order."
    nb = nbformat.read(REPO / "nbs" / "index.ipynb", as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## Reading order")]
    assert len(cells) == 1, "nbs/index.ipynb needs exactly one markdown cell starting with '## Reading order'"
    return CHAPTER.findall(cells[0])


def test_readme_table_and_index_reading_order_list_the_same_chapters():
    readme, index = readme_chapters(), index_chapters()
    assert len(readme) >= 12, readme
    assert readme == index, f"README table {readme}\n!= index reading order {index}"


def test_every_chapter_is_in_the_reading_order():
    on_disk = sorted(p.stem for p in (REPO / "nbs").glob("*.ipynb") if p.stem != "index")
    index = index_chapters()
    assert len(set(index)) == len(index), f"a chapter is listed twice: {index}"
    assert sorted(index) == on_disk, f"nbs/ holds {on_disk}, the reading order lists {index}"


def test_the_index_exports_nothing_and_keeps_imports_apart():
    nb = nbformat.read(REPO / "nbs" / "index.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert not any("default_exp" in s or "#| export" in s for s in code)
    imports = [s for s in code if any(l.startswith(("import ", "from ")) for l in s.splitlines())]
    assert imports and all(all(l.startswith(("import ", "from ")) for l in s.splitlines() if l.strip()) for s in imports), \
        "imports belong in their own cells (nbdev's tools read them apart from the code)"
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs), \
        "the pipeline picture's output is committed, so the front page reads without running it"
