"""Nothing an attacker or a mistake can do to a run: checkpoints load as data only (planted pickles never
run), remote names and keys never lead outside the destination, a run dir has one owner and one history, and
checkpoints reach S3 or the run says so. Real trainer, real files, real SeaweedFS; mocks only to inject faults."""
import json, os, pickle, shutil, signal, socket, subprocess, sys, time
from pathlib import Path
import pytest, torch
from _trainer_common import make_data, train_cfg, train_dict, write_run_config, run_module, latest, env, REPO
from dflash_nb import s3sync
from dflash_nb.train_config import lr_factor
from dflash_nb.trainer import train
from dflash_nb.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint, CheckpointError, rng_state
from dflash_nb.s3sync import S3Uploader, download_checkpoint


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "train", n=12)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, data_dir):
    "A real 2-step run; its checkpoint is copied (never modified) by the tests."
    run = tmp_path_factory.mktemp("ckpt") / "run"
    train(train_cfg(run, data_dir, steps=2, checkpoint={"every": 2}))
    return latest(run)


class Evil:
    "Unpickling this creates `marker`: a stand-in for any code a pickle can carry."
    def __init__(self, marker): self.marker = str(marker)
    def __reduce__(self): return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path):
    "Replace `path` with a malicious pickle (torch's zip format for .pt files, a raw pickle otherwise)."
    path.unlink(missing_ok=True)
    if path.suffix == ".pt": torch.save({"state": Evil(marker)}, path)
    else: path.write_bytes(pickle.dumps(Evil(marker)))


def test_planted_pickle_is_live(tmp_path):
    "The bait works: loaded the unsafe way it runs code (so the refusals below mean something)."
    marker = tmp_path / "ran"
    plant(tmp_path / "x.pt", marker)
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng.safetensors", "rng.pt", "drafter.safetensors", "state.json"])
def test_malicious_pickle_in_checkpoint_refused(tmp_path, ckpt, name):
    "A pickle planted in any file a resume reads is refused with an error naming that file, and never runs."
    d = tmp_path / "step-00000002"; shutil.copytree(ckpt, d)
    marker = tmp_path / "ran"
    if name == "rng.pt": (d / "rng.safetensors").unlink()   # an older checkpoint's RNG file
    plant(d / name, marker)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as e:
        load_checkpoint(d)
    assert "resume from another" in str(e.value)
    assert not marker.exists()


