"""Data pipeline input from a real S3-compatible server (SeaweedFS on 127.0.0.1): listing, streaming, retries, identity with local."""
import os, subprocess, sys
from pathlib import Path

import pytest

from dflash_nb import inputs as inputs_mod, storage
from dflash_nb.records import DataConfig, qwen3_tokenizer_dir
from dflash_nb.inputs import InputError, list_inputs
from dflash_nb.inputs import synthetic_records, write_jsonl
from dflash_nb.shards import load_manifest, tokenize_dataset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dataset(s3_server, tmp_path_factory):
    "The same files locally and in a bucket under data/: three JSONL files (one nested) and a file that is not data."
    local = tmp_path_factory.mktemp("local") / "data"
    write_jsonl(synthetic_records(7, seed=11, approx_tokens=300), local / "a.jsonl")
    write_jsonl(synthetic_records(4, seed=12, approx_tokens=300), local / "b.jsonl")
    write_jsonl(synthetic_records(3, seed=13, approx_tokens=300), local / "sub" / "c.jsonl")
    (local / "README.txt").write_text("not data\n")
    (local / "empty.jsonl").write_bytes(b"")             # reported as empty_file by both
    bucket = s3_server.make_bucket("data")
    client = s3_server.client()
    for p in sorted(local.rglob("*")):
        if p.is_file(): client.put_object(Bucket=bucket, Key=f"data/{p.relative_to(local).as_posix()}", Body=p.read_bytes())
    for i in range(5):                                   # more keys than one list page, outside the data prefix
        client.put_object(Bucket=bucket, Key=f"other/x{i}.jsonl", Body=b"{}\n")
    with s3_server.env():
        storage._S3_CLIENTS.clear()                      # clients made under other credentials must not be reused
        yield local, bucket
    storage._S3_CLIENTS.clear()


def _names(files): return [(f.name, f.size) for f in files]


def test_listing_paginates_and_matches_local(dataset):
    local, bucket = dataset
    cfg = DataConfig(s3_page_size=2)
    calls = []
    inputs_mod._s3(cfg).meta.events.register("before-call.s3.ListObjectsV2", lambda **kw: calls.append(1))
    files = list_inputs(f"s3://{bucket}/data/", cfg)
    assert _names(files) == _names(list_inputs(str(local))) == [(n, (local / n).stat().st_size) for n in ["a.jsonl", "b.jsonl", "empty.jsonl", "sub/c.jsonl"]]
    assert len(calls) >= 3                               # 5 keys under data/ at 2 per page
    assert _names(list_inputs(f"s3://{bucket}/data", cfg)) == _names(files)          # a prefix without the slash
    assert _names(list_inputs(f"s3://{bucket}/data/*.jsonl", cfg)) == _names(list_inputs(str(local / "*.jsonl")))
    assert _names(list_inputs(f"s3://{bucket}/data/sub/c.jsonl", cfg)) == [("c.jsonl", (local / "sub/c.jsonl").stat().st_size)]
    assert [f.uri for f in list_inputs(f"s3://{bucket}/data/b.jsonl", cfg)] == [f"s3://{bucket}/data/b.jsonl"]
    with pytest.raises(InputError, match="matches no objects"):
        list_inputs(f"s3://{bucket}/nothing-here/", cfg)


def test_streamed_read_survives_dropped_connections(dataset, monkeypatch):
    "Fault injection: the first streams die after a few KB; the reader reconnects at the byte where it stopped."
    local, bucket = dataset
    want = (local / "a.jsonl").read_bytes()
    real_open, opens = inputs_mod.S3RangeReader._open, []

    class Flaky:
        def __init__(self, body, limit): self.body, self.left = body, limit
        def read(self, n=-1):
            if self.left <= 0:
                from botocore.exceptions import ReadTimeoutError
                raise ReadTimeoutError(endpoint_url="injected")
            data = self.body.read(min(n, self.left)); self.left -= len(data); return data
        def close(self): self.body.close()

    def flaky_open(self):
        real_open(self)
        opens.append(self.pos)
        if len(opens) <= 3: self.body = Flaky(self.body, 3000)

    monkeypatch.setattr(inputs_mod.S3RangeReader, "_open", flaky_open)
    cfg = DataConfig(s3_backoff_s=0.01)
    f = list_inputs(f"s3://{bucket}/data/a.jsonl", cfg)[0]
    with inputs_mod.open_input(f, 100, cfg) as fh:
        assert fh.read() == want[100:]
    assert opens == [100, 3100, 6100, 9100]             # reopened exactly where each stream stopped

    opens.clear()
    monkeypatch.setattr(inputs_mod.S3RangeReader, "_open", lambda self: (_ for _ in ()).throw(ConnectionError("injected: endpoint down")))
    with pytest.raises(ConnectionError):
        with inputs_mod.open_input(f, 0, DataConfig(s3_backoff_s=0.001, s3_retries=2)) as fh: fh.read()


def test_s3_and_local_give_identical_shards(dataset, tmp_path, monkeypatch):
    local, bucket = dataset
    cfg = DataConfig(workers=1, shard_bytes=5000)
    m_local = tokenize_dataset(str(local), qwen3_tokenizer_dir(), tmp_path / "local", cfg, verbose=False)
    # through the command line with 2 worker processes, which find the credentials through boto3's default chain (env)
    r = subprocess.run([sys.executable, "-m", "dflash_nb.data", "--input", f"s3://{bucket}/data/", "--tokenizer", str(qwen3_tokenizer_dir()),
                        "--out", str(tmp_path / "s3"), "--workers", "2", "shard_bytes=5000"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    assert secret not in r.stdout and secret not in r.stderr and os.environ["AWS_ACCESS_KEY_ID"] not in r.stdout + r.stderr
    m_s3 = load_manifest(tmp_path / "s3")
    assert m_s3["run"]["workers"] == 2 and len(m_s3["shards"]) > 3
    local_shards = {p.name: p.read_bytes() for p in (tmp_path / "local").glob("shard-*.arrow")}
    assert local_shards == {p.name: p.read_bytes() for p in (tmp_path / "s3").glob("shard-*.arrow")}
    assert m_s3["audit"] == m_local["audit"] and m_s3["shards"] == m_local["shards"] and m_s3["inputs"] == m_local["inputs"]
    assert m_local["audit"]["kept"] == 14 and m_local["audit"]["malformed"]["by_kind"] == {"empty_file": 1}


def test_s3_errors_are_one_line_naming_the_input(dataset, tmp_path):
    "A bucket that does not exist: the CLI says which input, in one line, exit 2 (no traceback)."
    _, bucket = dataset
    with pytest.raises(InputError, match=r"input s3://no-such-bucket/data/: S3 error: .*NoSuchBucket"):
        list_inputs("s3://no-such-bucket/data/")
    r = subprocess.run([sys.executable, "-m", "dflash_nb.data", "--input", "s3://no-such-bucket/data/", "--tokenizer", str(qwen3_tokenizer_dir()),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, timeout=300, env=os.environ.copy())
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("python -m dflash_nb.data: error: input s3://no-such-bucket/data/: S3 error:") and not (tmp_path / "out").exists()
