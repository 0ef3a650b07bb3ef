"""A target split tensor-parallel (chapter 07c_parallel) trains as one process holding the whole target: real torchrun
processes, gloo on CPU, the tiny Qwen3 and a tiny Qwen3.5-style hybrid target, at dp 1 x tp 2 and dp 2 x tp 2. Losses,
weights, checkpoint -> resume and the exported drafter are compared with one process; a killed or hung rank and the
layouts that cannot work end in one line. (The features themselves are compared in the chapter's two-process example.)"""
import json, time
from pathlib import Path
import pytest, torch, yaml
from safetensors.torch import load_file
from _trainer_common import (make_data, train_cfg, train_dict, write_run_config, run_module, losses, weights, latest,
                             intra_op_threads, SUBPROCESS_THREADS)
from dflash_nb.trainer import train

pytestmark = pytest.mark.slow

# TINY's target with two KV heads: tensor parallelism gives each of 2 ranks whole heads (TINY's single one cannot split)
TP_TINY = {"hidden_size": 32, "num_layers": 4, "num_heads": 2, "num_kv_heads": 2, "head_dim": 16,
           "intermediate_size": 64, "seed": 1}
HYBRID = {**TP_TINY, "arch": "qwen3_5", "full_attention_interval": 2}   # Gated DeltaNet, full, Gated DeltaNet, full
STEPS = 20


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "train", n=24)


def one_process(run_dir, data_dir, tiny, **kw):
    "The reference: one process holding the whole target, with the subprocesses' thread count."
    with intra_op_threads(SUBPROCESS_THREADS):
        return train(train_cfg(run_dir, data_dir, steps=STEPS, global_batch=4, target={"tiny": tiny}, **kw))


def split_config(path, run_dir, data_dir, tiny, tp=2, export=False, **kw) -> Path:
    "A run config of the same run with the target split over `tp` ranks."
    cfg = write_run_config(path, train_dict(run_dir, data_dir, steps=STEPS, global_batch=4,
                                            target={"tiny": tiny, "tp_size": tp}, **kw))
    if export:
        doc = yaml.safe_load(cfg.read_text())
        cfg.write_text(yaml.safe_dump({**doc, "export": True}))
    return cfg