def test_malicious_resume_cli_local_and_s3(tmp_path, ckpt, data_dir, s3_server):
    "Through the real CLI: resume from a local dir and from s3:// with a poisoned optimizer.pt / rng.pt: exit 2, file named, nothing ran."
    marker = tmp_path / "ran"
    local = tmp_path / "poisoned" / "step-00000002"; shutil.copytree(ckpt, local)
    plant(local / "optimizer.pt", marker)
    cfg = write_run_config(tmp_path / "a.yaml", train_dict(tmp_path / "a", data_dir, steps=4, resume=str(local)))
    p = run_module(cfg)
    assert p.returncode == 2 and "optimizer.pt" in p.stderr and "not a valid checkpoint file" in p.stderr, p.stderr[-2000:]
    bucket = s3_server.make_bucket("evil"); c = s3_server.client()
    for f in ckpt.iterdir():
        if f.name != "rng.safetensors": c.upload_file(str(f), bucket, f"p/step-00000002/{f.name}")
    plant(tmp_path / "rng.pt", marker)
    c.upload_file(str(tmp_path / "rng.pt"), bucket, "p/step-00000002/rng.pt")
    c.put_object(Bucket=bucket, Key="p/latest", Body=b"step-00000002\n")
    cfg = write_run_config(tmp_path / "b.yaml", train_dict(tmp_path / "b", data_dir, steps=4, resume=f"s3://{bucket}/p"))
    p = subprocess.run([sys.executable, "-m", "dflash_nb.train", "--config", str(cfg)], cwd=REPO, env=env(**s3_server.env_vars()),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "rng.pt" in p.stderr, p.stderr[-2000:]
    assert not marker.exists()


def test_evaluate_loaders_refuse_pickles(tmp_path, ckpt):
    "What evaluate loads (a checkpoint's or an export's safetensors, a target dir's weights) is refused when it is a pickle."
    from dflash_nb.target import tiny_target, load_target
    from dflash_nb.evaluate import load_drafter_dir
    from dflash_nb.export import export_checkpoint
    marker = tmp_path / "ran"
    target = tiny_target(**train_dict(tmp_path, tmp_path)["target"]["tiny"])
    d = tmp_path / "ck" / "step-00000002"; shutil.copytree(ckpt, d)
    exp = export_checkpoint(d, tmp_path / "export")
    plant(d / "drafter.safetensors", marker); plant(exp / "model.safetensors", marker)
    for path in (d, exp):
        with pytest.raises(Exception): load_drafter_dir(path, target)
    tdir = tmp_path / "target"; target.save_pretrained(tdir)
    for f in tdir.glob("*.safetensors"): f.unlink()
    plant(tdir / "pytorch_model.bin", marker)
    with pytest.raises(Exception): load_target(tdir, device="cpu")
    assert not marker.exists()


# ---- stay inside your own directories -------------------------------------------------------------------------------
def test_crafted_local_latest_refused(tmp_path, ckpt):
    "A `latest` naming a path (absolute or with ..) is refused before anything is read, deleted or written."
    root = tmp_path / "checkpoints"; shutil.copytree(ckpt, root / "step-00000002")
    victim = tmp_path / "victim"; victim.mkdir(); (victim / "keep.txt").write_text("x")
    for text in (str(victim), "../victim", "step-00000002/../../victim"):
        (root / "latest").write_text(text + "\n")
        with pytest.raises(CheckpointError, match="not a checkpoint name"): resolve_checkpoint(tmp_path)
    assert (victim / "keep.txt").read_text() == "x"


def test_crafted_remote_latest_and_keys_refused(tmp_path, ckpt, s3_server, monkeypatch):
    "A remote `latest` naming a path, a nested key, and a key with `..` are refused; nothing lands outside the destination."
    bucket = s3_server.make_bucket("craft"); c = s3_server.client()
    for f in ckpt.iterdir(): c.upload_file(str(f), bucket, f"p/step-00000002/{f.name}")
    victim = tmp_path / "victim"; victim.mkdir(); (victim / "keep.txt").write_text("x")
    dest = tmp_path / "run" / "resume"
    with s3_server.env():
        for text in (str(victim), "../../victim", "step-00000002/../x"):
            c.put_object(Bucket=bucket, Key="p/latest", Body=(text + "\n").encode())
            with pytest.raises(CheckpointError, match="not a checkpoint name"): download_checkpoint(f"s3://{bucket}/p", dest)
        assert (victim / "keep.txt").read_text() == "x"
        c.put_object(Bucket=bucket, Key="p/latest", Body=b"step-00000002\n")
        assert download_checkpoint(f"s3://{bucket}/p", dest) == dest / "step-00000002"   # the honest case works
        (dest / "step-00000002" / "mine").mkdir(); (dest / "step-00000002" / "mine" / "x").write_text("x")
        with pytest.raises(CheckpointError, match="not an earlier download"): download_checkpoint(f"s3://{bucket}/p", dest)
        assert (dest / "step-00000002" / "mine" / "x").read_text() == "x"               # not ours to delete
        shutil.rmtree(dest / "step-00000002" / "mine")
        c.put_object(Bucket=bucket, Key="p/step-00000002/sub/state.json", Body=b"{}")
        with pytest.raises(CheckpointError, match="not a plain file name"): download_checkpoint(f"s3://{bucket}/p", dest)
        c.delete_object(Bucket=bucket, Key="p/step-00000002/sub/state.json")
        # SeaweedFS itself refuses keys with `..`; AWS stores them. Inject one into the listing (fault injection).
        real = s3sync.s3_client
        def client(*a, **k):
            cl = real(*a, **k); pag = cl.get_paginator
            class P:
                def paginate(self, **kw):
                    for page in pag("list_objects_v2").paginate(**kw):
                        yield {**page, "Contents": page.get("Contents", []) + [{"Key": "p/step-00000002/../../../escape.txt"}]}
            cl.get_paginator = lambda name: P()
            return cl
        monkeypatch.setattr(s3sync, "s3_client", client)
        with pytest.raises(CheckpointError, match="not a plain file name"): download_checkpoint(f"s3://{bucket}/p", dest)
    assert not list(tmp_path.rglob("escape.txt"))


# ---- one owner, one history -----------------------------------------------------------------------------------------
def test_second_trainer_refused_and_stale_lock_taken_over(tmp_path, data_dir):
    "A live trainer's lock stops a second one (message names pid, host, lock file); after a SIGKILL the lock is stale and taken over."
    cfg = write_run_config(tmp_path / "l.yaml", train_dict(tmp_path / "run", data_dir, steps=400, checkpoint={"every": 0}))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_nb.train", "--config", str(cfg)], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    m = tmp_path / "run" / "metrics.jsonl"
    t0 = time.time()
    while time.time() - t0 < 120 and not (m.exists() and '"loss"' in m.read_text()): time.sleep(0.2)
    try:
        before = m.read_text()
        with pytest.raises(CheckpointError) as e:
            train(train_cfg(tmp_path / "run", data_dir, steps=2))
        msg = str(e.value)
        assert f"pid {proc.pid} on host {socket.gethostname()}" in msg and "train.lock" in msg, msg
        assert m.read_text().startswith(before)          # the second trainer wrote nothing into the run
    finally:
        proc.send_signal(signal.SIGKILL); proc.communicate(timeout=60)
    assert json.loads((tmp_path / "run" / "train.lock").read_text())["pid"] == proc.pid   # left behind by the dead process
    s = train(train_cfg(tmp_path / "run", data_dir, steps=2, resume="auto"))
    assert s["steps"] == 2 and not (tmp_path / "run" / "train.lock").exists()


def test_rerun_without_resume_refused(tmp_path, data_dir):
    "A new run in a dir holding checkpoints refuses, says how to resume, and changes nothing there."
    train(train_cfg(tmp_path / "run", data_dir, steps=2, checkpoint={"every": 2}))
    snap = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="train.resume=auto"):
        train(train_cfg(tmp_path / "run", data_dir, steps=2, optim={"lr": 1e-2}))
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == snap


