"""vLLM (CPU) serving a drafter this project trained: vLLM's τ (its own spec-decode counters) next to dflash_nb's τ on
the same prompts, whether the outputs with and without the drafter are identical, and vLLM's output tokens/s without
and with the drafter, measured in one run; the with / without ratio is printed.

The input is a finished demo-style run dir trained on a target vLLM's CPU attention accepts (head_dim >= 32):

    python -m dflash_nb.train train.target.tiny.head_dim=64 train.run_dir=DIR

(~10 min wall on the 2-core machine: the run in the JSON trained in 588 s). Without `--run`, that command trains one
into runs/serving-demo64 when that folder holds no finished run. The evaluation is the real console script,
`dflash-eval --engine vllm`, on the run's held-out prompts with the assistant answers removed (no prompt carries its
reference answer), the target written as a model directory (weights from the run's config.yaml + the tokenizer files:
vLLM loads a directory), greedy, float32.

    python bench/serving.py --run /tmp/vllm_probe/demo64
    python bench/serving.py --max-new-tokens 32 --out /tmp/serving.json

Writes bench/results/serving-cpu.json (or --out).
"""
from __future__ import annotations
import argparse, json, os, platform, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import now_iso, write_json  # noqa: E402

DEFAULT_RUN = ROOT / "runs" / "serving-demo64"
EVAL = ROOT / ".venv" / "bin" / "dflash-eval"


def train_cmd(run_dir: Path) -> list[str]:
    "The demo's training command on a head_dim-64 target (vLLM's CPU attention refuses head_dim < 32)."
    return [sys.executable, "-m", "dflash_nb.train", "train.target.tiny.head_dim=64", f"train.run_dir={run_dir}"]


def finished(run_dir: Path) -> bool:
    return (run_dir / "drafter" / "config.json").is_file() and (run_dir / "config.yaml").is_file()


def write_target(run_dir: Path, out: Path) -> Path:
    "The run's target as a model directory vLLM loads: weights built from its config.yaml, plus its tokenizer files."
    import torch
    from dflash_nb.build import build_target, tokenizer_dir
    from dflash_nb.config import load_config
    from dflash_nb.train_config import TrainConfig
    tc = load_config(TrainConfig, run_dir / "config.yaml").target
    build_target(tc, torch.device("cpu")).save_pretrained(out)
    for f in tokenizer_dir(tc).iterdir():
        if f.is_file() and not (out / f.name).exists(): shutil.copy(f, out / f.name)
    return out


def write_prompts(heldout: Path, out: Path) -> tuple[int, int]:
    "Each held-out conversation up to its first assistant turn, as a chat JSONL; (prompts, those holding their answer)."
    n = leaks = 0
    with open(heldout) as src, open(out, "w") as dst:
        for line in src:
            if not line.strip(): continue
            msgs = json.loads(line)["messages"]
            k = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            answer, prompt = msgs[k]["content"], msgs[:k]
            leaks += bool(answer.strip()) and any(answer.strip() in m["content"] for m in prompt)
            dst.write(json.dumps({"messages": prompt}, ensure_ascii=False) + "\n")
            n += 1
    return n, leaks


def heldout_prompts(run_dir: Path, tmp: Path) -> tuple[Path, int, int, dict]:
    "The run's held-out prompts written for dflash-eval; (path, prompts, those holding their answer, template kwargs)."
    manifest = json.loads((run_dir / "data" / "heldout" / "manifest.json").read_text())
    n, leaks = write_prompts(run_dir / "generated" / "heldout.jsonl", tmp / "heldout-prompts.jsonl")
    return tmp / "heldout-prompts.jsonl", n, leaks, manifest.get("template_kwargs") or {}   # the run's template kwargs


def eval_cmd(target: Path, run_dir: Path, prompts: Path, max_new_tokens: int, kwargs: dict, out: Path, *more) -> list:
    "The real console script serving the run's drafter under vLLM: `dflash-eval --engine vllm ...` writing `out`."
    return [str(EVAL), "--engine", "vllm", "--target", str(target), "--drafter", str(run_dir / "drafter"), "--prompts",
            str(prompts), "--max-new-tokens", str(max_new_tokens), "--chat-template-kwargs", json.dumps(kwargs), *more,
            "--json", str(out)]


