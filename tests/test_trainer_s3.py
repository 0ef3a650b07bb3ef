"""Checkpoints to and from a real S3-compatible server (SeaweedFS on 127.0.0.1): background upload, resume from an
s3:// URI, and an S3 outage mid-run that is retried, reported and never costs the local checkpoint."""
import json, subprocess, sys, time
import pytest, torch
from _trainer_common import make_data, train_dict, write_run_config, losses, weights, latest, env, REPO
from s3_server import S3Server
from dflash_nb.checkpoint import load_checkpoint
from dflash_nb.s3sync import download_checkpoint


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "train", n=16)


def _run(cfg, s3, *overrides, timeout=300):
    return subprocess.run([sys.executable, "-m", "dflash_nb.train", "--config", str(cfg), *overrides], cwd=REPO,
                          env=env(**s3.env_vars()), capture_output=True, text=True, timeout=timeout)


def test_s3_upload_and_resume(tmp_path, data_dir, s3_server):
    "Every checkpoint reaches S3 (then `latest`); a fresh run dir resumes from the s3:// URI and ends bit-identical."
    bucket = s3_server.make_bucket("ckpt")
    uri = f"s3://{bucket}/runs/a"
    cfg = write_run_config(tmp_path / "a.yaml", train_dict(tmp_path / "a", data_dir, steps=6,
                                                          checkpoint={"every": 3, "keep": 3, "s3_uri": uri}))
    p = _run(cfg, s3_server)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # the run's own account first: it exits 0 even when S3 refuses everything (local copies kept), so say why here
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    problems = [l for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines() if '"s3_upload_' in l]
    assert (summary["s3_uploaded"], summary["s3_failed"], summary["s3_unfinished"]) == (["step-00000003", "step-00000006"], [], []), \
        "\n".join(problems[-6:]) + "\n" + s3_server.log.read_text()[-2000:]
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket, Prefix="runs/a/").get("Contents", [])}
    for step in ("step-00000003", "step-00000006"):
        for f in ("drafter.safetensors", "optimizer.pt", "scheduler.pt", "rng.safetensors", "state.json", "config.yaml"):
            assert f"runs/a/{step}/{f}" in keys
    assert s3_server.client().get_object(Bucket=bucket, Key="runs/a/latest")["Body"].read().decode().strip() == "step-00000006"
    events = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines() if '"s3_upload"' in l]
    assert [e["checkpoint"] for e in events] == ["step-00000003", "step-00000006"]
    with s3_server.env():   # `latest` resolution of a prefix URI
        assert download_checkpoint(uri, tmp_path / "dl").name == "step-00000006"
    # resume the half-way checkpoint from S3 into an empty run dir
    cfg_b = write_run_config(tmp_path / "b.yaml", train_dict(tmp_path / "b", data_dir, steps=6, resume=f"{uri}/step-00000003",
                                                            checkpoint={"every": 3}))
    p = _run(cfg_b, s3_server)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(lb) == [4, 5, 6]
    for k in lb: assert abs(la[k] - lb[k]) <= 1e-6 * max(1, abs(la[k]))
    wa, wb = weights(latest(tmp_path / "a")), weights(latest(tmp_path / "b"))
    for k in wa: assert torch.equal(wa[k], wb[k]), k


