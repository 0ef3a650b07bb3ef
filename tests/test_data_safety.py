"""Files a command reads from a directory it is pointed at are untrusted: names read from them stay inside their
directory, every such file is a regular file before it is opened (a FIFO would block, a link to /dev/zero read until
memory runs out), manifests are checked field by field, a run dir resumes only its own run, and a cleanup deletes only
what carries this program's own id. Each probe goes through the real command in-process: one line, exit 2, nothing
in the directory changed."""
import contextlib, json, os, shutil, signal, sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _trainer_common import make_data, train_cfg, train_dict, write_run_config   # noqa: E402
from dflash_nb import data as data_mod, evaluate as ev, train as train_mod          # noqa: E402
from dflash_nb.config import ExpectedError
from dflash_nb.commands import run_cli
from dflash_nb.records import qwen3_tokenizer_dir                                   # noqa: E402
from dflash_nb.shards import read_shards, shard_path                                # noqa: E402
from dflash_nb.trainer import train                                                 # noqa: E402


@contextlib.contextmanager
def deadline(seconds: int = 60):
    "Fail (instead of hanging the suite) when the body blocks, e.g. on opening a FIFO for reading."
    def expired(*_): raise TimeoutError(f"blocked for {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try: yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def snap(d: Path) -> dict:
    "Every entry below `d`: its kind and, for a regular file, its bytes (a FIFO is listed, never opened)."
    out = {}
    for p in sorted(d.rglob("*")):
        out[str(p.relative_to(d))] = (p.read_bytes() if p.is_file() and not p.is_symlink() else
                                      ("link", os.readlink(p)) if p.is_symlink() else ("dir",) if p.is_dir() else
                                      ("special",))
    return out


def one_line(capsys, prog: str) -> str:
    "The error of a refused command: one line, its last on stderr (progress lines of its stages may come before)."
    err = capsys.readouterr().err.strip().splitlines()
    errors = [e for e in err if ": error: " in e]
    assert len(errors) == 1 and err[-1] == errors[0] and errors[0].startswith(f"{prog}: error: "), err
    return errors[0].removeprefix(f"{prog}: error: ")


def plant(path: Path, kind: str, outside: Path):
    "Put a hostile entry of `kind` at `path`."
    path.unlink(missing_ok=True) if not path.is_dir() or path.is_symlink() else shutil.rmtree(path)
    if kind == "fifo": os.mkfifo(path)
    elif kind == "zero": path.symlink_to("/dev/zero")
    elif kind == "out": path.symlink_to(outside)
    elif kind == "dir": path.mkdir()


WORDS = {"fifo": "is a FIFO, not a regular file", "zero": "is a character device, not a regular file",
         "out": "leads outside", "dir": "is a directory, not a regular file"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("safety") / "data", n=8)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    "Two finished runs A and B (2 steps, a checkpoint at each), never modified: tests copy them."
    root = tmp_path_factory.mktemp("runs")
    for name in ("a", "b"):
        train(train_cfg(root / name, data, steps=2, checkpoint={"every": 1, "keep": 5}))
    return root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _rid(run: Path) -> str: return json.loads((run / "run.json").read_text())["run_id"]


# ---- the data command: special files and links at the names it reads in --out ----------------------------------------
@pytest.fixture(scope="module")
def tok():
    from dflash_nb.records import load_tokenizer, tokenizer_parts
    t = load_tokenizer(qwen3_tokenizer_dir())
    return t, tokenizer_parts(t)   # its real parts, hashed once (hashing the 11 MB tokenizer.json is most of a call)


def test_data_command_with_a_fifo_manifest_in_out_is_one_line(tmp_path, data, capsys):
    "The command as a user runs it: a FIFO named manifest.json in --out is refused at once, not waited on."
    out = _copy(data, tmp_path / "D")
    plant(out / "manifest.json", "fifo", tmp_path)
    before = snap(out)
    argv = ["--input", str(data.parent / "data.jsonl"), "--tokenizer", str(qwen3_tokenizer_dir()), "--out", str(out),
            "--workers", "1", "max_seq_len=160", "min_loss_tokens=8"]
    with deadline(): assert data_mod.main(argv) == 2
    assert f"{out / 'manifest.json'} is a FIFO, not a regular file" in one_line(capsys, "python -m dflash_nb.data")
    assert snap(out) == before


@pytest.mark.parametrize("name,kind", [("manifest.json", "zero"), ("manifest.json", "out"), ("manifest.json", "dir"),
                                       ("audit.json", "fifo"), ("audit.json", "zero"), ("shard-00000.arrow", "fifo"),
                                       ("shard-00000.arrow", "zero"), ("shard-00001.arrow", "out"),
                                       ("shard-00001.arrow", "dir")])
def test_data_out_with_a_special_file_is_refused_unopened(tmp_path, data, tok, monkeypatch, name, kind):
    "Every name the data command reads in --out, as a FIFO, a link to /dev/zero or out of --out, a directory."
    from dflash_nb import shards
    from dflash_nb.records import DataConfig
    from dflash_nb.shards import tokenize_dataset
    tok, parts = tok
    monkeypatch.setattr(shards, "tokenizer_parts", lambda t: parts)
    out = _copy(data, tmp_path / "D")
    (tmp_path / "elsewhere.json").write_text("{}")
    plant(out / name, kind, tmp_path / "elsewhere.json")
    before = snap(out)
    cfg = DataConfig(workers=1, max_seq_len=160, min_loss_tokens=8)
    with deadline(), pytest.raises(ExpectedError, match=WORDS[kind]) as e:
        tokenize_dataset([str(data.parent / "data.jsonl")], tok, out, cfg, verbose=False)
    assert name in str(e.value) and snap(out) == before


# ---- manifests: every field checked before training, names inside the data set ----------------------------------------
def _rewrite_shard(path: Path, edit, keep_metadata: bool = True):
    "Rewrite shard `path` with `edit(table)`, keeping its statistics (its data set id and position) unless told."
    t = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    new = edit(t).replace_schema_metadata(t.schema.metadata) if keep_metadata else edit(t)
    tmp = path.with_name("x.arrow")
    with pa.ipc.new_file(str(tmp), new.schema) as w: w.write_table(new)
    os.replace(tmp, path)


def _half_masks(t):
    ids, mask = t.column("input_ids").combine_chunks(), t.column("loss_mask").combine_chunks()
    halves = [m[: len(m) // 2] for m in mask.to_pylist()]
    return t.set_column(1, "loss_mask", pa.array(halves, pa.list_(pa.int8()))).set_column(0, "input_ids", ids)


def _manifest_edit(d: Path, edit):
    m = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(edit(m) if callable(edit) else edit)


PROBES = {   # name -> (edit of the data set copy in d, words of the refusal)
    "dotdot": (lambda d, o: _manifest_edit(d, lambda m: json.dumps(
        {**m, "shards": [{**m["shards"][0], "file": f"../{o.name}/shard-00000.arrow"}, *m["shards"][1:]]})),
        "is not a plain file name"),
    "absolute": (lambda d, o: _manifest_edit(d, lambda m: json.dumps(
        {**m, "shards": [{**m["shards"][0], "file": str(o / "shard-00000.arrow")}, *m["shards"][1:]]})),
        "is not a plain file name"),
    "link_out": (lambda d, o: plant(d / "shard-00000.arrow", "out", o / "shard-00000.arrow"), "leads outside"),
    "fifo_shard": (lambda d, o: plant(d / "shard-00000.arrow", "fifo", o), WORDS["fifo"]),
    "zero_shard": (lambda d, o: plant(d / "shard-00000.arrow", "zero", o), WORDS["zero"]),
    "fifo_manifest": (lambda d, o: plant(d / "manifest.json", "fifo", o), WORDS["fifo"]),
    "zero_manifest": (lambda d, o: plant(d / "manifest.json", "zero", o), WORDS["zero"]),
    "shards_strings": (lambda d, o: _manifest_edit(d, lambda m: json.dumps(
        {**m, "shards": [s["file"] for s in m["shards"]]})), "shards[0] must be an object"),
    "dup_row": (lambda d, o: _manifest_edit(d, lambda m: json.dumps(
        {**m, "duplicates": {m["shards"][0]["file"]: [10**6]}})), "increasing rows below"),
    "dup_unknown": (lambda d, o: _manifest_edit(d, lambda m: json.dumps(
        {**m, "duplicates": {"shard-99999.arrow": [0]}})), "must be a shard of the manifest"),
    "deep": (lambda d, o: _manifest_edit(d, "[" * 100_000 + "]" * 100_000), "nested deeper than 64 levels"),
    "not_object": (lambda d, o: _manifest_edit(d, "[1]"), "the manifest must be a JSON object"),
    "no_dataset_id": (lambda d, o: _manifest_edit(d, lambda m: json.dumps(
        {k: v for k, v in m.items() if k != "dataset_id"})), "dataset_id must be 16 hex digits"),
    "samples_string": (lambda d, o: _manifest_edit(d, lambda m: json.dumps(
        {**m, "shards": [{**m["shards"][0], "samples": "3"}, *m["shards"][1:]]})), "shards[0].samples must be"),
    "half_mask": (lambda d, o: _rewrite_shard(shard_path(d, 0), _half_masks),
                  "a loss mask of another length than its input ids"),
    "rows_dropped": (lambda d, o: _rewrite_shard(shard_path(d, 0), lambda t: t.slice(0, t.num_rows - 1)),
                     "rows, but its manifest entry says"),
}


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_hostile_data_set_is_refused_by_the_reader(tmp_path, data, probe):
    d, o = _copy(data, tmp_path / "D"), _copy(data, tmp_path / "outside")
    edit, words = PROBES[probe]
    edit(d, o)
    with deadline(), pytest.raises(ExpectedError, match=words.replace("[", r"\[").replace(".", r"\.")):
        read_shards(d)


def test_a_manifest_without_dataset_id_is_not_read_by_weaker_rules(tmp_path, data):
    "A shard of another data set, refused with the id, is refused as well once the manifest's id is deleted."
    d = _copy(data, tmp_path / "D")
    t = pa.ipc.open_file(pa.memory_map(str(shard_path(d, 0)))).read_all()
    st = json.loads(t.schema.metadata[b"dflash_nb.shard"])
    _rewrite_shard(shard_path(d, 0), lambda t: t.replace_schema_metadata(
        {b"dflash_nb.shard": json.dumps({**st, "dataset": "0123456789abcdef"}).encode()}), keep_metadata=False)
    with pytest.raises(ExpectedError, match="belongs to data set 0123456789abcdef"):
        read_shards(d)
    _manifest_edit(d, lambda m: json.dumps({k: v for k, v in m.items() if k != "dataset_id"}))
    with pytest.raises(ExpectedError, match="dataset_id must be 16 hex digits"):
        read_shards(d)


@pytest.mark.parametrize("probe", ["dotdot", "half_mask", "no_dataset_id", "fifo_manifest"])
def test_hostile_data_set_is_refused_by_the_train_command(tmp_path, data, capsys, probe):
    "Through the train command: one line, exit 2, and nothing written: the data is checked before the run dir."
    d, o = _copy(data, tmp_path / "D"), _copy(data, tmp_path / "outside")
    PROBES[probe][0](d, o)
    before = snap(o)
    cfg = write_run_config(tmp_path / "r.yaml", train_dict(tmp_path / "run", d, steps=2))
    with deadline(): assert train_mod.main(["--config", str(cfg)]) == 2
    assert PROBES[probe][1] in one_line(capsys, "python -m dflash_nb.train")
    assert not (tmp_path / "run").exists() and snap(o) == before


# ---- run identity: a run dir resumes only its own run ---------------------------------------------------------------
def _train_cli(tmp_path, run: Path, data, *overrides, steps=4) -> int:
    cfg = write_run_config(tmp_path / "r.yaml", train_dict(run, data, steps=steps,
                                                           checkpoint={"every": 1, "keep": 2}))
    with deadline(): return train_mod.main(["--config", str(cfg), *overrides])


def test_resume_auto_refuses_another_runs_step_over_its_own(tmp_path, runs, data, capsys):
    "Run B's step-2 copied over A's, `latest` naming it: refused naming both ids; A's dir untouched."
    a = _copy(runs / "a", tmp_path / "a")
    step = a / "checkpoints" / "step-00000002"
    shutil.rmtree(step)
    shutil.copytree(runs / "b" / "checkpoints" / "step-00000002", step)
    before = snap(a)
    assert _train_cli(tmp_path, a, data, "train.resume=auto") == 2
    line = one_line(capsys, "python -m dflash_nb.train")
    assert f"is a checkpoint of run {_rid(runs / 'b')}" in line and f"holds run {_rid(a)}" in line, line
    assert snap(a) == before


def test_resume_auto_refuses_another_runs_step_without_latest(tmp_path, runs, data, capsys):
    "Run B's step copied in as step-9, no `latest`: refused before A's own steps are rewritten or pruned."
    a = _copy(runs / "a", tmp_path / "a")
    (a / "checkpoints" / "latest").unlink()
    shutil.copytree(runs / "b" / "checkpoints" / "step-00000002", a / "checkpoints" / "step-00000009")
    before = snap(a)
    assert _train_cli(tmp_path, a, data, "train.resume=auto") == 2
    line = one_line(capsys, "python -m dflash_nb.train")
    assert "step-00000009 is a checkpoint of run " + _rid(runs / "b") in line and _rid(a) in line, line
    assert snap(a) == before


def test_resume_auto_refuses_a_step_with_its_run_id_removed(tmp_path, runs, data, capsys):
    "The step resume=auto picks must carry the run dir's id: one with none recorded is refused too."
    a = _copy(runs / "a", tmp_path / "a")
    f = a / "checkpoints" / "step-00000002" / "state.json"
    f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "run_id"}))
    before = snap(a)
    assert _train_cli(tmp_path, a, data, "train.resume=auto") == 2
    assert "(none recorded)" in one_line(capsys, "python -m dflash_nb.train")
    assert snap(a) == before


