"""`dflash-regen` and the vLLM worker under faults, bad input and a second run: real processes, signals and files.

The HF tests run the console script (or `main` in this process) on the servable tiny target of `_serving_common`, 8
bundled prompts in shards of one, 12 new tokens. The vLLM tests start the real worker in the serving environment."""
import json, os, random, shutil, signal, subprocess, sys, threading, time
from pathlib import Path

import pytest

from _regen_common import run_main, shards
from _serving_common import wait_for, worker_of, worker_tmp, write_served_target
from dflash_nb.regen import LOCK, MANIFEST, shard_name
from dflash_nb.train import demo_data_dir
from dflash_nb.vllm_worker import group_members, shm_files

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_PROGRESS": "off"}


def hidden(out) -> list:
    "What a run left in the out dir besides its shards and manifest: temp files, a lock."
    return sorted(f.name for f in Path(out).iterdir() if f.name.startswith(".") or f.name == LOCK)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    "8 bundled prompts in shards of 1, 12 new tokens, the HF engine, one whole run: (its arguments, its directory)."
    d = tmp_path_factory.mktemp("faults")
    served = write_served_target(d / "target")
    prompts = demo_data_dir() / "prompts.jsonl"
    (d / "p.jsonl").write_text("".join(prompts.read_text().splitlines(keepends=True)[:8]))

    def args(out, *more, prompts=d / "p.jsonl"):
        return ["--target", served, "--prompts", prompts, "--out", out, "--max-new-tokens", "12", "--shard-size", "1",
                *more, "enable_thinking=false"]
    rc, out, _ = run_main(*args(d / "whole"))
    assert rc == 0 and "8 of 8 shards done" in out, out
    return args, d


# A slow disk (fault injection): each fsync takes half a second, so a shard's temp file stays on disk long enough for a
# SIGKILL sent after it is seen to land inside the write. On a fast disk the rename could beat the signal.
SLOW_DISK = ("import os, sys, time; f = os.fsync; os.fsync = lambda fd: (time.sleep(0.5), f(fd))[1]; "
             "from dflash_nb.regen import cli; sys.exit(cli())")


