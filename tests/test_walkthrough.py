"""The README's real run (data, train, evaluate, export), command by command, through the installed console scripts, with
the demo's tiny target standing in for a real one: regenerate + tokenize + train from a user's prompt file, tokenize train
and held-out with dflash-data and train on them, compare the runs, evaluate per benchmark file, export."""
import json, subprocess, sys
from pathlib import Path
import pytest, yaml
import pyarrow as pa, pyarrow.parquet as pq
from _trainer_common import env, REPO
from dflash_nb.config import apply_overrides

BIN = Path(sys.executable).parent


def _run(*args, timeout=600) -> subprocess.CompletedProcess:
    "One console script (`dflash-train`, ...) as a user runs it; fails the test with its output on a non-zero exit."
    p = subprocess.run([str(BIN / args[0]), *map(str, args[1:])], cwd=REPO, env={**env(), "OMP_NUM_THREADS": "2"},
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{args[0]} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def _config(tmp_path: Path) -> Path:
    "The demo config made tiny: few steps, short answers, no bundled prompts (the file comes on the command line)."
    from dflash_nb.train import demo_config_path
    cfg = yaml.safe_load(demo_config_path().read_text())
    cfg = apply_overrides(cfg, {"train.steps": 3, "train.log_every": 1, "train.checkpoint": {"every": 3, "keep": 1}})
    cfg["regenerate"] = {"prompts": None, "max_new_tokens": 24, "batch_size": 16, "heldout": 3}
    cfg["evaluate"] = {"num_samples": 3}
    path = tmp_path / "my-target.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow   # eight real command lines end to end: ~2 min on a loaded 2-core machine
@pytest.mark.timeout(1200)
def test_readme_walkthrough(tmp_path):
    from dflash_nb.train import demo_data_dir
    cfg = _config(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((demo_data_dir() / "prompts.jsonl").read_text().splitlines(keepends=True)[:10]))
    run = tmp_path / "runs" / "my-drafter"
    # 2. regenerate, tokenize train and held-out, train, τ before/after, export: one command
    _run("dflash-train", "--config", cfg, f"train.run_dir={run}", f"regenerate.prompts={prompts}",
         "regenerate.heldout=3", "regenerate.max_new_tokens=24", "data.enable_thinking=false")
    assert len((run / "generated" / "train.jsonl").read_text().splitlines()) == 7
    assert len((run / "generated" / "heldout.jsonl").read_text().splitlines()) == 3
    for d in ("train", "heldout"): assert (run / "data" / d / "manifest.json").is_file()
    report = json.loads((run / "report.json").read_text())
    assert report["heldout_data"] == str(run / "data" / "heldout") and report["tau_after"]["samples"] == 3
    assert (run / "drafter" / "config.json").is_file()
    # 2b. answers regenerated elsewhere: tokenize the training and held-out sets with dflash-data, train on them
    from dflash_nb.records import qwen3_tokenizer_dir
    data = tmp_path / "data"
    for name, src in (("train", "train.jsonl"), ("heldout", "heldout.jsonl")):
        _run("dflash-data", "--input", run / "generated" / src, "--tokenizer", qwen3_tokenizer_dir(),
             "--out", data / name, "--workers", "1", "--min-loss-tokens", "8", "--max-degenerate-fraction", "0.5",
             "--chat-template-kwargs", '{"enable_thinking": false}')
    other = tmp_path / "runs" / "other"
    _run("dflash-train", "--config", cfg, f"train.run_dir={other}", f"train.data_dir={data / 'train'}",
         f"evaluate.data_dir={data / 'heldout'}", "data.enable_thinking=false", "export=false")
    assert json.loads((other / "report.json").read_text())["heldout_data"] == str(data / "heldout")
    # 3. compare the runs
    p = _run("dflash-report", run, other, "--out", tmp_path / "compare.png")
    table = [l.split()[0] for l in p.stdout.splitlines() if l.split()]
    assert "my-drafter" in table and "other" in table and (tmp_path / "compare.png").stat().st_size > 10_000
    # 4. evaluate per benchmark, files as published (a GSM8K parquet, MT-Bench's question.jsonl)
    gsm8k = [{"question": "Tom has 3 apples and buys 2. How many?", "answer": "#### 5"}] * 3
    pq.write_table(pa.Table.from_pylist(gsm8k), tmp_path / "gsm8k-test.parquet")
    mtbench = {"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now about snow."]}
    (tmp_path / "question.jsonl").write_text(json.dumps(mtbench) + "\n")
    p = _run("dflash-eval", "--drafter", run / "drafter", "--target", run / "config.yaml", "--temperature", "0", "1",
             "--prompts", f"gsm8k={tmp_path / 'gsm8k-test.parquet'}", f"mtbench={tmp_path / 'question.jsonl'}",
             "--max-prompts", "2", "--max-new-tokens", "6", "--chat-template-kwargs", '{"enable_thinking": false}',
             "--json", tmp_path / "tau.json")
    assert "format of mtbench: mtbench (named), 1 prompts (2 user turns)" in p.stdout
    tau = json.loads((tmp_path / "tau.json").read_text())
    assert set(tau["prompt_sets"]) == {"gsm8k", "mtbench"} and tau["prompt_sets"]["mtbench"]["0"]["turns"] == 2
    # 5. export a checkpoint
    _run("dflash-export", "--checkpoint", run / "checkpoints" / "latest", "--out", tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["block_size"] == yaml.safe_load(cfg.read_text())["train"]["drafter"]["block_size"]