def assert_same_run(one_dir, split_dir):
    "Every step's loss within fp32 noise, the final weights too (a split target sums its partial products in a "
    "different order: features differ by ~1e-7 of their scale)."
    l1, l2 = losses(one_dir), losses(split_dir)
    assert sorted(l1) == sorted(l2) == list(range(1, STEPS + 1))
    for k in l1: assert abs(l1[k] - l2[k]) <= 1e-5, (k, l1[k], l2[k])
    w1, w2 = weights(latest(one_dir)), weights(latest(split_dir))
    assert w1.keys() == w2.keys()
    for k in w1: torch.testing.assert_close(w1[k], w2[k], atol=2e-6, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def left_running(needle: str) -> list[str]:
    "Command lines of the processes still running that name `needle` (a run's config file)."
    out = []
    for p in Path("/proc").glob("[0-9]*"):
        try: cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError: continue
        if needle in cmd: out.append(cmd)
    return out


def error_lines(stderr: str) -> list[str]:
    return [l for l in stderr.splitlines() if "dflash_nb.train: error:" in l]


def test_hybrid_tp2_equals_one_process_through_a_killed_rank(tmp_path, data_dir):
    "A Qwen3.5-style hybrid (Gated DeltaNet + full attention) at dp 1 x tp 2: rank 1 SIGKILLed after the step-10 "
    "checkpoint ends the run in one line; the resumed run's 20 losses, weights and exported drafter equal one process's."
    from dflash_nb.train import export
    one = one_process(tmp_path / "one", data_dir, HYBRID, checkpoint={"every": 10})
    export(one["drafter"], one["drafter_config"], tmp_path / "one-drafter")
    cfg = split_config(tmp_path / "tp.yaml", tmp_path / "tp", data_dir, HYBRID, export=True,
                       checkpoint={"every": 10}, fault={"sigkill_at_step": 12, "rank": 1})
    t0 = time.monotonic()
    p = run_module(cfg, torchrun=2, timeout=300)
    took = time.monotonic() - t0
    assert p.returncode != 0 and took < 120, (took, p.stdout[-2000:], p.stderr[-3000:])
    said = error_lines(p.stderr)
    assert len(said) == 1 and "another rank of this run died during a collective" in said[0], p.stderr[-3000:]
    assert "train.resume=auto" in said[0]
    assert not left_running(str(cfg)), left_running(str(cfg))
    assert latest(tmp_path / "tp").name == "step-00000010"
    p = run_module(cfg, "train.resume=auto", "train.fault.sigkill_at_step=null", torchrun=2, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "resumed" in p.stdout and "ranks 2 = dp 1 x tp 2" in p.stdout and "target qwen3_5_text" in p.stdout
    assert_same_run(tmp_path / "one", tmp_path / "tp")
    assert json.loads((tmp_path / "tp" / "summary.json").read_text())["tp_size"] == 2
    a, b = tmp_path / "one-drafter", tmp_path / "tp" / "drafter"
    assert json.loads((a / "config.json").read_text())["dflash_config"] == json.loads((b / "config.json").read_text())[
        "dflash_config"]
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa: torch.testing.assert_close(wa[k], wb[k], atol=2e-6, rtol=1e-5)


def test_dp2_tp2_four_processes_equal_one_process(tmp_path, data_dir):
    "The tiny Qwen3 in four processes, two TP groups of two: each rank trains its own row of the global batch of 4; "
    "one process's run."
    one_process(tmp_path / "one", data_dir, TP_TINY)
    p = run_module(split_config(tmp_path / "tp.yaml", tmp_path / "tp", data_dir, TP_TINY), torchrun=4, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "ranks 4 = dp 2 x tp 2" in p.stdout
    assert_same_run(tmp_path / "one", tmp_path / "tp")
    state = json.loads((latest(tmp_path / "tp") / "state.json").read_text())
    assert state["world_size"] == 4


def test_a_hung_rank_ends_the_run_in_one_line(tmp_path, data_dir):
    "Rank 1 stops (SIGSTOP) at step 3: rank 0's collective gives up after collective_timeout_s; one line, every "
    "process gone, the checkpoint before kept."
    cfg = split_config(tmp_path / "tp.yaml", tmp_path / "tp", data_dir, TP_TINY, collective_timeout_s=5,
                       checkpoint={"every": 2}, fault={"hang_at_step": 3, "rank": 1})
    t0 = time.monotonic()
    p = run_module(cfg, torchrun=2, timeout=300)
    took = time.monotonic() - t0
    assert p.returncode != 0 and took < 150, (took, p.stderr[-3000:])
    said = error_lines(p.stderr)
    assert len(said) == 1 and "waited train.collective_timeout_s for another rank" in said[0], p.stderr[-3000:]
    assert not left_running(str(cfg)), left_running(str(cfg))
    assert latest(tmp_path / "tp").name == "step-00000002"


def test_kv_heads_that_tp_does_not_divide_are_one_line_before_any_step(tmp_path, data_dir):
    "One KV head cannot be split over 2 ranks: a rank says so in one line before any step (no traceback); torchrun "
    "SIGTERMs the other as soon as the first exits, so whether the other says it too (or is ended first) is a race."
    cfg = split_config(tmp_path / "tp.yaml", tmp_path / "tp", data_dir, {**TP_TINY, "num_kv_heads": 1})
    p = run_module(cfg, torchrun=2, timeout=300)
    assert p.returncode != 0, p.stdout[-2000:]
    said = error_lines(p.stderr)
    assert 1 <= len(said) <= 2, p.stderr[-3000:]
    assert all("num_key_value_heads=1 is not divisible by train.target.tp_size=2" in l for l in said)
    assert "Traceback" not in "\n".join(l for l in p.stderr.splitlines() if l.startswith("[rank"))
    assert not list((tmp_path / "tp").glob("checkpoints/step-*"))


def test_a_world_that_tp_does_not_divide_is_one_line(tmp_path, data_dir, capsys):
    "tp_size 2 in a plain one-process run (or any world it does not divide): one line, exit 2, nothing written."
    from dflash_nb.train import main
    cfg = split_config(tmp_path / "tp.yaml", tmp_path / "tp", data_dir, TP_TINY)
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.target.tp_size=2 does not divide the 1 processes of this run" in err[0], err
    assert not (tmp_path / "tp").exists()


def test_a_split_target_does_not_regenerate_in_the_training_run(tmp_path):
    "regenerate.prompts with tp_size 2 is refused before anything runs: regenerate with dflash-regen first."
    from dflash_nb.config import from_dict, ConfigError
    from dflash_nb.train import RunConfig, check_run
    cfg = from_dict(RunConfig, {"train": {"run_dir": str(tmp_path / "r"), "target": {"tp_size": 2}},
                                "regenerate": {"prompts": "bundled"}})
    with pytest.raises(ConfigError, match="run dflash-regen --engine vllm --tensor-parallel-size 2"):
        check_run(cfg)