def start(args, out, slow_disk=False) -> subprocess.Popen:
    cmd = [sys.executable, "-c", SLOW_DISK] if slow_disk else [str(BIN / "dflash-regen")]
    return subprocess.Popen([*cmd, *map(str, args(out))], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow   # two runs of the console script (~30 s each on the loaded 2-core machine)
def test_kills_resume_to_the_same_bytes_and_the_lock_holds(small, tmp_path):
    """SIGKILL inside a shard write (its temp file seen on disk), with a second run refused meanwhile by the lock; then
    SIGTERM at a random shard. Each rerun resumes (taking over the dead holder's lock) to the bytes one uninterrupted
    run wrote, and leaves no temp file and no lock behind."""
    args, d = small
    out = tmp_path / "killed"
    p = start(args, out, slow_disk=True)
    assert wait_for(lambda: (out / LOCK).exists(), p), p.communicate()
    rc, _, err = run_main(*args(out))                        # a second run on the same out dir, while the first works
    assert rc == 2 and err.count("\n") == 1 and f"{out} is in use by pid {p.pid} on host" in err, err
    in_write = lambda: any(f.name.startswith(".shard-") for f in os.scandir(out))
    seen = wait_for(in_write, p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert seen, "the run ended before a shard write was seen"
    done = json.loads((out / MANIFEST).read_text())["shards"] if (out / MANIFEST).exists() else {}
    assert len(done) < 8 and any(f.startswith(".shard-") for f in os.listdir(out)), os.listdir(out)   # torn write
    rc, stdout, _ = run_main(*args(out))
    assert rc == 0 and f"took over the lock of pid {p.pid}" in stdout, stdout
    assert shards(out) == shards(d / "whole") and hidden(out) == []

    out = tmp_path / "terminated"
    p = start(args, out)
    k = random.Random(os.getpid()).randrange(1, 7)           # after a random number of finished shards
    listed = lambda: (out / MANIFEST).exists() and len(json.loads((out / MANIFEST).read_text() or "{}")
                                                       .get("shards", {})) >= k
    assert wait_for(listed, p, poll=0.005), p.communicate()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and err.strip().splitlines()[-1] == ("dflash-regen: stopped by SIGTERM before it "
                                                                     "finished; nothing half-written was kept"), err
    assert hidden(out) == []                                  # no temp file, the lock given back
    rc, stdout, _ = run_main(*args(out))
    assert rc == 0 and "took over" not in stdout and shards(out) == shards(d / "whole")


def test_hostile_prompt_files_are_one_line(small, tmp_path):
    """NUL bytes, bad UTF-8, an oversized line, deep JSON, non-objects, no messages, no prompts, a lone surrogate:
    one line, exit 2."""
    args, _ = small
    good = b'{"prompt": "Hello there"}\n'
    cases = {b'{"prompt": "a\x00b"}\n': ":1: not JSON", good + b'{"prompt": "ab"}\x00\n': ":2: not JSON",
             b'{"prompt": "caf\xe9"}\n': ":1: not JSON (invalid UTF-8",
             good + b"[1]\n": ":2: record must be a JSON object",
             b'{"prompt": "' + b"x" * (2 << 20) + b'"}\n': ":1: record larger than 1048576 bytes",
             b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}\n": ":1: not JSON (nested too deeply)",
             good + b'"a string"\n': ":2: record must be a JSON object, got str",
             b'{"foo": 1}\n': ":1: no prompt or messages field", b'{"messages": []}\n': ":1: the conversation has",
             b"": ": no records", b"\n \n": ": no records",
             good + b'{"prompt": "a\\ud800b"}\n': ":2: a lone surrogate \\ud800"}   # valid JSON, not encodable text
    for i, (data, said) in enumerate(cases.items()):
        f = tmp_path / f"p{i}.jsonl"
        f.write_bytes(data)
        rc, _, err = run_main(*args(tmp_path / f"o{i}", prompts=f))
        assert rc == 2 and err.count("\n") == 1 and f"{f}{said}" in err, (data[:40], err)
        assert not (tmp_path / f"o{i}").exists()


def test_duplicates_and_prompts_too_long_are_counted_with_file_and_line(small, tmp_path):
    "A repeated prompt is dropped (the first kept), a prompt longer than the context skipped: each named FILE:LINE."
    args, _ = small
    f = tmp_path / "p.jsonl"
    long = json.dumps({"prompt": "word " * 40000}) + "\n"   # ~40K tokens: past the tiny target's 32768 positions
    f.write_text('{"prompt": "Hi"}\n' + long + '{"prompt": "Bye"}\n{"prompt": "Hi"}\n')
    rc, out, _ = run_main(*args(tmp_path / "o", "--shard-size", "8", prompts=f))
    assert rc == 0, out
    assert f"1 duplicated prompts dropped (the first kept), e.g. {f}:4 repeats {f}:1" in out, out
    assert f"1 prompts skipped: longer than the target's context with --max-new-tokens (e.g. {f}:2)" in out, out
    man = json.loads((tmp_path / "o" / MANIFEST).read_text())
    assert (man["prompts"], man["shards"]["0"]["too_long"], man["shards"]["0"]["too_long_at"]) == (3, 1, [f"{f}:2"])
    lines = (tmp_path / "o" / "shard-00000.jsonl").read_text().splitlines()
    assert [json.loads(l)["messages"][0]["content"] for l in lines] == ["Hi", "Bye"]


def test_overrides_after_the_prompt_files_are_overrides(small, tmp_path):
    """`--prompts FILE key=value`: a DataConfig override typed after the prompt files (where `dflash-train` takes one
    too) is an override, not a prompt file. Before: "enable_thinking=false: no such prompt file", exit 2."""
    args, d = small
    a = [str(x) for x in args(tmp_path / "o", "--max-shards", "1") if x != "enable_thinking=false"]
    at = a.index("--prompts") + 2
    rc, _, err = run_main(*a[:at], "max_seq_len=abc", *a[at:])
    assert rc == 2 and err.count("\n") == 1 and "max_seq_len" in err and "prompt file" not in err, err
    rc, out, err = run_main(*a[:at], "enable_thinking=false", *a[at:])
    assert rc == 0 and "1 of 8 shards done" in out, out + err
    assert shards(tmp_path / "o") == {k: v for k, v in shards(d / "whole").items() if k == "shard-00000.jsonl"}
    settings = lambda o: {k: v for k, v in json.loads((o / MANIFEST).read_text()).items() if k != "shards"}
    assert settings(tmp_path / "o") == settings(d / "whole")      # the template rendered with enable_thinking=false


def test_bad_out_dirs_are_refused_before_the_engine(small, tmp_path):
    "A FIFO, a link where the manifest goes, another program's JSON, a file, a read-only place: one line, exit 2."
    args, d = small
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "m").mkdir()
    os.mkfifo(tmp_path / "m" / MANIFEST)                      # before: reading it hung the command
    (tmp_path / "l").mkdir()
    (tmp_path / "precious").write_text("keep me\n")
    os.symlink(tmp_path / "precious", tmp_path / "l" / MANIFEST)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{}")
    cases = {tmp_path / "fifo": "is a FIFO, not a directory", tmp_path / "m": "regen.manifest is a FIFO",
             tmp_path / "l": "regen.manifest is a symbolic link", tmp_path / "data": "holds manifest.json",
             tmp_path / "precious": "is a regular file, not a directory", Path("/proc/1/dflash-out"): "cannot"}
    for out, said in cases.items():
        t0 = time.time()
        rc, stdout, err = run_main(*args(out))
        assert rc == 2 and err.count("\n") == 1 and said in err and "loading the target" not in stdout + err, err
        assert time.time() - t0 < 60
    assert (tmp_path / "precious").read_text() == "keep me\n" and os.listdir(tmp_path / "data") == ["manifest.json"]


