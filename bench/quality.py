"""Recipe quality: acceptance length τ of drafters trained with different recipes, with seeds and significance.

Every variant trains on the same tokenized data for the same number of optimizer steps, rows and tokens — so the same
target forwards, the cost that dominates at scale — from 3 seeds, and is measured with the project's evaluator (greedy
speculative-decoding walk) on held-out samples the training never saw. Per variant it prints τ mean ± sd over seeds, the
difference to the baseline in % with Welch's t-test over seeds and a paired bootstrap over held-out samples, and the
cost next to it: wall seconds, the drafter's busy share, the target layers run per forward.

Data: the demo's tiny Qwen3 target (6 layers, fixed-seed weights) completes templated chat prompts greedily (up to 160
tokens); the held-out prompts are about topics no training prompt mentions. Setups (drafter recipes on that data):
  demo    the embedded demo's recipe: 2-layer drafter, block 8, features of target layers [1, 3, 4], 256-token rows
  long    closer to the flagship drafter: block 16, layers [sliding, full] with a 48-token window (the per-query window
          matters), 512-token rows of several documents
(A tiny Qwen3.5-hybrid target was tried for the second setup: on CPU its Gated DeltaNet runs in transformers' reference
code, generating 32 completions took 5 minutes, and 90% of its tokens did not survive the text round trip.)

Variants (train config overrides on top of the setup's recipe):
  base           the current defaults
  distill        online distillation, 50% data CE + 50% KL to the target's distribution (loss.distill_weight 0.5)
  distill_only   KL to the target only (loss.distill_weight 1)
  anchors_x4     4x the anchors per row (more drafter work per target forward)
  dpace          D-PACE slot weights instead of the decay
  lr_x2          twice the peak learning rate

    python bench/quality.py                                  # default: both setups, 4 variants, seeds 0 1 2
    python bench/quality.py --setups demo --variants base distill --seeds 0 1
    python bench/quality.py --smoke                          # one setup, one variant, one seed, tiny: tests the script

Data is generated once per setup into --work (default bench/.quality_work, reused when present). Writes
bench/results/quality.json (or --out).
"""
from __future__ import annotations
import argparse, json, math, os, platform, random, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch

# One data set serves both setups: the demo's tiny target completes every prompt with up to 160 tokens (greedy)
TARGET = dict(arch="qwen3", hidden_size=64, num_layers=6, seed=11, initializer_range=0.04)
DATA = dict(max_new_tokens=160, enable_thinking=False, min_loss_tokens=8, max_degenerate_fraction=0.5)
SETUPS = {
    "demo": dict(
        drafter=dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, intermediate_size=512, block_size=8,
                     target_layer_ids=[1, 3, 4]),
        train=dict(max_tokens=256, global_batch=4, max_anchors=8, steps=100, optim={"lr": 2e-3})),
    "long": dict(
        drafter=dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, intermediate_size=512, block_size=16,
                     layer_types=["sliding", "full"], sliding_window=48, target_layer_ids=[1, 2, 4]),
        train=dict(max_tokens=512, global_batch=4, max_anchors=4, steps=100, optim={"lr": 2e-3})),
}
VARIANTS = {
    "base": {},
    "distill": {"loss": {"distill_weight": 0.5}},
    "distill_only": {"loss": {"distill_weight": 1.0}},
    "anchors_x4": {"max_anchors": "x4"},
    "dpace": {"loss": {"weighting": "dpace"}},
    "lr_x2": {"optim": {"lr": "x2"}},
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
          "glass", "the telescope", "dinosaurs", "rain forests", "elephants", "paper", "windmills", "migration of birds",
          "ancient Egypt", "calculus", "soap", "the printing of money", "ocean currents", "autumn leaves", "salt",
          "the compass", "wolves", "microscopes", "hurricanes", "spiders", "the guitar", "canals", "vinegar",
          "lightning", "ice cream", "the Amazon river", "robots", "magnets", "cheese", "seashells", "umbrellas"]


