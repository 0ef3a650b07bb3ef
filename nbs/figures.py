"""Drawing code for the book's pictures, kept out of the chapters so that the picture, not the matplotlib, sits next to
the prose. Not part of the package: the chapters import it from nbs/ (notebooks run with nbs/ as working directory).

Every picture is drawn at 110 dpi with labels of at least 9 pt and at most ~9.5 inches wide, so it is legible at 100%
zoom in GitHub's notebook view without being scaled down.
"""

import io

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

DPI = 110  # 110 or more: 9 pt is then 14 px, legible without zooming
STYLE = {"font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "xtick.labelsize": 9, "ytick.labelsize": 9,
         "legend.fontsize": 9, "figure.dpi": DPI, "savefig.dpi": DPI}


def _show(fig, rect=(0, 0, 1, 1), colors: int = 64):
    "Display the figure as a PNG quantized to a few colours: a third of the bytes, the same look and bytes every run."
    from IPython.display import Image, display
    from PIL import Image as PILImage

    fig.tight_layout(rect=rect)
    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=DPI)
    plt.close(fig)
    small = io.BytesIO()
    PILImage.open(raw).convert("RGB").quantize(colors).save(small, format="png", optimize=True)
    display(Image(data=small.getvalue()))


def _box(ax, x, y, text, chapter, color):
    "A rounded box centred at (x, y) with the stage's name and the chapter that builds it."
    ax.add_patch(FancyBboxPatch((x - 0.82, y - 0.4), 1.64, 0.8, boxstyle="round,pad=0.04", fc=color, ec="0.3", lw=0.8))
    ax.text(x, y + 0.09, text, ha="center", va="center", fontsize=9)
    ax.text(x, y - 0.28, chapter, ha="center", va="center", fontsize=9, color="0.35")


def _arrow(ax, p, q, color="0.2", **kw):
    ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=10, lw=1, color=color, **kw))


def pipeline():
    "The front page's picture: every stage of the project and the chapters that build it."
    data_c, train_c, serve_c = "#dbe9f6", "#fde2c8", "#d9f0d3"
    top = [("JSONL / S3\nconversations", "01", data_c), ("chat template\n+ loss masks", "01", data_c),
           ("packed rows\n+ anchors", "02", data_c), ("frozen target\n+ hooks", "07", train_c),
           ("target features\n(5 layers)", "07", train_c)]
    bottom = [("drafter: anchor-\nblock attention", "03 04 05", train_c), ("decayed block\nloss", "06", train_c),
              ("τ: tokens per\ntarget forward", "09", serve_c), ("export\n(safetensors)", "10 09b", serve_c),
              ("vLLM · SGLang\n· dflash", "serving", serve_c)]
    xs = [1 + 2 * i for i in range(5)]
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(9.5, 3.6), dpi=DPI)
        for x, (text, chapter, color) in zip(xs, top):
            _box(ax, x, 2, text, chapter, color)
        for x, (text, chapter, color) in zip(xs[::-1], bottom):
            _box(ax, x, 0.4, text, chapter, color)
        for x in xs[:-1]:
            _arrow(ax, (x + 0.86, 2), (x + 1.14, 2))
        _arrow(ax, (xs[-1], 1.56), (xs[-1], 0.84))  # features → drafter
        for x in xs[1:][::-1]:
            _arrow(ax, (x - 0.86, 0.4), (x - 1.14, 0.4))
        _arrow(ax, (xs[3] - 0.3, -0.04), (xs[4] - 0.3, -0.04), connectionstyle="arc3,rad=0.5", ls="--",
               color="tab:red")  # the gradient flows from the loss back into the drafter only
        ax.text(7.7, -0.72, "gradient (the target stays frozen)", ha="center", fontsize=9, color="tab:red")
        ax.add_patch(FancyBboxPatch((5.9, -0.86), 4.3, 3.32, boxstyle="round,pad=0.02", fc="none", ec="tab:orange",
                                    ls=":", lw=1))
        ax.text(5.95, 2.52, "trainer (08, 08b, 11): pipelined, no feature cache", ha="left",
                va="bottom", fontsize=9, color="tab:orange")
        ax.set_xlim(-0.1, 10.3)
        ax.set_ylim(-0.92, 2.85)
        ax.axis("off")
        _show(fig)


