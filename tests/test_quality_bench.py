"""bench/quality.py stays runnable: a one-variant smoke run (tiny data, a few steps) writes the JSON the full bench writes.
Its statistics are the library's (dflash_nb.report: Welch's t against a textbook value, the paired t, the bootstrap on
known differences), tested by chapter 12_report's examples."""
import json, subprocess, sys
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


def test_real_lm_prompts_hold_out_whole_topics():
    train, held = quality.prompts_for(1280, 152, quality.REAL_TEMPLATES)       # the real-LM protocol's sizes
    assert len(train) == 1280 and len(held) == 152 >= 150
    text = lambda ps: " ".join(p[0]["content"] for p in ps)
    held_topics = {t for t in quality.TOPICS if t in text(held)}
    train_topics = {t for t in quality.TOPICS if t in text(train)}
    assert len(held_topics) == 10 and not held_topics & train_topics   # no training prompt names a held-out topic
    assert not any(t in text(train) for t in quality.REAL_EXTRA_HELD_TOPICS)   # the real LM's extra held-out topics
    assert len({p[0]["content"].split(" ")[0] for p in held}) >= 6    # varied requests, not one template


def test_variant_overrides_scale_the_setup_and_gamma():
    setup = quality.SETUPS["smollm2"]
    before = json.dumps(setup)
    assert quality.variant_config(setup, quality.VARIANTS["anchors_x4"])["max_anchors"] == 4 * setup["train"]["max_anchors"]
    assert quality.variant_config(setup, quality.VARIANTS["gamma_x2"])["gamma"] == 2 * 4.0   # block 8: γ = 4 by default
    d = quality.variant_config(setup, quality.VARIANTS["distill"])
    assert d["loss"] == {"weighting": "decay", "distill_weight": 0.5} and d["optim"] == setup["train"]["optim"]
    assert quality.variant_config(setup, quality.VARIANTS["dpace"])["loss"] == {"weighting": "dpace"}
    assert quality.variant_config(setup, quality.VARIANTS["base"])["loss"] == {"weighting": "decay"}   # pinned
    assert quality.variant_config(setup, quality.VARIANTS["lr_x2"])["optim"]["lr"] == 2 * setup["train"]["optim"]["lr"]
    assert json.dumps(setup) == before                                # the setup itself is never changed
    assert quality.curve_steps(100, 5) == [20, 40, 60, 80, 100] and quality.curve_steps(10, 3) == [3, 6, 9, 10]


def test_results_merge_keeps_other_setups_and_replaces_reruns(tmp_path):
    def run(setup, variant, seed, tau):
        return dict(setup=setup, variant=variant, seed=seed, tau=tau, per_sample_tau=[tau, tau], per_position=[0.1],
                    train_wall_s=1.0, drafter_busy=0.5, target_layers_run=2, target_layers=3)
    def result(runs, protocol):
        setups = list(dict.fromkeys(r["setup"] for r in runs))
        return dict(what="x", runs=runs, summary=quality.summarize(runs, setups, ["base", "distill"]),
                    setups={s: {} for s in setups}, protocol=protocol)
    out = tmp_path / "q.json"
    quality.write_merged(out, result([run("demo", "base", 0, 1.5), run("demo", "base", 1, 1.7)], {"demo": {"steps": 9}}))
    m = quality.write_merged(out, result([run("smollm2", "base", 0, 1.1)], {"smollm2": {"steps": 5}}))
    assert [r["setup"] for r in m["runs"]] == ["demo", "demo", "smollm2"] and m["summary"]["demo"]["base"]["tau_mean"] == 1.6
    m = quality.write_merged(out, result([run("smollm2", "base", 0, 1.2), run("smollm2", "distill", 0, 1.3)],
                                         {"smollm2": {"steps": 5}}))
    assert m["summary"]["smollm2"]["base"]["taus"] == [1.2] and m["summary"]["smollm2"]["distill"]["diff_pct"] > 0
    m = quality.write_merged(out, result([run("smollm2", "base", 1, 1.0)], {"smollm2": {"steps": 50}}))
    assert [(r["setup"], r["seed"]) for r in m["runs"]] == [("demo", 0), ("demo", 1), ("smollm2", 1)]   # new protocol
    assert json.loads(out.read_text()) == m
