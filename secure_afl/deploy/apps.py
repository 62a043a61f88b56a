"""The Flower apps: ``server_app`` (drives :class:`FederationServer`) and ``client_app`` (calls
:func:`secure_afl.deploy.client.handle`).

Component references for a Flower app's ``pyproject.toml``::

    [tool.flwr.app.components]
    serverapp = "secure_afl.deploy.apps:server_app"
    clientapp = "secure_afl.deploy.apps:client_app"

Run config (``[tool.flwr.app.config]``, all read by the ServerApp on the server's machine):
``roster`` (path; it must name the coordinator), ``out-dir`` (where ``classifier.json`` and
``report.json`` go), ``sign-timeout`` (300 s: how long the ServerApp waits for ``deploy run``'s
signature), ``classes``
(comma-separated), ``dim``, ``backbone``, ``weights-id``, ``preprocessing``, ``gamma``, ``balance``,
``gram``, ``rounds``, round 2's ``tau`` (0.7), ``alpha`` (0.5), ``min-pos`` (5) and ``min-neg`` (50)
(paper §III; each refused out of range, :class:`~secure_afl.deploy.errors.StudyParameterError`),
``protection`` (``mask``, the default, or ``ckks``), ``ckks-degree`` (8192),
``ckks-moduli`` (comma-separated bit sizes, ``60,40,40,60``), ``ckks-scale-bits`` (40),
``threshold`` (0: ⌊2n/3⌋+1; masking only), ``min-group-size``, ``frac-bits`` (masking only),
``round-timeout``, ``statistics-timeout`` (a session's first round, where clients compute),
``round-limit`` (how long a node Flower still reports online is waited for past its round's timeout;
default 10 x round-timeout, R0 at least statistics-timeout) and ``connect-timeout`` (seconds),
``min-nodes`` (0: the roster's size), ``colluders`` (``n-t``, the default, or the number the
nodes' own ``colluders`` assume: round 2 forms only pseudo-label groups of at least that many + 2
members, which their exposure checks accept).  Differential privacy
(SECURITY.md §9): ``dp-epsilon`` (its presence turns DP on), ``dp-delta`` (1e-6), ``clip`` (32),
``dp-unit`` (``image`` or ``patient``), ``dp-max-images-per-patient`` (4), ``dp-dim`` (K: the public
random projection of the rows, absent: none), ``dp-projection-seed`` (0), ``dp-ridge`` (``bound``,
``adaptive``, the default with ``dp-dim``, or ``adassp``), ``dp-class-sums`` (``split`` or
``positives``, secure_afl/privacy/dp.py), ``dp-row-centre`` (true or false) and ``class-lists``, every
roster institution's labelled classes as ``"hospital-a=0,1,2;hospital-b=1,3"`` (class indices).
Without DP, ``class-lists`` publishes the same lists in the study, so that round 1 under
``gram = "class"`` may send a class's Gram sum as the ``all`` group's minus the group of those that
do not label it (:func:`~secure_afl.deploy.study.round1_plan`; the same classifier, fewer Grams).
A growing study: ``extends``, the digest of the study it extends (its sums are read from
``out-dir/sums-<digest>.npz``, which every additive study writes; README, a federation that grows).

The coordinator's key and passphrase are in no run config (the ServerApp refuses one naming
``identity-key``, ``passphrase-file`` or ``passphrase-env``): the ServerApp writes the unsigned
classifier record (``out-dir/classifier.unsigned.json``) and prints ``sign request <content digest>``;
``secure-afl deploy run``, which holds the key, signs it into ``out-dir/classifier.json``; the
ServerApp verifies that file against the roster's coordinator and sends its bytes to the nodes
(:func:`await_signature`).

Node config (each SuperNode's ``--node-config``): see :class:`~secure_afl.deploy.client.NodeSettings`.
Importing this module loads Flower and the protocol, not torch: the analytic method is imported
only where statistics are computed or solved.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from secure_afl.keys.roster import Roster
from secure_afl.privacy.dp_config import default_ridge

from .classifier import (
    LATEST_NAME,
    SIGN_REQUEST,
    UNSIGNED_NAME,
    Classifier,
    ClassifierSigner,
    write_classifier_file,
)
from .client import NodeSettings, handle, path_free
from .errors import ConfigurationError, DeploymentError, FederationAbortedError
from .metrics import METRICS_NAME, Metrics, record_node_message
from .node_state import NodeStateFiles
from .server import FederationServer
from .study import Method, Study, StudyDp, parse_class_lists
from .sums import load_sums, save_sums
from .wire import MESSAGE_TYPE, Envelope, from_record_dict, to_record_dict

server_app = ServerApp()
client_app = ClientApp()
POLL_SECONDS = 0.2


def _log(text: str) -> None:
    print(f"secure-afl server: {text}", flush=True)


class GridTransport:
    """Push envelopes to nodes, then pull replies until each node answers, Flower reports it gone, or
    the round's limit passes (a :class:`~secure_afl.deploy.server.LiveTransport`).

    Liveness is Flower's own: the SuperLink counts a SuperNode online while its heartbeats arrive
    (one about every 24 s from the SuperNode's process, whatever its ClientApp computes; offline after
    2 x 30 s without), answers a message to a node that went offline with a NODE_UNAVAILABLE error
    reply, and lists only online nodes in ``get_node_ids``.  A node gone is a dropout as soon as
    Flower says so; one still online when ``timeout`` passes is slow, not gone, and is waited for up
    to ``limit``.  Replies are pulled by this round's message ids only: a late reply to an earlier
    round is never read.

    Flower delivers a pulled message once, so a connection reset that cuts the pull's response loses
    it and the node, online, never answers.  A node still online without an answer is therefore sent
    the same envelope again (a new Flower message) at ``timeout``, then at 3 and 7 x ``timeout``
    (at most ``resends`` times); its replies are pulled for every id it was sent, the first that is
    an envelope wins and later ones are ignored.  The node answers an identical repeat with its
    recorded reply (:func:`secure_afl.deploy.client.handle`), but a slow node still starts one
    ClientApp process per copy before its next round's message: hence the doubling waits.  A Flower
    error or a malformed reply to one id decides the node only once every id it was sent is answered."""

    ONLINE_CHECK_SECONDS = 5.0
    RESENDS = 3  # what the ServerApp asks for: re-sends per node and round

    def __init__(
        self,
        grid: Grid,
        *,
        log: Any = None,
        clock: Any = time.monotonic,
        sleep: Any = time.sleep,
        resends: int = 0,
    ) -> None:
        if not isinstance(resends, int) or resends < 0:
            raise ConfigurationError(f"GridTransport's resends must be a whole number >= 0, got {resends!r}")
        self.grid = grid
        self.log = log or _log
        self.clock = clock
        self.sleep = sleep
        self.resends = resends

    def node_ids(self) -> list[int]:
        return [int(n) for n in self.grid.get_node_ids()]

    def exchange(self, outgoing: Mapping[int, Envelope], group: str, timeout: float) -> dict[int, Envelope]:
        return self.exchange_live(outgoing, group, timeout, timeout)

    def exchange_live(
        self, outgoing: Mapping[int, Envelope], group: str, timeout: float, limit: float
    ) -> dict[int, Envelope]:
        limit = max(timeout, limit)
        node_of: dict[str, int] = {}  # every message id pushed this round -> its node

        def push(nodes: list[int]) -> None:
            messages = [
                Message(
                    to_record_dict(outgoing[node]),
                    dst_node_id=node,
                    message_type=MESSAGE_TYPE,
                    group_id=group,
                    ttl=max(limit * 2, 60.0),
                )
                for node in nodes
            ]
            for message_id, node in zip(self.grid.push_messages(messages), nodes, strict=True):
                if message_id:  # Flower gives None for a message it could not push: sent again later
                    node_of[message_id] = node

        push(list(outgoing))
        pending = set(outgoing)  # nodes without an answer
        answered: set[str] = set()  # ids whose reply was pulled
        resent = dict.fromkeys(outgoing, 0)
        fallback: dict[int, Envelope] = {}  # a node's first Flower error or malformed reply
        replies: dict[int, Envelope] = {}
        started = self.clock()
        next_check = started + timeout  # past the timeout: who is still online, every few seconds
        waiting_said = False
        for _ in range(int(limit / POLL_SECONDS) + 2):  # bounded; the clock ends it first
            asked = [m for m, node in node_of.items() if node in pending and m not in answered]
            for reply in self.grid.pull_messages(asked) if asked else ():
                message_id = reply.metadata.reply_to_message_id
                if message_id not in asked or message_id in answered:
                    continue  # another round's, or a node's later duplicate
                answered.add(message_id)
                node = node_of[message_id]
                if node not in pending:
                    continue
                envelope, valid = _envelope_of(reply)
                if not valid:
                    fallback.setdefault(node, envelope)
                    if any(m not in answered for m, n in node_of.items() if n == node):
                        continue  # another copy may still bring the node's answer
                pending.discard(node)
                replies[node] = envelope if valid else fallback[node]
            now = self.clock()
            if not pending or now >= started + limit:
                break
            if now >= next_check:
                online = set(self.node_ids())
                for node in sorted(pending - online):
                    pending.discard(node)
                    replies[node] = Envelope(
                        "dropped",
                        {"error": "NodeOffline", "message": "no longer among the SuperLink's online nodes"},
                    )
                if pending and not waiting_said:  # a count: the coordinator sees roster ids, never node ids
                    self.log(
                        f"{group}: {len(pending)} node(s) still online after {timeout:.0f} s (Flower "
                        f"heartbeats): slow, not gone; waiting up to {limit:.0f} s"
                    )
                    waiting_said = True
                due = sorted(
                    n
                    for n in pending
                    if resent[n] < self.resends and now >= started + timeout * (2 ** (resent[n] + 1) - 1)
                )
                if due:
                    push(due)
                    for node in due:
                        resent[node] += 1
                    self.log(
                        f"{group}: sent the round's message again to {len(due)} node(s) online without an "
                        f"answer (at most {self.resends} times each; a reset may have lost it)"
                    )
                next_check = now + self.ONLINE_CHECK_SECONDS
            if pending:
                self.sleep(POLL_SECONDS)
        for node in sorted(pending & set(fallback)):  # Flower's error or a malformed reply, and no other
            replies[node] = fallback[node]
        return replies


def _envelope_of(reply: Message) -> tuple[Envelope, bool]:
    """A pulled reply as an envelope, and whether it is the node's answer (not Flower's error for the
    message, nor malformed)."""
    if reply.has_error():
        # Flower's own error (the node went offline, its ClientApp process died): not an answer the
        # hospital gave but the loss of the node, a dropout.
        error = reply.error
        return Envelope("dropped", {"error": f"FlowerError{error.code}", "message": str(error.reason)}), False
    try:
        return from_record_dict(reply.content), True
    except ValueError as exc:
        return Envelope("refused", {"error": "MalformedReply", "message": str(exc)}), False


def study_from_run_config(config: Mapping[str, Any]) -> Study:
    try:
        return Study(
            classes=tuple(c.strip() for c in str(config["classes"]).split(",") if c.strip()),
            # The numbers as the run config types them: the study refuses a bool, a string or a value
            # out of range by name (StudyParameterError), where int() or float() would pass it on.
            dim=config["dim"],
            backbone={
                "name": str(config["backbone"]),
                "weights_id": str(config["weights-id"]),
                "preprocessing": str(config["preprocessing"]),
            },
            method=Method(
                gamma=config.get("gamma", 1.0),
                # DP needs plain sums and counts: its default balance is "global"
                balance=str(config.get("balance", "global" if "dp-epsilon" in config else "client")),
                gram=str(config.get("gram", "global")),
                rounds=config.get("rounds", 1),
                alpha=config.get("alpha", 0.5),
                tau=config.get("tau", 0.7),
                min_pos=config.get("min-pos", 5),
                min_neg=config.get("min-neg", 50),
            ),
            threshold=config.get("threshold", 0),
            min_group_size=config.get("min-group-size", 2),
            frac_bits=config.get("frac-bits", 32),
            dp=_dp_from_run_config(config),
            protection=str(config.get("protection", "mask")),
            ckks_degree=int(config.get("ckks-degree", 8192)),
            ckks_coeff_mod_bit_sizes=tuple(
                int(b) for b in str(config.get("ckks-moduli", "60,40,40,60")).split(",") if b.strip()
            ),
            ckks_scale_bits=int(config.get("ckks-scale-bits", 40)),
            extends=str(config.get("extends", "")).strip().lower(),
            # Without DP, published class lists let round 1 send the per-class Gram by difference.
            class_lists=parse_class_lists(str(config["class-lists"]))
            if "class-lists" in config and "dp-epsilon" not in config
            else {},
        )
    except KeyError as exc:
        raise ConfigurationError(f"the run config lacks {exc.args[0]!r}") from None
    except ValueError as exc:
        raise ConfigurationError(f"the run config has a malformed number: {exc}") from None


def coordinator_signer(config: Mapping[str, Any], roster: Roster) -> ClassifierSigner:
    """The coordinator's identity from the run config (``identity-key``, ``passphrase-file``)."""

    from secure_afl.keys.files import KeyFileError, load_identity_key
    from secure_afl.keys.store import KeyStoreError, read_passphrase

    sources = [key for key in ("passphrase-file", "passphrase-env") if str(config.get(key, ""))]
    missing = [] if str(config.get("identity-key", "")) else ["identity-key"]
    if not sources:
        missing.append("passphrase-file")
    if missing:
        raise ConfigurationError(
            f"the run config lacks {missing}: the coordinator signs the classifier file with its roster "
            "identity. Create it with `secure-afl keys init --id coordinator --key-dir DIR`, add "
            "DIR/identity.pub.json to the roster with `secure-afl keys roster add --coordinator --entry "
            "...`, and set identity-key (DIR/identity.key) and passphrase-file (or passphrase-env, an "
            "environment variable of the SuperLink's process) in the run config"
        )
    if len(sources) > 1:
        raise ConfigurationError("the run config sets both passphrase-file and passphrase-env: keep one")
    try:
        passphrase = read_passphrase(
            Path(str(config["passphrase-file"])) if "passphrase-file" in sources else None,
            str(config["passphrase-env"]) if "passphrase-env" in sources else None,
        )
    except KeyStoreError as exc:  # a missing file, open permissions, an unset variable
        raise ConfigurationError(f"the coordinator's {sources[0]}: {exc.message}") from None
    try:
        key = load_identity_key(Path(str(config["identity-key"])), passphrase)
    except KeyFileError as exc:  # deploy app's --key-dir (its identity.key), as deploy run's
        raise ConfigurationError(
            f"the coordinator's key {config['identity-key']} (--key-dir): {exc}; the run config's "
            "identity-key names this file"
        ) from None
    return ClassifierSigner.for_roster(roster, key)


