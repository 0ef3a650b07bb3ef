"""A real prompt set from text nobody here wrote: the Python standard library's docstrings and reference topics and the
machine's English manual pages, turned into prompts of five kinds (explain, summarise, continue, answer, code).

    python bench/prompt_set.py --out data/prompts [--min-prompts 5000] [--heldout-fraction 0.05] [--max-per-source 2]

Writes `train.jsonl` and `heldout.jsonl` ({"prompt", "kind", "source"} a line) and `prompt_set.json` (counts per
source family and kind, the sources' digest). Deterministic for a given Python and set of manual pages; de-duplicated
by normalised text; the held-out split is by source text (a source text's prompts all go to one side, so no held-out
prompt shares its source with a training prompt). Fewer prompts than `--min-prompts`, or a split that would overlap:
one line, exit 2. The set itself is not committed; this rebuilds it in about a minute.
"""
from __future__ import annotations

import argparse, contextlib, gzip, hashlib, importlib, inspect, io, json, pkgutil, re, sys, warnings
from pathlib import Path

SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__main__", "xxsubtype", "test",
        "lib2to3", "ensurepip", "pydoc_data", "pty", "tty", "webbrowser", "getpass"}   # side effects or GUI
MIN_CHARS, MAX_CHARS = 200, 1800          # a source text long enough to ask about, short enough for a prompt
MAN_DIRS = [f"/usr/share/man/man{s}" for s in "12345678"]
PER_FAMILY = 150   # at most this many manual pages whose names share a first word (gcloud ships thousands of its own)


def digest(text: str) -> str: return hashlib.sha256(text.encode()).hexdigest()


def clean(text: str) -> str:
    "Whitespace folded, doctest prompts kept; cut at a paragraph boundary below MAX_CHARS."
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    out = ""
    for p in paras:
        if len(out) + len(p) > MAX_CHARS: break
        out = f"{out}\n\n{p}" if out else p
    return out


def stdlib_texts():
    "('py:<qualified name>', docstring) for the standard library's modules, classes, functions and methods."
    seen = set()
    def walk(names):
        for name in names:
            if name.split(".")[0] in SKIP or any(part.startswith("_") for part in name.split(".")): continue
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    mod = importlib.import_module(name)
            except BaseException: continue
            yield name, mod
            if hasattr(mod, "__path__"):
                yield from walk(sorted(f"{name}.{m.name}" for m in pkgutil.iter_modules(mod.__path__)))
    for name, mod in walk(sorted(sys.stdlib_module_names)):
        public = [a for a in sorted(dir(mod)) if not a.startswith("_")]
        objs = [(name, mod)] + [(f"{name}.{a}", getattr(mod, a, None)) for a in public]
        for qual, obj in objs:
            if obj is not mod and getattr(obj, "__module__", None) != name: continue   # defined here, not imported
            members = [(qual, obj)]
            if inspect.isclass(obj):
                members += [(f"{qual}.{a}", v) for a, v in sorted(vars(obj).items())
                            if not a.startswith("_") and callable(v)]
            for q, o in members:
                doc = inspect.getdoc(o)
                if doc and len(doc) >= MIN_CHARS and id(o) not in seen:
                    seen.add(id(o))
                    yield f"py:{q}", doc


def topic_texts():
    "('pydoc:<topic>', text) for the Python reference topics pydoc ships."
    from pydoc_data.topics import topics
    for k in sorted(topics): yield f"pydoc:{k}", topics[k]


ROFF_ESCAPES = re.compile(r"\\f[BIRPC0-9]|\\f\(..|\\f\[[^]]*\]|\\s[+-]?\d|\\[&|^%:]|\\\(..|\\\[[^]]*\]|\\\*\(..|\\\*.")


def roff_text(src: str) -> str:
    "The DESCRIPTION section of a manual page as plain text (macros dropped, font escapes removed)."
    out, on = [], False
    for line in src.splitlines():
        if line.startswith(".SH") or line.startswith(".Sh"):
            on = "DESCRIPTION" in line.upper()
            continue
        if not on or line.startswith(('.\\"', "'\\\"")): continue
        if line.startswith("."):
            word = line.split(None, 1)
            if word[0] in (".PP", ".P", ".LP", ".TP", ".IP", ".sp", ".br", ".Pp"):
                out.append("")
                if word[0] == ".IP" and len(word) > 1: out.append(word[1].split('"')[1] if '"' in word[1] else "")
                continue
            if word[0] in (".B", ".I", ".BR", ".IR", ".RB", ".BI", ".IB", ".RI", ".Nm", ".Ar", ".Fl") and len(word) > 1:
                line = word[1].replace('"', "")
            else: continue
        line = ROFF_ESCAPES.sub("", line).replace("\\-", "-").replace("\\e", "\\").replace("\\ ", " ")
        out.append(line)
    return "\n".join(out)


