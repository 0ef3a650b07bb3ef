"""Shared helpers of the trainer tests: a small real tokenized data set, a tiny run config, subprocess runs."""
import contextlib, json, multiprocessing, os, subprocess, sys
from pathlib import Path
import torch, yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]

# a tiny target (real Qwen3 vocabulary, so the real tokenizer fits) and a one-layer drafter: every step is cheap
TINY = {
    "max_tokens": 160, "max_anchors": 8, "global_batch": 2, "log_every": 1, "seed": 3,
    "amp": "off",   # fp32 throughout: tests compare runs bit for bit, and tiny shapes gain nothing from bf16
    "target": {"tiny": {"hidden_size": 32, "num_layers": 4, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                        "intermediate_size": 64, "seed": 1}, "dtype": "float32"},
    "drafter": {"num_hidden_layers": 1, "block_size": 4, "target_layer_ids": [1, 2]},
    "optim": {"lr": 3e-3},
}


def make_data(out_dir, n=24, seed=0, tokenizer_dir=None):
    "Tokenize `n` synthetic conversations with the real pipeline (dflash_nb.data) into `out_dir`."
    from dflash_nb.records import qwen3_tokenizer_dir, DataConfig
    from dflash_nb.inputs import synthetic_records, write_jsonl
    from dflash_nb.shards import tokenize_dataset
    out_dir = Path(out_dir)
    src = write_jsonl(synthetic_records(n, seed=seed, approx_tokens=40), out_dir.parent / f"{out_dir.name}.jsonl")
    tokenize_dataset([str(src)], tokenizer_dir or qwen3_tokenizer_dir(), out_dir, DataConfig(workers=1, max_seq_len=160, min_loss_tokens=8), verbose=False)
    return out_dir


def train_dict(run_dir, data_dir, **kw):
    "A TrainConfig as a plain dict: TINY, then `kw` through `apply_overrides` (a dict for a section of TINY sets its keys)."
    from dflash_nb.config import apply_overrides
    dotted = {f"{k}.{k2}": v2 for k, v in kw.items() if isinstance(v, dict) and isinstance(TINY.get(k), dict)
              for k2, v2 in v.items()}
    dotted.update({k: v for k, v in kw.items() if not (isinstance(v, dict) and isinstance(TINY.get(k), dict))})
    return apply_overrides(TINY, {"run_dir": str(run_dir), "data_dir": str(data_dir), **dotted})


def train_cfg(run_dir, data_dir, **kw):
    from dflash_nb.config import from_dict
    from dflash_nb.train_config import TrainConfig
    return from_dict(TrainConfig, train_dict(run_dir, data_dir, **kw))


def write_run_config(path, train: dict) -> Path:
    "A RunConfig YAML that only trains (no regeneration, no τ, no export)."
    path = Path(path)
    path.write_text(yaml.safe_dump({"train": train, "evaluate": {"num_samples": 0}, "export": False}))
    return path


SUBPROCESS_THREADS = 1   # intra-op threads of every subprocess run; in-process references compared bitwise use it too


def env(**extra):
    e = {**os.environ, "OMP_NUM_THREADS": str(SUBPROCESS_THREADS), "PYTHONUNBUFFERED": "1", **extra}
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def run_module(cfg_path, *overrides, torchrun: int = 0, timeout=300, **kw) -> subprocess.CompletedProcess:
    "Run `python -m dflash_nb.train --config cfg_path ...` (or under torchrun with `torchrun` processes) as a real subprocess."
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
               "-m", "dflash_nb.train", "--config", str(cfg_path), *overrides]
    else:
        cmd = [sys.executable, "-m", "dflash_nb.train", "--config", str(cfg_path), *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout, **kw)


def losses(run_dir) -> dict:
    "step -> loss from metrics.jsonl (the last record of a step wins: a resumed run re-logs nothing it did not redo)."
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r: out[r["step"]] = r["loss"]
    return out


def weights(ckpt_dir) -> dict:
    return load_file(str(Path(ckpt_dir) / "drafter.safetensors"))


def latest(run_dir) -> Path:
    root = Path(run_dir) / "checkpoints"
    return root / (root / "latest").read_text().strip()


@contextlib.contextmanager
def intra_op_threads(n: int):
    "Run the body with `n` torch intra-op threads (what `OMP_NUM_THREADS=n` gives a subprocess), restored after."
    # CPU reductions split their work by thread count, so bitwise equality holds only between runs with the same count
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try: yield
    finally: torch.set_num_threads(before)


def _burn(stop):
    "Spin until `stop` is set: a process that keeps one core busy."
    x = 0
    while not stop.is_set():
        for i in range(100_000): x += i


@contextlib.contextmanager
def cpu_load(n: int | None = None):
    "Keep `n` (default: every core) CPU-burning processes running for the duration of the body."
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(n or os.cpu_count())]
    for p in procs: p.start()
    try: yield procs
    finally:
        stop.set()
        for p in procs:
            p.join(5)
            if p.is_alive(): p.kill()


def free_port() -> int:
    "A TCP port free on 127.0.0.1 right now (the rendezvous of processes started without torchrun)."
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(cfg_path, per_rank: list, cwd=None, **popen) -> list[subprocess.Popen]:
    """`python -m dflash_nb.train --config cfg_path` as len(per_rank) real ranks of one gloo world (torchrun's
    environment, set by hand), rank r with the `key=value` overrides per_rank[r]: ranks that torchrun would start alike
    can be started unlike. cwd: one directory, or one per rank."""
    port, world = free_port(), len(per_rank)
    cwds = cwd if isinstance(cwd, list) else [cwd or REPO] * world
    return [subprocess.Popen([sys.executable, "-m", "dflash_nb.train", "--config", str(cfg_path), *over], cwd=cwds[r],
                             env=env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
            for r, over in enumerate(per_rank)]