def test_a_shard_changed_after_it_was_written_is_refused_and_kept(small, tmp_path):
    "A finished shard whose bytes no longer match the manifest's hash: one line, exit 2, nothing written; deleted, it is rewritten."
    args, d = small
    shutil.copytree(d / "whole", tmp_path / "o")
    f = tmp_path / "o" / "shard-00003.jsonl"
    f.write_bytes(f.read_bytes()[:-10])
    before = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()}
    rc, out, err = run_main(*args(tmp_path / "o"))
    assert rc == 2 and err.count("\n") == 1 and f"{f}: not the bytes regen.manifest lists" in err, err
    assert "loading the target" not in out + err
    assert {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()} == before
    f.unlink()
    rc, out, _ = run_main(*args(tmp_path / "o"))
    assert rc == 0 and "7 of 8 shards done" in out, out
    assert shards(tmp_path / "o") == shards(d / "whole")


# --- the vLLM worker ------------------------------------------------------------------------------------------------

def listed(out) -> list:
    "The shards the manifest in `out` lists as finished, in order ([] before it has one)."
    try: return sorted(map(int, json.loads((out / MANIFEST).read_text() or "{}").get("shards", {})))
    except (OSError, ValueError): return []


@pytest.mark.slow   # two vLLM starts (~1 min each here), each stopped once it has written a shard; a 30 s timeout
def test_parent_killed_then_worker_hung_mid_generation(small, tmp_path):
    """`dflash-regen --engine vllm`, its engine core in a process of its own, under a TMPDIR too long for vLLM's sockets
    (its worker's own goes under /tmp; before, vLLM failed to start with a ZMQError).

    1. The parent SIGKILLed once it has written a shard: the worker and every process it started exit within seconds;
       its TMPDIR and /dev/shm files are gone.
    2. The rerun resumes, and once it has written a shard of its own its worker hangs (SIGSTOP): after
       --worker-timeout (30 s, each shard's answer; the load has its own --load-timeout) one line naming the last shard
       written, exit 2, the worker and its engine core killed and gone with their TMPDIR and /dev/shm files (the
       stopped worker cannot remove them: the engine does, as after the OOM killer), the lock given back.
    Every shard the two runs wrote has the bytes one uninterrupted HF run wrote (vLLM and HF write the same bytes at
    T = 0: test_regen's test_vllm_completions_equal_hf_on_the_bundled_prompts). A worker SIGKILLed is reported as
    such (the test below, while it loads)."""
    args, d = small
    tmp, out = tmp_path / ("t" * 60), tmp_path / "out"
    tmp.mkdir()
    # 32 prompts, not the fixture's 8: a shard takes the tiny engine a few ms, so with 8 the second run could finish
    # between two looks at its manifest on a loaded machine (a CI run saw it write all 5 it had left before the SIGSTOP)
    n, prompts = 32, tmp_path / "p32.jsonl"
    prompts.write_text("".join((demo_data_dir() / "prompts.jsonl").read_text().splitlines(keepends=True)[:n]))
    rc, said, _ = run_main(*args(tmp_path / "whole", prompts=prompts))
    assert rc == 0 and f"{n} of {n} shards done" in said, said
    env = {**ENV, "TMPDIR": str(tmp), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    started = []                                                       # (run, its worker): stopped at the end

    def start_and_wait(more_than: int):
        "The run, once it has written more than `more_than` shards: (it, its worker, group, shm files, TMPDIR)."
        p = subprocess.Popen([str(BIN / "dflash-regen"), *map(str, args(out, "--engine", "vllm", "--dtype", "float32",
                                                                         "--worker-timeout", "30", prompts=prompts))],
                             env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append((p, None))
        assert wait_for(lambda: len(listed(out)) > more_than, p, timeout=600, poll=0.002), p.communicate()[1][-3000:]
        w = worker_of(p.pid)
        started[-1] = (p, w)
        group = [w, *group_members(w)]
        wtmp = worker_tmp(w)
        assert wtmp.parent == Path("/tmp") and wtmp.is_dir(), wtmp     # out of the long TMPDIR
        return p, w, group, shm_files(group), wtmp

    try:
        p, w, group, held, wtmp = start_and_wait(0)
        assert len(group) >= 2 and held, (group, held)                 # the engine core: a process of its own
        p.send_signal(signal.SIGKILL)
        p.wait()
        t0 = time.time()
        while group_members(w) and time.time() - t0 < 20: time.sleep(0.05)
        assert group_members(w) == [] and time.time() - t0 < 10, group_members(w)
        assert not wtmp.exists() and not [f for f in held if os.path.exists(f)], (wtmp.exists(), held)
        first = len(listed(out))

        p, w, group, held, wtmp = start_and_wait(first)
        os.kill(w, signal.SIGSTOP)
        t_fault = time.time()
        stdout, err = p.communicate(timeout=120)
        waited = time.time() - t_fault
        done = listed(out)
        assert first < len(done) < n and f"{first} of {n} shards done" in stdout, (first, done, stdout)
        lines = [l for l in err.splitlines() if not l.startswith("starting vLLM on")]   # the stage lines, then one
        assert p.returncode == 2 and len(lines) == 1, err
        assert lines[0].startswith("dflash-regen: error: the vLLM worker did not answer 'generate' within 30 s"), err
        assert lines[0].endswith(f"; last shard written: shard-{done[-1]:05d}.jsonl ({len(done)} of {n} done in {out}); "
                                 "rerun to resume"), err
        assert waited < 30 + 20, waited                                # the timeout, then the group killed
        assert not os.path.exists(f"/proc/{w}") and group_members(w) == [], group_members(w)   # reaped, all of it
        assert not wtmp.exists() and not [f for f in held if os.path.exists(f)], (wtmp.exists(), held)
        assert hidden(out) == []                                       # no temp file, the lock given back
        whole = shards(tmp_path / "whole")
        assert shards(out) == {k: whole[k] for k in shards(out)} and len(shards(out)) == len(done)
    finally:
        for p, w in started:
            if p.poll() is None: p.kill()
            if w and group_members(w): os.killpg(w, signal.SIGKILL)


def test_worker_faults_while_loading_are_one_line_naming_where_to_resume(small, tmp_path, monkeypatch):
    """The worker stopped while loading (SIGSTOP: it hangs) is given up after --load-timeout; killed (SIGKILL, what the
    OOM killer sends) is reported as such. Both: one line, exit 2, no worker left. A half-built serving env: `make serving`."""
    args, d = small
    out = tmp_path / "o"
    for sig, timeout, said in ((signal.SIGSTOP, "3", "did not answer 'load' within 3 s (hung?)"),
                               (signal.SIGKILL, "600", "killed by SIGKILL (out of memory?")):   # --load-timeout
        found = []
        def fault():
            t0 = time.time()
            while time.time() - t0 < 120 and not found:
                if (w := worker_of(os.getpid())) is not None:
                    found.append(w)
                    time.sleep(0.5)
                    os.kill(w, sig)
                time.sleep(0.05)
        t = threading.Thread(target=fault, daemon=True)
        t.start()
        t0 = time.time()
        rc, _, err = run_main(*args(out, "--engine", "vllm", "--load-timeout", timeout))
        t.join()
        err = [l for l in err.splitlines() if not l.startswith("starting vLLM on")][-1]   # the stage lines, then one
        assert rc == 2 and err.startswith("python -m dflash_nb.regen: error: the vLLM worker ") and said in err, err
        assert f"no shard written yet (0 of 8 done in {out}); rerun to resume" in err, err
        assert found and not os.path.exists(f"/proc/{found[0]}")          # stopped and reaped
        assert time.time() - t0 < 120
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    import dflash_nb.serving as serving
    monkeypatch.delenv("DFLASH_SERVING_PYTHON", raising=False)
    monkeypatch.setattr(serving, "REPO", tmp_path / "repo")
    (tmp_path / "repo").mkdir()
    os.symlink(venv, tmp_path / "repo" / ".venv-serving")
    rc, _, err = run_main(*args(tmp_path / "o2", "--engine", "vllm"))
    assert rc == 2 and err.count("\n") == 1 and "not a finished serving environment" in err and "make serving" in err


@pytest.mark.slow   # three console scripts at once (~40 s on the loaded 2-core machine)
def test_three_machines_merge_to_one_machines_run(small, tmp_path):
    "`--shard-index i --num-shards 3` in three processes, then `--merge`: the shards one whole run wrote, each once."
    args, d = small
    parts = [tmp_path / f"part{i}" for i in range(3)]
    ps = [start(lambda out, i=i: args(out, "--shard-index", str(i), "--num-shards", "3"), parts[i]) for i in range(3)]
    for p in ps:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    assert [sorted(f.name for f in p.glob("shard-*")) for p in parts] == [
        ["shard-00000.jsonl", "shard-00003.jsonl", "shard-00006.jsonl"],
        ["shard-00001.jsonl", "shard-00004.jsonl", "shard-00007.jsonl"], ["shard-00002.jsonl", "shard-00005.jsonl"]]
    rc, _, err = run_main("--merge", parts[0], parts[1], "--out", tmp_path / "short")
    assert rc == 2 and "2 of 8 shards are in no part (first: shard-00002.jsonl)" in err, err
    rc, _, err = run_main("--merge", parts[0], parts[1], parts[1], parts[2], "--out", tmp_path / "twice")
    assert rc == 2 and "shard-00001.jsonl is in both" in err, err
    rc, out, _ = run_main("--merge", *parts, "--out", tmp_path / "merged")
    assert rc == 0 and f"merged 3 parts: 8 of 8 shards in {tmp_path / 'merged'}" in out, out
    assert shards(tmp_path / "merged") == shards(d / "whole")
    rc, out, _ = run_main("--merge", *parts, "--out", tmp_path / "merged")    # the same merge again: one run still
    assert rc == 0 and f"{tmp_path / 'merged'} holds this merge already: 8 of 8 shards; nothing written" in out, out
    strip = lambda m: {k: {n: v for n, v in st.items() if n != "seconds"} for k, st in m["shards"].items()}
    man = lambda o: json.loads((o / MANIFEST).read_text())
    assert strip(man(tmp_path / "merged")) == strip(man(d / "whole"))
    rc, out, _ = run_main(*args(tmp_path / "merged"))                 # the merged dir is a finished run's
    assert rc == 0 and "8 of 8 shards done" in out and "loading the target" not in out


# --- issue 46: inputs, manifests, merges, empty runs, sampling, names ------------------------------------------------

def part_of(whole, out, i: int, n: int) -> Path:
    "Machine i of n's directory, cut from a whole run's (no generation): its own shards and a manifest of them."
    shutil.copytree(whole, out)
    man = json.loads((out / MANIFEST).read_text())
    man["part"], man["shards"] = [i, n], {k: v for k, v in man["shards"].items() if int(k) % n == i}
    for f in out.glob("shard-*.jsonl"):
        if int(f.stem[6:]) % n != i: f.unlink()
    (out / MANIFEST).write_text(json.dumps(man))
    return out


def test_a_command_never_writes_where_it_reads(small, tmp_path):
    """Prompts inside --out (even with --replace), a merge into one of its parts or around them: one line, exit 2, the
    inputs untouched. Before: the prompt file was overwritten by shard 0 (exit 0), the merge nested in the part."""
    args, d = small
    shutil.copytree(d / "whole", tmp_path / "o")
    prompts = tmp_path / "o" / "shard-00000.jsonl"
    prompts.write_bytes((d / "p.jsonl").read_bytes())
    before = {f.name: f.read_bytes() for f in (tmp_path / "o").iterdir()}
    rc, _, err = run_main(*args(tmp_path / "o", "--replace", prompts=prompts))
    assert rc == 2 and err.count("\n") == 1 and f"--prompts {prompts} lies in --out {tmp_path / 'o'}" in err, err
    assert {f.name: f.read_bytes() for f in (tmp_path / "o").iterdir()} == before
    parts = [part_of(d / "whole", tmp_path / f"m{i}", i, 2) for i in range(2)]
    (parts[1] / "shard-00042.jsonl").write_text('{"messages": [{"role": "user", "content": "stray"}]}\n')
    for out, said in ((parts[0] / "sub", f"--out {parts[0] / 'sub'} lies in --merge {parts[0]}"),
                      (tmp_path, f"--merge {parts[0]} lies in --out {tmp_path}")):
        rc, _, err = run_main("--merge", *parts, "--out", out)
        assert rc == 2 and err.count("\n") == 1 and said in err, err
    assert not (parts[0] / "sub").exists() and not (tmp_path / MANIFEST).exists()
    rc, _, err = run_main("--merge", parts[0], "", "--out", tmp_path / "e")   # '' (an unset variable): not the cwd
    assert rc == 2 and err.count("\n") == 1 and "--merge: an empty word names no part" in err, err
    rc, out, _ = run_main("--merge", *parts, "--out", tmp_path / "merged")   # a part's stray: noted, not copied
    assert rc == 0 and f"note: {parts[1] / 'shard-00042.jsonl'} is not a shard of this run" in out, out
    assert shards(tmp_path / "merged") == shards(d / "whole")


@pytest.mark.parametrize("edit, said", [
    (lambda m: m["shards"].__setitem__("+1", m["shards"]["1"]), "lists shard '+1', which is not one of the 4 shards"),
    (lambda m: m["shards"].__setitem__("-1", m["shards"]["1"]), "lists shard '-1'"),
    (lambda m: m["shards"].__setitem__("0", m["shards"]["1"]), "lists shard '0'"),        # the other part's index
    (lambda m: m["shards"].__setitem__("01", m["shards"]["1"]), "lists shard '01'"),
    (lambda m: m["shards"].__setitem__("x", m["shards"]["1"]), "lists shard 'x'"),
    (lambda m: m["shards"].__setitem__("1", [1, 2]), "the entry of shard 1 is list, not an object"),
    (lambda m: m.__setitem__("shards", list(m["shards"].values())), "not a manifest of this program"),
    (lambda m: m.__setitem__("part", [1, "2"]), "`part` must be [i, n] with 0 <= i < n"),
])
def test_a_malformed_manifest_is_one_line_to_merge_and_to_resume(small, tmp_path, edit, said):
    """A part whose manifest lists a shard it does not own, or is not shaped like one: --merge and a resume there are
    each one line, exit 2, nothing written. Before: '+1' merged as "7 of 6 shards", 'x' a ValueError traceback."""
    args, d = small
    parts = [part_of(d / "whole", tmp_path / f"m{i}", i, 2) for i in range(2)]
    man = json.loads((parts[1] / MANIFEST).read_text())
    edit(man)
    (parts[1] / MANIFEST).write_text(json.dumps(man))
    rc, _, err = run_main("--merge", *parts, "--out", tmp_path / "merged")
    assert rc == 2 and err.count("\n") == 1 and f"{parts[1] / MANIFEST}: " in err and said in err, err
    assert not (tmp_path / "merged").exists()
    rc, out, err = run_main(*args(parts[1], "--shard-index", "1", "--num-shards", "2"))
    assert rc == 2 and err.count("\n") == 1 and said in err and "loading the target" not in out + err, err


def test_a_killed_merge_is_finished_by_merging_again(small, tmp_path, monkeypatch):
    """A merge stopped after its second shard (a write made to fail: fault injection) leaves a directory that
    dflash-data and a resume both call unfinished; the same merge again completes it to one run's bytes. Before: the
    next merge refused ("holds shards already") and dflash-data read the two shards as a data set."""
    from dflash_nb import regen   # the merge writes through the name regen imported from storage
    from dflash_nb.inputs import list_inputs
    args, d = small
    parts = [part_of(d / "whole", tmp_path / f"m{i}", i, 2) for i in range(2)]
    real, calls = regen.atomic_write_bytes, []
    def dies_on_third(*a, **kw):
        calls.append(1)
        if len(calls) == 3: raise OSError(28, "No space left on device")
        return real(*a, **kw)
    monkeypatch.setattr(regen, "atomic_write_bytes", dies_on_third)
    rc, _, err = run_main("--merge", *parts, "--out", tmp_path / "merged")
    monkeypatch.undo()
    assert rc != 0 and len(shards(tmp_path / "merged")) == 2, err
    with pytest.raises(Exception, match=r"an unfinished dflash-regen --merge \(2 of 8 shards copied\)"):
        list_inputs([str(tmp_path / "merged")])               # the two copies counted (before: "0 of 8 shards done")
    rc, out, err = run_main(*args(tmp_path / "merged"))
    assert rc == 2 and "holds an unfinished --merge" in err and "loading the target" not in out + err, err
    rc, out, err = run_main("--merge", *parts, "--out", tmp_path / "merged")
    assert rc == 0 and "8 of 8 shards" in out, err
    assert shards(tmp_path / "merged") == shards(d / "whole")
    assert [f.name for f in list_inputs([str(tmp_path / "merged")])] == list(shards(d / "whole"))


def longer_run(whole, out, copies: int) -> Path:
    "`whole` made `copies` times as long, no generation: shard k holds whole's shard k % n, listed as it."
    out.mkdir()
    man = json.loads((whole / MANIFEST).read_text())
    n = len(man["shards"])
    man["prompts"], man["shards"] = n * copies * man["shard_size"], {str(k): man["shards"][str(k % n)]
                                                                     for k in range(n * copies)}
    for k in range(n * copies): shutil.copyfile(whole / shard_name(k % n), out / shard_name(k))
    (out / MANIFEST).write_text(json.dumps(man))
    return out


def stopped_inside_a_write(p: subprocess.Popen, out: Path) -> bool:
    """SIGSTOP `p` and wait until it is stopped; True when it stopped inside a shard write after its first shard (a
    temp file on disk), else SIGCONT and False. Raises when `p` ended first: it could not be killed midway."""
    if not (out / shard_name(0)).exists(): return False
    p.send_signal(signal.SIGSTOP)
    _, status = os.waitpid(p.pid, os.WUNTRACED)          # returns once it is stopped (or has ended)
    if not os.WIFSTOPPED(status): raise AssertionError(f"the merge ended (status {status}) before it was killed")
    if any(f.name.startswith(".shard-") for f in os.scandir(out)): return True
    p.send_signal(signal.SIGCONT)
    return False


def everything(d) -> dict:
    "{name: bytes} of every file in `d`, hidden ones (temp files, a lock) included."
    return {f.name: f.read_bytes() for f in sorted(Path(d).iterdir())}


def test_a_merge_killed_by_sigkill_is_finished_by_merging_again(small, tmp_path):
    """A real `dflash-regen --merge` SIGKILLed inside a shard write after its first shard (stopped first, so what is on
    disk at the kill is known): dflash-data refuses the directory as unfinished; the same merge again leaves exactly the
    files, bytes and all, of a merge never interrupted, and dflash-data reads it as one complete run."""
    from dflash_nb.inputs import list_inputs
    _, d = small
    big = longer_run(d / "whole", tmp_path / "big", 12)                          # 96 shards: ~0.5 s of writes
    parts = [part_of(big, tmp_path / f"m{i}", i, 2) for i in range(2)]
    rc, said, err = run_main("--merge", *parts, "--out", tmp_path / "once")     # the merge never interrupted
    assert rc == 0 and "96 of 96 shards" in said, err
    out = tmp_path / "merged"
    p = subprocess.Popen([str(BIN / "dflash-regen"), "--merge", *map(str, parts), "--out", str(out)], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try: assert wait_for(lambda: stopped_inside_a_write(p, out), p, timeout=120), p.communicate()
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate()
    assert p.returncode == -signal.SIGKILL
    killed = everything(out)
    man = json.loads(killed[MANIFEST])
    assert man["merging"] and man["shards"] == {} and 1 <= len(shards(out)) < 96, sorted(killed)
    assert any(n.startswith(".shard-") for n in killed) and LOCK in killed, sorted(killed)   # a torn write, a dead lock
    copied = len(shards(out))                               # each copy is atomic: a file there is whole
    with pytest.raises(Exception, match=rf"an unfinished dflash-regen --merge \({copied} of 96 shards copied\)"):
        list_inputs([str(out)])
    rc, said, err = run_main("--merge", *parts, "--out", out)
    assert rc == 0 and f"merged 2 parts: 96 of 96 shards in {out}" in said, err
    assert everything(out) == everything(tmp_path / "once")     # no temp file, no lock: the same files, the same bytes
    assert [f.name for f in list_inputs([str(out)])] == [shard_name(k) for k in range(96)]


def test_a_stray_shard_is_noted_and_never_read(small, tmp_path):
    "A shard-00042.jsonl that no manifest lists: the run notes it, dflash-data lists only the run's shards."
    from dflash_nb.inputs import list_inputs
    args, d = small
    shutil.copytree(d / "whole", tmp_path / "o")
    (tmp_path / "o" / "shard-00042.jsonl").write_text('{"messages": [{"role": "user", "content": "stray"}]}\n')
    rc, out, _ = run_main(*args(tmp_path / "o"))
    assert rc == 0 and f"note: {tmp_path / 'o' / 'shard-00042.jsonl'} is not a shard of this run" in out, out
    assert [f.name for f in list_inputs([str(tmp_path / "o")])] == list(shards(d / "whole"))


def test_a_run_with_no_completion_does_not_succeed(small, tmp_path):
    """--max-new-tokens past the target's context: one line before anything is loaded. A run whose every prompt is
    too long for the context: its summary, then one line, exit 2. Before: "8 of 8 shards done", 0 completions, exit
    0."""
    args, _ = small
    rc, out, err = run_main(*args(tmp_path / "o1", "--max-new-tokens", "1000000000000"))
    assert rc == 2 and err == ("python -m dflash_nb.regen: error: --max-new-tokens 1000000000000: the target's context "
                               "is 32,768 tokens, prompt and answer together; no prompt would fit\n"), err
    assert not (tmp_path / "o1").exists()
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"prompt": "word " * 40000}) + "\n")     # ~40K tokens: past the 32768 positions
    rc, out, err = run_main(*args(tmp_path / "o2", prompts=f))
    assert rc == 2 and "1 of 1 shards done" in out and "1 prompts skipped" in out, out
    assert err.splitlines()[-1].endswith("no completion was written: all 1 prompts of the 1 shards done were skipped "
                                         "(longer than the target's context with --max-new-tokens)"), err