def test_named_resume_of_a_checkpoint_without_run_id_into_a_run_is_refused(tmp_path, runs, data, capsys):
    a, b = _copy(runs / "a", tmp_path / "a"), _copy(runs / "b", tmp_path / "b")
    f = b / "checkpoints" / "step-00000002" / "state.json"
    f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "run_id"}))
    before = snap(a)
    assert _train_cli(tmp_path, a, data, f"train.resume={b / 'checkpoints' / 'step-00000002'}") == 2
    line = one_line(capsys, "python -m dflash_nb.train")
    assert f"holds run {_rid(a)}" in line and "(none recorded)" in line, line
    assert snap(a) == before


# ---- run dirs: special files and links at every name the trainer reads ------------------------------------------------
@pytest.mark.parametrize("name,kind", [("checkpoints/latest", "fifo"), ("checkpoints/latest", "zero"),
                                       ("checkpoints/latest", "out"), ("run.json", "fifo"), ("run.json", "zero"),
                                       ("checkpoints/step-00000002/state.json", "fifo"),
                                       ("checkpoints/step-00000002/optimizer.pt", "fifo")])
def test_run_dir_with_a_special_file_is_refused_unopened(tmp_path, runs, data, capsys, name, kind):
    a = _copy(runs / "a", tmp_path / "a")
    (tmp_path / "elsewhere").write_text("step-00000002\n")
    plant(a / name, kind, tmp_path / "elsewhere")
    before = snap(a)
    assert _train_cli(tmp_path, a, data, "train.resume=auto") == 2
    line = one_line(capsys, "python -m dflash_nb.train")
    assert WORDS[kind] in line and Path(name).name in line, line
    assert snap(a) == before


