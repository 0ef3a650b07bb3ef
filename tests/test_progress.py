"""What a user sees: progress lines with elapsed time, rate and ETA when the output is not a terminal (and never `nan`),
the trainer's projected cost, reruns of the demo that just work, and outputs that tell the truth (sample counts, the
attention backend record, readable exports, error messages that fit the input and come in the order a user can act
on)."""
import contextlib, io, json, re, stat, subprocess, sys
import pytest
from _trainer_common import make_data, train_cfg, env, REPO


def test_lines_with_eta_when_piped():
    "A process whose stderr is a pipe prints a start line, periodic lines with elapsed, rate and ETA, and an end line."
    code = ("import time\nfrom dflash_nb.progress import progress\n"
            "for _ in progress(range(8), desc='work', unit='items', warmup=1): time.sleep(0.15)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(DFLASH_PROGRESS_EVERY="0.3"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert lines[0] == "work: started (8 items) | elapsed 0:00 | — | ETA —", lines
    periodic = [l for l in lines[1:-1] if l.startswith("work: ")]
    assert len(periodic) >= 2, lines                                    # about one every 0.3 s over ~1.2 s
    measured = r"\d/8 items \(\d+%\) \| elapsed 0:0\d \| [\d.]+ items/s \| ETA 0:0\d"
    assert any(re.search(measured, l) for l in periodic), lines
    assert lines[-1].startswith("work: done 8/8 items (100%) | elapsed"), lines
    assert "nan" not in p.stderr.lower()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "train", n=24)


def test_training_progress_eta_and_cost_when_piped(tmp_path, data_dir, monkeypatch, capsys):
    """Piped, training prints step lines with elapsed and ETA ('—' before a rate is measured, never nan), progress
    lines, and after the first interval the projected cost, which summary.json keeps."""
    from dflash_nb.trainer import train
    monkeypatch.setenv("DFLASH_PROGRESS_EVERY", "0")
    monkeypatch.setenv("DFLASH_PROGRESS", "auto")                      # capsys's stderr is no terminal: lines
    run_dir = tmp_path / "run"
    train(train_cfg(run_dir, data_dir, steps=6, log_every=2))
    out, err = capsys.readouterr()
    assert "nan" not in (out + err).lower()
    steps = [l for l in out.splitlines() if l.startswith("step ")]
    assert len(steps) == 3 and all("elapsed " in l and " ETA " in l for l in steps), steps
    assert steps[0].endswith("ETA —") and re.search(r"ETA \d+:\d\d$", steps[1]), steps   # 3 warm-up steps left out
    assert "train: started (6 steps)" in err and "train: done 6/6 steps (100%)" in err, err
    assert re.search(r"train: [1-5]/6 steps \(\d+%\) \| elapsed \d:\d\d \| .* \| ETA ", err), err
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert recs[0]["eta_s"] is None and isinstance(recs[1]["eta_s"], float) and recs[1]["eta_s"] >= 0
    # the projection: printed once, kept in summary.json
    assert out.count("projected: 6 steps ≈") == 1 and "bound by the " in out, out
    cost = json.loads((run_dir / "summary.json").read_text())["cost"]
    assert cost["step_s"] > 0 and cost["total_s"] == pytest.approx(cost["step_s"] * 6)
    rows = cost["steps_per_epoch"] * 2
    assert rows == int(rows) and rows >= 1                               # whole packed rows per epoch, 2 rows per step
    assert cost["bound"] == ("target" if cost["target_busy"] >= cost["drafter_busy"] else "drafter")
    assert cost["balanced_anchors_per_row"] == max(1, round(8 * cost["target_busy"] / cost["drafter_busy"]))
    assert "proportional" in cost["assumption"]
    # a CPU run records its backend choice like a probed one
    rec = json.loads((run_dir / "attention_backend.json").read_text())
    assert rec["backend"] == "sdpa" and rec["reason"].startswith("CPU") and rec["probed"] is False


def _main(*argv) -> tuple[int, str, str]:
    "`python -m dflash_nb.train` in this process: (exit status, stdout, stderr)."
    from dflash_nb.train import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


# the demo, made tiny: fewer and shorter completions, a few steps, τ on a few held-out samples
TINY_DEMO = ["regenerate.max_prompts=10", "regenerate.heldout=3", "regenerate.max_new_tokens=16", "train.steps=2",
             "train.log_every=1", "evaluate.num_samples=3"]


@pytest.fixture(scope="module")
def demo_twice(tmp_path_factory):
    "The demo run twice in a row with the same settings, as `make demo` twice would."
    first = tmp_path_factory.mktemp("runs") / "demo"
    a = _main(*TINY_DEMO, f"train.run_dir={first}")
    stamp = {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()}
    b = _main(*TINY_DEMO, f"train.run_dir={first}")
    return first, a, b, stamp