def test_rollback_refused_and_config_change_reported(tmp_path, data_dir, capsys):
    "Resuming past `steps` or from an older step than the dir's `latest` is refused; a changed lr/steps is reported and applied."
    run = tmp_path / "run"
    train(train_cfg(run, data_dir, steps=4, checkpoint={"every": 2, "keep": 5}))
    with pytest.raises(CheckpointError, match="past train.steps=3"):
        train(train_cfg(run, data_dir, steps=3, resume="auto"))
    with pytest.raises(CheckpointError, match="later than the resume point"):
        train(train_cfg(run, data_dir, steps=6, resume=str(run / "checkpoints" / "step-00000002")))
    assert latest(run).name == "step-00000004"
    capsys.readouterr()
    train(train_cfg(run, data_dir, steps=6, resume="auto", optim={"lr": 1e-3}))
    out = capsys.readouterr().out
    assert "steps 4 -> 6" in out and "optim.lr 0.003 -> 0.001" in out and "apply from step 4" in out, out
    rec = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    lr5 = [r["lr"] for r in rec if r.get("step") == 5][-1]          # lr after the 5th step = schedule at index 5
    assert abs(lr5 - 1e-3 * lr_factor(5, 6, 0.04, 0.0)) < 1e-12, lr5
    assert latest(run).name == "step-00000006"