def test_run_json_too_deep_is_one_line(tmp_path, runs, data, capsys):
    a = _copy(runs / "a", tmp_path / "a")
    (a / "run.json").write_text("[" * 100_000 + "]" * 100_000)
    before = snap(a)
    assert _train_cli(tmp_path, a, data, "train.resume=auto") == 2
    assert "run.json is not a run file" in one_line(capsys, "python -m dflash_nb.train")
    assert snap(a) == before


# ---- prompt files: special files, and a Parquet file that expands ---------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "zero", "dir", "bomb"])
def test_evaluate_refuses_a_hostile_prompt_file_before_loading_anything(tmp_path, capsys, kind):
    import pyarrow.parquet as pq
    p = tmp_path / "prompts.parquet"
    if kind == "bomb":   # a few hundred bytes: one 1 MB string, dictionary-encoded 18,000 times (18 GB as rows)
        big = pa.DictionaryArray.from_arrays(pa.array(np.zeros(18_000, np.int32)), pa.array(["x" * 1_000_000]))
        pq.write_table(pa.table({"prompt": big}), p, compression="zstd")
        assert p.stat().st_size < 1000
    else: plant(p, kind, tmp_path)
    argv = ["--drafter", str(tmp_path / "none"), "--target", "tiny", "--prompts", str(p)]
    with deadline(): assert run_cli(ev.main, argv, prog="dflash_nb.evaluate", expected=(ValueError,)) == 2
    line = one_line(capsys, "python -m dflash_nb.evaluate")
    assert ("the records read reach 256 MiB" if kind == "bomb" else WORDS[kind]) in line, line