@pytest.mark.slow   # shares the demo_twice fixture: two tiny demo runs, ~70 s on a loaded 2-core machine
def test_demo_runs_twice(demo_twice):
    "A second demo writes to the next free dir, says so in one line, reuses the completions, leaves the first alone."
    first, (rc1, out1, err1), (rc2, out2, err2), stamp = demo_twice
    assert rc1 == 0, out1[-3000:] + err1[-3000:]
    assert rc2 == 0, out2[-3000:] + err2[-3000:]
    second = first.with_name("demo-2")
    said = [l for l in out2.splitlines() if "holds an earlier demo run" in l]
    assert len(said) == 1 and f"this run writes to {second}" in said[0], out2[:2000]
    assert f"reused the completions regenerated earlier in {first / 'generated'}" in out2
    assert "regenerate train.jsonl (generating): started" in err1
    assert "regenerate train.jsonl" not in err2                          # no second generation
    assert (second / "generated" / "train.jsonl").read_text() == (first / "generated" / "train.jsonl").read_text()
    assert json.loads((second / "report.json").read_text())["run_dir"] == str(second)
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()} == stamp   # the first run is untouched
    # every long step showed its progress
    for what in ("loading the target (tiny): started", "tokenize 1 file(s): started", "train: started (2 steps)",
                 "acceptance length: started", "export: done"):
        assert what in err1, (what, err1[-3000:])


@pytest.mark.slow   # shares the demo_twice fixture: two tiny demo runs, ~70 s on a loaded 2-core machine
def test_run_over_earlier_checkpoints_fails_before_any_work(demo_twice):
    "A configured run (not the demo) over a run dir with checkpoints stops at once, before regenerating anything."
    first, _, _, _ = demo_twice
    from dflash_nb.train import demo_config_path
    before = (first / "generated" / "train.jsonl").stat().st_mtime_ns
    rc, out, err = _main("--config", str(demo_config_path()), *TINY_DEMO, f"train.run_dir={first}")
    assert rc == 2 and "already holds checkpoints" in err and "train.resume=auto" in err, err
    assert "loading the target" not in err and "regenerate" not in err
    assert (first / "generated" / "train.jsonl").stat().st_mtime_ns == before


@pytest.mark.slow   # shares the demo_twice fixture: two tiny demo runs, ~70 s on a loaded 2-core machine
def test_console_and_report_count_the_same_samples(demo_twice):
    "The τ line names the number of held-out samples actually measured, the number report.json keeps."
    first, (_, out, _), _, _ = demo_twice
    report = json.loads((first / "report.json").read_text())
    n = re.search(r"tau before training: [\d.]+ on (\d+) held-out samples", out).group(1)
    assert int(n) == report["tau_before"]["samples"] == report["tau_after"]["samples"], (n, report["tau_before"])


@pytest.mark.slow   # shares the demo_twice fixture: two tiny demo runs, ~70 s on a loaded 2-core machine
def test_every_run_dir_records_its_attention_backend(demo_twice):
    first, _, _, _ = demo_twice
    for d in (first, first.with_name("demo-2")):
        rec = json.loads((d / "attention_backend.json").read_text())
        assert rec["backend"] == "sdpa" and rec["device"] == "cpu", rec


@pytest.mark.slow   # shares the demo_twice fixture: two tiny demo runs, ~70 s on a loaded 2-core machine
def test_exported_files_are_readable_by_others(demo_twice):
    first, _, _, _ = demo_twice
    files = sorted((first / "drafter").iterdir())
    assert {p.name for p in files} >= {"config.json", "model.safetensors"}
    for p in files: assert stat.S_IMODE(p.stat().st_mode) & 0o044 == 0o044, (p.name, oct(p.stat().st_mode))


def test_missing_target_is_named_before_the_tokenizer():
    """With neither the target nor its tokenizer present, the first error is the target, the thing to fix first (the
    config's CUDA devices moved to the CPU: on a machine without that GPU the devices are named first, before any path)."""
    rc, _, err = _main("--config", str(REPO / "configs" / "qwen3-8b-1gpu.yaml"), "train.devices=[[cpu, cpu]]")
    assert rc == 2 and err.strip().splitlines()[-1].startswith("python -m dflash_nb.train: error: train.target.path "), err
    assert "tokenizer" not in err.splitlines()[-1]


def test_config_key_typo_suggests_the_near_key():
    rc, _, err = _main("train.stepz=3")
    assert rc == 2 and "unknown config key train.stepz — did you mean steps?" in err, err
