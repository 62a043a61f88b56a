"""Prometheus metrics of a federation: the coordinator's and each node's counters, a monitoring
system scrapes them and ``deploy status`` prints them.

Every party keeps its counters in one small JSON file, ``metrics.json``, which the process that sees
the events updates under a lock (:class:`Metrics`): the coordinator's in the run config's out-dir
(the ServerApp, a process the SuperLink starts for one run, writes it), a node's in its ledger-dir
(the ClientApp, which Flower starts once per message, writes it).  Neither process lives long
enough to serve an endpoint, so the counters outlive them in the file and a long-lived process
serves it: ``deploy run --metrics`` and ``deploy local --metrics`` while the federation runs, ``deploy
node-metrics --ledger-dir DIR`` at a hospital (or ``--textfile`` for node_exporter's textfile
collector).  :class:`StateCollector` renders the file for a ``prometheus_client`` registry made per
process (:func:`registry_of`); :func:`serve` binds loopback unless told otherwise.

The counters say how many sessions, rounds, refusals and dropouts there were, never what was
released: no statistic, no image digest, no client's value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import math
import os
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from secure_afl.core.locking import exclusive_lock

from .errors import ConfigurationError

METRICS_NAME = "metrics.json"
FORMAT = "secure-afl-metrics/v1"
ROLES = ("coordinator", "node")
DEFAULT_HOST = "127.0.0.1"
NODE_PORT = 9101  # deploy node-metrics' default (node_exporter's 9100 is left to node_exporter)


@dataclass
class MetricsState:
    """One party's counters since its file was created (a counter never goes down)."""

    role: str = "coordinator"
    sessions_started: int = 0  # node: sessions it advertised in
    sessions_finished: int = 0  # node: sessions whose release point its ledger signed
    sessions_aborted: int = 0  # coordinator only
    rounds: int = 0  # coordinator: rounds run (a repeated CKKS round once); node: messages answered
    round_seconds: float = 0.0
    round_count: int = 0  # node: messages handled
    session_seconds: float = 0.0
    dropouts: int = 0  # coordinator only
    refusals: dict[str, int] = field(default_factory=dict)  # error class (the rule) -> count
    rejections: dict[str, int] = field(default_factory=dict)  # coordinator: replies it rejected
    classifiers: int = 0  # coordinator: delivered; node: stored
    last_success: float | None = None  # Unix time: the last session finished (node: classifier stored)
    # coordinator: institution -> the ε its last DP release spent there; node: unit -> its ledger's ε
    epsilon_spent: dict[str, float] = field(default_factory=dict)
    epsilon_limit: float | None = None  # node: its dp-epsilon

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, document: Mapping[str, Any], source: str) -> MetricsState:
        if not isinstance(document, Mapping) or document.get("format") != FORMAT:
            raise ConfigurationError(
                f"{source} is not a {FORMAT} file: give a coordinator's out-dir or a node's ledger-dir"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            state = cls(**{k: v for k, v in document.items() if k in names})
        except TypeError as exc:
            raise ConfigurationError(f"{source}: {exc}") from None
        if state.role not in ROLES:
            raise ConfigurationError(f"{source}: role {state.role!r} is not one of {ROLES}")
        return state


def read_state(path: Path, role: str | None = None) -> MetricsState:
    """The counters in ``path`` (a fresh state of ``role`` when it does not exist yet)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if role is None:
            raise ConfigurationError(
                f"{path} does not exist: the coordinator writes it in its out-dir at its first session, "
                "a node in its ledger-dir at its first message"
            ) from None
        return MetricsState(role)
    except OSError as exc:
        raise ConfigurationError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ConfigurationError(f"{path}: not JSON ({exc})") from None
    return MetricsState.from_json(document, str(path))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # a ledger-dir is 0700 (FileLedger's)
    with exclusive_lock(path.with_name(path.name + ".lock")):
        yield


def _write(path: Path, state: MetricsState) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(state.to_json(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)


class Metrics:
    """The coordinator's counters as :class:`~secure_afl.deploy.server.FederationServer` records
    them; with ``path`` each change is also written there (read, changed and replaced under a lock,
    so the counters of earlier runs carry on)."""

    def __init__(
        self, path: Path | None = None, *, role: str = "coordinator", clock: Callable[[], float] = time.time
    ):
        self.path = path
        self.clock = clock
        self.state = read_state(path, role) if path is not None else MetricsState(role)

    def change(self, apply: Callable[[MetricsState], None]) -> None:
        if self.path is None:
            apply(self.state)
            return
        with _locked(self.path):
            self.state = read_state(self.path, self.state.role)
            apply(self.state)
            _write(self.path, self.state)

    def session_started(self) -> None:
        self.change(lambda s: setattr(s, "sessions_started", s.sessions_started + 1))

    def session_finished(self, seconds: float) -> None:
        now = self.clock()

        def apply(s: MetricsState) -> None:
            s.sessions_finished += 1
            s.session_seconds += seconds
            s.last_success = now

        self.change(apply)

    def session_aborted(self, seconds: float) -> None:
        def apply(s: MetricsState) -> None:
            s.sessions_aborted += 1
            s.session_seconds += seconds

        self.change(apply)

    def round_done(self, seconds: float, *, repeated: bool = False) -> None:
        def apply(s: MetricsState) -> None:
            s.rounds += 0 if repeated else 1
            s.round_count += 1
            s.round_seconds += seconds

        self.change(apply)

    def dropout(self) -> None:
        self.change(lambda s: setattr(s, "dropouts", s.dropouts + 1))

    def refusal(self, rule: str) -> None:
        self.change(lambda s: s.refusals.__setitem__(rule, s.refusals.get(rule, 0) + 1))

    def rejection(self, error: str) -> None:
        self.change(lambda s: s.rejections.__setitem__(error, s.rejections.get(error, 0) + 1))

    def delivered(self) -> None:
        self.change(lambda s: setattr(s, "classifiers", s.classifiers + 1))

    def privacy(self, record: Mapping[str, Any] | None) -> None:
        """A DP release's ε per institution (its privacy record's ``epsilon_spent``)."""
        spent = (record or {}).get("epsilon_spent")
        if isinstance(spent, Mapping) and spent:
            self.change(lambda s: setattr(s, "epsilon_spent", {str(k): float(v) for k, v in spent.items()}))


# --- a node's counters -----------------------------------------------------------------------------


def record_node_message(
    ledger_dir: Path,
    request_kind: str,
    reply_kind: str,
    error: str,
    seconds: float,
    *,
    dp_epsilon: float | None = None,
    dp_delta: float = 1e-6,
    clock: Callable[[], float] = time.time,
) -> MetricsState:
    """Count one message a node's ClientApp answered (``reply_kind``: ``reply``, ``ack`` or
    ``refused`` with ``error``, the error class) into ``ledger_dir/metrics.json``; the sessions it
    released and the ε they spent are read from its ledger there."""
    metrics = Metrics(ledger_dir / METRICS_NAME, role="node", clock=clock)
    released, spent = ledger_summary(ledger_dir, dp_delta)
    now = clock()

    def apply(s: MetricsState) -> None:
        s.round_count += 1
        s.round_seconds += seconds
        if reply_kind == "refused":
            s.refusals[error or "?"] = s.refusals.get(error or "?", 0) + 1
        else:
            s.rounds += 1
            if request_kind == "advertise":
                s.sessions_started += 1
            if request_kind == "classifier" and reply_kind == "ack":
                s.classifiers += 1
                s.last_success = now
        s.sessions_finished = max(s.sessions_finished, released)
        s.epsilon_spent = spent
        s.epsilon_limit = dp_epsilon

    metrics.change(apply)
    return metrics.state


def ledger_summary(ledger_dir: Path, delta: float) -> tuple[int, dict[str, float]]:
    """(sessions released, ε spent per DP unit) of the ledgers in ``ledger_dir``, read for display
    (the ClientApp verifies its ledger's signature before it relies on it; this does not)."""
    from secure_afl.privacy.dp_growth import NodeSpend, chain_spend

    released = 0
    spends: dict[str, list[Any]] = {}
    for path in sorted(ledger_dir.glob("*.ledger.json")):
        try:
            sessions = json.loads(path.read_text(encoding="utf-8")).get("sessions", {})
        except (OSError, ValueError, AttributeError):
            continue
        for entry in sessions.values() if isinstance(sessions, dict) else ():
            if not isinstance(entry, dict) or entry.get("survivors") is None:
                continue
            released += 1
            if entry.get("spend"):
                with contextlib.suppress(Exception):
                    spend = NodeSpend.from_text(str(entry["spend"]))
                    spends.setdefault(spend.unit, []).append(spend)
    spent = {}
    for unit, items in sorted(spends.items()):
        with contextlib.suppress(Exception):
            spent[unit] = float(chain_spend(items[:-1], items[-1], delta).total)
    return released, spent


# --- Prometheus -------------------------------------------------------------------------------------


class StateCollector(Collector):
    """Renders a :class:`MetricsState` (``read()`` at each scrape) as Prometheus metrics."""

    def __init__(self, read: Callable[[], MetricsState]) -> None:
        self.read = read

    def collect(self) -> Iterator[Any]:
        s = self.read()
        node = s.role == "node"
        info = GaugeMetricFamily("secure_afl_party_info", "The party these metrics are of.", labels=["role"])
        info.add_metric([s.role], 1)
        yield info
        what = "advertised in" if node else "started"
        yield CounterMetricFamily(
            "secure_afl_sessions_started", f"Sessions {what}.", value=s.sessions_started
        )
        what = "whose release point this node's ledger signed" if node else "finished (sums released)"
        yield CounterMetricFamily(
            "secure_afl_sessions_finished", f"Sessions {what}.", value=s.sessions_finished
        )
        what = (
            "Messages this node answered." if node else "Protocol rounds run (a repeated round counts once)."
        )
        yield CounterMetricFamily("secure_afl_rounds", what, value=s.rounds)
        what = "Seconds this node spent answering messages." if node else "Seconds of the rounds run."
        yield SummaryMetricFamily(
            "secure_afl_round_seconds", what, count_value=s.round_count, sum_value=s.round_seconds
        )
        refusals = CounterMetricFamily(
            "secure_afl_refusals",
            "Sessions refused, by error class (the rule): "
            + ("refusals this node sent." if node else "refusals the nodes sent."),
            labels=["rule"],
        )
        for rule, count in sorted(s.refusals.items()):
            refusals.add_metric([rule], count)
        yield refusals
        what = "Classifiers stored." if node else "Classifiers delivered."
        yield CounterMetricFamily("secure_afl_classifiers", what, value=s.classifiers)
        if not node:
            yield CounterMetricFamily(
                "secure_afl_sessions_aborted", "Sessions aborted.", value=s.sessions_aborted
            )
            yield SummaryMetricFamily(
                "secure_afl_session_seconds",
                "Seconds of the sessions (finished and aborted).",
                count_value=s.sessions_finished + s.sessions_aborted,
                sum_value=s.session_seconds,
            )
            yield CounterMetricFamily(
                "secure_afl_dropouts", "Nodes that dropped out of a round.", value=s.dropouts
            )
            rejections = CounterMetricFamily(
                "secure_afl_rejections", "Replies the coordinator rejected, by error class.", labels=["error"]
            )
            for error, count in sorted(s.rejections.items()):
                rejections.add_metric([error], count)
            yield rejections
        if s.last_success is not None:
            what = "a classifier stored" if node else "a session finished"
            yield GaugeMetricFamily(
                "secure_afl_last_success_timestamp_seconds", f"Unix time {what} last.", value=s.last_success
            )
        label = "unit" if node else "institution"
        if s.epsilon_spent:
            what = (
                "this node's ledger records, by DP unit"
                if node
                else "the last DP release spent, by institution"
            )
            spent = GaugeMetricFamily("secure_afl_dp_epsilon_spent", f"The ε {what}.", labels=[label])
            for name, value in sorted(s.epsilon_spent.items()):
                spent.add_metric([name], value)
            yield spent
        if node and s.epsilon_limit is not None:
            yield GaugeMetricFamily(
                "secure_afl_dp_epsilon_limit", "This node's dp-epsilon.", value=s.epsilon_limit
            )
            remaining = GaugeMetricFamily(
                "secure_afl_dp_epsilon_remaining", "dp-epsilon less the ε spent, by DP unit.", labels=["unit"]
            )
            for unit in sorted(s.epsilon_spent) or ["image"]:
                remaining.add_metric([unit], max(0.0, s.epsilon_limit - s.epsilon_spent.get(unit, 0.0)))
            yield remaining


def registry_of(read: Callable[[], MetricsState]) -> CollectorRegistry:
    """A registry of its own (no process-wide default) holding one :class:`StateCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(read))
    return registry


def file_registry(path: Path, role: str) -> CollectorRegistry:
    """A registry that reads ``path`` at each scrape (a fresh state of ``role`` until it exists)."""
    return registry_of(lambda: read_state(path, role))


def write_textfile(path: Path, registry: CollectorRegistry) -> None:
    """The metrics in node_exporter's textfile-collector format (written atomically)."""
    write_to_textfile(str(path), registry)


def parse_address(
    text: str, *, default_port: int | None = None, option: str = "--metrics"
) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``PORT`` (then on 127.0.0.1) as (host, port); port 0: one
    the kernel chooses when it binds (the endpoint's URL then names it)."""
    text = text.strip()
    host, _, port_text = text.rpartition(":")
    if not _:
        host, port_text = DEFAULT_HOST, text
    host = host.strip("[]") or DEFAULT_HOST
    if not port_text and default_port is not None:
        port_text = str(default_port)
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port < 65536:
        raise ConfigurationError(
            f"{option} {text!r}: give HOST:PORT (e.g. 127.0.0.1:9464) or a port alone (bound to "
            f"{DEFAULT_HOST})"
        )
    return host, port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Endpoint:
    """A running ``/metrics`` endpoint; :meth:`close` stops it."""

    host: str
    port: int
    server: Any
    thread: Any

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def serve(registry: CollectorRegistry, host: str, port: int) -> Endpoint:
    """Serve ``registry`` on ``host:port`` in a thread of this process (prometheus_client's server)."""
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot serve the metrics on {host}:{port} ({exc.strerror}): choose a free port"
        ) from None
    return Endpoint(host, server.server_port, server, thread)


# --- reading them back --------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Prometheus text as {(sample name, sorted labels): value}."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


def scrape(url: str, timeout: float = 10.0) -> Samples:
    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(
            f"--url {url!r}: give an http:// address (e.g. http://127.0.0.1:9464/metrics)"
        )
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return parse(response.read().decode("utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"cannot scrape {url}: {exc}") from None


def samples_of(registry: CollectorRegistry) -> Samples:
    from prometheus_client import generate_latest

    return parse(generate_latest(registry).decode("utf-8"))


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def expected_from_reports(reports: Sequence[Mapping[str, Any]]) -> Samples:
    """The coordinator's counters that ``reports`` (report.json documents) imply, summed."""
    out: Samples = {}

    def add(name: str, amount: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        out[key] = out.get(key, 0.0) + amount

    for report in reports:
        sessions = list(report.get("sessions", []))
        add("secure_afl_sessions_started_total", len(sessions))
        finished = sum(1 for s in sessions if s.get("survivors"))
        add("secure_afl_sessions_finished_total", finished)
        add("secure_afl_sessions_aborted_total", len(sessions) - finished)
        add("secure_afl_rounds_total", sum(len(s.get("round_seconds", {})) for s in sessions))
        add("secure_afl_dropouts_total", len(report.get("dropouts", [])))
        for item in report.get("refusals", []):
            add("secure_afl_refusals_total", 1, rule=str(item.get("error", "?")))
        for item in report.get("rejections", []):
            add("secure_afl_rejections_total", 1, error=str(item.get("error", "?")))
        add("secure_afl_classifiers_total", 1 if report.get("acknowledged") else 0)
    return out


def mismatches(
    samples: Samples, reports: Sequence[Mapping[str, Any]], before: Samples | None = None
) -> list[str]:
    """Where the scraped counters differ from what ``reports`` imply (empty: they match); with
    ``before`` (a scrape before those runs) their increase since then."""
    expected = expected_from_reports(reports)
    names = {name for name, _ in expected}
    keys = set(expected) | {k for k in samples if k[0] in names}
    wrong = []
    for key in sorted(keys):
        got = samples.get(key, 0.0) - (before or {}).get(key, 0.0)
        want = expected.get(key, 0.0)
        if not math.isclose(got, want):
            labels = ",".join(f"{k}={v}" for k, v in key[1])
            wrong.append(f"{key[0]}{{{labels}}}: scraped {got:g}, the report(s) say {want:g}")
    return wrong


# --- for a person -------------------------------------------------------------------------------------


def status_lines(samples: Samples, now: float | None = None) -> list[str]:
    """What ``deploy status`` prints: the same numbers, in words."""
    now = time.time() if now is None else now
    role = next((dict(labels)["role"] for name, labels in samples if name == "secure_afl_party_info"), "?")
    node = role == "node"
    v = lambda name, **labels: int(value(samples, name, **labels))  # noqa: E731
    lines = [f"{role} metrics"]
    lines.append(
        f"  sessions: {v('secure_afl_sessions_started_total')} {'advertised in' if node else 'started'}, "
        f"{v('secure_afl_sessions_finished_total')} {'released' if node else 'finished'}"
        + ("" if node else f", {v('secure_afl_sessions_aborted_total')} aborted")
    )
    count = value(samples, "secure_afl_round_seconds_count")
    mean = value(samples, "secure_afl_round_seconds_sum") / count if count else 0.0
    what = "messages answered" if node else "rounds"
    lines.append(f"  {what}: {v('secure_afl_rounds_total')} (mean {mean:.1f} s)")
    if not node:
        count = value(samples, "secure_afl_session_seconds_count")
        if count:
            lines.append(
                f"  session duration: mean {value(samples, 'secure_afl_session_seconds_sum') / count:.1f} s"
            )
        lines.append(f"  dropouts: {v('secure_afl_dropouts_total')}")
    for title, name, label in (
        ("refusals", "secure_afl_refusals_total", "rule"),
        ("rejections", "secure_afl_rejections_total", "error"),
    ):
        items = sorted((dict(k)[label], int(x)) for (n, k), x in samples.items() if n == name)
        if name.endswith("rejections_total") and node:
            continue
        lines.append(
            f"  {title}: " + (", ".join(f"{key} {count}" for key, count in items) if items else "none")
        )
    lines.append(f"  classifiers {'stored' if node else 'delivered'}: {v('secure_afl_classifiers_total')}")
    last = samples.get(("secure_afl_last_success_timestamp_seconds", ()))
    if last is None:
        lines.append("  last success: never")
    else:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(last))
        lines.append(f"  last success: {stamp} ({_ago(now - last)} ago)")
    spent = sorted((dict(k), x) for (n, k), x in samples.items() if n == "secure_afl_dp_epsilon_spent")
    if spent:
        lines.append("  DP ε spent: " + ", ".join(f"{next(iter(k.values()))} {x:.4g}" for k, x in spent))
    limit = samples.get(("secure_afl_dp_epsilon_limit", ()))
    if limit is not None:
        remaining = sorted(
            (dict(k)["unit"], x) for (n, k), x in samples.items() if n == "secure_afl_dp_epsilon_remaining"
        )
        lines.append(
            f"  DP ε remaining of dp-epsilon {limit:g}: " + ", ".join(f"{u} {x:.4g}" for u, x in remaining)
        )
    return lines


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
