"""Nothing a test session started outlives it: a pytest session holding the S3 server and two child processes (one in
its own session, as the vLLM workers are) is interrupted by Ctrl-C (SIGINT), SIGTERM (a CI runner's stop) or SIGKILL
(an out-of-memory kill); every one of them is gone within seconds (`session_guard.py` for the last two)."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def alive(pids) -> list[int]:
    "Those of `pids` still running (a zombie, dead but not yet waited for, does not count)."
    out = []
    for pid in pids:
        try: state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError): continue
        if state != "Z": out.append(pid)
    return out


@pytest.mark.slow   # three pytest sessions, each starting the S3 server (~10 s each here)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_nothing_the_session_started_outlives_it(tmp_path, sig):
    """The inner pytest gets Ctrl-C's default action back: a shell ignores SIGINT in what it starts in the background
    (`make test &`, as CI may run it), the ignoring is inherited, and Python then never raises KeyboardInterrupt."""
    report = tmp_path / "pids.json"
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                          str(tmp_path / "base"), str(HERE / "held_session.py")], cwd=HERE.parent,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
                              "HELD_SESSION_REPORT": str(report)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))   # see below
    try:
        t0 = time.monotonic()
        while not report.exists() and p.poll() is None and time.monotonic() - t0 < 180: time.sleep(0.1)
        assert report.exists(), p.communicate(timeout=60)[0][-3000:]
        time.sleep(0.2)                                   # the file is written in one call; let it land
        pids, guard = json.loads(report.read_text()).values()
        assert len(alive(pids)) == 3, pids
        p.send_signal(getattr(signal, sig))
        try: out, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            left = {pid: (Path(f"/proc/{pid}/cmdline").read_bytes()[:200], Path(f"/proc/{pid}/wchan").read_text())
                    for pid in alive([*pids, guard, p.pid])}
            p.kill()
            try: out = p.communicate(timeout=30)[0][-3000:]
            except subprocess.TimeoutExpired: out = "(its output is still held open)"
            raise AssertionError(f"no end of pytest's output 90 s after {sig}; alive: {left}\n{out}") from None
        t0 = time.monotonic()
        while alive(pids) and time.monotonic() - t0 < 60: time.sleep(0.1)
        waited = time.monotonic() - t0
        assert alive(pids) == [], (alive(pids), out[-3000:])
        assert waited < 20, waited                        # the guard's grace (5 s) and SIGTERM's (5 s at most)
    finally:
        if p.poll() is None: p.kill()
        held = json.loads(report.read_text())["pids"] if report.exists() else []
        for pid in alive(held): os.kill(pid, signal.SIGKILL)
