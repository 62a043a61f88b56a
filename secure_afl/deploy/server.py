"""The server's side of a deployment, over any transport (Flower's Grid in production).

:class:`FederationServer` runs round 1 (and round 2 when the study asks for it) as secure-aggregation
sessions, solves the classifier in closed form and sends the classifier file to every participant.
It is generic over the study's protection backend (:mod:`secure_afl.aggregation.backend`: pairwise
masking or CKKS): it follows the server session's ``next_round()`` until it sends nothing, sending
each round only to the clients the session addresses, and knows Flower only through
:class:`Transport`.  A node that does not answer a round within ``round_timeout`` seconds is a
dropout, unless the transport follows liveness (:class:`LiveTransport`, Flower's heartbeats): then a
node it reports gone is a dropout at once, and one still alive is waited for up to ``round_limit``
(a busy host is slow, not gone).  A reply the session rejects is logged with its error class and
treated as a dropout too.
Flower node ids only route: a client is known by the id its signed advertisement carries, and later
replies must come from the node that delivered that advertisement.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from secure_afl.aggregation.backend import ProtectionBackend, SessionOutcome
from secure_afl.aggregation.layout import Layout
from secure_afl.core.errors import (
    DuplicateClientError,
    ProtocolError,
    SessionAbortedError,
    UnknownClientError,
)
from secure_afl.keys.roster import Roster
from secure_afl.privacy.policy import active_threshold

from .classifier import Classifier, ClassifierSigner
from .errors import ConfigurationError, FederationAbortedError
from .metrics import Metrics
from .solve import StudySolver
from .study import (
    Study,
    class_group,
    classifier_fields,
    noise_plan,
    pseudo_members,
    round1_plan,
    round2_classes,
    round2_layout,
    round2_min_group_size,
    session_context,
    study_protocol,
    study_session_id,
)
from .sums import AccumulatedSums, chain_entry, is_additive
from .verify import ServerCheck, count_claims
from .wire import Envelope


class Transport(Protocol):
    def node_ids(self) -> list[int]: ...

    def exchange(
        self, outgoing: Mapping[int, Envelope], group: str, timeout: float
    ) -> dict[int, Envelope]: ...


@runtime_checkable
class LiveTransport(Transport, Protocol):
    """A transport that knows whether a node is alive (Flower: the SuperLink's heartbeats).

    ``exchange_live`` returns a ``dropped`` envelope for a node it finds gone, as soon as it does, and
    waits for a node still alive past ``timeout``, up to ``limit`` seconds.  A reply that comes after
    it returns is never read: the round's survivor set is fixed without it."""

    def exchange_live(
        self, outgoing: Mapping[int, Envelope], group: str, timeout: float, limit: float
    ) -> dict[int, Envelope]: ...


Log = Callable[[str], None]


def one_line(value: object, limit: int = 500) -> str:
    """A node's text as one printable line of at most ``limit`` characters, for the log and report.

    The server's log is the stream ``deploy run`` reads line by line (``sign request``, ``FAILED:``):
    a refusal message with a line break must not become a line of its own."""
    text = "".join(ch if ch.isprintable() else " " for ch in str(value))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class SessionRecord:
    label: str
    session_id: bytes
    participants: tuple[str, ...] = ()  # whose advertisement the session accepted
    survivors: tuple[str, ...] = ()  # whose masked inputs are in the sums
    completed: tuple[str, ...] = ()  # who answered every round
    groups: list[dict[str, Any]] = field(default_factory=list)
    round_seconds: dict[str, float] = field(default_factory=dict)
    key_holder: str = ""  # CKKS: the client that generated the session's key
    replaced_key_holders: tuple[str, ...] = ()  # CKKS: key holders that sent no key (re-elected)
    # CKKS: group -> who decrypted it (several, comma-separated, when its decryption was split by chunk)
    decryptors: dict[str, str] = field(default_factory=dict)


@dataclass
class FederationReport:
    sessions: list[SessionRecord] = field(default_factory=list)
    refusals: list[dict[str, str]] = field(default_factory=list)  # replies that said "refused"
    rejections: list[dict[str, str]] = field(default_factory=list)  # replies the server rejected
    dropouts: list[dict[str, str]] = field(default_factory=list)  # no answer within the timeout
    seconds: dict[str, float] = field(default_factory=dict)
    acknowledged: tuple[str, ...] = ()
    verified: tuple[str, ...] = ()  # who verified the classifier against the sums (deploy/verify.py)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sessions": [
                {
                    "label": s.label,
                    "session_id": s.session_id.hex(),
                    "participants": list(s.participants),
                    "survivors": list(s.survivors),
                    "completed": list(s.completed),
                    "round_seconds": s.round_seconds,
                    **(
                        {
                            "key_holder": s.key_holder,
                            "replaced_key_holders": list(s.replaced_key_holders),
                            "decryptors": s.decryptors,
                        }
                        if s.key_holder
                        else {}
                    ),
                }
                for s in self.sessions
            ],
            "refusals": self.refusals,
            "rejections": self.rejections,
            "dropouts": self.dropouts,
            "seconds": self.seconds,
            "acknowledged": list(self.acknowledged),
            "verified": list(self.verified),
        }


