"""`dflash-prompt-set` (chapter 01i_prompt_set) on this machine's own text: a prompt set from the standard library's
docstrings and the manual pages, de-duplicated, split by source text (no held-out prompt shares its source with a
training prompt), the same bytes on a second run; too few prompts is one line, exit 2, nothing written."""
import json, subprocess, sys
from pathlib import Path

SCRIPT = Path(sys.executable).parent / "dflash-prompt-set"


def run(*args):
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_the_set_is_deduplicated_and_split_by_source(tmp_path):
    p = run("--out", str(tmp_path), "--min-prompts", "1000")
    assert p.returncode == 0, p.stderr
    rows = {side: [json.loads(l) for l in (tmp_path / f"{side}.jsonl").read_text().splitlines()]
            for side in ("train", "heldout")}
    train, held = rows["train"], rows["heldout"]
    assert len(train) >= 1000 and held
    prompts = [r["prompt"] for r in train + held]
    assert len(set(prompts)) == len(prompts)                                   # no prompt twice
    assert not {r["source_digest"] for r in train} & {r["source_digest"] for r in held}   # no shared source text
    assert {r["kind"] for r in train} == {"explain", "summarise", "continue", "answer", "code"}
    manifest = json.loads((tmp_path / "prompt_set.json").read_text())
    assert (manifest["train"], manifest["heldout"]) == (len(train), len(held))
    assert json.loads(p.stdout) == manifest                                    # the manifest, printed as one line
    again = tmp_path / "again"
    assert run("--out", str(again), "--min-prompts", "1000").returncode == 0
    for f in ("train.jsonl", "heldout.jsonl", "prompt_set.json"):              # deterministic, across processes
        assert (again / f).read_bytes() == (tmp_path / f).read_bytes(), f


def test_fewer_prompts_than_asked_is_one_line(tmp_path):
    p = run("--out", str(tmp_path / "set"), "--min-prompts", "100000000")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-prompt-set: error: the sources here yield "), p.stderr
    assert "fewer than --min-prompts 100000000" in lines[0], p.stderr
    assert not (tmp_path / "set").exists()                                     # refused before anything was written


def test_a_bad_value_is_one_line_before_anything_is_read(tmp_path):
    p = run("--out", str(tmp_path / "set"), "--heldout-fraction", "1")
    assert p.returncode == 2 and p.stderr == "dflash-prompt-set: error: --heldout-fraction: must be < 1, got 1.0\n"
    assert not (tmp_path / "set").exists()
