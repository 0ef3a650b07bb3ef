"""A data set knows what it is: its id covers its inputs (names, sizes, content), other inputs into its directory are
refused unless --replace, a file this program did not write is never deleted, killed writes' temp files are cleaned,
and every shard is checked against the manifest before training (real Qwen3 tokenizer, real CLI process)."""
import os, shutil, subprocess, sys
from pathlib import Path

import pytest

from dflash_nb.records import qwen3_tokenizer_dir
from dflash_nb.inputs import synthetic_records, write_jsonl
from dflash_nb.shards import DataMismatchError, OutDirError, load_manifest, read_shards, shard_path, tokenize_dataset

sys.path.insert(0, str(Path(__file__).parent))
from _trainer_common import train_cfg   # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(workers=1, max_seq_len=160, min_loss_tokens=1, shard_bytes=1500, verbose=False)


def _cli(*args):
    cmd = [sys.executable, "-m", "dflash_nb.data", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


def _files(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _inputs(tmp_path):
    a = write_jsonl(synthetic_records(4, seed=1, approx_tokens=40), tmp_path / "a.jsonl")
    b = write_jsonl(synthetic_records(4, seed=2, approx_tokens=40), tmp_path / "b.jsonl")
    return a, b


def test_other_inputs_into_a_data_set_are_refused_unless_replace(tmp_path):
    "Other input, same settings: CLI exit 2 (one line), nothing touched; the same input resumes; --replace replaces."
    a, b = _inputs(tmp_path)
    out = tmp_path / "D"
    first = tokenize_dataset(str(a), qwen3_tokenizer_dir(), out, **SMALL)
    before = _files(out)
    r = _cli("--input", b, "--tokenizer", qwen3_tokenizer_dir(), "--out", out, "--workers", "1", "max_seq_len=160",
             "min_loss_tokens=1", "shard_bytes=1500")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"--out {out} holds another data set ({first['dataset_id']}" in r.stderr, r.stderr
    assert "--replace" in r.stderr
    assert _files(out) == before
    again = tokenize_dataset(str(a), qwen3_tokenizer_dir(), out, **SMALL)     # the same inputs: a resume
    assert again["dataset_id"] == first["dataset_id"] and again["run"]["shards_skipped"] == len(first["shards"])
    assert [i["name"] for i in again["inputs"]] == ["a.jsonl"] and again["inputs"][0]["hash"].startswith("sha256:")
    before = _files(out)
    data = a.read_bytes()                                  # one byte edited, same size: another input
    a.write_bytes(data.replace(b"the", b"thE", 1))
    with pytest.raises(OutDirError, match="holds another data set"):
        tokenize_dataset(str(a), qwen3_tokenizer_dir(), out, **SMALL)
    assert _files(out) == before
    r = _cli("--input", b, "max_seq_len=160", "min_loss_tokens=1", "shard_bytes=1500",   # overrides after the files
             "--tokenizer", qwen3_tokenizer_dir(), "--out", out, "--workers", "1", "--replace")
    assert r.returncode == 0, r.stderr
    m = load_manifest(out)
    assert [i["name"] for i in m["inputs"]] == ["b.jsonl"] and m["dataset_id"] != first["dataset_id"]
    assert {x["source"].split("@")[0] for x in read_shards(out)} == {"b.jsonl"}


def test_a_file_this_program_did_not_write_is_never_deleted(tmp_path):
    "Someone's audit.json in a data set's directory: refused, never deleted, even with --replace."
    a, b = _inputs(tmp_path)
    out = tmp_path / "D"
    tokenize_dataset(str(a), qwen3_tokenizer_dir(), out, **SMALL)
    (out / "audit.json").write_text("my own audit notes\n")
    before = _files(out)
    for src, replace in ((a, False), (b, True)):
        with pytest.raises(OutDirError, match="audit.json was not written by python -m dflash_nb.data"):
            tokenize_dataset(str(src), qwen3_tokenizer_dir(), out, replace=replace, **SMALL)
        assert _files(out) == before
    (out / "audit.json").unlink()                                             # moved away: a rerun is a resume again
    assert tokenize_dataset(str(a), qwen3_tokenizer_dir(), out, **SMALL)["run"]["shards_skipped"] > 0


def test_leftover_temp_files_of_a_killed_run_are_cleaned(tmp_path):
    """Temp files carrying this data set's id whose pid is gone (a killed run's, or this process's own: a pid come
    round) go at the next start; look-alikes without it, and a live writer's (no lock guards --out), all stay."""
    a, _ = _inputs(tmp_path)
    out = tmp_path / "D"
    ds = tokenize_dataset(str(a), qwen3_tokenizer_dir(), out, **SMALL)["dataset_id"]
    dead = 2**22 + 1                                             # above Linux's largest pid: no process has it
    ours = [f".shard-00000.arrow.tmp-{ds}-{dead}", f".manifest.json.tmp-{ds}-{dead + 1}",
            f".audit.json.tmp-{ds}-{dead + 2}", f".shard-00001.arrow.tmp-{ds}-{os.getpid()}"]
    with subprocess.Popen(["sleep", "60"]) as live:               # a concurrent writer of the same data set
        foreign = [".shard-00000.arrow.tmp-77", ".manifest.json.tmp-5", f".audit.json.tmp-{dead}", ".mine.tmp-1",
                   ".shard-00000.arrow.tmp-0123456789abcdef-6", ".manifest.json.tmp5", f".shard-00000.arrow.tmp-{ds}-x",
                   f".shard-00002.arrow.tmp-{ds}-{live.pid}"]
        for n in ours + foreign: (out / n).write_bytes(b"half written")
        tokenize_dataset(str(a), qwen3_tokenizer_dir(), out, **SMALL)
        live.kill()
    assert not any((out / n).exists() for n in ours)
    assert all((out / n).read_bytes() == b"half written" for n in foreign)


def test_a_shard_of_another_data_set_is_refused_by_training(tmp_path):
    "A shard of another data set copied in under the right manifest: reading and training refuse it, naming the shard."
    from dflash_nb.trainer import train
    a, b = _inputs(tmp_path)
    da, db = tmp_path / "A", tmp_path / "B"
    tokenize_dataset(str(a), qwen3_tokenizer_dir(), da, **SMALL)
    other = tokenize_dataset(str(b), qwen3_tokenizer_dir(), db, **SMALL)
    shutil.copy(shard_path(db, 0), shard_path(da, 0))
    msg = f"shard {shard_path(da, 0)} belongs to data set {other['dataset_id']}, not to its manifest's data set"
    with pytest.raises(DataMismatchError, match=msg):
        read_shards(da)
    with pytest.raises(DataMismatchError, match=msg):
        train(train_cfg(tmp_path / "run", da, steps=1))
    assert not (tmp_path / "run" / "checkpoints").exists()
