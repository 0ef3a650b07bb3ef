"""Fresh-venv install time of the two locked environments, pip against uv, with the same warm caches.

    python bench/install.py [--out bench/results/install.json] [--envs train serving]

For each environment (locks/train.txt, locks/serving.txt) and each installer: a new venv in a scratch dir, then the
lock installed with --no-deps, as `make install` / `make serving` do. Each installer's cache is warmed by one untimed
install first (so the timed runs download nothing and compare the installers, not the network). Prints each time and
the ratio pip / uv; writes JSON with the load averages before and after.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import now_iso, write_json

REPO = Path(__file__).resolve().parents[1]
LOCKS = {"train": REPO / "locks" / "train.txt", "serving": REPO / "locks" / "serving.txt"}


def install(installer: str, lock: Path, venv: Path) -> float:
    "Seconds to create `venv` and install `lock` into it with `installer` (pip or uv)."
    find_links = os.environ.get("PIP_FIND_LINKS") or ("/opt/wheels" if Path("/opt/wheels").is_dir() else "")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if installer == "pip":
        cmd = [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "-r", str(lock)]
    else:
        uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or "uv"
        cmd = [uv, "pip", "install", "-q", "--no-deps", "--python", str(venv / "bin" / "python"), "-r", str(lock)]
        cmd += ["--find-links", find_links] if find_links else []
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "install.json")
    parser.add_argument("--envs", nargs="+", choices=sorted(LOCKS), default=sorted(LOCKS, reverse=True))
    args = parser.parse_args()
    result = dict(started=now_iso(), load_before=os.getloadavg(), cpu_count=os.cpu_count(), envs={})
    with tempfile.TemporaryDirectory(prefix="dflash-install-bench-") as scratch:
        for env in args.envs:
            times = {}
            for installer in ("pip", "uv"):
                install(installer, LOCKS[env], Path(scratch) / f"{env}-{installer}-warm-up")   # fills the cache
                times[installer] = round(install(installer, LOCKS[env], Path(scratch) / f"{env}-{installer}"), 1)
                shutil.rmtree(Path(scratch) / f"{env}-{installer}-warm-up")
            times["pip_over_uv"] = round(times["pip"] / times["uv"], 2)
            result["envs"][env] = times
            print(f"{env:8s} pip {times['pip']:7.1f} s  uv {times['uv']:6.1f} s  pip / uv {times['pip_over_uv']:.2f}x")
    result.update(load_after=os.getloadavg(), finished=now_iso())
    write_json(args.out, result)


if __name__ == "__main__":
    main()