def _flag(value: object, key: str) -> bool:
    """A yes/no run-config value: TOML's true/false, or the words a ``--set KEY=VALUE`` gives."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0"):
        return False
    raise ConfigurationError(f"the run config's {key} must be true or false, got {value!r}")


def _dp_from_run_config(config: Mapping[str, Any]) -> StudyDp | None:
    if "dp-epsilon" not in config:
        return None
    if "class-lists" not in config:
        raise ConfigurationError(
            "dp-epsilon needs class-lists, every roster institution's classes (e.g. "
            '"hospital-a=0,1,2;hospital-b=1,3"): a client sizes its noise from its groups\' members'
        )
    try:
        return StudyDp(
            epsilon=float(config["dp-epsilon"]),
            delta=float(config.get("dp-delta", 1e-6)),
            clip=float(config.get("clip", 32.0)),
            unit=str(config.get("dp-unit", "image")),
            max_images_per_patient=int(config.get("dp-max-images-per-patient", 4)),
            class_lists=parse_class_lists(str(config["class-lists"])),
            projection_dim=int(config["dp-dim"]) if "dp-dim" in config else None,
            projection_seed=int(config.get("dp-projection-seed", 0)),
            class_sums=str(config.get("dp-class-sums", "split")),
            row_centre=_flag(config.get("dp-row-centre", False), "dp-row-centre"),
            ridge=default_ridge(
                str(config["dp-ridge"]) if "dp-ridge" in config else None,
                int(config["dp-dim"]) if "dp-dim" in config else None,
            ),
        )
    except ValueError as exc:
        raise ConfigurationError(f"the run config's DP settings: {exc}") from None


KEY_SETTINGS = ("identity-key", "passphrase-file", "passphrase-env")


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    config = context.run_config
    out_dir = Path(str(config["out-dir"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    named = [key for key in KEY_SETTINGS if key in config]
    if named:  # the SuperLink spawned this process: the coordinator's key has no business here
        raise ConfigurationError(
            f"the run config names {named}: the coordinator's key and passphrase are never given to the "
            "ServerApp (a process the SuperLink starts); remove them from the app and give them to "
            "`secure-afl deploy run --key-dir ... --passphrase-env ...`, which signs the classifier"
        )
    roster = Roster.from_json(Path(str(config["roster"])).read_text(encoding="utf-8"))
    study = study_from_run_config(config)
    _log(f"protection: {study.describe_protection()}")
    # A growing study adds its sums to those of the study it extends, kept in this out-dir.
    earlier = load_sums(out_dir, study.extends) if study.extends else None
    server = FederationServer(
        GridTransport(grid, resends=GridTransport.RESENDS),
        roster,
        study,
        round_timeout=float(config.get("round-timeout", 120)),
        statistics_timeout=float(config.get("statistics-timeout", 600)),
        round_limit=float(config["round-limit"]) if "round-limit" in config else None,
        connect_timeout=float(config.get("connect-timeout", 300)),
        min_nodes=int(config.get("min-nodes", 0)) or None,
        log=_log,
        colluders=config.get("colluders", "n-t"),
        earlier=earlier,
        metrics=Metrics(out_dir / METRICS_NAME),  # served by deploy run --metrics, read by deploy status
    )
    report_path = out_dir / "report.json"
    try:
        classifier = server.run()
        if server.accumulated is not None:
            saved = save_sums(out_dir, server.accumulated)
            _log(f"wrote {saved} (a later study may extend {study.digest()})")
        signed = await_signature(classifier, roster, out_dir, float(config.get("sign-timeout", 300)))
        stored = server.deliver(classifier, signed)
        _log(f"classifier stored by {list(stored)}")
    except DeploymentError as exc:
        report_path.write_text(
            json.dumps({**server.report.to_dict(), "error": f"{type(exc).__name__}: {exc}"})
        )
        _log(f"FAILED: {type(exc).__name__}: {exc}")
        raise
    report_path.write_text(json.dumps(server.report.to_dict(), indent=1))
    _log(f"wrote {report_path}")


def await_signature(
    classifier: Classifier, roster: Roster, out_dir: Path, timeout: float, *, poll: float = POLL_SECONDS
) -> bytes:
    """Write the unsigned classifier record, ask ``deploy run`` to sign it, and wait for the signed
    file: ``out_dir/classifier.json`` whose signature verifies against the roster's coordinator and
    whose content digest is this record's.  Its bytes go to the nodes as they are."""
    unsigned = classifier.to_json(None).encode("utf-8")
    digest = str(json.loads(unsigned)["content_sha256"])
    signed_path = out_dir / LATEST_NAME
    write_classifier_file(out_dir / UNSIGNED_NAME, unsigned)
    _log(
        f"{SIGN_REQUEST} {digest}: wrote {out_dir / UNSIGNED_NAME}; waiting up to {timeout:.0f} s for "
        "the signature"
    )
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / poll) + 2):
        if signed_path.is_file():
            data = signed_path.read_bytes()
            try:
                Classifier.from_json(data, roster=roster, source=str(signed_path))
                if json.loads(data)["content_sha256"] == digest:
                    _log(f"signed by {roster.coordinator.client_id}: {signed_path}")  # type: ignore[union-attr]
                    return data
            except (DeploymentError, ValueError, KeyError):
                pass  # being written, or another file: wait for this record's
        if time.monotonic() >= deadline:
            break
        time.sleep(poll)
    raise FederationAbortedError(
        f"no signed classifier for {digest[:16]}... in {out_dir} within {timeout:.0f} s: the coordinator "
        "signs it in `secure-afl deploy run` (a plain `flwr run` does not), with the roster's coordinator key"
    )


