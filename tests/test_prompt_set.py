"""`dflash-prompt-set` (chapter 01i_prompt_set) on this machine's own text: a prompt set from the standard library's
docstrings and the manual pages, de-duplicated, split by source text (no held-out prompt shares its source with a
training prompt), the same bytes on a second run; too few prompts is one line, exit 2, nothing written."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

import pytest

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


# ---- --out is claimed; what a killed run left goes with the next run (issue 55) -------------------------------------

SET_FILES = ("train.jsonl", "heldout.jsonl", "prompt_set.json")


def files(d) -> dict:
    "{name: bytes} of every entry of `d`, hidden ones (temp files) included."
    return {f.name: f.read_bytes() for f in sorted(Path(d).iterdir())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    "The set of an uninterrupted run."
    out = tmp_path_factory.mktemp("reference") / "set"
    assert run("--out", str(out), "--min-prompts", "1000").returncode == 0
    return files(out)


def temps(d: Path) -> list:
    return sorted(e.name for e in os.scandir(d) if ".tmp-" in e.name) if d.is_dir() else []


def killed_inside_a_write(out: Path) -> list:
    """Run dflash-prompt-set into `out`, SIGSTOP it once a temp file of its is on disk, SIGKILL it there; the temps left
    ([] when it finished before it could be caught inside a write)."""
    p = subprocess.Popen([str(SCRIPT), "--out", str(out), "--min-prompts", "1000"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        while p.poll() is None:
            if temps(out):
                p.send_signal(signal.SIGSTOP)
                _, status = os.waitpid(p.pid, os.WUNTRACED)             # returns once it is stopped (or has ended)
                if not os.WIFSTOPPED(status): return []
                if temps(out):
                    p.send_signal(signal.SIGKILL)
                    p.wait()
                    assert p.returncode == -signal.SIGKILL
                    return temps(out)
                p.send_signal(signal.SIGCONT)
            time.sleep(0.0005)
        return []
    finally:
        if p.poll() is None: p.kill(); p.wait()


def test_a_run_sigkilled_inside_a_write_is_cleaned_by_the_next_run(tmp_path, reference):
    """A real dflash-prompt-set SIGKILLed while a file of the set is written leaves its temp file
    (`.train.jsonl.tmp-PID`); the next run removes it and leaves exactly the files, bytes and all, of a run never
    interrupted. Before: the torn temp stayed for ever beside the set."""
    for attempt in range(5):
        out = tmp_path / f"set{attempt}"
        left = killed_inside_a_write(out)
        if left: break
    assert left, "never caught inside a write"
    assert all(n.startswith(tuple(f".{f}.tmp-" for f in SET_FILES)) for n in left), left
    p = run("--out", str(out), "--min-prompts", "1000")
    assert p.returncode == 0, p.stderr
    assert files(out) == reference                                    # no temp left: the same files, the same bytes


def test_out_holding_files_it_did_not_write_is_refused(tmp_path):
    """`--out` holding a user's train.jsonl (or prompt_set.json): one line, exit 2, the files intact, refused before the
    sources are read. Before: the user's train.jsonl was overwritten, exit 0."""
    for name, mine in (("train.jsonl", '{"prompt": "my own prompt"}\n'), ("prompt_set.json", '{"mine": 1}\n')):
        out = tmp_path / name
        out.mkdir()
        (out / name).write_text(mine)
        (out / "notes.txt").write_text("mine too")
        p = run("--out", str(out), "--min-prompts", "1000")
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert f"{name} was not written by dflash-prompt-set" in p.stderr, p.stderr
        assert files(out) == {name: mine.encode(), "notes.txt": b"mine too"}


def test_a_rerun_into_its_own_set_works_and_another_set_needs_replace(tmp_path, reference):
    """Into its own finished set (with a file of another name beside it): exit 0, the same bytes; a set with other
    settings there: one line, exit 2, nothing changed, until --replace."""
    out = tmp_path / "set"
    out.mkdir()
    for name, data in reference.items(): (out / name).write_bytes(data)
    (out / "README").write_text("mine")
    assert run("--out", str(out), "--min-prompts", "1000").returncode == 0
    assert files(out) == {**reference, "README": b"mine"}
    p = run("--out", str(out), "--min-prompts", "1000", "--max-per-source", "1")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "holds another prompt set" in p.stderr, p.stderr
    assert files(out) == {**reference, "README": b"mine"}
    assert run("--out", str(out), "--min-prompts", "1000", "--max-per-source", "1", "--replace").returncode == 0
    assert json.loads((out / "prompt_set.json").read_text())["max_per_source"] == 1 and (out / "README").exists()