def test_s3_outage_is_retried_reported_and_local_checkpoints_kept(tmp_path, data_dir):
    """The S3 server dies mid-run: uploads are retried and reported, training finishes, every local checkpoint is intact, and
    the run exits 2 naming the local copy of the final checkpoint; once the server is back, resume=auto uploads it."""
    with S3Server.start(tmp_path) as s3:
        bucket = s3.make_bucket("outage")
        cfg = write_run_config(tmp_path / "o.yaml", train_dict(tmp_path / "o", data_dir, steps=40, log_every=1,
                               checkpoint={"every": 4, "keep": 20, "s3_uri": f"s3://{bucket}/x", "s3_retries": 3, "s3_backoff": 0.2}))
        proc = subprocess.Popen([sys.executable, "-m", "dflash_nb.train", "--config", str(cfg)], cwd=REPO,
                                env=env(**s3.env_vars()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        m = tmp_path / "o" / "metrics.jsonl"
        t0 = time.time()
        while time.time() - t0 < 180 and not (m.exists() and '"s3_upload"' in m.read_text()): time.sleep(0.2)
        assert '"s3_upload"' in m.read_text(), "the first checkpoint never reached S3"
        s3.stop(grace=0.5)                                   # the outage
        out, _ = proc.communicate(timeout=300)
        root = tmp_path / "o" / "checkpoints"
        assert proc.returncode == 2, out[-3000:]
        assert f"the final checkpoint {root / 'step-00000040'} is not in s3://{bucket}/x" in out and "train.resume=auto" in out
        recs = [json.loads(l) for l in m.read_text().splitlines()]
        failed = [r for r in recs if r.get("event") == "s3_upload_failed"]
        assert failed, "the outage was not reported"
        assert {r["attempt"] for r in failed} >= {1, 2, 3}       # retried before giving up
        assert all(r["local_copy"] and not r["permanent"] for r in failed)
        assert "s3_upload_failed" in out                          # and reported on the console
        summary = json.loads((tmp_path / "o" / "summary.json").read_text())
        assert summary["s3_failed"] and summary["s3_uploaded"] and summary["s3_unfinished"] == []
        assert latest(tmp_path / "o").name == "step-00000040"
        for d in sorted(root.glob("step-*")): assert load_checkpoint(d)["state"]["step"] == int(d.name[5:])
        assert len(list(root.glob("step-*"))) == 10
        s3.restart()                                           # the server is back: the final checkpoint gets there
        p = subprocess.run([sys.executable, "-m", "dflash_nb.train", "--config", str(cfg), "train.resume=auto"], cwd=REPO,
                           env=env(**s3.env_vars()), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert s3.client().get_object(Bucket=bucket, Key="x/latest")["Body"].read() == b"step-00000040\n"


@pytest.mark.slow   # two real trainers at once: ~40 s on the shared, loaded 2-core machine
def test_two_trainers_started_together_on_one_prefix(tmp_path, data_dir, s3_server):
    "Two trainers at once on one S3 prefix (claimed by a conditional put): one trains, the other uploads nothing."
    bucket = s3_server.make_bucket("race")
    uri = f"s3://{bucket}/shared"
    ck = {"every": 1, "keep": 5, "s3_uri": uri}
    cfgs = [write_run_config(tmp_path / f"{n}.yaml", train_dict(tmp_path / n, data_dir, steps=4, checkpoint=ck))
            for n in "ab"]
    procs = [subprocess.Popen([sys.executable, "-m", "dflash_nb.train", "--config", str(c)], cwd=REPO,
                              env=env(**s3_server.env_vars()), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for c in cfgs]
    outs = [p.communicate(timeout=300) for p in procs]
    rcs = sorted((p.returncode, n) for p, n in zip(procs, "ab"))
    assert [rc for rc, _ in rcs] == [0, 2], outs
    win, lose = tmp_path / rcs[0][1], tmp_path / rcs[1][1]
    err = outs["ab".index(rcs[1][1])][1]
    assert "belongs to run" in err or "already holds checkpoints" in err, err
    rid = json.loads((win / "run.json").read_text())["run_id"]
    assert rid != json.loads((lose / "run.json").read_text())["run_id"]
    c = s3_server.client()
    assert json.loads(c.get_object(Bucket=bucket, Key="shared/run.json")["Body"].read())["run_id"] == rid
    lose_log = (lose / "metrics.jsonl").read_text() if (lose / "metrics.jsonl").exists() else ""
    assert '"s3_upload"' not in lose_log                                   # the loser uploaded nothing
    for step in range(1, 5):
        name = f"step-{step:08d}"
        st = json.loads(c.get_object(Bucket=bucket, Key=f"shared/{name}/state.json")["Body"].read())
        assert st["run_id"] == rid, (name, st)
        with s3_server.env(): d = download_checkpoint(f"{uri}/{name}", tmp_path / "dl")
        wa, wr = weights(win / "checkpoints" / name), weights(d)
        for k in wa: assert torch.equal(wa[k], wr[k]), (name, k)
