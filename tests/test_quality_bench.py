"""bench/quality.py stays runnable: a one-variant smoke run (tiny data, a few steps) writes the JSON the full bench writes,
and its statistics behave (Welch's t against a textbook value, the bootstrap on known differences)."""
import json, math, subprocess, sys
from pathlib import Path
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import quality


@pytest.mark.slow
def test_smoke_run_writes_the_table_and_json(tmp_path):
    out = tmp_path / "q.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "quality.py"), "--smoke", "--work", str(tmp_path / "w"),
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "demo: tau on held-out samples" in p.stdout and "base" in p.stdout
    r = json.loads(out.read_text())
    (run,) = r["runs"]
    assert run["setup"] == "demo" and run["variant"] == "base" and run["samples"] == len(run["per_sample_tau"]) >= 1
    assert 1.0 <= run["tau"] <= 8 and len(run["per_position"]) == 7 and run["config"]["steps"] == 4
    assert r["summary"]["demo"]["base"]["tau_mean"] == run["tau"]
    assert r["data"]["stats"]["heldout"]["prompts"] == 4


def test_statistics():
    # Welch's t: two samples with a known answer (t = -2.0, df = 4 for equal sizes and variances)
    w = quality.welch([1.0, 2.0, 3.0], [3.0, 4.0, 5.0])
    assert w["t"] == pytest.approx(-2 / math.sqrt(2 / 3))
    assert w["df"] == pytest.approx(4.0)
    assert w["p"] == pytest.approx(0.0704, abs=2e-3)                  # two-sided p of t = -2.449 with 4 df
    assert quality.t_two_sided_p(0.0, 5) == pytest.approx(1.0) and quality.t_two_sided_p(1.96, 1e6) == pytest.approx(0.05, abs=1e-3)
    assert quality.welch([1.0], [2.0, 3.0])["p"] is None
    # the paired bootstrap: a constant improvement is significant, noise around 0 is not
    base = [[1.0, 1.5, 2.0, 1.2] * 10]
    b = quality.paired_bootstrap([[x + 0.3 for x in base[0]]], base)
    assert b["mean_diff"] == pytest.approx(0.3) and b["p"] < 0.01 and b["ci95"][0] == pytest.approx(0.3)
    noisy = quality.paired_bootstrap([[x + (0.2 if i % 2 else -0.2) for i, x in enumerate(base[0])]], base)
    assert noisy["p"] > 0.5 and noisy["ci95"][0] < 0 < noisy["ci95"][1]
