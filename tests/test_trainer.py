"""The pipelined online trainer: overlap never changes results, DDP ranks == one rank, exact resume after
SIGKILL, crash-safe checkpoints, non-finite steps, template guard, SIGTERM. Real processes, real tokenizer, no mocks
beyond the trainer's own fault-injection switches."""
import json, shutil, signal, subprocess, sys, time
from pathlib import Path
import pytest, torch
from _trainer_common import (make_data, train_cfg, train_dict, write_run_config, run_module, losses, weights, latest, env, REPO)
from _trainer_common import intra_op_threads, SUBPROCESS_THREADS
from dflash_nb.rows import RowStream, rank_row
from dflash_nb.trainer import train, NonFiniteError
from dflash_nb.checkpoint import load_checkpoint, load_rngs


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "train", n=24)


def _close(a: dict, b: dict, atol=1e-6, rtol=1e-5):
    assert a.keys() == b.keys()
    for k in a: torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")


def test_pipelined_equals_sequential(tmp_path, data_dir):
    "Overlap changes timing, never results: same loss at every step and same final weights."
    runs = {}
    for mode in (True, False):
        s = train(train_cfg(tmp_path / f"p{int(mode)}", data_dir, steps=5, pipeline=mode))
        runs[mode] = (losses(tmp_path / f"p{int(mode)}"), s["drafter"].trainable_state_dict())
    (lp, wp), (ls, ws) = runs[True], runs[False]
    assert sorted(lp) == [1, 2, 3, 4, 5]
    for k in lp: assert abs(lp[k] - ls[k]) <= 1e-6 * max(1, abs(ls[k])), (k, lp[k], ls[k])
    _close(wp, ws, atol=0, rtol=0)


def test_distillation_and_dpace_train(tmp_path, data_dir):
    "train.loss: online distillation (the target's final states ride with the features) and D-PACE run in the real loop, "
    "pipelined or not with the same result, and change the training signal."
    plain = losses(Path(train(train_cfg(tmp_path / "ce", data_dir, steps=3, pipeline=False))["run_dir"]))
    runs = {}
    for mode in (True, False):
        train(train_cfg(tmp_path / f"kd{int(mode)}", data_dir, steps=3, pipeline=mode,
                        loss={"distill_weight": 0.5, "weighting": "dpace"}))
        runs[mode] = losses(tmp_path / f"kd{int(mode)}")
    assert sorted(runs[True]) == [1, 2, 3]
    for k in runs[True]: assert abs(runs[True][k] - runs[False][k]) <= 1e-6 * max(1, abs(runs[False][k]))
    assert all(abs(runs[True][k] - plain[k]) > 1e-3 for k in plain)


def test_data_order_one_rank_equals_two():
    "The row stream sliced for 2 ranks with G/2 each is, step by step, the 1-rank slice with G."
    s = RowStream([30, 70, 20, 90, 40, 10, 60, 50, 80], max_tokens=120, seed=5)
    for step in range(8):
        one = [s[rank_row(step, i, 4, 0, 1)] for i in range(4)]
        two = [s[rank_row(step, i, 4, r, 2)] for r in range(2) for i in range(2)]
        assert one == two