def _draw_mask(ax, m, S, B, anchors, keep, doc_ids, title):
    "Colour a dense anchor-block mask: blue = context key, orange = own-block key, white = hidden; grey = padded block."
    import torch

    NB = m.shape[0]
    img = torch.zeros(m.shape, dtype=torch.long)
    img[:, :S][m[:, :S]] = 1
    img[:, S:][m[:, S:]] = 2
    ax.imshow(img, cmap=ListedColormap(["white", "tab:blue", "tab:orange"]), vmin=0, vmax=2, aspect="equal")
    xlabels = [*range(0, S, 2), *[f"k{k}" for _ in range(NB // B) for k in range(0, B, 2)]]
    ax.set_xticks(range(0, S + NB, 2), xlabels, fontsize=9)
    ax.set_yticks(range(NB), [f"a{int(anchors[q // B])}+{q % B}" if keep[q // B] else "pad" for q in range(NB)],
                  fontsize=9)
    ax.set_xticks([x - 0.5 for x in range(S + NB)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(NB)], minor=True)
    ax.grid(which="minor", color="0.85", lw=0.5)
    ax.tick_params(which="minor", length=0)
    for x in [S + i * B for i in range(NB // B)]:  # context | block 0 | block 1 ...
        ax.axvline(x - 0.5, color="k", lw=1.2)
    for y in range(B, NB, B):
        ax.axhline(y - 0.5, color="k", lw=0.8)
    for x in (torch.nonzero(doc_ids[1:] != doc_ids[:-1]).flatten() + 1).tolist():  # document boundaries
        ax.axvline(x - 0.5, color="red", lw=1.2, ls="--")
    for j in torch.nonzero(~keep).flatten().tolist():
        ax.axhspan(j * B - 0.5, (j + 1) * B - 0.5, color="0.5", alpha=0.25)
    ax.set_title(title)
    ax.set_xlabel("key: context position | own-block slot")


def masks(
    panels: dict,  # title -> dense anchor-block mask (N·B, S + N·B), drawn side by side
    S: int,  # context length
    B: int,  # block size
    anchors,  # (N,) anchor positions, for the row labels
    keep,  # (N,) bool, False rows are drawn as the padded band
    doc_ids,  # (S,) document id per position, for the boundary lines
):
    "Dense anchor-block masks side by side, as coloured grids (03_masks)."
    with plt.rc_context(STYLE):
        fig, axs = plt.subplots(1, len(panels), figsize=(9.5, 3.5), dpi=DPI)
        for ax, (title, m) in zip(axs, panels.items()):
            _draw_mask(ax, m, S, B, anchors, keep, doc_ids, title)
        axs[0].set_ylabel("query: anchor + slot")
        _show(fig)


def tiles(
    panels: dict,  # title -> (q tiles, kv tiles) long: 0 empty, 1 partial, 2 full
    S: int,  # context length: the black line between context and block tiles
    T: int,  # tile size
    boundaries: list,  # context positions where a document (or the padding tail) starts
):
    "A BlockMask's tile kinds side by side: empty, partial (mask_mod per pair) and full (03_masks)."
    with plt.rc_context(STYLE):
        fig, axs = plt.subplots(1, len(panels), figsize=(9.5, 2.9), dpi=DPI)
        for ax, (title, kinds) in zip(axs, panels.items()):
            ax.imshow(kinds, cmap=ListedColormap(["white", "tab:olive", "tab:green"]), vmin=0, vmax=2, aspect="equal")
            ax.axvline(S / T - 0.5, color="k", lw=1.2)
            for x in boundaries:
                ax.axvline(x / T - 0.5, color="red", lw=0.8, ls="--")
            n = [(kinds == v).sum().item() for v in (0, 1, 2)]
            ax.set_title(f"{title}:\n{n[0]} empty, {n[1]} partial, {n[2]} full tiles")
            ax.set_xlabel(f"key tile ({T} keys; context | blocks)")
        axs[0].set_ylabel(f"query tile ({T} queries)")
        legend = [Patch(color="tab:olive", label="partial: mask_mod per pair"),
                  Patch(color="tab:green", label="full: no mask_mod"),
                  Patch(facecolor="white", edgecolor="k", label="empty: skipped")]
        fig.legend(handles=legend, loc="lower center", ncol=3)
        _show(fig, rect=(0, 0.1, 1, 1))


def slot_weights(
    k,  # slots 1 .. B-1
    curves: dict,  # label -> weights per slot, scaled so that slot 1 weighs 1; the first is the fixed decay
    title: str,
):
    "Slot weights of the decayed loss against D-PACE's (06_loss)."
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(8, 3.6), dpi=DPI)
        for i, (label, w) in enumerate(curves.items()):
            ax.plot(k, w, "k-o" if i == 0 else "--o", ms=3, lw=2 if i == 0 else 1.5, label=label)
        ax.set_xlabel("slot k")
        ax.set_ylabel("weight / weight of slot 1")
        ax.set_xticks(k[::2])
        ax.set_ylim(0, None)
        ax.legend()
        ax.set_title(title)
        _show(fig)


def quality(summary: dict):
    "τ per recipe variant (dots: seeds; bar: mean ± sd) and per-position acceptance, one row per setup (06_loss)."
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(len(summary), 2, figsize=(9.5, 3.4 * len(summary)), dpi=DPI, squeeze=False)
        for (ax, ax_pos), (setup, rows) in zip(axes, summary.items()):
            names = list(rows)
            base = rows["base"]["tau_mean"] if "base" in rows else None
            for j, v in enumerate(names):
                r = rows[v]
                color = "0.4" if v == "base" else "tab:blue"
                ax.errorbar(j, r["tau_mean"], yerr=r["tau_sd"], fmt="o", ms=7, capsize=5, color=color)
                ax.plot([j + 0.18] * len(r["taus"]), r["taus"], ".", ms=6, color="k", alpha=0.6)
                diff = r.get("diff_pct")   # the summary's difference: on the seeds both have (None: no seed in common)
                if base and v != "base" and diff is not None:
                    ax.annotate(f"{diff / 100:+.1%}", (j, r["tau_mean"] + r["tau_sd"]), ha="center",
                                va="bottom", xytext=(0, 4), textcoords="offset points", fontsize=9)
            if base:
                ax.axhline(base, color="0.4", lw=0.8, ls=":")
            lo = min(min(rows[v]["taus"]) for v in names)
            hi = max(max(rows[v]["taus"]) for v in names)
            ax.set_ylim(lo - 0.03, hi + 0.04)
            ax.set_xticks(range(len(names)), names, rotation=20)
            ax.set_xlim(-0.5, len(names) - 0.3)
            ax.set_ylabel("τ (held-out, greedy)")
            ax.set_title(f"{setup}: τ per variant (axis {lo - 0.03:.2f}–{hi + 0.04:.2f}, not from 0)")
            for v in names:
                pp = rows[v]["per_position"]
                ax_pos.plot(range(1, len(pp) + 1), pp, marker=".", label=v)
            ax_pos.set_ylim(0, None)
            ax_pos.set_xlabel("draft position k")
            ax_pos.set_ylabel("P(position k accepted)")
            ax_pos.set_title(f"{setup}: per-position acceptance")
            ax_pos.legend()
        _show(fig)


def demo_run(run: dict):
    "A demo run: training loss, top-1 accuracy per slot, held-out acceptance per position before and after (11_train)."
    steps = [m["step"] for m in run["metrics"]]
    acc = list(zip(*[m["acc"] for m in run["metrics"]]))  # per slot 1 .. B-1
    with plt.rc_context(STYLE):
        fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(9.5, 3.3), dpi=DPI)
        a1.plot(steps, [m["loss"] for m in run["metrics"]], "o-", ms=3)
        a1.set(title="training loss", xlabel="step", ylim=(0, None))
        for k, ys in enumerate(acc, start=1):
            a2.plot(steps, ys, lw=1, label=f"slot {k}" if k in (1, len(acc)) else None)
        a2.set(title="top-1 accuracy per slot", xlabel="step", ylim=(0, None))
        a2.legend()
        pos = range(1, len(run["tau_after"]["per_position"]) + 1)
        before, after = run["tau_before"], run["tau_after"]
        a3.bar([p - 0.2 for p in pos], before["per_position"], 0.4, label=f"before (τ {before['tau']:.2f})")
        a3.bar([p + 0.2 for p in pos], after["per_position"], 0.4, label=f"after (τ {after['tau']:.2f})")
        a3.set(title="held-out acceptance\nper position", xlabel="draft position")
        a3.legend()
        _show(fig)


def quality_curve(runs: list, setups=("smollm2", "smollm2_long")):
    "τ vs target tokens: learning curves (checkpoints of one run each) and the other runs' final drafters (06_loss)."
    curves = [r for r in runs if r["setup"] in setups and r.get("curve")]
    finals = [r for r in runs if r["setup"] in setups and not r.get("curve")]
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(9.5, 4))
        for r, color in zip(curves, ("tab:blue", "tab:cyan", "navy", "tab:gray")):
            ax.plot([p["target_tokens"] / 1e3 for p in r["curve"]], [p["tau"] for p in r["curve"]], "o-", lw=2, ms=5,
                    color=color, label=f"base, {r['config']['steps']} steps, seed {r['seed']} (its checkpoints)")
        marks = {"base": ("s", "0.35"), "dpace": ("^", "tab:red"), "anchors_x4": ("D", "tab:purple"),
                 "distill": ("v", "tab:olive"), "gamma_x2": ("x", "tab:brown")}
        for v, (mark, color) in marks.items():
            e = [r for r in finals if r["variant"] == v]
            if e: ax.plot([r["target_tokens"] / 1e3 for r in e], [r["tau"] for r in e], mark, color=color, ms=7,
                          label=f"{v}: final drafters, one per seed")
        ax.axhline(1.0, color="0.45", ls=":", lw=1.5, label="τ = 1: no draft token accepted")
        ax.set_xlim(0, None)
        ax.set_ylim(0.98, max(r["tau"] for r in curves + finals) + 0.03)
        ax.set_xlabel("target tokens run through the trainer (thousands)")
        ax.set_ylabel(f"τ, greedy, {curves[0]['samples']} held-out answers")
        ax.set_title("SmolLM2-135M-Instruct as the target: τ vs target tokens seen (block 8; axis from τ = 1)",
                     loc="left")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        _show(fig, colors=128)


def speedup(res: dict, dtype: str = "bfloat16"):
    "The cost model: target step cost per appended tokens, and predicted vs vLLM-measured speed-up against k (09b)."
    cm = res["cost_model"]
    with plt.rc_context(STYLE):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.6), dpi=DPI)
        for dt, color in (("bfloat16", "tab:blue"), ("float32", "tab:orange")):
            if dt not in cm: continue
            st = cm[dt]["steps"]
            a1.plot([r["tokens"] for r in st], [r["verify"] for r in st], "o-", color=color, ms=4,
                    label=f"target step, {dt}")
            a1.plot([r["tokens"] for r in st], [r["verify"] + r["drafter"] for r in st], "s--", color=color, ms=3,
                    lw=1, label=f"+ drafter proposal, {dt}")
        a1.axhline(1.0, color="0.45", ls=":", lw=1)
        a1.set(title=f"cost of one step, relative to 1 token\n(KV cache {cm[dtype]['context_tokens']} tokens)",
               xlabel="tokens appended (k drafts + 1)", ylabel="× one-token step", ylim=(0, None))
        a1.legend()
        pred = cm[dtype]["predicted"]
        ks = [p["k"] for p in pred]
        a2.plot(ks, [p["predicted_speedup"] for p in pred], "o-", color="tab:blue", label=f"predicted ({dtype})")
        a2.plot(ks, [p["tau"] for p in pred], ":", color="0.5", label="τ(k) of the drafter")
        a2.plot(ks, [p["break_even_tau"] for p in pred], "--", color="tab:red", lw=1, label="break-even τ(k)")
        cells = (res.get("sweep") or {}).get("cells", [])
        for b, mark, color in ((1, "D", "tab:green"), (16, "v", "tab:purple")):
            c = [x for x in cells if x["batch"] == b]
            if c: a2.plot([x["k"] for x in c], [x["speedup"] for x in c], mark, color=color, ms=7,
                          label=f"measured by vLLM, batch {b}")
        a2.axhline(1.0, color="0.45", ls=":", lw=1)
        a2.set(title="speed-up against k", xlabel="num_speculative_tokens k", ylabel="× plain decoding",
               ylim=(0, None))
        a2.legend(fontsize=8)
        _show(fig)


def tau_curve_and_fit(res: dict):
    "Held-out τ against training steps (tokens seen on top), and vLLM's measured against predicted speed-up per cell."
    curve = res["tau_curve"]
    fits = {dt: (res.get("sweeps", {}).get(dt) or {}).get("fit", []) for dt in ("float32", "bfloat16")}
    with plt.rc_context(STYLE):
        if not any(fits.values()):   # a curve with no sweep beside it (yet): the left panel alone
            fig, a1 = plt.subplots(1, 1, figsize=(5.2, 3.6), dpi=DPI)
        else: fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.6), dpi=DPI)
        steps = [r["step"] for r in curve]
        a1.plot(steps, [r["tau"] for r in curve], "o-", color="tab:blue", ms=4, label="τ, block 8 (held-out walk)")
        for c in (res.get("comparisons") or {}).values():   # the recipe's losers, measured on the same held-out walk
            a1.plot([r["step"] for r in c["tau_curve"]], [r["tau"] for r in c["tau_curve"]], "o:", color="0.55", ms=3,
                    label=f"τ, {c['label']}")
        for i, color in ((0, "tab:green"), (1, "tab:orange"), (2, "tab:red")):
            a1.plot(steps, [r["per_position"][i] for r in curve], "s--", color=color, ms=3, lw=1,
                    label=f"slot {i + 1} accepted")
        a1.set(title="held-out τ while training", xlabel="training step", ylabel="τ / share of cycles", ylim=(0, None))
        seen = [r for r in curve if r.get("tokens_seen")]
        if seen:
            top = a1.secondary_xaxis("top", functions=(lambda s: s * seen[-1]["tokens_seen"] / seen[-1]["step"] / 1e6,
                                                       lambda t: t * 1e6 * seen[-1]["step"] / seen[-1]["tokens_seen"]))
            top.set_xlabel("million training tokens seen (≈)")
        a1.legend(fontsize=8)
        if not any(fits.values()):
            _show(fig)
            return
        marks = {1: "o", 4: "s", 16: "^"}
        lo, hi = 10.0, 0.0
        for dt, color in (("float32", "tab:blue"), ("bfloat16", "tab:orange")):
            for r in fits[dt]:
                a2.plot(r["predicted_speedup"], r["measured_speedup"], marks.get(r["batch"], "x"), color=color, ms=6)
                lo, hi = min(lo, r["predicted_speedup"], r["measured_speedup"]), max(hi, r["predicted_speedup"],
                                                                                      r["measured_speedup"])
        if hi > lo:
            xs = [lo * 0.9, hi * 1.1]
            a2.plot(xs, xs, ":", color="0.45", lw=1, label="measured = predicted")
            a2.fill_between(xs, [x * 0.85 for x in xs], [x * 1.15 for x in xs], color="0.9", label="± 15%")
        for dt, color in (("float32", "tab:blue"), ("bfloat16", "tab:orange")):
            a2.plot([], [], "o", color=color, label=dt)
        for b, m in marks.items():
            a2.plot([], [], m, color="0.4", label=f"batch {b}")
        a2.set(title="speed-up per (k, batch) cell, vLLM CPU", xlabel="predicted (cost fitted on an untrained drafter)",
               ylabel="measured")
        a2.legend(fontsize=8)
        _show(fig)
