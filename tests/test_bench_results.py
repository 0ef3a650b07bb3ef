"""The committed bench results say nothing of the machine they ran on: no absolute path in any string of
bench/results/*.json, because bench/_common.write_json, the one writer every bench uses, makes each path relative to
the repository or cuts it to its last two parts."""
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from _common import write_json   # noqa: E402  (bench/_common.py: the benches' helpers, not a package)

# a path of two parts or more that starts at the root: not a URL's `//host/...`, not `3/5`, not `~/x` or `../x`
ABSOLUTE = re.compile(r"(?<![\w.:/~-])/[\w.+@~-]+/")


def strings(obj):
    "Every string of a JSON value, keys included."
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj: yield from strings(v)
    elif isinstance(obj, str): yield obj


@pytest.mark.parametrize("result", sorted(p.name for p in (REPO / "bench" / "results").glob("*.json")))
def test_a_committed_result_holds_no_machine_path(result):
    found = [s for s in strings(json.loads((REPO / "bench" / "results" / result).read_text())) if ABSOLUTE.search(s)]
    assert not found, f"bench/results/{result} holds absolute paths: {[ABSOLUTE.search(s).group(0) for s in found][:5]}"


def test_the_bench_writer_drops_machine_paths(tmp_path):
    out = write_json(tmp_path / "r.json", {"run_dir": tmp_path / "runs" / "a", "log": f"see {REPO}/bench/x.log",
                                           str(tmp_path / "k"): ["https://docs.pytest.org/en/stable/", "3/5", "/tmp"]})
    got = json.loads(out.read_text())
    assert got == {"run_dir": ".../runs/a", "log": "see bench/x.log",
                   f".../{tmp_path.name}/k": ["https://docs.pytest.org/en/stable/", "3/5", "/tmp"]}, got
    assert not any(ABSOLUTE.search(s) for s in strings(got))


def test_the_bench_annex_stays_small():
    """bench/ holds measurement scripts only (what a test or the library needs lives in the package): at most 12% of the
    lines of dflash_nb, kernels and bench together. nbdev's generated index `_modidx.py` is not code and is not counted."""
    lines = {d: sum(len(p.read_text().splitlines()) for p in (REPO / d).rglob("*") if p.suffix in (".py", ".sh")
                    and p.is_file() and "__pycache__" not in p.parts and not p.is_symlink() and p.name != "_modidx.py")
             for d in ("dflash_nb", "kernels", "bench")}
    share = lines["bench"] / sum(lines.values())
    assert share <= 0.12, f"bench/ is {share:.1%} of the code ({lines}): move what the library or a test needs out of it"