def test_two_gloo_ranks_equal_one_rank(tmp_path, data_dir):
    "torchrun with 2 gloo ranks × 2 rows == 1 rank × 4 rows: same losses and same weights after N steps."
    with intra_op_threads(SUBPROCESS_THREADS):         # bitwise-close needs the subprocesses' thread count
        train(train_cfg(tmp_path / "one", data_dir, steps=4, global_batch=4))
    cfg = write_run_config(tmp_path / "two.yaml", train_dict(tmp_path / "two", data_dir, steps=4, global_batch=4))
    p = run_module(cfg, torchrun=2, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ranks 2" in p.stdout
    l1, l2 = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for k in l1: assert abs(l1[k] - l2[k]) < 1e-5, (k, l1[k], l2[k])
    _close(weights(latest(tmp_path / "one")), weights(latest(tmp_path / "two")), atol=2e-6, rtol=1e-5)
    assert json.loads((latest(tmp_path / "two") / "state.json").read_text())["world_size"] == 2
    assert len(load_rngs(latest(tmp_path / "two") / "rng.safetensors")) == 2  # every rank's RNG state


def test_exact_resume_after_sigkill(tmp_path, data_dir):
    "N steps straight == N/2 steps, SIGKILL (real subprocess), resume, N/2 steps: same losses, same weights, same optimizer."
    N = 6
    with intra_op_threads(SUBPROCESS_THREADS):        # bitwise equality needs the subprocesses' thread count
        train(train_cfg(tmp_path / "straight", data_dir, steps=N, checkpoint={"every": N // 2}))
    cfg = write_run_config(tmp_path / "k.yaml", train_dict(tmp_path / "killed", data_dir, steps=N, checkpoint={"every": N // 2},
                                                         fault={"sigkill_at_step": N // 2 + 1}))
    p = run_module(cfg)
    assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-2000:]
    assert latest(tmp_path / "killed").name == f"step-{N // 2:08d}"
    assert max(losses(tmp_path / "killed")) == N // 2 + 1       # it ran past the checkpoint before dying
    p = run_module(cfg, "train.resume=auto", "train.fault.sigkill_at_step=null")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "resumed" in p.stdout
    ls, lk = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(lk) == list(range(1, N + 1))
    for k in ls: assert abs(ls[k] - lk[k]) <= 1e-6 * max(1, abs(ls[k])), (k, ls[k], lk[k])
    a, b = load_checkpoint(latest(tmp_path / "straight")), load_checkpoint(latest(tmp_path / "killed"))
    _close(a["weights"], b["weights"], atol=0, rtol=0)
    assert a["state"]["step"] == b["state"]["step"] == N
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        _close(sa, sb, atol=0, rtol=0)


def test_kill_during_checkpoint_write_keeps_previous(tmp_path, data_dir):
    "SIGKILL half-way through writing a checkpoint leaves the previous one as `latest`, loadable; resume then finishes."
    cfg = write_run_config(tmp_path / "c.yaml", train_dict(tmp_path / "run", data_dir, steps=6, checkpoint={"every": 2},
                                                         fault={"kill_in_checkpoint": 4}))
    p = run_module(cfg)
    assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-2000:]
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000002"
    assert list(root.glob(".step-00000004.tmp-*")), "the half-written checkpoint should be a temp dir"
    assert not (root / "step-00000004").exists()
    ck = load_checkpoint(tmp_path / "run")
    assert ck["state"]["step"] == 2 and ck["weights"]
    p = run_module(cfg, "train.resume=auto", "train.fault.kill_in_checkpoint=null")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert latest(tmp_path / "run").name == "step-00000006"
    assert not list(root.glob(".step-*.tmp-*")), "stale temp dirs are cleaned by the next save"


def test_nan_loss_is_skipped_and_counted(tmp_path, data_dir):
    "An injected NaN loss skips that step (weights and AdamW moments unchanged) and is counted; training goes on."
    s = train(train_cfg(tmp_path / "r", data_dir, steps=5, fault={"nan_loss_steps": [2]}, checkpoint={"every": 1, "keep": 10}))
    assert s["nonfinite_total"] == 1 and s["stopped"] is None
    root = tmp_path / "r" / "checkpoints"
    w2, w3, w4 = (load_checkpoint(root / f"step-0000000{i}") for i in (2, 3, 4))
    _close(w2["weights"], w3["weights"], atol=0, rtol=0)          # step index 2 (the 3rd step) was skipped
    for sa, sb in zip(w2["optimizer"]["state"].values(), w3["optimizer"]["state"].values()): _close(sa, sb, atol=0, rtol=0)
    assert any((w3["weights"][k] != w4["weights"][k]).any() for k in w3["weights"])  # and the next one trained
    recs = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert [r["skipped"] for r in recs] == [0, 0, 1, 0, 0]
    assert recs[-1]["nonfinite_total"] == 1
    assert all(torch.isfinite(v).all() for v in s["drafter"].trainable_state_dict().values())


def test_too_many_nonfinite_stops_with_last_good_checkpoint(tmp_path, data_dir):
    "Non-finite steps in a row beyond max_nonfinite stop the run with an error; `latest` stays the last good checkpoint."
    cfg = train_cfg(tmp_path / "r", data_dir, steps=10, max_nonfinite=3, checkpoint={"every": 2},
                    fault={"nan_loss_steps": list(range(3, 10))})
    with pytest.raises(NonFiniteError, match="non-finite steps in a row"):
        train(cfg)
    ck = load_checkpoint(tmp_path / "r")
    assert ck["state"]["step"] in (2, 4)      # written before the streak reached the limit
    assert all(torch.isfinite(v).all() for v in ck["weights"].values())
    assert not (tmp_path / "r" / "checkpoints" / "step-00000006").exists()


def test_wrong_template_refused(tmp_path):
    "Data rendered with another chat template than the target's is refused with a message that says so."
    from dflash_nb.records import qwen3_tokenizer_dir
    tok = tmp_path / "tok"
    shutil.copytree(qwen3_tokenizer_dir(), tok)
    tc = json.loads((tok / "tokenizer_config.json").read_text())
    tc["chat_template"] = tc["chat_template"] + "{#- another template revision -#}"
    (tok / "tokenizer_config.json").write_text(json.dumps(tc))
    other = make_data(tmp_path / "other", n=6, tokenizer_dir=tok)
    with pytest.raises(ValueError, match="chat template"):
        train(train_cfg(tmp_path / "r", other, steps=1))
    # the same data is accepted by a target whose tokenizer is that one
    s = train(train_cfg(tmp_path / "r2", other, steps=1, target={"tokenizer": str(tok)}))
    assert s["steps"] == 1


def test_sigterm_checkpoints_then_exits(tmp_path, data_dir):
    """SIGTERM (preemption) → a checkpoint at the next step boundary, exit code 143, and one stderr line saying where
    it stopped and how to continue (train.resume=auto); summary.json counts the steps the checkpoint holds."""
    cfg = write_run_config(tmp_path / "s.yaml", train_dict(tmp_path / "run", data_dir, steps=400, checkpoint={"every": 0}))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_nb.train", "--config", str(cfg)], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    t0 = time.time()
    while time.time() - t0 < 120 and not (metrics.exists() and metrics.read_text().count('"loss"') >= 2): time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-2000:] + err[-2000:]
    ck = load_checkpoint(tmp_path / "run")
    step = ck["state"]["step"]
    assert 2 <= step < 400
    assert max(losses(tmp_path / "run")) == step
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == step
    assert err.strip().splitlines()[-1] == (
        f"python -m dflash_nb.train: stopped early by SIGTERM after step {step} of 400 (checkpoint {tmp_path / 'run' / 'checkpoints' / f'step-{step:08d}'}); "
        "run the same command with train.resume=auto to continue from there"), err[-2000:]


def test_shipped_configs_parse():
    "Every config in configs/ loads into RunConfig (strict: unknown keys and wrong types would fail); the demo is the packaged one."
    from dflash_nb.config import load_config
    from dflash_nb.train import RunConfig, demo_config_path
    names = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    assert {"demo.yaml", "qwen3-8b-1gpu.yaml", "qwen3.6-27b-4gpu-pairs.yaml"} <= set(names)
    for n in names: load_config(RunConfig, REPO / "configs" / n)
    assert (REPO / "configs" / "demo.yaml").read_text() == demo_config_path().read_text()
    pairs = load_config(RunConfig, REPO / "configs" / "qwen3.6-27b-4gpu-pairs.yaml").train
    assert pairs.devices == [["cuda:0", "cuda:2"], ["cuda:1", "cuda:3"]] and pairs.global_batch % 2 == 0
    from dflash_nb.parallel import Layout, check_tp_target
    from transformers import Qwen3_5TextConfig
    tp = load_config(RunConfig, REPO / "configs" / "qwen3.6-27b-8gpu-tp.yaml")   # 8 GPUs, the target split 4 ways
    t = tp.train
    assert t.target.tp_size == 4 and t.devices == [] and not tp.regenerate.prompts and t.global_batch % 8 == 0
    assert Layout(world=8, rank=0, tp=t.target.tp_size).dp == 2
    check_tp_target(Qwen3_5TextConfig(num_attention_heads=24, num_key_value_heads=4), t.target.tp_size)  # heads divide


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
def test_gpu_pipelined_equals_sequential(tmp_path, data_dir, split):
    "On CUDA (streams, events, non_blocking copies, bf16 autocast, fused AdamW skip): pipelined == sequential; split pair if 2 GPUs."
    if split and torch.cuda.device_count() < 2: pytest.skip("needs 2 GPUs for a split target -> drafter pair")
    devices = [["cuda:0", "cuda:1" if split else "cuda:0"]]
    runs = {}
    for mode in (True, False):
        s = train(train_cfg(tmp_path / f"g{int(mode)}", data_dir, steps=4, pipeline=mode, devices=devices, backend="sdpa",
                            fault={"nan_loss_steps": [2]}))
        runs[mode] = losses(tmp_path / f"g{int(mode)}")
        assert s["nonfinite_total"] == 1
        rec = s["final"]
        assert set(rec["peak_mem_gb"]) == {d for pair in devices for d in pair}
        if split: assert rec["transfer_gb_s"] and rec["transfer_gb_s"] > 0
    for k in runs[True]:
        if k == 3: continue   # the NaN step
        assert abs(runs[True][k] - runs[False][k]) <= 2e-3 * max(1, abs(runs[False][k])), (k, runs[True][k], runs[False][k])
