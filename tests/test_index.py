"""The front page lists every chapter once, in the reading order; the README points to it instead of repeating the list
(nbdev_readme would generate the README from the index, but it needs quarto, which is not installed here)."""
import re
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
CHAPTER = re.compile(r"\b(\d\d[a-z]?_\w+)\.ipynb\b")


def index_chapters() -> list[str]:
    "Notebook names in the index's reading order (the markdown cell headed '## Reading order'), in order."
    nb = nbformat.read(REPO / "nbs" / "index.ipynb", as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## Reading order")]
    assert len(cells) == 1, "nbs/index.ipynb needs exactly one markdown cell starting with '## Reading order'"
    return CHAPTER.findall(cells[0])


def test_the_readme_points_to_the_index_and_names_only_real_chapters():
    "The README sends readers to the index for the chapters instead of repeating its list; the chapters it names exist."
    readme = (REPO / "README.md").read_text()
    assert "nbs/index.ipynb" in readme
    assert not [l for l in readme.splitlines() if l.startswith("| `nbs/")], "the chapter table lives in nbs/index.ipynb"
    on_disk = {p.stem for p in (REPO / "nbs").glob("*.ipynb")}
    named = set(re.findall(r"`(\d\d[a-z]?_\w+)`", readme))
    assert named and named <= on_disk, f"the README names chapters that do not exist: {sorted(named - on_disk)}"


def test_where_a_reader_starts_says_where_pictures_and_the_kernel_live():
    readme = (REPO / "README.md").read_text()
    index = "\n".join(c.source for c in nbformat.read(REPO / "nbs" / "index.ipynb", as_version=4).cells)
    for text in (readme, index):
        assert "nbs/figures.py" in text and "dflash_nb.kernels" in text


def test_every_chapter_is_in_the_reading_order():
    on_disk = sorted(p.stem for p in (REPO / "nbs").glob("*.ipynb") if p.stem != "index")
    index = index_chapters()
    assert len(set(index)) == len(index), f"a chapter is listed twice: {index}"
    assert sorted(index) == on_disk, f"nbs/ holds {on_disk}, the reading order lists {index}"
    assert index == on_disk, f"the reading order is the file-name order (name a chapter by where it is read): {index}"


def test_the_index_exports_nothing_and_keeps_imports_apart():
    nb = nbformat.read(REPO / "nbs" / "index.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert not any("default_exp" in s or "#| export" in s for s in code)
    imports = [s for s in code if any(l.startswith(("import ", "from ")) for l in s.splitlines())]
    assert imports and all(all(l.startswith(("import ", "from ")) for l in s.splitlines() if l.strip()) for s in imports), \
        "imports belong in their own cells (nbdev's tools read them apart from the code)"
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs), \
        "the pipeline picture's output is committed, so the front page reads without running it"


def test_where_to_change_what_names_every_chapter():
    "The index's 'Where to change what' table sorts every chapter into ML core or plumbing, and names only real ones."
    nb = nbformat.read(REPO / "nbs" / "index.ipynb", as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## Where to change what")]
    assert len(cells) == 1, "nbs/index.ipynb needs one markdown cell starting with '## Where to change what'"
    rows = [l for l in cells[0].splitlines() if l.startswith("| ") and l.count("|") == 4][1:]   # after the header
    named = {ch for r in rows for ch in re.findall(r"`(\d\d[a-z]?_\w+)`", r)}
    assert all(r.split("|")[2].strip() in ("ML core", "plumbing") for r in rows), rows
    on_disk = {p.stem for p in (REPO / "nbs").glob("*.ipynb") if p.stem != "index"}
    assert named == on_disk, f"missing: {sorted(on_disk - named)}, not a chapter: {sorted(named - on_disk)}"