def test_existing_step_is_replaced_and_latest_never_moves_back(tmp_path):
    "Saving a step that exists writes the new weights (the old copy is not kept); saving an earlier step than `latest` is refused."
    m = torch.nn.Linear(3, 2); o = torch.optim.AdamW(m.parameters()); s = torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1.0)
    rng = [rng_state(torch.device("cpu"))]
    save_checkpoint(tmp_path, 2, {"w": torch.zeros(2)}, o, s, {"step": 2}, rng)
    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, o, s, {"step": 2}, rng)
    assert torch.equal(load_checkpoint(tmp_path)["weights"]["w"], torch.ones(2))
    save_checkpoint(tmp_path, 4, {"w": torch.ones(2)}, o, s, {"step": 4}, rng)
    with pytest.raises(CheckpointError, match="refusing to move `latest` back"):
        save_checkpoint(tmp_path, 3, {"w": torch.ones(2)}, o, s, {"step": 3}, rng)
    assert (tmp_path / "latest").read_text().strip() == "step-00000004" and not (tmp_path / "step-00000003").exists()


# ---- checkpoints reach S3 or the run says so ------------------------------------------------------------------------
def _keys(s3, bucket, prefix):
    return sorted(o["Key"][len(prefix) + 1:] for o in s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []))

def _steps(s3, bucket, prefix): return sorted({k.split("/")[0] for k in _keys(s3, bucket, prefix) if k.startswith("step-")})

def _fake_ckpt(root: Path, step: int) -> Path:
    d = root / f"step-{step:08d}"; d.mkdir(parents=True)
    (d / "drafter.safetensors").write_bytes(b"w" * 100); (d / "state.json").write_text(json.dumps({"step": step}))
    return d


def test_shared_prefix(tmp_path, data_dir, s3_server):
    "A second run on a prefix holding another run's checkpoints refuses before training; two uploaders sharing a prefix prune only their own steps, never `latest`'s."
    bucket = s3_server.make_bucket("shared"); uri = f"s3://{bucket}/p"
    with s3_server.env():
        train(train_cfg(tmp_path / "a", data_dir, steps=2, checkpoint={"every": 2, "s3_uri": uri}))
        with pytest.raises(CheckpointError, match="already holds checkpoints"):
            train(train_cfg(tmp_path / "b", data_dir, steps=2, checkpoint={"every": 2, "s3_uri": uri}))
        assert not (tmp_path / "b" / "metrics.jsonl").exists() or '"loss"' not in (tmp_path / "b" / "metrics.jsonl").read_text()
        assert _steps(s3_server, bucket, "p") == ["step-00000002"]
        # two uploaders started at once on one prefix (the start check cannot see each other yet)
        ev = []
        a, b = (S3Uploader(f"s3://{bucket}/q", retries=1, keep=1, report=ev.append) for _ in range(2))
        ra, rb = tmp_path / "ra", tmp_path / "rb"
        for up, root, step in ((a, ra, 5), (b, rb, 6), (a, ra, 7)):
            up.submit(_fake_ckpt(root, step)); time.sleep(0)
            while up.not_in_s3(): time.sleep(0.05)
        assert _steps(s3_server, bucket, "q") == ["step-00000006", "step-00000007"]   # a pruned its own 5, not b's 6
        class Racing(S3Uploader):   # another writer points `latest` at one of our old steps just before we prune
            def _prune(self, c):
                c.put_object(Bucket=self.bucket, Key=self.key("latest"), Body=b"step-00000007\n"); super()._prune(c)
        r = Racing(f"s3://{bucket}/q", retries=1, keep=1, report=ev.append); r.remote = ["step-00000007"]; r.latest_step = 7
        r.submit(_fake_ckpt(ra, 9))
        assert r.close(timeout=60) and a.close(timeout=60) and b.close(timeout=60)
        assert "step-00000007" in _steps(s3_server, bucket, "q")                      # named by `latest`: kept
        b2 = S3Uploader(f"s3://{bucket}/q", retries=3, keep=1, report=ev.append)    # behind `latest`: a conflict, not retried
        b2.submit(_fake_ckpt(rb, 1))
        assert not b2.close(timeout=60) and "another run writes to this prefix" in b2.fatal
    assert [e["attempt"] for e in ev if e["event"] == "s3_upload_failed"] == [1]