# ---- config.json: the drafter (export) dir and the target dir --------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    "An exported one-layer drafter of the built-in tiny target, that target saved as a local HF dir, a prompt file."
    from dflash_nb.export import export_drafter
    from dflash_nb.model import DrafterConfig, DFlashDrafter
    from dflash_nb.target import tiny_target
    root = tmp_path_factory.mktemp("dirs")
    target = tiny_target()
    cfg = DrafterConfig.from_target(target.config, num_hidden_layers=1, block_size=4, target_layer_ids=[0, 2],
                                    mask_token_id=151669)
    export_drafter(DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings()), cfg,
                   root / "drafter")
    target.save_pretrained(root / "target")
    (root / "p.jsonl").write_text('{"prompt": "hi"}\n')
    return root


@pytest.mark.parametrize("which,kind", [("drafter", "fifo"), ("drafter", "zero"), ("target", "fifo"),
                                        ("target", "zero")])
def test_evaluate_refuses_a_special_config_json(tmp_path, dirs, capsys, which, kind):
    d = {w: _copy(dirs / w, tmp_path / w) for w in ("drafter", "target")}
    plant(d[which] / "config.json", kind, tmp_path)
    argv = ["--drafter", str(d["drafter"]), "--target", str(d["target"]), "--prompts", str(dirs / "p.jsonl"),
            "--max-new-tokens", "2"]
    with deadline(): assert run_cli(ev.main, argv, prog="dflash_nb.evaluate", expected=(ValueError,)) == 2
    line = one_line(capsys, "python -m dflash_nb.evaluate")
    assert "config.json" in line and ("is not a file" in line or WORDS[kind] in line), line