class FederationServer:
    def __init__(
        self,
        transport: Transport,
        roster: Roster,
        study: Study,
        *,
        backend: ProtectionBackend | None = None,
        round_timeout: float = 120.0,
        statistics_timeout: float | None = None,
        round_limit: float | None = None,
        connect_timeout: float = 300.0,
        min_nodes: int | None = None,
        log: Log = print,
        session_ids: Sequence[bytes] | None = None,
        signer: ClassifierSigner | None = None,
        colluders: object = "n-t",
        earlier: AccumulatedSums | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.transport = transport
        # What a monitoring system scrapes (deploy/metrics.py): counted where the report records it.
        self.metrics = metrics or Metrics()
        # A growing study: the sums of the chain it extends (the coordinator's own earlier outputs).
        if study.extends and (earlier is None or earlier.study_digest != study.extends):
            raise ConfigurationError(
                f"the study extends {study.extends[:16]}..., but the server was given "
                f"{'no earlier sums' if earlier is None else f'the sums of {earlier.study_digest[:16]}...'}"
            )
        if earlier is not None and not study.extends:
            raise ConfigurationError("earlier sums were given for a study that extends none")
        self.earlier = earlier
        # A DP chain: every earlier session's noise record (its solve sizes the ridge from them all).
        self.earlier_noise = _earlier_noise(earlier, private=study.dp is not None)
        self.accumulated: AccumulatedSums | None = None  # after run(): the sums to extend next
        # The colluders the nodes' exposure checks assume (run config ``colluders``, the same value as
        # theirs): round 2 forms only pseudo-label groups they would accept.
        self.round2_min_group_size = round2_min_group_size(study, len(roster), colluders)
        # The coordinator's roster identity: it signs the classifier file (deliver refuses without).
        if signer is not None:
            ClassifierSigner.for_roster(roster, signer.key)
        self.signer = signer
        self.roster = roster
        self.study = study
        self.backend = backend or study.backend(len(roster))
        if self.backend.name != study.protection:
            raise ConfigurationError(
                f"the study's protection is {study.protection!r}, the server was given the "
                f"{self.backend.name!r} backend"
            )
        self.round_timeout = round_timeout
        # A session's first round is where clients compute their statistics (round 1) or their
        # pseudo-labels (round 2): it may take much longer than a protocol round.
        self.statistics_timeout = max(round_timeout, statistics_timeout or 0.0)
        # Over a LiveTransport: how long a node that is alive (heartbeats) but has not answered yet is
        # waited for, past its round's timeout (default 10 x round_timeout; R0: at least
        # statistics_timeout).  A node the transport reports gone is a dropout at once.
        self.round_limit = max(round_timeout, 10 * round_timeout if round_limit is None else round_limit)
        self.connect_timeout = connect_timeout
        self.min_nodes = len(roster) if min_nodes is None else min_nodes
        self.log = log
        self.report = FederationReport()
        self.check = ServerCheck(study, [entry.client_id for entry in roster])  # the classifier check
        self._session_ids = list(session_ids or [])  # under DP: the nonces the session ids commit with
        self._node_of: dict[str, int] = {}
        self.privacy: dict[str, Any] | None = None
        if study.dp is not None:
            if self.backend.name != "mask":
                raise ConfigurationError(
                    "differential privacy runs only with the masking protocol (secure 'mask'), not "
                    f"{self.backend.name!r}: TenSEAL's CKKS has no threshold decryption, so a server "
                    "colluding with the decrypting client could read one client's noisy statistics alone"
                )
            roster_ids = sorted(entry.client_id for entry in roster)
            if sorted(study.dp.class_lists) != roster_ids:
                raise ConfigurationError(
                    f"the study's class lists name {sorted(study.dp.class_lists)}, the roster {roster_ids}: "
                    "list every roster institution's classes (class-lists)"
                )

    # --- the run ------------------------------------------------------------------------------

    def run(self) -> Classifier:
        started = time.perf_counter()
        # Under DP the plan comes first: a study it cannot satisfy stops the run before any session.
        plan = noise_plan(self.study, len(self.roster)) if self.study.dp is not None else None
        # Round 1's wire layout: every node derives the same one from the study and the roster.
        layout1, difference = round1_plan(self.study, [entry.client_id for entry in self.roster])
        if difference is not None and not self.backend.exact_sums:
            raise ConfigurationError(
                f"the study's round 1 sends Grams by difference, which needs exact sums; the "
                f"{self.backend.name!r} backend given to the server has none"
            )
        nodes = self._wait_for_nodes()
        method = self.study.method
        if difference is not None:
            self.log(f"round 1: {difference.describe()}")
        solver = StudySolver(self.study, plan, self.earlier_noise)
        record1, outcome1 = self._session("1", nodes, layout1, {})
        solve_started = time.perf_counter()
        # Under DP the session's noise record goes into a growing chain's entry before the solve.
        gram_survivors = len(self._group(record1, "all")["survivors"]) if plan is not None else 0
        noise = solver.session_noise(gram_survivors)
        model = solver.fit(self._accumulate(record1, outcome1.sums, noise), gram_survivors)
        self.report.seconds["solve"] = time.perf_counter() - solve_started
        if method.rounds == 2:
            labelled = {
                cid: {c for c in range(self.study.n_classes) if cid in self._members(record1, class_group(c))}
                for cid in record1.participants
            }
            members = pseudo_members(labelled, record1.completed, self.study.n_classes)
            classes = round2_classes(members, self.round2_min_group_size)
            skipped = [c for c in range(self.study.n_classes) if c not in classes]
            if skipped:
                self.log(
                    f"round 2: no pseudo-label group for classes {skipped} (fewer than "
                    f"{self.round2_min_group_size} live clients miss them)"
                )
            if classes:
                layout2 = round2_layout(self.study, classes)
                targets = [self._node_of[cid] for cid in record1.completed]
                record2, outcome2 = self._session("2", targets, layout2, {"coef": model.coef_})
                solve_started = time.perf_counter()
                survivors2 = {g["name"]: len(g["survivors"]) for g in record2.groups}
                model = solver.refine(model, outcome2.sums, survivors2)
                self.report.seconds["solve"] += time.perf_counter() - solve_started
        weights = solver.weights(model)  # under --dp-dim the classifier holds W = P W_K
        self.privacy = solver.privacy_record(model)  # under DP: every session's ε, and a chain's
        self.metrics.privacy(self.privacy)
        classifier = self._classifier(weights)
        self.report.seconds["federation"] = time.perf_counter() - started
        return classifier

    def _accumulate(self, record: SessionRecord, sums: Any, noise: Any = None) -> Any:
        """The sums to solve on: a growing study's added to the chain's earlier sums.  An additive
        study's are kept (``self.accumulated``) so that a later study may extend it; under DP with
        the session's noise record ``noise`` (a :class:`~secure_afl.privacy.dp_growth.SessionNoise`)
        in its chain entry, which a later DP solve of the chain sizes its ridge from."""
        if not is_additive(self.study):
            return sums
        from secure_afl.growth import GrowthError, accumulate_sums

        earlier = self.earlier
        try:
            total = accumulate_sums(None if earlier is None else earlier.sums, sums)
        except GrowthError as exc:
            if earlier is not None:
                why = f"the session's sums do not add to the earlier ones: {exc}"
                raise FederationAbortedError(why) from exc
            self.log(f"the sums are not kept for a growing study: {exc}")
            return sums
        entry = chain_entry(
            self.study.digest(),
            record.session_id,
            record.survivors,
            None if noise is None else noise.to_json(),
        )
        chain = (*(() if earlier is None else earlier.chain), entry)
        self.accumulated = AccumulatedSums(self.study.digest(), total, chain)
        return total if earlier is not None else sums

    def sign(self, classifier: Classifier) -> bytes:
        """The classifier file, signed by the coordinator (Ed25519 is deterministic: same bytes each time)."""
        if self.signer is None:
            raise ConfigurationError(
                "the server has no coordinator identity to sign the classifier with, and every institution "
                "refuses an unsigned one: give it the roster coordinator's key (run config identity-key and "
                "passphrase-file)"
            )
        return classifier.to_json(self.signer).encode("utf-8")

    def deliver(self, classifier: Classifier, data: bytes | None = None) -> tuple[str, ...]:
        """Send the signed classifier file (``data``, signed by ``deploy run``; without it, signed here
        with the server's own signer) to every client that completed the last session; return who
        stored it."""
        last = self.report.sessions[-1]
        data = self.sign(classifier) if data is None else data
        # Global balance and DP (the additive layout): the count sums the solve divided by, sent with
        # the classifier; none kept (the nodes then refuse the check for want of them).
        kept = self.accumulated
        counts = {} if kept is None else count_claims(self.check.form, self.check.n_classes, kept.sums)
        meta = {"round": "classifier", **self.check.delivery_meta(last.survivors, counts)}
        outgoing = {self._node_of[cid]: Envelope("classifier", meta, data) for cid in last.completed}
        started = time.perf_counter()
        replies, silence = self._exchange(outgoing, "classifier", self.round_timeout)
        self.report.seconds["deliver"] = time.perf_counter() - started
        client_of = {node: cid for cid, node in self._node_of.items()}
        stored = []
        for node, envelope in sorted(replies.items()):
            if envelope.kind == "ack":
                stored.append(client_of[node])
            elif envelope.kind == "refused":
                self._refused(client_of.get(node, f"node {node}"), "classifier", envelope)
            elif envelope.kind == "dropped":
                reason = f"Flower reports it gone ({one_line(envelope.meta.get('error', '?'), 100)})"
                self.report.dropouts.append({"at": "classifier", "client": client_of[node], "reason": reason})
                self.metrics.dropout()
                self.log(f"classifier: {client_of[node]} {reason} (dropout)")
        for node in sorted(set(outgoing) - set(replies)):
            reason = silence
            self.report.dropouts.append({"at": "classifier", "client": client_of[node], "reason": reason})
            self.metrics.dropout()
            self.log(f"classifier: {client_of[node]} {reason} (dropout)")
        self.report.acknowledged = tuple(sorted(stored))
        if stored:
            self.metrics.delivered()
        return self._verify_classifier(replies)

    def _verify_classifier(self, replies: Mapping[int, Envelope]) -> tuple[str, ...]:
        """The classifier check's relay (secure_afl.deploy.verify); who stored the classifier: a
        node that held it until verified counts once it verified it."""

        def exchange(outgoing: Mapping[int, Envelope], group: str, timeout: float) -> dict[int, Envelope]:
            return self._exchange(outgoing, group, timeout)[0]

        verified = self.check.run(exchange, self._node_of, replies, self.round_timeout, self.log)
        self.report.seconds["verify"] = self.check.seconds
        self.report.verified = verified
        for step, who, envelope in self.check.refusals:
            self._refused(who, f"classifier check {step}", envelope)
        client_of = {node: cid for cid, node in self._node_of.items()}
        held = {client_of[n] for n, e in replies.items() if e.kind == "ack" and e.meta.get("held")}
        self.report.acknowledged = tuple(sorted((set(self.report.acknowledged) - held) | set(verified)))
        return self.report.acknowledged

    # --- sessions -----------------------------------------------------------------------------

    def _exchange(
        self, outgoing: Mapping[int, Envelope], group: str, timeout: float
    ) -> tuple[dict[int, Envelope], str]:
        """One round's replies, and why a node that sent none is a dropout.  Over a
        :class:`LiveTransport` a node alive past ``timeout`` keeps its place up to the round's limit."""
        if isinstance(self.transport, LiveTransport):
            limit = max(timeout, self.round_limit)
            replies = self.transport.exchange_live(outgoing, group, timeout, limit)
            return replies, f"was alive but did not answer within {limit:.0f} s"
        return self.transport.exchange(outgoing, group, timeout), f"did not answer within {timeout:.0f} s"

    def _wait_for_nodes(self) -> list[int]:
        started = time.perf_counter()
        deadline = time.monotonic() + self.connect_timeout
        nodes: list[int] = []
        for _ in range(100_000):
            nodes = sorted(self.transport.node_ids())
            if len(nodes) >= self.min_nodes or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        self.report.seconds["wait_for_nodes"] = time.perf_counter() - started
        if self.study.protection == "mask":
            needed = self.study.threshold_for(len(self.roster))
            what = f"the threshold t={needed} of a {len(self.roster)}-institution roster"
        else:  # CKKS: t of the roster sign the one view (R3), every group needs min_group_size
            needed = max(self.study.min_group_size, active_threshold(len(self.roster)))
            what = (
                f"the t={active_threshold(len(self.roster))} of a {len(self.roster)}-institution roster that "
                f"must sign the session's view, or the minimum group size {self.study.min_group_size}"
            )
        if len(nodes) < needed:
            raise FederationAbortedError(
                f"{len(nodes)} SuperNode(s) connected within {self.connect_timeout:.0f} s, fewer than {what}"
            )
        self.log(f"{len(nodes)} SuperNode(s) connected (roster: {len(self.roster)} institutions)")
        return nodes

    def _session(
        self, label: str, nodes: Sequence[int], layout: Layout, arrays: Mapping[str, np.ndarray]
    ) -> tuple[SessionRecord, SessionOutcome]:
        """One session (:meth:`_run_session`), counted started, then finished or aborted."""
        self.metrics.session_started()
        started = time.perf_counter()
        try:
            result = self._run_session(label, nodes, layout, arrays)
        except Exception:
            self.metrics.session_aborted(time.perf_counter() - started)
            raise
        self.metrics.session_finished(time.perf_counter() - started)
        return result

    def _run_session(
        self, label: str, nodes: Sequence[int], layout: Layout, arrays: Mapping[str, np.ndarray]
    ) -> tuple[SessionRecord, SessionOutcome]:
        """Run one session: follow the server session's ``next_round()`` until it sends nothing.

        Each round goes only to the clients the session addresses (CKKS's R3 only to decryptors,
        and again to replacements when one drops); a client that refused, was rejected or did not
        answer within the timeout is a dropout for the rest of the session and is not asked again.
        """
        session_id = self._session_ids.pop(0) if self._session_ids else os.urandom(32)
        meta = {
            "session": label,
            "study": self.study.to_json(),
            "roster": self.roster.fingerprint,
            "backend": self.backend.name,
        }
        if self.study.dp is not None:
            # The id commits to the study, so every advertisement signs it (clients check the nonce).
            meta["study-nonce"] = session_id.hex()
            session_id = study_session_id(self.study, session_id)
        session = self.backend.server_session(
            self.roster,
            layout,
            session_id=session_id,
            min_group_size=self.study.min_group_size,
            context=session_context(self.study, label, arrays),  # what every node binds (one view)
        )
        record = SessionRecord(label, session_id)
        self.report.sessions.append(record)
        first = session.start()
        first_bytes = self.backend.encode(first, session.max_message_bytes)
        outgoing = {
            node: Envelope("advertise", {**meta, "round": "R0"}, first_bytes, dict(arrays)) for node in nodes
        }
        node_of: dict[str, int] = {}
        failed: set[str] = set()  # participants that refused, were rejected or dropped
        round_name = "R0"
        # Bounded: masking has 5 rounds; CKKS 4, plus at most one repeated R1 or R3 per client (every
        # repetition replaces a key holder or at least one decryptor, who is never asked again).
        max_rounds = len(self.backend.rounds) + len(self.roster) + 1
        for _ in range(max_rounds):
            round_name = str(session.round.value)  # type: ignore[attr-defined]
            again = round_name in record.round_seconds
            started = time.perf_counter()
            timeout = self.statistics_timeout if round_name == "R0" else self.round_timeout
            at = f"session {label} {round_name}"
            client_of = {node: cid for cid, node in node_of.items()}
            addressed = [client_of.get(n, f"node {n}") for n in outgoing] if node_of else []
            self.log(f"{at}: sent to {', '.join(addressed) if addressed else f'{len(outgoing)} node(s)'}")
            replies, silence = self._exchange(outgoing, f"s{label}-{round_name}", timeout)
            answers = 0
            answered: list[str] = []
            lost: dict[int, str] = {}  # nodes Flower reports gone: dropouts, with Flower's reason
            unnamed: list[tuple[int, Envelope]] = []  # refusals of nodes that never advertised
            for node, envelope in sorted(replies.items()):
                who = client_of.get(node) or self._known(node) or f"node {node}"
                if envelope.kind == "dropped":
                    lost[node] = one_line(
                        f"{envelope.meta.get('error', '?')}: {envelope.meta.get('message', '')}"
                    )
                    continue
                if envelope.kind == "refused":
                    if who.startswith("node "):  # never advertised: named once every advertisement is in
                        unnamed.append((node, envelope))
                        continue
                    self._refused(who, at, envelope)
                    failed.add(who)
                    continue
                try:
                    if envelope.kind != "reply":
                        raise FederationAbortedError(f"unexpected {envelope.kind!r} message")
                    if not envelope.payload and round_name != "R0":
                        # Nothing to send this round (CKKS's R1 for all but the key holder): an
                        # answer, not a message.  The session decides whether it needed one.
                        answers += 1
                        continue
                    message = self.backend.decode(envelope.payload, session.max_message_bytes)
                    sender = self.backend.sender(message)
                    if round_name == "R0":
                        if sender in node_of:
                            raise DuplicateClientError(f"a second advertisement for {sender!r}")
                    elif node_of.get(sender) != node:
                        raise UnknownClientError(
                            f"node {node} answered as {sender!r}, which advertised elsewhere"
                        )
                    session.receive(message)
                except (ProtocolError, FederationAbortedError, ValueError, TypeError) as exc:
                    text = one_line(exc, 2000)  # it may quote what the node sent
                    self.report.rejections.append(
                        {"at": at, "from": who, "error": type(exc).__name__, "message": text}
                    )
                    self.metrics.rejection(type(exc).__name__)
                    self.log(f"{at}: rejected the reply of {who}: {type(exc).__name__}: {text}")
                    if who in node_of:
                        failed.add(who)
                    continue
                if round_name == "R0":
                    node_of[sender] = node
                    self.check.note(label, sender, envelope.meta)  # its classifier-check commitment
                answers += 1
                answered.append(sender if round_name == "R0" else who)
            for node, envelope in unnamed:  # a claimed name only: it changes no one's part in the session
                self._refused(self._claimed(envelope, node_of, node), at, envelope)
            gone = {n for n in outgoing if n not in replies} | set(lost)
            silent: set[str] = set()
            for node in sorted(gone):
                who = client_of.get(node) or self._known(node) or "an unidentified node"
                why = f"Flower reports it gone ({lost[node]})" if node in lost else silence
                self.report.dropouts.append({"at": at, "client": who, "reason": why})
                self.metrics.dropout()
                self.log(f"{at}: {who} {why} (dropout)")
                silent.add(who)
            failed |= silent & set(node_of)
            if round_name == "R0" and not again:
                refused = {r["from"] for r in self.report.refusals if r["at"] == at}
                absent = sorted({e.client_id for e in self.roster} - set(node_of) - refused)
                if absent:
                    self.log(f"{at}: no advertisement from {', '.join(absent)} (not taking part)")
            try:
                requests = session.next_round()
            except SessionAbortedError as exc:
                raise FederationAbortedError(f"session {label} aborted after {round_name}: {exc}") from exc
            elapsed = time.perf_counter() - started
            record.round_seconds[round_name] = record.round_seconds.get(round_name, 0.0) + elapsed
            self.metrics.round_done(elapsed, repeated=again)
            repeated = " (again: replacing the key holder or decryptors)" if again else ""
            names = f" ({', '.join(sorted(answered))})" if answered else ""
            self.log(f"{at}{repeated}: {answers} answer(s) in {time.perf_counter() - started:.1f} s{names}")
            if round_name == "R0":
                self._node_of.update(node_of)
                record.participants = tuple(sorted(node_of))
            if not requests:
                break
            next_round = str(session.round.value)  # type: ignore[attr-defined]
            encoded: dict[int, bytes] = {}  # a broadcast message is encoded once
            outgoing = {}
            for cid, request in sorted(requests.items()):
                if cid in failed:
                    continue  # a dropout stays one: the session sees it as silent
                if id(request) not in encoded:
                    encoded[id(request)] = self.backend.encode(request, session.max_message_bytes)
                outgoing[node_of[cid]] = Envelope(
                    "protocol", {"session": label, "round": next_round}, encoded[id(request)]
                )
        else:  # pragma: no cover - the session ends within the bound above
            raise FederationAbortedError(f"session {label} did not finish within {max_rounds} rounds")
        outcome = self.backend.outcome(session, layout)
        record.survivors = tuple(sorted(outcome.clients))
        record.completed = tuple(sorted(set(outcome.clients) - failed))
        # The audit's groups (Layout.group_records): every node derives the same records and refuses
        # a classifier whose audit states others.
        for entry in layout.group_records(outcome.members, outcome.survivors):
            record.groups.append({"session": label, **entry})
        if "key_holder" in outcome.details:
            record.key_holder = str(outcome.details["key_holder"])
            record.replaced_key_holders = tuple(outcome.details.get("replaced_key_holders", ()))  # type: ignore[arg-type]
            record.decryptors = dict(outcome.details.get("decryptors", {}))  # type: ignore[call-overload]
        return record, outcome

    @staticmethod
    def _members(record: SessionRecord, group: str) -> tuple[str, ...]:
        for item in record.groups:
            if item["name"] == group:
                return tuple(item["members"])
        return ()

    @staticmethod
    def _group(record: SessionRecord, group: str) -> dict[str, Any]:
        for item in record.groups:
            if item["name"] == group:
                return item
        raise FederationAbortedError(f"session {record.label} has no group {group!r}")

    def _known(self, node: int) -> str | None:
        """The roster id that node advertised as in an earlier session of this run, if any."""
        for cid, known in self._node_of.items():
            if known == node:
                return cid
        return None

    def _claimed(self, envelope: Envelope, node_of: Mapping[str, int], node: int) -> str:
        """A refusing node that never advertised: the roster id it says it holds the key of (not
        signed: a refusal is no message of the protocol), if that is a roster member no other node
        advertised as; else it stays unidentified."""
        claimed = str(envelope.meta.get("client", ""))
        members = {entry.client_id for entry in self.roster}
        if claimed in members and node_of.get(claimed, node) == node:
            return claimed
        return "an unidentified node"

    def _refused(self, who: str, where: str, envelope: Envelope) -> None:
        error = one_line(envelope.meta.get("error", "?"), 100)
        message = one_line(envelope.meta.get("message", ""), 2000)
        self.report.refusals.append({"at": where, "from": who, "error": error, "message": message})
        self.metrics.refusal(error)
        self.log(f"{where}: {who} refused: {error}: {message}")

    def _protocol(self) -> dict[str, Any]:
        if self.study.extends and self.accumulated is not None:
            # A growing study: the classifier is the fit on every image the chain released.
            growth = {"extends": self.study.extends, "chain": [dict(e) for e in self.accumulated.chain]}
            return {**self._backend_protocol(), "growth": growth}
        return self._backend_protocol()

    def _backend_protocol(self) -> dict[str, Any]:
        protocol = study_protocol(self.study, len(self.roster))
        if self.study.protection == "mask":
            return protocol
        return {
            **protocol,
            "key_holders": {s.label: s.key_holder for s in self.report.sessions},
            "trust_model": self.backend.trust_model,
        }

    def _classifier(self, coef: np.ndarray) -> Classifier:
        groups = [g for s in self.report.sessions for g in s.groups]
        learned = "its noisy statistics (DP)" if self.study.dp is not None else "its statistics"
        warnings = [
            f"session {g['session']}, group {g['name']}: a single survivor ({g['survivors'][0]}); the server "
            f"learned {learned}"
            for g in groups
            if len(g["survivors"]) == 1
        ]
        if any(s.label == "2" for s in self.report.sessions):
            # Every node in it declared this (the rest refuse a two-round study in R0: SECURITY.md §3.6).
            warnings.append(
                "session 2 (round 2) scored each node's rows with a teacher the coordinator chose; every "
                "node in it declared an honest-but-curious coordinator (node config coordinator = "
                '"honest-but-curious"): an active coordinator could choose a teacher that reveals one '
                "hospital's values exactly (SECURITY.md §3.6)"
            )
        fields = classifier_fields(self.study, len(self.roster))  # what the study decides
        return Classifier(
            weights=np.array(coef, dtype=np.float64),
            classes=tuple(fields["classes"]),
            backbone=fields["backbone"],
            method=fields["method"],
            decision_threshold=fields["decision_threshold"],
            protocol=self._protocol(),
            sessions=tuple(
                {
                    "label": s.label,
                    "session_id": s.session_id.hex(),
                    "participants": list(s.participants),
                    "survivors": list(s.survivors),
                }
                for s in self.report.sessions
            ),
            roster_fingerprint=self.roster.fingerprint,
            audit={
                "groups": groups,
                "warnings": warnings,
                "refusals": self.report.refusals,
                "rejections": self.report.rejections,
                "dropouts": self.report.dropouts,
            },
            study_digest=fields["study_digest"],
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            privacy=self.privacy,
        )


def _earlier_noise(earlier: AccumulatedSums | None, *, private: bool) -> Any:
    """The DP chain of the earlier sessions (None without DP or without earlier sums), after
    refusing a chain that would mix DP and non-DP sessions (secure_afl/growth.py decides), before
    any session runs: a refused chain releases nothing."""
    if earlier is None:
        return None
    from secure_afl.growth import GrowthError, check_same_privacy, is_private

    try:
        check_same_privacy(is_private(earlier.sums), private)
    except GrowthError as exc:
        raise ConfigurationError(str(exc)) from None
    if not private:
        return None
    from secure_afl.privacy.dp_config import DpError
    from secure_afl.privacy.dp_growth import chain_of

    records = [entry.get("dp") for entry in earlier.chain]
    if any(r is None for r in records):
        raise ConfigurationError(
            "the earlier sums are noisy but a study of their chain left no DP noise record: the chain's "
            "solve cannot size its ridge; start a new chain over images not yet released"
        )
    try:
        return chain_of(records)
    except DpError as exc:
        raise ConfigurationError(f"the earlier sums' chain: {exc}") from None
