"""The ranks of one run run one config on one data set (chapter 07c_parallel, `check_ranks_agree`): real gloo ranks,
started by hand with torchrun's environment so that they can differ, end together when they do, each in one line naming
the first keys and both values, exit 2, before any step and before anything is written. A distributed run that SIGTERM
stops at a step boundary says so on stderr (rank 0, once), with the step and how to resume."""
import signal, time
import pytest
from _trainer_common import make_data, train_dict, write_run_config, start_ranks, losses, latest

pytestmark = pytest.mark.slow   # two real processes per test, each importing torch and transformers (~30-60 s here)
PROG = "python -m dflash_nb.train"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "train", n=8)


def finish(procs, timeout=300) -> list[tuple[int, str]]:
    "(exit code, stderr) of every rank, once all have ended (none is left running, even on a timeout)."
    try: return [(p.communicate(timeout=timeout)[1], p.returncode)[::-1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None: p.kill()


# (what differs, rank 0's overrides, rank 1's, the line's words); the tp_size case uses two KV heads so that tp 2 fits
CASES = [
    ("lr", [], ["train.optim.lr=0.03"], "train.optim.lr 0.03 vs 0.003"),
    ("tp_size", ["train.target.tp_size=2", "train.target.tiny.num_kv_heads=2"], ["train.target.tiny.num_kv_heads=2"],
     "train.target.tp_size 1 vs 2"),
    ("drafter depth", [], ["train.drafter.num_hidden_layers=2"], "train.drafter.num_hidden_layers 2 vs 1"),
]


@pytest.mark.parametrize("what,rank0,rank1,words", CASES, ids=[c[0] for c in CASES])
def test_ranks_with_different_configs_end_in_one_line(tmp_path, data_dir, what, rank0, rank1, words):
    cfg = write_run_config(tmp_path / "run.yaml", train_dict(tmp_path / "run", data_dir, steps=4))
    ended = finish(start_ranks(cfg, [rank0, rank1]))
    for rank, (rc, err) in enumerate(ended):
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (rank, rc, err[-3000:])
        assert lines[0] == f"{PROG}: error: rank 1's config differs from rank 0's: {words}; start every rank with " \
                           "the same config file and key=value overrides", (rank, lines)
    assert not (tmp_path / "run").exists()          # no step ran, nothing was written: not even the run dir


def test_ranks_that_read_different_data_end_in_one_line(tmp_path, data_dir):
    "One config, `data_dir: data` read from two working directories that hold two data sets: the data ids differ."
    for r, seed in ((0, 0), (1, 1)): make_data(tmp_path / f"cwd{r}" / "data", n=8, seed=seed)
    cfg = write_run_config(tmp_path / "run.yaml", train_dict(tmp_path / "run", "data", steps=4))
    ended = finish(start_ranks(cfg, [[], []], cwd=[tmp_path / "cwd0", tmp_path / "cwd1"]))
    for rank, (rc, err) in enumerate(ended):
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (rank, rc, err[-3000:])
        assert lines[0].startswith(f"{PROG}: error: rank 1's data differs from rank 0's: data_id "), lines
        assert lines[0].endswith("train.data_dir data must hold the same data set (shards and chat template) on every "
                                 "rank"), lines
    assert not (tmp_path / "run" / "config.yaml").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_a_sigtermed_two_rank_run_says_where_it_stopped_and_how_to_resume(tmp_path, data_dir):
    "SIGTERM to both ranks: they stop after the same step, rank 0 checkpoints it and says so once on stderr, exit 143."
    cfg = write_run_config(tmp_path / "run.yaml", train_dict(tmp_path / "run", data_dir, steps=400,
                                                             checkpoint={"every": 0}))
    procs = start_ranks(cfg, [[], []])
    metrics, t0 = tmp_path / "run" / "metrics.jsonl", time.time()
    while time.time() - t0 < 240 and not (metrics.exists() and metrics.read_text().count('"loss"') >= 2):
        time.sleep(0.2)
    for p in procs: p.send_signal(signal.SIGTERM)
    (rc0, err0), (rc1, err1) = finish(procs)
    assert rc0 == rc1 == 143, (rc0, rc1, err0[-2000:], err1[-2000:])
    step = int(latest(tmp_path / "run").name.split("-")[1])
    assert 2 <= step < 400 and max(losses(tmp_path / "run")) == step
    said = [l for l in err0.splitlines() if "stopped early by SIGTERM" in l]
    assert said == [f"{PROG}: stopped early by SIGTERM after step {step} of 400 (checkpoint "
                    f"{tmp_path / 'run' / 'checkpoints' / f'step-{step:08d}'}); run the same command with "
                    "train.resume=auto to continue from there"], err0[-2000:]
    assert "stopped early" not in err1, err1[-2000:]