def test_a_sampled_run_resumed_at_another_batch_size_is_refused(small, tmp_path):
    """The HF engine samples a batch from one generator, so a sampled run's --batch-size is part of its identity: a
    resume at another size is one line, exit 2. Before: the missing shards were sampled differently, one run."""
    args, d = small
    target = tmp_path / "t"
    served = next(a for a in args(tmp_path) if isinstance(a, Path) and (a / "config.json").is_file())
    shutil.copytree(served, target)
    gen = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, "temperature": 0.8}))
    sampled = lambda *more: [target if a == served else a
                             for a in args(tmp_path / "o", "--sampling", "recommended", *more)]
    assert run_main(*sampled("--batch-size", "4", "--max-shards", "1"))[0] == 0
    assert json.loads((tmp_path / "o" / MANIFEST).read_text())["settings"]["batch_size"] == 4
    rc, _, err = run_main(*sampled("--batch-size", "2"))
    assert rc == 2 and err.count("\n") == 1 and "other settings (batch_size)" in err, err
    assert len(shards(tmp_path / "o")) == 1


@pytest.mark.parametrize("name, head", [("bom.jsonl", b"\xef\xbb\xbf"), (os.fsdecode(b"p\xff.jsonl"), b"")])
def test_a_bom_and_an_undecodable_name_are_read(small, tmp_path, name, head):
    """A prompt file starting with a UTF-8 byte-order mark, and one whose name is not UTF-8 printed to a strict UTF-8
    stdout: the same prompts as the plain file (the finished run is recognised), the name escaped. Before: the BOM file
    was refused as "not JSON", the name a UnicodeEncodeError traceback."""
    import contextlib, io
    from dflash_nb.regen import main
    args, d = small
    f = tmp_path / name
    f.write_bytes(head + (d / "p.jsonl").read_bytes())
    shutil.copytree(d / "whole", tmp_path / "o")
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", errors="strict")
    with contextlib.redirect_stdout(out): rc = main(list(map(str, args(tmp_path / "o", prompts=f))))
    out.flush()
    text = raw.getvalue().decode()
    assert rc == 0 and "8 of 8 shards done" in text, text
    assert f"{str(f).encode('utf-8', 'backslashreplace').decode()}: 8" in text, text


