"""Experiment tracking: a real training run with report_to=[tensorboard] leaves event files whose scalars, read back with
TensorBoard's own reader, equal metrics.jsonl record by record; bad names and missing packages stop the run at startup."""
import json, struct, sys
from pathlib import Path
import pytest, torch
from _trainer_common import make_data, train_cfg, train_dict, write_run_config, run_module
from dflash_nb.trainer import train
from dflash_nb.config import ConfigError
from dflash_nb.tracking import flatten_scalars, wandb_mode, MissingTrackerError


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "train", n=12)


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()   # TensorBoard stores scalars as float32


def _check_events_equal_metrics(run):
    "One event file; every tag's (step, value) series equals the scalars of metrics.jsonl's interval records."
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "event" not in r]
    assert [r["step"] for r in recs] == [2, 4]
    files = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    ea = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0}); ea.Reload()
    want = [flatten_scalars(r) for r in recs]
    tags = set().union(*want)   # a value not measured yet (eta_s before the rate exists) is null: no point for it
    assert sorted(ea.Tags()["scalars"]) == sorted(tags)
    for tag in ("loss", "acc/1", "acc/3", "tau_est", "lr", "grad_norm", "tokens_per_s", "target_busy", "drafter_busy",
                "queue_depth", "skipped", "nonfinite_total", "eta_s"):
        assert tag in tags, tag
    for tag in tags:
        got = [(e.step, e.value) for e in ea.Scalars(tag)]
        assert got == [(r["step"], _f32(w[tag])) for r, w in zip(recs, want) if tag in w], tag


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path, data_dir):
    train(train_cfg(tmp_path / "run", data_dir, steps=4, log_every=2, report_to=["tensorboard"]))
    _check_events_equal_metrics(tmp_path / "run")


def test_tensorboard_rank0_only_under_torchrun(tmp_path, data_dir):
    "Two gloo ranks through `python -m dflash_nb.train`: rank 0 alone writes events (one file), equal to metrics.jsonl."
    cfg = write_run_config(tmp_path / "two.yaml", train_dict(tmp_path / "two", data_dir, steps=4, log_every=2,
                                                             report_to=["tensorboard"]))
    p = run_module(cfg, torchrun=2, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ranks 2" in p.stdout
    _check_events_equal_metrics(tmp_path / "two")


def test_bad_report_to_stops_at_startup(tmp_path, data_dir):
    with pytest.raises(ConfigError, match="train.report_to: unknown tracker 'mlflow'"):
        train(train_cfg(tmp_path / "a", data_dir, steps=1, report_to=["mlflow"]))
    saved = sys.modules.get("wandb"); sys.modules["wandb"] = None   # fault injection: wandb not installed
    try:
        with pytest.raises(MissingTrackerError, match=r"'wandb' but the wandb package is not installed \(pip install wandb\)"):
            train(train_cfg(tmp_path / "b", data_dir, steps=1, report_to=["tensorboard", "wandb"]))
    finally:
        if saved is None: del sys.modules["wandb"]
        else: sys.modules["wandb"] = saved
    assert not (tmp_path / "b" / "tensorboard").exists() and not (tmp_path / "b" / "checkpoints").exists()


def read_wandb_history(path) -> list[dict]:
    "History rows of an offline W&B run file (a LevelDB-style log of wandb Record protobufs, 32 KiB blocks)."
    from wandb.proto import wandb_internal_pb2 as pb
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, rows, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7: pos += left; continue
        length, kind = struct.unpack("<HB", data[pos + 4: pos + 7])
        if length == 0 and kind == 0: pos += left; continue   # zero padding at a block's end
        chunk = data[pos + 7: pos + 7 + length]; pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            r = pb.Record(); r.ParseFromString(buf); buf = b""
            if r.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def test_wandb_offline_run_equals_metrics_jsonl(tmp_path, data_dir, monkeypatch):
    "No WANDB_MODE set: an offline run under run_dir/wandb whose history rows are metrics.jsonl's scalars, step by step."
    for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"): monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wbconfig")); monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wbcache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    train(train_cfg(run, data_dir, steps=4, log_every=2, report_to=["wandb"]))
    runs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and not list((run / "wandb").glob("run-*"))   # offline, not a synced online run
    recs = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
    rows = read_wandb_history(runs[0])
    assert [r["_step"] for r in rows] == [r["step"] for r in recs] == [2, 4]
    for row, rec in zip(rows, recs):
        assert {k: v for k, v in row.items() if not k.startswith("_")} == pytest.approx(flatten_scalars(rec), nan_ok=True)


def test_wandb_offline_unless_configured(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode() == "online"
