"""Every exported cell is introduced: it comes right after a markdown sentence saying why, or after an example (a visible
code cell that is not exported) that motivates it, the way fastcore's `01_basics` reads. The share over all chapters is
a ratchet: it may rise, never fall below FLOOR (raise FLOOR when you raise the share). `python tests/test_prose.py`
prints the share per chapter, fewest introduced first, and the longest run of bare exported cells in each."""
import json, re, sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
FLOOR = 0.97           # the share of exported cells that come after prose or an example (measured: see the report)
EXAMPLE_FLOOR = 0.86   # the share of exported cells with an example within the next two cells
WORDS_CEILING = 50     # markdown words per exported cell over the book (fastcore's chapters: 17-28; lower it, never raise)
DIRECTIVE = re.compile(r"^#\|\s*(\w+)")


def kind(cell: dict) -> str:
    "'md' (prose), 'export', 'example' (visible, not exported), 'hidden' (`#| hide`, not exported) or 'empty'."
    src = cell["source"]
    text = "".join(src) if isinstance(src, list) else src
    if not text.strip(): return "empty"
    if cell["cell_type"] == "markdown": return "md"
    if cell["cell_type"] != "code": return "empty"
    directives = {m.group(1) for l in text.splitlines() if (m := DIRECTIVE.match(l))}
    if directives & {"export", "exports", "exporti"}: return "export"
    return "hidden" if "hide" in directives else "example"


class Chapter(NamedTuple):
    name: str
    exported: int      # exported cells
    introduced: int    # of them, right after prose or an example
    shown: int         # of them, with an example within the next two cells
    longest_bare: int  # the longest run of exported cells with nothing before each but another exported or hidden cell


def chapter(nb_path: Path) -> Chapter:
    kinds = [k for k in (kind(c) for c in json.loads(nb_path.read_text())["cells"]) if k != "empty"]
    exported = introduced = shown = run = longest = 0
    for i, k in enumerate(kinds):
        if k != "export": continue
        exported += 1
        if i and kinds[i - 1] in ("md", "example"):
            introduced, run = introduced + 1, 0
        else:
            run += 1
            longest = max(longest, run)
        shown += "example" in kinds[i + 1:i + 3]
    return Chapter(nb_path.stem, exported, introduced, shown, longest)


def chapters(nbs: Path = REPO / "nbs") -> list[Chapter]:
    return [c for c in (chapter(p) for p in sorted(nbs.glob("*.ipynb"))) if c.exported]


def shares(chs: list[Chapter]) -> tuple[float, float]:
    n = sum(c.exported for c in chs)
    return sum(c.introduced for c in chs) / n, sum(c.shown for c in chs) / n


def report(chs: list[Chapter]) -> str:
    intro, shown = shares(chs)
    lines = [f"exported cells: {sum(c.exported for c in chs)}, after prose or an example {intro:.1%} (floor {FLOOR:.0%}), "
             f"with an example within two cells {shown:.1%} (floor {EXAMPLE_FLOOR:.0%})"]
    for c in sorted(chs, key=lambda c: c.introduced / c.exported):
        lines.append(f"  {c.name:<22} {c.introduced:>3}/{c.exported:<3} introduced, {c.shown:>3} shown, "
                     f"longest bare run {c.longest_bare}")
    return "\n".join(lines)


def test_exported_cells_are_introduced():
    chs = chapters()
    intro, shown = shares(chs)
    assert intro >= FLOOR and shown >= EXAMPLE_FLOOR, report(chs)


def test_the_counter(tmp_path):
    "The measure itself, on a notebook made here: prose and examples introduce, a hidden cell does not."
    def cell(kind, text): return {"cell_type": kind, "source": text}
    cells = [cell("markdown", "# x"), cell("code", "#| export\na = 1"), cell("code", "#| export\nb = 2"),
             cell("code", "#| hide\nimport os"), cell("code", "#| export\nc = 3"), cell("code", "b"),
             cell("code", "#| export\nd = 4"), cell("markdown", ""), cell("code", "#| exports\ne = 5")]
    (tmp_path / "01_x.ipynb").write_text(json.dumps({"cells": cells}))
    test = chapter(tmp_path / "01_x.ipynb")
    assert test == Chapter("01_x", exported=5, introduced=2, shown=1, longest_bare=2), test
    assert shares([test]) == (0.4, 0.2)


def markdown_words(nb_path: Path) -> int:
    "Words (whitespace-separated) in a notebook's markdown cells."
    cells = json.loads(nb_path.read_text())["cells"]
    return sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")


def test_the_book_is_terse():
    "Prose says why in a sentence or two per exported cell; the wordiest chapters per exported cell are named on failure."
    words = {p.stem: markdown_words(p) for p in sorted((REPO / "nbs").glob("*.ipynb"))}
    exported = {c.name: c.exported for c in chapters()}
    per_cell = sum(words.values()) / sum(exported.values())
    wordiest = sorted(exported, key=lambda n: -words[n] / exported[n])[:5]
    assert per_cell <= WORDS_CEILING, (f"{sum(words.values())} markdown words, {per_cell:.1f} per exported cell "
                                       f"(ceiling {WORDS_CEILING}); wordiest per cell: "
                                       + ", ".join(f"{n} {words[n] / exported[n]:.0f}" for n in wordiest))


def _without_env(name, fn):
    import os
    saved = os.environ.pop(name, None)
    try: return fn()
    finally:
        if saved is not None: os.environ[name] = saved


# prose that quotes a default: (chapter, the words as written, what the code says)
QUOTED_DEFAULTS = [
    ("05_model", "`n_d` (default 5)", lambda: __import__("dflash_nb.model").model.DrafterConfig().num_hidden_layers),
    ("07a_target", "`n_t` (default 5)", lambda: __import__("dflash_nb.model").model.DrafterConfig().num_target_features),
    ("00c_progress", "between lines (default 15)",
     lambda: _without_env("DFLASH_PROGRESS_EVERY", __import__("dflash_nb.progress").progress.default_every_s)),
    ("08h_trainer", "a bounded queue (depth 2)",
     lambda: __import__("dflash_nb.train_config").train_config.TrainConfig().queue_depth),
]


def test_quoted_defaults_are_the_code_s():
    "A default the prose quotes is the one the code has: change one, and this names the sentence to change with it."
    bad = []
    for stem, words, actual in QUOTED_DEFAULTS:
        text = (REPO / "nbs" / f"{stem}.ipynb").read_text()
        quoted = float(re.search(r"(?:default|depth) (\d+)", words)[1])
        if json.dumps(words)[1:-1] not in text: bad.append(f"nbs/{stem}.ipynb no longer says {words!r}: update QUOTED_DEFAULTS")
        elif float(actual()) != quoted: bad.append(f"nbs/{stem}.ipynb says {words!r}, the code's default is {actual()}")
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    chs = chapters()
    print(report(chs))
    intro, shown = shares(chs)
    sys.exit(0 if intro >= FLOOR and shown >= EXAMPLE_FLOOR else 1)