def prompts_for(n_train: int, n_held: int) -> tuple[list, list]:
    "Chat prompts: held-out ones from topics disjoint from the training ones."
    topics = TOPICS[:]
    random.Random(0).shuffle(topics)
    n_held_topics = max(1, -(-n_held // len(TEMPLATES)))
    held_t, train_t = topics[:n_held_topics], topics[n_held_topics:]
    mk = lambda ts: [[{"role": "user", "content": tpl.format(t=t)}] for t in ts for tpl in TEMPLATES]
    train, held = mk(train_t), mk(held_t)
    random.Random(1).shuffle(train)
    if len(train) < n_train or len(held) < n_held:
        raise SystemExit(f"quality.py: only {len(train)} training / {len(held)} held-out prompts available")
    return train[:n_train], held[:n_held]


def build_data(work: Path, n_train: int, n_held: int, max_new_tokens: int = DATA["max_new_tokens"], log=print) -> dict:
    "The target and its tokenized train / held-out completions (generated once, reused from `work`)."
    from dflash_nb.target import tiny_target
    from dflash_nb.records import DataConfig, qwen3_tokenizer_dir, load_tokenizer
    from dflash_nb.shards import tokenize_dataset
    from dflash_nb.train import regenerate
    from dflash_nb.config import from_dict
    d = work / f"data-{n_train}-{n_held}-{max_new_tokens}"
    target = tiny_target(**TARGET)
    dcfg = from_dict(DataConfig, {"workers": 1, **{k: v for k, v in DATA.items() if k != "max_new_tokens"}})
    done = d / "done.json"
    if not done.exists():
        t0 = time.perf_counter()
        tok = load_tokenizer(qwen3_tokenizer_dir())
        train_p, held_p = prompts_for(n_train, n_held)
        stats = {}
        for part, prompts in (("train", train_p), ("heldout", held_p)):
            r = regenerate(target, tok, prompts, d / "generated" / f"{part}.jsonl", max_new_tokens, 64, dcfg)
            tokenize_dataset([str(r["path"])], qwen3_tokenizer_dir(), d / part, dcfg, verbose=False)
            stats[part] = {k: r[k] for k in ("prompts", "generated", "kept", "cut_by_verify", "cut_by_round_trip")}
        done.write_text(json.dumps({"stats": stats, "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
        log(f"data generated in {time.perf_counter() - t0:.0f}s: {stats}")
    return dict(target=target, train_dir=d / "train", held_dir=d / "heldout", data=json.loads(done.read_text()))


def variant_config(setup: dict, variant: dict) -> dict:
    "The setup's train section with the variant's overrides ('xK' multiplies the setup's value)."
    t = json.loads(json.dumps(setup["train"]))
    for k, v in variant.items():
        if isinstance(v, dict):
            t.setdefault(k, {})
            for kk, vv in v.items():
                base = t[k].get(kk)
                t[k][kk] = base * float(vv[1:]) if isinstance(vv, str) and vv.startswith("x") else vv
        else:
            t[k] = type(t[k])(t[k] * float(v[1:])) if isinstance(v, str) and v.startswith("x") else v
    return t


def train_and_measure(name, setup, data, vname, variant, seed, work, n_held, eval_tokens, log=print) -> dict:
    "One training run of one variant and seed, then τ on the held-out samples."
    from dflash_nb.config import from_dict
    from dflash_nb.train_config import TrainConfig
    from dflash_nb.trainer import train, load_samples
    from dflash_nb.target import TargetFeatures
    from dflash_nb.decoding import acceptance_length
    t = variant_config(setup, variant)
    run_dir = work / "runs" / f"{name}-{vname}-s{seed}-{os.getpid()}"
    cfg = from_dict(TrainConfig, {**t, "run_dir": str(run_dir), "data_dir": str(data["train_dir"]), "seed": seed,
                                  "log_every": max(1, t["steps"] // 4), "target": {"tiny": TARGET},
                                  "drafter": setup["drafter"], "checkpoint": {"every": 0, "keep": 1, "final": False}})
    t0 = time.perf_counter()
    s = train(cfg, target=data["target"], log_prefix=f"[{name}/{vname}/s{seed}] ")
    wall = time.perf_counter() - t0
    drafter, dcfg = s["drafter"].eval(), s["drafter_config"]
    feats = TargetFeatures(data["target"], dcfg.target_layer_ids)
    t1 = time.perf_counter()
    tau = acceptance_length(drafter, feats, load_samples(data["held_dir"]), block_size=dcfg.block_size, num_samples=n_held,
                            max_new_tokens=eval_tokens)
    f = s["final"]
    layers = len(feats.layers) if cfg.loss.distill_weight > 0 else max(dcfg.target_layer_ids) + 1
    rec = dict(setup=name, variant=vname, seed=seed, tau=tau["tau"], per_sample_tau=tau["per_sample_tau"],
               per_position=tau["per_position"], samples=tau["samples"], train_wall_s=round(wall, 2),
               eval_wall_s=round(time.perf_counter() - t1, 2), final_loss=f.get("loss"), acc=f.get("acc"),
               drafter_busy=f.get("drafter_busy"), target_busy=f.get("target_busy"),
               target_layers_run=layers, target_layers=len(feats.layers), config=t)
    log(f"[{name}/{vname}/s{seed}] tau {rec['tau']:.3f} on {rec['samples']} held-out samples | train {wall:.0f}s")
    import shutil; shutil.rmtree(run_dir, ignore_errors=True)
    return rec


# ---- statistics (no scipy here: Student's t tail by numerical integration of its density) ----------------------------
def t_two_sided_p(t: float, df: float) -> float:
    "Two-sided p-value of Student's t with `df` degrees of freedom (Simpson's rule on the density, 4000 intervals)."
    if not math.isfinite(t): return 0.0
    t = abs(t)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    pdf = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)
    n, h = 4000, t / 4000
    area = pdf(0) + pdf(t) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
    return max(0.0, min(1.0, 1 - 2 * area * h / 3))


def welch(a: list, b: list) -> dict:
    "Welch's t-test of mean(a) − mean(b): t, Welch–Satterthwaite df, two-sided p."
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1) if na > 1 else 0.0
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1) if nb > 1 else 0.0
    se2 = va / na + vb / nb
    if na < 2 or nb < 2 or se2 == 0: return dict(t=None, df=None, p=None)
    t = (ma - mb) / math.sqrt(se2)
    df = se2 ** 2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    return dict(t=t, df=df, p=t_two_sided_p(t, df))


def paired_bootstrap(var: list[list[float]], base: list[list[float]], n: int = 2000, seed: int = 0) -> dict:
    "Bootstrap over held-out samples of the mean per-sample τ difference (seed-averaged, paired by sample): CI and p."
    ns = len(var[0])
    dv = [sum(r[i] for r in var) / len(var) - sum(r[i] for r in base) / len(base) for i in range(ns)]
    g = random.Random(seed)
    means = sorted(sum(dv[g.randrange(ns)] for _ in range(ns)) / ns for _ in range(n))
    mean = sum(dv) / ns
    p = 2 * min(sum(m <= 0 for m in means), sum(m >= 0 for m in means)) / n
    return dict(mean_diff=mean, ci95=[means[int(0.025 * n)], means[int(0.975 * n) - 1]], p=min(1.0, p))


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
                       per_position=[sum(r["per_position"][k] for r in rs) / len(rs) for k in range(len(rs[0]["per_position"]))])
            if v != "base" and base:
                bt = [r["tau"] for r in base]; bm = sum(bt) / len(bt)
                row["diff_pct"] = 100 * (m - bm) / bm
                row["welch"] = welch(taus, bt)
                same = [r["seed"] for r in base] == row["seeds"]
                row["bootstrap"] = paired_bootstrap([r["per_sample_tau"] for r in rs], [r["per_sample_tau"] for r in base]) if same else None
            rows[v] = row
        out[s] = rows
    return out


def table(summary: dict) -> str:
    lines = []
    for s, rows in summary.items():
        lines.append(f"\n{s}: tau on held-out samples, mean ± sd over seeds (greedy)")
        lines.append(f"  {'variant':14s} {'tau':>15s} {'vs base':>9s} {'Welch p':>8s} {'boot p':>7s} {'train s':>8s} "
                     f"{'drafter':>8s} {'target layers':>14s}")
        for v, r in rows.items():
            w = r.get("welch") or {}; b = r.get("bootstrap") or {}
            fmt = lambda x, f: (f % x) if x is not None else "-"
            lines.append(f"  {v:14s} {r['tau_mean']:8.3f} ± {r['tau_sd']:.3f} {fmt(r.get('diff_pct'), '%+8.1f%%')} "
                         f"{fmt(w.get('p'), '%8.3f')} {fmt(b.get('p'), '%7.3f')} {r['train_wall_s']:8.1f} "
                         f"{100 * r['drafter_busy']:7.0f}% {r['target_layers_run']:>6d} of {r['target_layers']:<5d}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the setup's)")
    ap.add_argument("--train-prompts", type=int, default=320)
    ap.add_argument("--heldout", type=int, default=168, help="held-out prompts; τ is measured on those that survive the audit (>= 150)")
    ap.add_argument("--eval-tokens", type=int, default=40, help="generated tokens walked per held-out sample (the walk "
                    "drafts every position: its vocabulary projections dominate the bench's time on CPU)")
    ap.add_argument("--work", default=str(ROOT / "bench" / ".quality_work"), help="generated data (reused) and run dirs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quality.json"))
    ap.add_argument("--smoke", action="store_true", help="demo setup, base variant, one seed, 6 steps, few samples")
    a = ap.parse_args(argv)
    if a.smoke:
        a.setups = ["demo"] if a.setups == list(SETUPS) else a.setups   # unless setups were named
        a.variants, a.seeds = a.variants if a.variants != DEFAULT_VARIANTS else ["base"], a.seeds[:1]
        a.steps, a.train_prompts, a.heldout, a.eval_tokens = a.steps or 4, min(a.train_prompts, 12), min(a.heldout, 4), 16
    if "base" not in a.variants: a.variants = ["base"] + a.variants   # every difference is to the baseline
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    work = Path(a.work); work.mkdir(parents=True, exist_ok=True)
    t0, records = time.perf_counter(), []
    data_config = {**DATA, "max_new_tokens": 32 if a.smoke else DATA["max_new_tokens"]}
    data = build_data(work, a.train_prompts, a.heldout, data_config["max_new_tokens"])
    for s in a.setups:
        setup = json.loads(json.dumps(SETUPS[s]))
        if a.steps: setup["train"]["steps"] = a.steps
        for v in a.variants:
            for seed in a.seeds:
                records.append(train_and_measure(s, setup, data, v, VARIANTS[v], seed, work, a.heldout, a.eval_tokens))
    summary = summarize(records, a.setups, a.variants)
    print(table(summary))
    result = dict(
        what="tau of drafters trained with recipe variants at equal steps/rows/tokens (equal target forwards), 3 seeds, "
             "held-out greedy speculative-decoding walk; Welch's t over seeds and a paired bootstrap over held-out samples",
        machine=dict(platform=platform.platform(), python=platform.python_version(), torch=torch.__version__,
                     cpus=os.cpu_count(), threads=torch.get_num_threads()),
        args=vars(a), target=TARGET, data_config=data_config, setups={s: SETUPS[s] for s in a.setups},
        variants={v: VARIANTS[v] for v in a.variants}, data=data["data"], summary=summary, runs=records, wall_s=round(time.perf_counter() - t0, 1))
    out = Path(a.out); out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp"); tmp.write_text(json.dumps(result, indent=1)); os.replace(tmp, out)
    print(f"\n{len(records)} runs in {result['wall_s']:.0f}s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
