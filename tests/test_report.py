"""dflash-report: two demo-sized runs (the real trainer, via dflash_nb.train.run as dflash-train runs it) side by side:
the table holds both runs' numbers from their files, the PNG decodes at the promised size, gaps are one line per run."""
import json, subprocess, sys
from pathlib import Path
import pytest, torch
from PIL import Image
from _trainer_common import make_data, train_dict, env, REPO


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    "Run `a` with τ before/after (report.json); run `b` the trainer alone (no report.json): both tiny, 4 steps."
    from dflash_nb.config import from_dict
    from dflash_nb.train import RunConfig, run
    from dflash_nb.trainer import train
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("report")
    data, held = make_data(root / "data", n=12), make_data(root / "held", n=4, seed=1)
    run(from_dict(RunConfig, {"train": train_dict(root / "a", data, steps=4),
                              "evaluate": {"num_samples": 2, "data_dir": str(held)}, "export": False}))
    from _trainer_common import train_cfg
    train(train_cfg(root / "b", data, steps=4, max_anchors=16))
    return root


def _metrics(run_dir) -> list[dict]:
    "The step records of metrics.jsonl (it also holds event records, e.g. the run's start)."
    recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r]


@pytest.mark.slow   # the two runs take ~35 s on a loaded 2-core machine
def test_report_cli_table_and_picture(two_runs, tmp_path):
    "`dflash-report a b --out x.png`: the table shows each run's own numbers; the PNG decodes, 13 x 7.5 in at --dpi."
    a, b = two_runs / "a", two_runs / "b"
    out = tmp_path / "pics" / "compare.png"
    p = subprocess.run([sys.executable, "-m", "dflash_nb.report", str(a), str(b), "--out", str(out), "--dpi", "110",
                        "--json", str(tmp_path / "rows.json")], cwd=REPO, env=env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    with Image.open(out) as im:
        im.load()
        assert im.format == "PNG" and im.size == (1430, 825)
    lines = p.stdout.splitlines()
    # b has no report.json: one line says so, its training numbers are still in the table
    said = f"{b}: no report.json (no τ before/after: the run did not go through dflash-train's evaluate step)"
    assert [l for l in lines if l.startswith(str(b))] == [said]
    assert not [l for l in lines if l.startswith(str(a))]
    head = next(l for l in lines if l.startswith("run "))
    assert "τ before" in head and "tok/s" in head and "drafter busy" in head
    rows = {l.split()[0]: l.split()[1:] for l in lines if l.split() and l.split()[0] in ("a", "b")}
    report = json.loads((a / "report.json").read_text())
    for name, run_dir in (("a", a), ("b", b)):
        last = _metrics(run_dir)[-1]
        steps, loss, acc1, tau_est, tau_before, tau_after = rows[name][:6]
        assert steps == "4" and loss == f"{last['loss']:.4f}" and acc1 == f"{last['acc'][0]:.3f}"
        assert tau_est == f"{last['tau_est']:.3f}"
    assert rows["a"][4:6] == [f"{report['tau_before']['tau']:.3f}", f"{report['tau_after']['tau']:.3f}"]
    assert rows["b"][4:6] == ["—", "—"]
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert [r["run"] for r in saved["runs"]] == ["a", "b"] and saved["picture"] == str(out)
    # the busy shares are the wall-time-weighted means of the intervals after the first
    ms = _metrics(b)[1:]
    wall = sum(m["wall_s"] for m in ms)
    assert saved["runs"][1]["drafter_busy"] == pytest.approx(sum(m["drafter_busy"] * m["wall_s"] for m in ms) / wall)


@pytest.mark.slow
def test_report_missing_and_damaged(two_runs, tmp_path, capsys):
    "A missing dir, a torn metrics line, no summary: one line per run, the rest reported; nothing at all: exit 2."
    from dflash_nb.report import main, read_run
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "metrics.jsonl").write_text((two_runs / "a" / "metrics.jsonl").read_text() + '{"step": 5, "lo\n')
    res = main([str(two_runs / "a"), str(torn), str(tmp_path / "nope"), "--out", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert f"{tmp_path / 'nope'}: not a directory" in out
    torn_line = next(l for l in out.splitlines() if l.startswith(f"{torn}:"))
    torn_at = len((two_runs / "a" / "metrics.jsonl").read_text().splitlines()) + 1
    assert f"metrics.jsonl: 1 unreadable line(s) skipped, the first at line {torn_at}" in torn_line
    assert "no summary.json" in torn_line
    assert [r["run"] for r in res["rows"]] == ["a", "torn"] and res["rows"][1]["steps"] == 4
    assert read_run(torn).steps == read_run(two_runs / "a").steps
    env_ = {**env(), "COLUMNS": "200"}
    script = Path(sys.executable).parent / "dflash-report"   # the console script (settings.ini console_scripts)
    p = subprocess.run([str(script), str(tmp_path / "nope"), str(tmp_path / "nope2")],
                       cwd=REPO, env=env_, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("dflash-report: error: nothing to report"), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = subprocess.run([sys.executable, "-m", "dflash_nb.report", str(two_runs / "a"), "--dpi", "72"],
                       cwd=REPO, env=env_, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--dpi: must be >= 110, got 72" in p.stderr