def test_permanent_errors_fail_fast(tmp_path, data_dir, s3_server, monkeypatch):
    "A missing bucket or a wrong secret stops the run before training, with a message naming the URI; not retried."
    with s3_server.env():
        with pytest.raises(CheckpointError, match="NoSuchBucket|404|Not Found") as e:
            train(train_cfg(tmp_path / "a", data_dir, steps=2, checkpoint={"s3_uri": "s3://no-such-bucket-x1/p"}))
        assert "s3://no-such-bucket-x1/p" in str(e.value)
        bucket = s3_server.make_bucket("auth")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
        t0 = time.time()
        with pytest.raises(CheckpointError, match="credentials"):
            train(train_cfg(tmp_path / "b", data_dir, steps=2, checkpoint={"s3_uri": f"s3://{bucket}/p", "s3_retries": 5, "s3_backoff": 5}))
        assert time.time() - t0 < 60
    for run in ("a", "b"): assert '"loss"' not in (tmp_path / run / "metrics.jsonl").read_text()


def test_permanent_error_mid_run_stops_at_next_checkpoint(tmp_path, data_dir, s3_server, monkeypatch):
    "Credentials revoked mid-run (AccessDenied injected on the 2nd upload): not retried, the run stops at its next checkpoint, local copies kept."
    from botocore.exceptions import ClientError
    real, calls = S3Uploader._upload, []
    def revoked(self, d):
        calls.append(d.name)
        if len(calls) >= 2: raise ClientError({"Error": {"Code": "AccessDenied", "Message": "revoked (injected)"}}, "PutObject")
        return real(self, d)
    monkeypatch.setattr(S3Uploader, "_upload", revoked)
    bucket = s3_server.make_bucket("revoked")
    with s3_server.env(), pytest.raises(CheckpointError, match="S3 refuses the checkpoints .*AccessDenied.*train.resume=auto"):
        train(train_cfg(tmp_path / "r", data_dir, steps=8, checkpoint={"every": 1, "keep": 1, "s3_uri": f"s3://{bucket}/p",
                                                                        "s3_retries": 5, "s3_backoff": 0.05}))
    recs = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    failed = [r for r in recs if r.get("event") == "s3_upload_failed"]
    assert [(r["checkpoint"], r["attempt"], r["permanent"]) for r in failed] == [("step-00000002", 1, True)]   # not retried
    assert max(r["step"] for r in recs if "loss" in r) < 8                         # stopped early
    local = sorted(p.name for p in (tmp_path / "r" / "checkpoints").glob("step-*"))
    assert "step-00000002" in local and len(local) >= 2                            # not in S3, so not pruned (keep=1)


def test_keep1_slow_upload_every_checkpoint_reaches_s3(tmp_path, data_dir, s3_server, monkeypatch):
    "keep=1 with uploads slower than training: local pruning waits for each upload, so all 6 reach S3; both sides end with 1."
    real = S3Uploader._upload
    def slow(self, d): time.sleep(0.4); return real(self, d)        # fault injection: a slow link
    monkeypatch.setattr(S3Uploader, "_upload", slow)
    bucket = s3_server.make_bucket("slow")
    with s3_server.env():
        s = train(train_cfg(tmp_path / "r", data_dir, steps=6, checkpoint={"every": 1, "keep": 1, "s3_uri": f"s3://{bucket}/p"}))
    names = [f"step-{i:08d}" for i in range(1, 7)]
    assert s["s3_uploaded"] == names and s["s3_failed"] == []
    assert _steps(s3_server, bucket, "p") == ["step-00000006"]
    assert s3_server.client().get_object(Bucket=bucket, Key="p/latest")["Body"].read() == b"step-00000006\n"
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").glob("step-*")) == ["step-00000006"]


def test_server_killed_during_upload_then_back(tmp_path):
    "Uploads that fail while the server is down are retried once it is back (before the next one), in order; `latest` last."
    from s3_server import S3Server
    ev = []
    with S3Server.start(tmp_path) as s3, s3.env():
        bucket = s3.make_bucket("back")
        up = S3Uploader(f"s3://{bucket}/p", retries=2, backoff=0.1, keep=5, report=ev.append)
        up.submit(_fake_ckpt(tmp_path / "r", 1))
        while up.not_in_s3(): time.sleep(0.05)
        s3.stop(grace=0.5)
        up.submit(_fake_ckpt(tmp_path / "r", 2))
        while "step-00000002" in up.pending: time.sleep(0.05)
        assert up.failed == ["step-00000002"]
        s3.restart()
        up.submit(_fake_ckpt(tmp_path / "r", 3))
        assert up.close(timeout=120)
        assert _steps(s3, bucket, "p") == ["step-00000001", "step-00000002", "step-00000003"]
        assert s3.client().get_object(Bucket=bucket, Key="p/latest")["Body"].read() == b"step-00000003\n"
    assert [e["checkpoint"] for e in ev if e["event"] == "s3_upload"] == ["step-00000001", "step-00000002", "step-00000003"]


