"""The prose names only what exists: every repository path (`bench/x.py`, `tests/…`, `nbs/…`), script (`x.sh`, `x.py`),
chapter (`08d_build`), command (`dflash-…`) and make target (`make x`) that the book's markdown, README.md or
bench/results/README.md mentions is in the repository now. A renamed or deleted file otherwise leaves prose that sends
the reader nowhere. A path whose parts are placeholders in capitals (`nbs/X.ipynb`) or that is marked "(removed)" is
not a reference; `*` in a path is a glob that must match something."""
import fnmatch, json, re, subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = ("bench", "tests", "nbs", "dflash_nb", "kernels", "locks", "configs", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*[\w*])" % "|".join(re.escape(t) for t in TOP))
REMOVED = re.compile(r"`?\s*\(removed\)")
SCRIPT = re.compile(r"(?<![\w./*-])([\w-]+\.(?:py|sh|ipynb))\b")
CHAPTER = re.compile(r"`(\d\d[a-z]?_[a-z][a-z0-9_]*)`")
COMMAND = re.compile(r"(?<![\w/.-])(dflash-[a-z][\w-]*[a-z0-9])")
MAKE = re.compile(r"`make ([\w-]+)")
PLACEHOLDER = re.compile(r"(^|[/_])[A-Z]+(\.\w+)?$")


def tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()


def prose(path: Path) -> str:
    "The markdown of a notebook, or a markdown file's text."
    if path.suffix == ".md": return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def dangling(text: str, files: list[str]) -> list[str]:
    "The mentions in `text` of paths, scripts, chapters, commands and make targets this repository does not have."
    dirs = {str(p) for f in files for p in Path(f).parents}
    names = {Path(f).name for f in files}
    chapters = {Path(f).stem for f in files if f.startswith("nbs/") and f.endswith(".ipynb")}
    commands = set(re.findall(r"(dflash-[\w-]+)=", (REPO / "settings.ini").read_text()))
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    bad = []
    for m in PATH.finditer(text):
        p = m.group(1).rstrip("/.")
        if PLACEHOLDER.search(p) or p in dirs or REMOVED.match(text, m.end()): continue
        if not (fnmatch.filter(files, p) if "*" in p else p in files): bad.append(p)
    bad += [m.group(1) for m in SCRIPT.finditer(text) if m.group(1) not in names and not PLACEHOLDER.search(m.group(1))]
    bad += [m.group(1) for m in CHAPTER.finditer(text) if m.group(1) not in chapters]
    bad += [m.group(1) for m in COMMAND.finditer(text) if m.group(1) not in commands]
    bad += [f"make {m.group(1)}" for m in MAKE.finditer(text) if m.group(1) not in targets]
    return bad


def test_the_prose_names_only_what_exists():
    files = tracked()
    docs = sorted((REPO / "nbs").glob("*.ipynb")) + [REPO / "README.md", REPO / "bench" / "results" / "README.md"]
    bad = {d.relative_to(REPO).as_posix(): got for d in docs if (got := dangling(prose(d), files))}
    assert not bad, f"prose names what the repository does not have: {bad}"


def test_the_checker_finds_what_is_gone():
    "The checker itself, on made-up prose: each kind of stale mention is caught, the live and placeholder ones are not."
    files = ["bench/speedup.py", "nbs/08d_build.ipynb", "bench/results/gpu_check.json", "tests/test_x.py"]
    text = ("see `bench/attention.py` and `bench/speedup.py`, `gpu_check.sh`, chapters `08d_build` and `07z_gone`, "
            "`dflash-nope`, `make nothing-here`, `bench/results/gpu_*.json`, `bench/results/cpu_*.json`, "
            "`nbs/X.ipynb`, `bench/pipeline.py` (removed), `tests/`")
    assert dangling(text, files) == ["bench/attention.py", "bench/results/cpu_*.json", "gpu_check.sh", "07z_gone",
                                     "dflash-nope", "make nothing-here"]
