"""The README stays short and true: at most 200 lines; every figure it quotes names the bench/results JSON it comes from,
which exists and holds that figure; every command it shows parses with the command's own parser (the runs themselves
are tests/test_walkthrough.py and tests/test_gguf.py), and `make demo` / `make test` are the Makefile's."""
import json, re, shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SCRIPTS = {"dflash-data": "data", "dflash-train": "train", "dflash-eval": "evaluate", "dflash-export": "export",
           "dflash-report": "report", "dflash-gguf": "gguf", "dflash-regen": "regen"}


def figure_rows() -> list[tuple[str, str, str]]:
    "(figure, value, file) of each row of the table under '## Where the figures come from'."
    section = README.split("## Where the figures come from", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in section.splitlines() if l.startswith("| ")]
    return [tuple(r) for r in rows[1:]]           # the header row left out (the separator does not start with "| ")


def commands() -> list[str]:
    "Every command line of the README's ```sh blocks, continuation lines joined."
    blocks = re.findall(r"```sh\n(.*?)```", README, re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [l.strip() for l in text.splitlines() if l.strip()]


def test_the_readme_is_short():
    n = len(README.splitlines())
    assert n <= 200, f"README.md is {n} lines: move what a chapter owns into it"


def test_dpace_is_defined_before_it_is_used():
    first = README.index("D-PACE")
    assert README[first:first + 80].startswith("D-PACE** (*Dynamic Position-Aware Cross-Entropy*)"), README[first:first + 80]


def test_every_figure_names_a_json_that_exists():
    rows = figure_rows()
    assert len(rows) >= 8, rows
    for figure, value, file in rows:
        if file == "(arithmetic)": continue
        path = re.fullmatch(r"`(bench/results/[\w.-]+\.json)`", file)
        assert path, f"{figure}: the file column must name one bench/results/*.json, got {file!r}"
        json.loads((REPO / path.group(1)).read_text())      # exists and is JSON
    named = set(re.findall(r"bench/results/[\w.-]+\.json", README))
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"the README names results that do not exist: {missing}"


def _value(file: str) -> dict:
    return json.loads((REPO / "bench" / "results" / file).read_text())


def _pct(x: float) -> str: return f"{x:+.1f}%"


# (file, words of the figure column) -> the strings the value column must hold, computed from the JSON
CHECKS = {
    ("demo-run.json", "2-core CPU"): lambda d: [f"{d['tau_before']['tau']:.3f} → {d['tau_after']['tau']:.3f}",
                                                re.search(r"(\d+) s end to end", d["what"]).group(1) + " s"],
    ("demo-run-gpu.json", "H200"): lambda d: [f"{d['auto_flex']['tau_after']['tau']:.2f}",
                                              f"{d['auto_flex']['train']['wall_s']:.0f} s / {d['triton']['train']['wall_s']:.0f} s"],
    ("quality.json", "D-PACE"): lambda d: [_pct(d["summary"]["smollm2"]["dpace"]["diff_pct"]),
                                           f"p {d['summary']['smollm2']['dpace']['paired_t']['p']:.3f}"],
    ("quality.json", "anchors"): lambda d: [_pct(d["summary"]["smollm2"]["anchors_x4"]["diff_pct"]),
                                            f"p {d['summary']['smollm2']['anchors_x4']['paired_t']['p']:.3f}"],
    ("gpu_speed.json", "fwd + bwd"): lambda d: [
        " / ".join(f"{[r for r in d['runs'] if r['kind'] == 'sliding'][0]['backends'][b]['ms_fwd_bwd']:.1f} ms"
                   for b in ("triton", "flex"))],
    ("gpu_pipeline.json", "64-layer"): lambda d: [f"{d['extrapolation']['I_64_layer_target_s']:.2f} s"],
    ("target_packing.json", "padded"): lambda d: [f"{1 + d['tokens']['padded_waste']:.3f} → "
                                                  f"{1 + d['tokens']['packed_waste']:.3f}"],
    ("speedup-cpu-fp32.json", "fp32"): lambda d: [f"{d['best']['identical']} of {d['best']['prompts']}",
                                                  f"{d['best']['plain_tokens_per_s']:.1f} → {d['best']['tokens_per_s']:.1f}",
                                                  f"{d['best']['speedup']:.2f}×"],
    ("speedup-cpu.json", "SmolLM2"): lambda d: [f"k {d['best']['k']}", f"τ {d['best']['tau']:.2f}",
                                                f"{d['best']['plain_tokens_per_s']:.1f} → {d['best']['tokens_per_s']:.1f}",
                                                f"{d['best']['speedup']:.2f}×",
                                                f"{d['best']['identical']} of {d['best']['prompts']}"],
    ("speedup-cpu-round3.json", "round 3"): lambda d: [f"k {d['best']['k']}", f"τ {d['best']['tau']:.2f}",
                                                       f"{d['best']['plain_tokens_per_s']:.1f} → "
                                                       f"{d['best']['tokens_per_s']:.1f}", f"{d['best']['speedup']:.2f}×",
                                                       f"{d['best']['identical']} of {d['best']['prompts']}"],
    ("cpu_check.json", "share of the bf16"): lambda d: [
        f"{d['stages']['target_forward']['fraction']:.2f} / {d['stages']['drafter_step']['fraction']:.2f}",
        f"{d['stages']['trainer_step']['ratio_to_slower_stage']:.2f}"],
    ("cpu_check.json", "regenerating"): lambda d: [
        f"{(v := d['stages']['regen_vllm']['variants'])['old_defaults']['batches']['256']['tokens_per_s']:.1f} → "
        f"{v['defaults']['batches']['256']['tokens_per_s']:.1f} "
        f"({v['defaults']['batches']['256']['tokens_per_s'] / v['old_defaults']['batches']['256']['tokens_per_s']:.1f}×)"],
    ("eval_cache.json", "4K"): lambda d: [f"{c['proposers']['prefix']['snapshot']['target_tokens_per_committed']:.2f}"
                                          for c in d["contexts"] if c["context"] == 4096],
}


def test_the_figures_are_the_json_figures():
    "Each quoted value is what its JSON holds, rounded as quoted: a rerun bench that changes a figure fails here."
    rows, checked = figure_rows(), set()
    for (file, words), expect in CHECKS.items():
        row = [r for r in rows if r[2] == f"`bench/results/{file}`" and words in r[0]]
        assert len(row) == 1, f"no single row for {file} ({words!r}): {rows}"
        for text in expect(_value(file)): assert text in row[0][1], f"{row[0][0]}: {text!r} not in {row[0][1]!r}"
        checked.add(row[0])
    assert checked == {r for r in rows if r[2] != "(arithmetic)"}, "every row of the figure table has a check here"


def _parses(module: str, argv: list[str]) -> object:
    "The parsed arguments of `dflash_nb.<module>` for `argv` (every command parses through `parse_cli`), nothing run."
    import importlib
    if module == "train":
        from dflash_nb.config import parse_cli
        from dflash_nb.train import RunConfig
        return parse_cli(RunConfig, argv, prog="dflash_nb.train")
    return importlib.import_module(f"dflash_nb.{module}").parse_args(argv)


def test_every_command_parses():
    cmds = commands()
    seen = {c.split()[0] for c in cmds}
    assert {"make", "dflash-data", "dflash-train", "dflash-eval", "dflash-export", "dflash-gguf", "vllm"} <= seen, seen
    makefile = (REPO / "Makefile").read_text()
    for cmd in cmds:
        argv = shlex.split(cmd)
        if argv[0] == "make":
            assert re.search(rf"(?m)^{argv[1]}:", makefile), f"the Makefile has no target {argv[1]}"
        elif argv[0] == "vllm":
            spec = json.loads(argv[argv.index("--speculative-config") + 1])
            assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 15, spec
        else:
            assert argv[0] in SCRIPTS, f"a README command that no test parses: {cmd}"
            assert _parses(SCRIPTS[argv[0]], argv[1:]) is not None, cmd
    assert re.search(r"(?m)^demo:.*\n(?:\t.*\n)*\t\$\(PY\) -m dflash_nb\.train$", makefile), "make demo runs the trainer"


def test_the_parse_check_sees_a_bad_flag():
    "The check itself: a flag the command does not know stops in its parser (one error line), not at the sentinel."
    from dflash_nb.config import ConfigError
    with pytest.raises(ConfigError, match="unknown flag --no-such-flag"):
        _parses("export", ["--checkpoint", "c", "--out", "o", "--no-such-flag"])