# --- issue 55: what killed writers left, an empty --prompts word ------------------------------------------------------

def test_a_rerun_removes_what_killed_runs_left_and_nothing_else(small, tmp_path):
    """Temps of the names a run writes (a shard, the manifest), whatever their pid (the run holds regen.lock), go with
    the next run; a look-alike of another name and a link stay, the link's target untouched."""
    args, d = small
    out = tmp_path / "o"
    shutil.copytree(d / "whole", out)
    torn = [f".shard-00003.jsonl.tmp-{os.getppid()}", f".{MANIFEST}.tmp-{2**22 + 7}", ".shard-00001.jsonl.tmp-9.a1b2c3"]
    kept = [".notes.txt.tmp-9", ".shard-00001.jsonl.tmp", "shard-00001.jsonl.tmp-9"]
    for n in torn + kept: (out / n).write_text("half")
    (tmp_path / "elsewhere").write_text("theirs")
    os.symlink(tmp_path / "elsewhere", out / ".shard-00002.jsonl.tmp-9")
    rc, said, err = run_main(*args(out))
    assert rc == 0 and "8 of 8 shards done" in said and "loading the target" not in said, err
    left = sorted(f.name for f in out.iterdir() if f.name not in shards(out) and f.name != MANIFEST)
    assert left == sorted([".shard-00002.jsonl.tmp-9", *kept]), left
    assert (tmp_path / "elsewhere").read_text() == "theirs" and shards(out) == shards(d / "whole")


def test_an_empty_prompts_word_is_refused(small, tmp_path):
    """`--prompts ''` (an unset shell variable): one line, exit 2, nothing written. Before: the empty word read as the
    current directory ("--out ... lies in --prompts :" or ". is a directory")."""
    args, d = small
    out = tmp_path / "o"
    for words in ([""], [d / "p.jsonl", ""]):
        argv = args(out)
        at = argv.index("--prompts") + 1
        argv[at:at + 1] = words
        rc, said, err = run_main(*argv)
        assert rc == 2 and err.count("\n") == 1 and "--prompts: an empty word names no file" in err, err
        assert not out.exists() and "loading the target" not in said
