"""Kill the tokenization run mid-way (SIGKILL to the whole process group) and rerun: the final shards are identical."""
import os, signal, subprocess, sys, time
from pathlib import Path

import pytest

from dflash_nb.records import DataConfig, qwen3_tokenizer_dir
from dflash_nb.inputs import synthetic_records, write_jsonl
from dflash_nb.shards import load_manifest, tokenize_dataset

ROOT = Path(__file__).resolve().parents[1]


def _shards(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.arrow"))}


@pytest.mark.slow
def test_kill_mid_run_then_rerun_gives_identical_shards(tmp_path):
    for i in range(3):
        write_jsonl(synthetic_records(40, seed=100 + i, approx_tokens=1000), tmp_path / "in" / f"part-{i}.jsonl")
    shard_bytes = 20_000                                   # ~5 samples per shard, ~24 shards
    ref = tokenize_dataset(str(tmp_path / "in"), qwen3_tokenizer_dir(), tmp_path / "ref", DataConfig(workers=1, shard_bytes=shard_bytes),
                           verbose=False)
    n = len(ref["shards"])
    assert n >= 20

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dflash_nb.data", "--input", str(tmp_path / "in"), "--tokenizer", str(qwen3_tokenizer_dir()),
           "--out", str(out), "--workers", "2", f"shard_bytes={shard_bytes}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len(list(out.glob("shard-*.arrow"))) < 2:     # kill once the workers are producing shards
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no shard appeared"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)                # the driver and its worker processes, no clean-up
    finally:
        proc.wait(30)
    done = len(list(out.glob("shard-*.arrow")))
    assert 2 <= done < n and not (out / "manifest.json").exists()

    m = tokenize_dataset(str(tmp_path / "in"), qwen3_tokenizer_dir(), out, DataConfig(workers=1, shard_bytes=shard_bytes), verbose=False)
    assert m["run"]["shards_skipped"] >= 2 and m["run"]["shards_skipped"] < n
    assert _shards(out) == _shards(tmp_path / "ref")
    assert not list(out.glob(".*tmp*"))
    assert load_manifest(out)["audit"] == ref["audit"]


def _children(pid: int) -> list[int]:
    try: return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError: return []


def _alive(pid: int) -> bool:
    "A process that exists and is not a zombie (an orphan's zombie may linger where nothing reaps it)."
    try: return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError: return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc (Linux)")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_exit_when_the_parent_is_killed(tmp_path, method):
    "SIGKILL of the driver alone (not its process group): its worker processes must not live on as orphans."
    write_jsonl(synthetic_records(400, seed=200, approx_tokens=1500), tmp_path / "in.jsonl")   # ~600K tokens: seconds of work
    cmd = [sys.executable, "-m", "dflash_nb.data", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(qwen3_tokenizer_dir()),
           "--out", str(tmp_path / "out"), "--workers", "2", "shard_bytes=20000", f"start_method={method}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    kids = []
    try:
        deadline = time.monotonic() + 120
        while len(kids := _children(proc.pid)) < 2:
            assert proc.poll() is None, "the run ended before its workers could be seen"
            assert time.monotonic() < deadline, "no workers appeared"
            time.sleep(0.01)
        time.sleep(0.5)
        kids = _children(proc.pid)
        assert proc.poll() is None and len(kids) >= 2
        os.kill(proc.pid, signal.SIGKILL)                    # the driver only; the workers get no signal from us
        proc.wait(30)
        deadline = time.monotonic() + 15
        while any(_alive(k) for k in kids) and time.monotonic() < deadline: time.sleep(0.05)
        assert not [k for k in kids if _alive(k)], "workers outlived their parent"
    finally:
        for k in kids:                                       # never leave strays behind, even when the test fails
            if _alive(k): os.kill(k, signal.SIGKILL)
        if proc.poll() is None: os.killpg(proc.pid, signal.SIGKILL)