def run_summary(run_dir: Path) -> dict:
    "What was trained: target and drafter dims, block size, layer types, training steps and wall, τ before/after."
    import yaml
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    d = json.loads((run_dir / "drafter" / "config.json").read_text())
    rep = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else {}
    return {"run_dir": str(run_dir), "steps": cfg.get("steps"), "target": cfg["target"],
            "drafter": {k: d.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "head_dim", "intermediate_size", "layer_types")},
            "block_size": d.get("block_size"), "target_layer_ids": d.get("dflash_config", {}).get("target_layer_ids"),
            "train_wall_s": rep.get("train", {}).get("wall_s"),
            "tau_before": rep.get("tau_before", {}).get("tau"), "tau_after": rep.get("tau_after", {}).get("tau")}


def accepted_per_pos(histogram: list[int]) -> list[int]:
    "Cycles that accepted position k (histogram[j]: cycles accepting j draft tokens) — vLLM's per-position counter."
    return [sum(histogram[k + 1:]) for k in range(len(histogram) - 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=str(DEFAULT_RUN), help="finished run dir (default: trained here when missing)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--note", default="", help="conditions worth recording (e.g. other work loading the machine)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving-cpu.json"))
    a = ap.parse_args(argv)
    run_dir, load0, t0 = Path(a.run).resolve(), os.getloadavg(), time.perf_counter()
    trained_here = not finished(run_dir)
    if trained_here:
        if run_dir != DEFAULT_RUN.resolve():
            print(f"--run {run_dir}: no finished run there (drafter/config.json, config.yaml)", file=sys.stderr)
            return 2
        print("training", " ".join(train_cmd(run_dir)), "(~10 min on 2 cores)", flush=True)
        subprocess.run(train_cmd(run_dir), check=True, cwd=ROOT)
    with tempfile.TemporaryDirectory(prefix="dflash_nb-serving-") as tmp:
        tmp = Path(tmp)
        target = write_target(run_dir, tmp / "target")
        prompts, n_prompts, leaks, kwargs = heldout_prompts(run_dir, tmp)
        if leaks: raise SystemExit(f"{leaks} prompts hold their reference answer")
        cmd = eval_cmd(target, run_dir, prompts, a.max_new_tokens, kwargs, tmp / "eval.json")
        t1 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT)
        eval_s = time.perf_counter() - t1
        res = json.loads((tmp / "eval.json").read_text())
        tcfg = json.loads((target / "config.json").read_text())
    (cell,) = res["prompt_sets"].values()
    r = cell["0"]
    v = r["vllm"]
    out = {
        "bench": "serving", "when": now_iso(), "host": platform.node(), "cpus": os.cpu_count(),
        "command": [c.replace(str(tmp), "$TMP") for c in cmd], "trained_here": trained_here,
        "run": run_summary(run_dir),
        "target": {k: tcfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "num_key_value_heads", "head_dim", "intermediate_size", "layer_types")},
        "serving_python": os.environ.get("DFLASH_SERVING_PYTHON", "the checkout's .venv-serving"),
        "prompts": n_prompts, "prompts_holding_answer": leaks,
        "chat_template_kwargs": kwargs, "max_new_tokens": res["max_new_tokens"], "temperature": 0.0,
        "dtype": "float32",
        "dflash_nb": {"tau": r["tau"], "cycles": r["cycles"], "tokens": r["tokens"], "histogram": r["histogram"],
                      "accepted_per_pos": accepted_per_pos(r["histogram"]), "per_position": r["per_position"],
                      "seconds": r["seconds"]},
        "vllm": {"tau": v["tau"], "drafts": v["drafts"], "accepted": v["accepted"],
                 "accepted_per_pos": v["accepted_per_pos"], "per_position": v["per_position"], "tokens": v["tokens"]},
        "identical": v["identical"], "identical_of": v["prompts"],
        "tokens_per_s": {"without_drafter": v["plain_tokens_per_s"], "with_drafter": v["tokens_per_s"]},
        "speedup": v["speedup"],
        "eval_wall_s": round(eval_s, 1), "wall_s": round(time.perf_counter() - t0, 1),
        "load_start": [round(x, 2) for x in load0], "load_end": [round(x, 2) for x in os.getloadavg()],
        "note": a.note,
    }
    path = write_json(a.out, out)
    print(f"τ: dflash_nb {r['tau']:.3f}, vLLM {v['tau']:.3f}; identical {v['identical']}/{v['prompts']}")
    print(f"vLLM output tokens/s: {v['plain_tokens_per_s']:.1f} without the drafter, {v['tokens_per_s']:.1f} with it "
          f"-> ratio {v['speedup']:.3f}x")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