def test_half_uploaded_step_is_never_latest(tmp_path, s3_server, monkeypatch):
    "A step whose upload breaks half-way (fault injected on state.json) is not named by `latest`, and a download of it is refused."
    real = s3sync.s3_client
    def client(*a, **k):
        cl = real(*a, **k); up = cl.upload_file
        def upload_file(f, b, key, *x, **y):
            if key.endswith("step-00000002/state.json"): raise ConnectionError("link dropped")
            return up(f, b, key, *x, **y)
        cl.upload_file = upload_file
        return cl
    monkeypatch.setattr(s3sync, "s3_client", client)
    bucket = s3_server.make_bucket("half")
    with s3_server.env():
        up = S3Uploader(f"s3://{bucket}/p", retries=2, backoff=0.05, report=lambda e: None)
        up.submit(_fake_ckpt(tmp_path, 1)); up.submit(_fake_ckpt(tmp_path, 2))
        assert not up.close(timeout=60)
        assert s3_server.client().get_object(Bucket=bucket, Key="p/latest")["Body"].read() == b"step-00000001\n"
        assert "step-00000002/drafter.safetensors" in _keys(s3_server, bucket, "p")
        with pytest.raises(CheckpointError, match="not a complete checkpoint"):
            download_checkpoint(f"s3://{bucket}/p/step-00000002", tmp_path / "dl")


# ---- a run dir is one run --------------------------------------------------------------------------------------------
def _snap(d: Path) -> dict:
    return {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}


@pytest.mark.slow   # three short runs and a CLI process: ~39 s on the shared, loaded 2-core machine
def test_resume_of_another_runs_checkpoint_into_a_run_dir_refused(tmp_path, data_dir):
    "CLI: train.resume=<run B> into run A's dir: exit 2, one line naming both run ids and a fresh dir; A untouched."
    a, b = tmp_path / "a", tmp_path / "b"
    train(train_cfg(a, data_dir, steps=2, checkpoint={"every": 2}))
    train(train_cfg(b, data_dir, steps=4, checkpoint={"every": 4}))
    before = _snap(a)
    cfg = write_run_config(tmp_path / "a.yaml", train_dict(a, data_dir, steps=6, checkpoint={"every": 2}))
    p = run_module(cfg, f"train.resume={b}")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert _snap(a) == before
    rid_a, rid_b = (json.loads((d / "run.json").read_text())["run_id"] for d in (a, b))
    assert rid_a != rid_b and json.loads((latest(a) / "state.json").read_text())["run_id"] == rid_a
    assert f"holds run {rid_a}" in p.stderr and f"checkpoint of run {rid_b}" in p.stderr, p.stderr
    assert "fresh train.run_dir" in p.stderr
    s = train(train_cfg(tmp_path / "c", data_dir, steps=6, resume=str(b)))   # into a fresh dir: run B goes on there
    assert s["steps"] == 6 and json.loads((tmp_path / "c" / "run.json").read_text())["run_id"] == rid_b


