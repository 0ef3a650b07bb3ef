"""What the regeneration tests share: `dflash-regen` run in this process, and the shards a run wrote."""
import contextlib, io
from pathlib import Path

from dflash_nb.regen import main


def run_main(*argv) -> tuple[int, str, str]:
    "`dflash-regen` in this process: (exit status, stdout, stderr)."
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(map(str, argv)))
    return rc, out.getvalue(), err.getvalue()


def shards(out) -> dict:
    "{file name: bytes} of every shard in `out`."
    return {f.name: f.read_bytes() for f in sorted(Path(out).glob("shard-*.jsonl"))}