def test_export_into_a_dir_with_a_fifo_config_json_is_refused(tmp_path, runs, dirs, capsys):
    from dflash_nb import export as ex
    out = tmp_path / "out"
    out.mkdir()
    plant(out / "config.json", "fifo", tmp_path)
    before = snap(out)
    ck = runs / "a" / "checkpoints" / "step-00000002"
    with deadline(): assert run_cli(ex.main, ["--checkpoint", str(ck), "--out", str(out)], "dflash_nb.export") == 2
    assert "config.json" in one_line(capsys, "python -m dflash_nb.export")
    assert snap(out) == before


@pytest.mark.parametrize("text,words", [
    ('{"format": "dflash_nb.data/2", "dataset_id": [1], "shards": [{"file": [1]}, "x"]}', "holds another data set"),
    ('{"format": "dflash_nb.data/2", "shards": "shard-00000.arrow"}', "holds another data set (an older format"),
    ("[" * 100_000 + "]" * 100_000, "manifest.json was not written by python -m dflash_nb.data"),
    ("[1]", "manifest.json was not written by python -m dflash_nb.data"),
])
def test_data_out_with_a_hostile_manifest_is_refused_untouched(tmp_path, data, tok, monkeypatch, text, words):
    "The data command judges --out by its manifest: wrong types and deep JSON there are a refusal, not a traceback."
    from dflash_nb import shards
    from dflash_nb.records import DataConfig
    tok, parts = tok
    monkeypatch.setattr(shards, "tokenizer_parts", lambda t: parts)
    out = _copy(data, tmp_path / "D")
    (out / "manifest.json").write_text(text)
    before = snap(out)
    with pytest.raises(ExpectedError, match=words.replace("(", r"\(").replace(".", r"\.")):
        shards.tokenize_dataset([str(data.parent / "data.jsonl")], tok, out,
                                DataConfig(workers=1, max_seq_len=160, min_loss_tokens=8), verbose=False)
    assert snap(out) == before


def test_writers_never_overwrite_a_file_at_their_unmarked_temp_name(tmp_path):
    "Someone's files at exactly the temp names this process would use (its own pid): every writer leaves them be."
    from dflash_nb.storage import atomic_dir, atomic_write_text, temp_sibling
    theirs = {temp_sibling(tmp_path / "config.yaml"): "a", temp_sibling(tmp_path / "export"): "b",
              temp_sibling(tmp_path / "export", "old"): "c"}
    for p, text in theirs.items(): p.write_text(text)
    atomic_write_text(tmp_path / "config.yaml", "x: 1\n")
    for _ in range(2):   # the second write swaps the first one out through the `old` name
        with atomic_dir(tmp_path / "export") as d: (d / "config.json").write_text("{}")
    assert all(p.read_text() == text for p, text in theirs.items())
    assert (tmp_path / "config.yaml").read_text() == "x: 1\n" and (tmp_path / "export" / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.yaml", "export", *(p.name for p in theirs)])


@pytest.mark.parametrize("where", ["same", "below", "file"])
def test_data_never_writes_where_it_reads(tmp_path, capsys, where):
    """`--out` equal to an input directory, inside it, or holding an input file: one line, exit 2, the inputs as they
    were. Before: --input d --out d wrote manifest.json into d, and the next run over d read it as 135 bad records."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "hello there"}]}) + "\n")
    spec, out = {"same": (d, d), "below": (d, d / "sub"), "file": (d / "a.jsonl", d)}[where]
    before = snap(d)
    argv = ["--input", str(spec), "--tokenizer", str(qwen3_tokenizer_dir()), "--out", str(out), "--workers", "1"]
    assert data_mod.main(argv) == 2
    assert "a command never writes where it reads" in one_line(capsys, "python -m dflash_nb.data")
    assert snap(d) == before