@pytest.mark.slow   # three short runs: ~29 s on the shared, loaded 2-core machine
def test_resume_auto_without_latest_uses_the_newest_complete_step_or_refuses(tmp_path, data_dir):
    "Step dirs but no `latest` (a killed save): resume=auto continues from the newest complete step, never from 0."
    run = tmp_path / "run"
    train(train_cfg(run, data_dir, steps=4, checkpoint={"every": 2, "keep": 5}))
    root = run / "checkpoints"
    (root / "latest").unlink()
    (root / "step-00000004" / "optimizer.pt").unlink()                 # step 4 incomplete: the loader refuses it
    s = train(train_cfg(run, data_dir, steps=6, resume="auto", checkpoint={"every": 2, "keep": 5}))
    resumed = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"resumed"' in l]
    assert [(r["from"], r["step"]) for r in resumed] == [(str(root / "step-00000002"), 2)] and s["steps"] == 6
    assert latest(run).name == "step-00000006" and load_checkpoint(root / "step-00000004")["state"]["step"] == 4
    other = tmp_path / "other"                                   # no complete step at all: refused, nothing written
    train(train_cfg(other, data_dir, steps=2, checkpoint={"every": 2}))
    (other / "checkpoints" / "latest").unlink()
    (other / "checkpoints" / "step-00000002" / "state.json").unlink()
    before = _snap(other / "checkpoints")
    with pytest.raises(CheckpointError, match="no `latest` and no complete checkpoint"):
        train(train_cfg(other, data_dir, steps=4, resume="auto"))
    assert _snap(other / "checkpoints") == before


def test_train_cli_refuses_the_run_dir_before_tokenizing(tmp_path, data_dir):
    "CLI with inputs=: a run dir that will be refused (checkpoints, no resume) is refused before any tokenizing."
    from dflash_nb.inputs import synthetic_records, write_jsonl
    import yaml
    run = tmp_path / "run"
    train(train_cfg(run, data_dir, steps=2, checkpoint={"every": 2}))
    before = _snap(run)
    src = write_jsonl(synthetic_records(4, seed=5, approx_tokens=40), tmp_path / "in.jsonl")
    cfg = tmp_path / "r.yaml"
    data = {"workers": 1, "max_seq_len": 160, "min_loss_tokens": 1}
    cfg.write_text(yaml.safe_dump({"train": train_dict(run, data_dir, steps=2), "inputs": [str(src)], "export": False,
                                   "data": data, "evaluate": {"num_samples": 0}}))
    p = run_module(cfg)
    assert p.returncode == 2 and "already holds checkpoints" in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    assert not (run / "data").exists() and _snap(run) == before


def test_leftovers_of_killed_saves_are_cleaned_on_the_next_start(tmp_path, data_dir):
    "Temp dirs/files carrying the run's id (its killed saves) go at the next start; look-alikes of every name stay."
    run = tmp_path / "run"
    train(train_cfg(run, data_dir, steps=2, checkpoint={"every": 2}))
    rid = json.loads((run / "run.json").read_text())["run_id"]
    root = run / "checkpoints"
    (root / f".step-00000004.tmp-{rid}-999999").mkdir()
    (root / f".step-00000004.tmp-{rid}-999999" / "optimizer.pt").write_bytes(b"half")
    (root / f".latest.tmp-{rid}-999999").write_text("step-00000004\n")
    foreign = [".step-00000004.tmp-999999", ".latest.tmp-999999", ".step-00000002.old-77", ".tmp-step-00000003-999997",
               ".old-step-00000002-5", ".step-00000004.tmp-0123456789abcdef-6", ".tmp-mine"]
    for n in foreign: (root / n).write_text("not provably the trainer's")
    (run / "resume" / ".step-00000002.tmp-999998").mkdir(parents=True)
    # the run dir's own files are not all written under its lock: their temps go only when their pid is gone
    dead, live = 2**22 + 7, os.getppid()                     # no process has `dead`
    (run / f".run.json.tmp-{dead}").write_text("{")
    (run / f".drafter.tmp-{dead}").mkdir()                   # a killed export of the run's drafter
    (run / f".report.json.tmp-{live}").write_text("{")
    train(train_cfg(run, data_dir, steps=3, resume="auto", checkpoint={"every": 0, "final": False}))
    assert sorted(p.name for p in run.glob(".*.tmp-*")) == [f".report.json.tmp-{live}"]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == sorted(foreign)
    assert all((root / n).read_text() == "not provably the trainer's" for n in foreign)
    assert [p.name for p in (run / "resume").iterdir()] == [".step-00000002.tmp-999998"]
