"""A test session made to be interrupted: run only by `test_interrupted_session.py`, which signals the pytest running
it (its name does not match `test_*.py`, so the suite itself never collects it)."""
import json, os, subprocess, sys, time
from pathlib import Path

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_holds_a_server_and_two_children(s3_server, request):
    "The S3 server (a session of its own), a child in pytest's process group and one in a session of its own."
    kids = [subprocess.Popen(SLEEPER, stdout=subprocess.DEVNULL),
            subprocess.Popen(SLEEPER, stdout=subprocess.DEVNULL, start_new_session=True)]
    Path(os.environ["HELD_SESSION_REPORT"]).write_text(json.dumps(
        {"pids": [s3_server.proc.pid, *(k.pid for k in kids)], "guard": request.config._session_guard.pid}))
    time.sleep(600)