def man_texts():
    "('man:<page>.<section>', DESCRIPTION text) for the English manual pages installed here."
    taken = {}
    for d in MAN_DIRS:
        for p in sorted(Path(d).glob("*.gz")) if Path(d).is_dir() else []:
            first = re.split(r"[_.-]", p.name, maxsplit=1)[0]
            if taken.get(first, 0) >= PER_FAMILY: continue
            taken[first] = taken.get(first, 0) + 1
            try: src = gzip.decompress(p.read_bytes()).decode("utf-8", "replace")
            except (OSError, EOFError): continue
            if src.startswith(".so "): continue                      # a link to another page
            yield f"man:{p.name[:-3]}", roff_text(src)


KINDS = {   # kind -> prompt from (name, text); names are the source's own (a function, a topic, a command)
    "explain": lambda n, t: f"Explain what the following documentation of `{n}` says, for someone who has not used "
                            f"it:\n\n{t}",
    "summarise": lambda n, t: f"Summarise this in three sentences:\n\n{t}",
    "continue": lambda n, t: f"Continue this text with one more paragraph in the same style:\n\n{t[: len(t) // 2]}",
    "answer": lambda n, t: f"Read this documentation of `{n}`, then answer: when would you use it, and what should you "
                           f"watch out for?\n\n{t}",
    "code": lambda n, t: f"Write a short, runnable Python example that uses `{n}` as documented here, and explain each "
                         f"line:\n\n{t}",
}


def prompts_of(source: str, text: str, per_source: int):
    "Up to `per_source` prompts of different kinds for one source text, the kinds picked by the text's digest."
    family, name = source.split(":", 1)
    kinds = [k for k in KINDS if family == "py" or k != "code"]          # code prompts only about Python objects
    start = int(digest(text)[:8], 16)
    for i in range(min(per_source, len(kinds))):
        kind = kinds[(start + i) % len(kinds)]
        yield kind, KINDS[kind](name, text)


def build(min_prompts: int, heldout_fraction: float, per_source: int) -> dict:
    "Every source's prompts, de-duplicated, split by source text into train and held-out; counts for the manifest."
    sources, seen_text = [], set()
    for family, texts in (("py", stdlib_texts()), ("pydoc", topic_texts()), ("man", man_texts())):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for source, raw in texts:
                text = clean(raw)
                key = digest(" ".join(text.lower().split()))
                if len(text) < MIN_CHARS or key in seen_text: continue   # one source per distinct text
                seen_text.add(key)
                sources.append((source, text, key))
    train, held, seen_prompt = [], [], set()
    for source, text, key in sources:
        side = held if int(key[:8], 16) / 0xFFFFFFFF < heldout_fraction else train   # by the source text itself
        for kind, prompt in prompts_of(source, text, per_source):
            if (pk := digest(prompt)) in seen_prompt: continue
            seen_prompt.add(pk)
            side.append({"prompt": prompt, "kind": kind, "source": source, "source_digest": key[:16]})
    overlap = {r["source_digest"] for r in train} & {r["source_digest"] for r in held}
    if overlap:
        raise SystemExit(f"prompt_set.py: error: {len(overlap)} source texts have prompts on both sides of the split")
    if len(train) < min_prompts:
        raise SystemExit(f"prompt_set.py: error: the sources here yield {len(train)} training prompts, fewer than "
                         f"--min-prompts {min_prompts} (families: {_count(train, 'family')}); install manual pages or "
                         f"lower --min-prompts")
    return {"train": train, "heldout": held, "sources": len(sources),
            "sources_digest": digest("".join(k for _, _, k in sources))}


def _count(rows, what) -> dict:
    out = {}
    for r in rows:
        k = r["source"].split(":", 1)[0] if what == "family" else r[what]
        out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for train.jsonl, heldout.jsonl and prompt_set.json")
    ap.add_argument("--min-prompts", type=int, default=5000, help="fewer training prompts than this: exit 2")
    ap.add_argument("--heldout-fraction", type=float, default=0.05, help="share of source texts held out")
    ap.add_argument("--max-per-source", type=int, default=2, help="prompts (of different kinds) per source text")
    a = ap.parse_args(argv)
    if not 0 <= a.heldout_fraction < 1 or a.min_prompts < 1 or a.max_per_source < 1:
        print("prompt_set.py: error: --heldout-fraction must be in [0, 1), --min-prompts and --max-per-source >= 1",
              file=sys.stderr)
        return 2
    try: s = build(a.min_prompts, a.heldout_fraction, a.max_per_source)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for side in ("train", "heldout"):
        with open(out / f"{side}.jsonl", "w") as f:
            for r in s[side]: f.write(json.dumps(r, ensure_ascii=False) + "\n")
    manifest = {"train": len(s["train"]), "heldout": len(s["heldout"]), "source_texts": s["sources"],
                "sources_digest": s["sources_digest"], "python": sys.version.split()[0],
                "train_by_family": _count(s["train"], "family"), "train_by_kind": _count(s["train"], "kind"),
                "heldout_by_family": _count(s["heldout"], "family"), "max_per_source": a.max_per_source,
                "heldout_fraction": a.heldout_fraction}
    (out / "prompt_set.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
