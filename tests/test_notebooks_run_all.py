"""Run All, the way a reader runs a chapter in JupyterLab: a notebook top to bottom in a fresh kernel with nbclient,
flagged cells included. `make nbtest` (nbdev_test with the `slow` flag, in a TMPDIR of its own, checked for leftovers)
already runs every other cell of every chapter, so Run All runs the chapters holding cells nbdev_test skips on this
machine (`#| eval: false`, `#| gpu` without CUDA): no cell may fail (GPU-only cells must say what they would do and
skip on a CPU machine), nothing may be left behind in the repository or in the kernel's temp dir, and each chapter must
finish within its time budget. What else differs under a kernel, the `__main__` guards of the CLIs (JupyterLab's kernel
runs cells as `__main__` with `-f` in argv), is checked on every chapter's source."""
import re, subprocess, time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((REPO / "nbs").glob("*.ipynb"))
SKIPPED_BY_NBDEV_TEST = re.compile(r"^#\|\s*(eval:\s*false|gpu)\b", re.M)   # cells `make nbtest` does not run here


def _cells(nb: Path) -> list[str]:
    return ["".join(c["source"]) for c in nbformat.read(nb, as_version=4).cells if c.cell_type == "code"]


NOTEBOOKS = [nb for nb in CHAPTERS if any(SKIPPED_BY_NBDEV_TEST.search(src) for src in _cells(nb))]
BUDGET_S = 420          # per chapter on a 2-core CI machine (the three run here take under a minute each)


def _repo_state() -> set[str]:
    "Every path git sees, ignored ones included (a chapter writing runs/ or a stray file is caught), minus bytecode caches."
    out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return {l for l in out.splitlines() if "__pycache__" not in l and ".pyc" not in l and ".ipynb_checkpoints" not in l}


def test_every_chapter_is_collected():
    assert len(CHAPTERS) >= 12 and all(nb.name[:2].isdigit() or nb.name == "index.ipynb" for nb in CHAPTERS)
    assert {"01d_data", "06_loss"} <= {nb.stem for nb in NOTEBOOKS}, NOTEBOOKS   # an eval: false and a gpu cell


def test_main_guards_hold_under_a_kernel():
    "A CLI's `__main__` guard must not fire in JupyterLab's kernel, whose cells run as `__main__` (11_train once did)."
    bad = [f"{nb.name}: {line.strip()}" for nb in CHAPTERS for src in _cells(nb) for line in src.splitlines()
           if re.match(r"\s*if __name__ == .__main__.", line) and '"ipykernel" not in sys.modules' not in line]
    assert not bad, "guard with `and \"ipykernel\" not in sys.modules`:\n" + "\n".join(bad)


def test_main_guards_come_last():
    "A module's `__main__` guard is its last statement: a definition after it is missing when the CLI runs (09b once)."
    import ast
    late = []
    for py in sorted((REPO / "dflash_nb").glob("*.py")):
        body = ast.parse(py.read_text()).body
        guards = [i for i, node in enumerate(body) if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        if guards and guards[-1] != len(body) - 1: late.append(f"{py.name}: {ast.unparse(body[guards[-1] + 1])[:60]}")
    assert not late, "defined after the `__main__` guard (move the guard's cell last):\n" + "\n".join(late)


@pytest.mark.slow
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_run_all_in_a_fresh_kernel(nb, tmp_path, monkeypatch):
    tmp = tmp_path / "kernel-tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))           # the kernel's tempfile.* land here: we can see leftovers
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = _repo_state()
    # IPC sockets under tmp_path, not TCP ports: kernels started at the same moment by parallel test workers would
    # otherwise race for the same free port ("Kernel died before replying to kernel_info")
    km = KernelManager(kernel_name="python3", transport="ipc", ip=str(tmp_path / "kernel-ipc"))
    client = NotebookClient(nbformat.read(nb, as_version=4), km=km, timeout=BUDGET_S, kernel_name="python3",
                            resources={"metadata": {"path": str(nb.parent)}})
    t0 = time.perf_counter()
    try:
        client.execute()                              # raises CellExecutionError naming the cell on any failure
    finally:
        took = time.perf_counter() - t0
        if km.has_kernel: km.shutdown_kernel()        # a km we pass in is ours to stop (its atexit hooks run then)
    assert took < BUDGET_S, f"{nb.name} took {took:.0f} s (budget {BUDGET_S} s)"
    assert _repo_state() == before, f"{nb.name} left files behind: {sorted(_repo_state() ^ before)[:10]}"
    left = [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]   # torch's compile cache is not ours
    assert not left, f"{nb.name} left temp files/dirs behind: {left[:10]}"