@client_app.query()
def client_query(message: Message, context: Context) -> Message:
    return Message(to_record_dict(answer(message.content, context)), reply_to=message)


def answer(content: Any, context: Context) -> Envelope:
    """This node's answer to a message's content (its Flower record form): a refusal for a malformed
    message, node config or session record, else :func:`~secure_afl.deploy.client.handle`'s.  The
    session's records are the node's files (:class:`NodeStateFiles`), not ``context.state``, which
    Flower stores after the reply has left."""
    try:
        envelope = from_record_dict(content)
        settings = NodeSettings.from_node_config(context.node_config)
        started = time.perf_counter()
        records = NodeStateFiles(settings.ledger_dir, context.run_id)
        with records.exclusive():
            reply = handle(envelope, records, settings)
    except (ValueError, OSError, DeploymentError) as exc:  # the node's disk too: a full one is said
        print(f"secure-afl client: REFUSED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return Envelope("refused", {"error": type(exc).__name__, "message": path_free(str(exc), None)})
    _count(settings, envelope, reply, time.perf_counter() - started)
    return reply


def _count(settings: NodeSettings, envelope: Envelope, reply: Envelope, seconds: float) -> None:
    """This message in the node's counters (ledger-dir/metrics.json, deploy/metrics.py): this
    process ends with the message, so ``deploy node-metrics`` serves them.  A counter that cannot be
    written is said on stderr and changes no answer."""
    from .client import DEFAULT_DP_DELTA_FLOOR

    try:
        record_node_message(
            settings.ledger_dir, envelope.kind, reply.kind, str(reply.meta.get("error", "")), seconds,
            dp_epsilon=settings.dp_epsilon,
            dp_delta=settings.dp_delta if settings.dp_delta is not None else DEFAULT_DP_DELTA_FLOOR,
        )  # fmt: skip
    except (OSError, DeploymentError) as exc:
        print(f"secure-afl client: metrics not written: {exc}", file=sys.stderr, flush=True)
