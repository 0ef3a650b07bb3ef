"""Target features from a vLLM engine (chapter 07d_engine_features, `train.target.source=vllm`) train the drafter as
the in-process hooks do, one rank or two (each its own engine): a real engine of the serving environment on the
servable tiny Qwen3, real tokenized data."""
import json, os, signal, subprocess, sys, time
from pathlib import Path
import pytest
from _serving_common import wait_for, worker_of, worker_tmp, write_served_target
from _trainer_common import (REPO, SUBPROCESS_THREADS, env, intra_op_threads, losses, make_data, run_module,
                            train_cfg, train_dict, write_run_config)

from dflash_nb.config import ConfigError, from_dict
from dflash_nb.train import RunConfig, check_run
from dflash_nb.trainer import train
from dflash_nb.vllm_worker import group_members

pytestmark = pytest.mark.slow

SERVED = {"path": None, "dtype": "float32"}   # the path is set per test: a directory vLLM can load
RUN = dict(steps=10, global_batch=2, drafter={"num_hidden_layers": 1, "block_size": 4, "target_layer_ids": [2, 0]})


def with_tmpdir(tmp) -> list:
    "The processes whose TMPDIR is `tmp`."
    def env_of(pid):
        try: return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError: return []
    mark = f"TMPDIR={tmp}".encode()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and mark in env_of(p)]


@pytest.fixture(scope="module")
def target_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return write_served_target(root / "target"), make_data(root / "data", n=16)


def test_a_run_the_engine_cannot_serve_is_one_line_before_any_step(tmp_path, target_and_data):
    _, data_dir = target_and_data
    for target, loss, says in (({"source": "vllm"}, {}, "train.target.path not set"),
                               ({"source": "vllm", "path": "t"}, {"distill_weight": 0.5}, "distill_weight=0.5")):
        cfg = train_cfg(tmp_path / "run", data_dir, steps=2, target=target, loss=loss)
        with pytest.raises(ConfigError, match=says): train(cfg)
        assert not (tmp_path / "run" / "checkpoints").exists()
    target_dir, _ = target_and_data   # τ and regeneration inside the run need the whole target in process
    for run, says in (({}, "with evaluate.num_samples > 0: this process holds only the target's head"),
                      ({"evaluate": {"num_samples": 0}, "regenerate": {"prompts": "bundled", "engine": "vllm"}},
                       "with regenerate.prompts: this process holds only the target's head")):
        cfg = from_dict(RunConfig, {"train": {"run_dir": str(tmp_path / "r"), "data_dir": str(data_dir),
                                              "target": {"source": "vllm", "path": str(target_dir)}}, **run})
        with pytest.raises(ConfigError, match=says): check_run(cfg)


@pytest.mark.parametrize("fault, timeout_s, says", [(signal.SIGKILL, None, "killed by SIGKILL"),
                                                    (signal.SIGSTOP, 20, "did not answer 'features' within 20 s")])
def test_a_worker_that_dies_or_hangs_ends_the_run_in_one_line_leaving_nothing(tmp_path, target_and_data, fault,
                                                                               timeout_s, says):
    """The run's own vLLM worker SIGKILLed, or stopped (SIGSTOP) past train.target.engine_timeout_s, mid-run: one line,
    exit 2, no worker, no feature files."""
    target_dir, data_dir = target_and_data
    target = {**SERVED, "path": str(target_dir), "source": "vllm", "engine_timeout_s": timeout_s}
    train = train_dict(tmp_path / "run", data_dir, steps=500, target=target,
                       drafter={"num_hidden_layers": 1, "block_size": 4, "target_layer_ids": [2, 0]})
    cfg = write_run_config(tmp_path / "run.yaml", train)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_nb.train", "--config", str(cfg)], cwd=REPO, text=True,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert wait_for(lambda: metrics.exists() and len(losses(tmp_path / "run")) >= 2, proc), proc.communicate()
    worker = worker_of(proc.pid)
    tmp = worker_tmp(worker)
    os.kill(worker, fault)
    out, err = proc.communicate(timeout=180)
    lines = [l for l in err.splitlines() if "error:" in l or "Traceback" in l]
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], err[-2000:]
    assert "'features'" in lines[0]
    assert not tmp.exists() and not os.path.exists(f"/proc/{worker}") and group_members(worker) == []


def test_two_ranks_each_with_its_engine_lose_what_one_hooked_rank_loses(tmp_path, target_and_data):
    """torchrun, 2 gloo ranks × 1 row, features from each rank's own vLLM engine, 10 steps == 1 rank × 2 rows on hooks
    (relative 1e-4); every worker ends with the run."""
    target_dir, data_dir = target_and_data
    with intra_op_threads(SUBPROCESS_THREADS):         # the subprocesses' thread count: close to the last bits
        train(train_cfg(tmp_path / "one", data_dir, target={**SERVED, "path": str(target_dir)}, **RUN))
    two = train_dict(tmp_path / "two", data_dir, target={**SERVED, "path": str(target_dir), "source": "vllm"}, **RUN)
    p = run_module(write_run_config(tmp_path / "two.yaml", two), torchrun=2, timeout=400)
    assert p.returncode == 0 and "ranks 2" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    want, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step in want: assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), (step, got[step], want[step])
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("dflash")]
    c = json.loads((target_dir / "config.json").read_text())   # the trainer held the target's head, no layer
    head = 4 * (c["vocab_size"] * c["hidden_size"] * (1 if c.get("tie_word_embeddings") else 2) + c["hidden_size"])
    held = json.loads((tmp_path / "two" / "summary.json").read_text())["cost"]["target"]
    assert round(held["whole_gb_per_rank"] * 1e9) == head and held["split_gb_per_rank"] == 0, held


def test_a_killed_run_resumes_exactly_and_leaves_no_worker(tmp_path, target_and_data):
    """SIGKILL after step 6 of 10 (its engine, split over two processes, follows its parent), resume=auto on an
    unsplit engine: the hooks' 10 losses (1e-4), steps 1-5 from the split engine."""
    target_dir, data_dir = target_and_data
    run = {**RUN, "checkpoint": {"every": 5}}
    with intra_op_threads(SUBPROCESS_THREADS):
        train(train_cfg(tmp_path / "straight", data_dir, target={**SERVED, "path": str(target_dir)}, **run))
    target = {**SERVED, "path": str(target_dir), "source": "vllm", "engine_tp_size": 2}   # the engine: two processes
    killed = train_dict(tmp_path / "killed", data_dir, target=target, fault={"sigkill_at_step": 6}, **run)
    cfg = write_run_config(tmp_path / "k.yaml", killed)
    tmp = tmp_path / "tmp"; tmp.mkdir()   # the killed run's TMPDIR: its worker's own dir is made in it
    p = subprocess.run([sys.executable, "-m", "dflash_nb.train", "--config", str(cfg)], cwd=REPO, text=True,
                       env=env(TMPDIR=str(tmp)), capture_output=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-2000:]
    deadline = time.time() + 60   # the orphaned worker sees its parent gone, ends its group and removes its dir
    while (left := [*tmp.glob("dflash_nb-vllm*"), *with_tmpdir(tmp)]) and time.time() < deadline: time.sleep(0.2)
    assert not left, left
    p = run_module(cfg, "train.resume=auto", "train.fault.sigkill_at_step=null", "train.target.engine_tp_size=1")
    assert p.returncode == 0 and "resumed" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    want, got = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step in want: assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), (step, got[step], want[step])
