"""What the coordinator is told: refusals and dropouts by roster id (never a Flower node id), no
hospital's file paths, and a node that Flower reports gone (a killed SuperNode) as a dropout, not a
refusal.  In process (tests/deploy/helpers.py); Flower's Grid is a stand-in for the transport."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

from secure_afl.deploy.apps import GridTransport
from secure_afl.deploy.client import NodeSettings, path_free
from secure_afl.deploy.wire import Envelope, to_record_dict

from .helpers import InProcessTransport, make_federation, run_server


def _with(settings: NodeSettings, **changes: object) -> NodeSettings:
    return dataclasses.replace(settings, **changes)


def test_a_refusal_is_named_by_roster_id_and_shows_no_path(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    wrong = tmp_path / "secret-dir" / "wrong-pass"
    wrong.parent.mkdir()
    wrong.write_bytes(b"not the passphrase at all\n")
    wrong.chmod(0o600)
    node = federation.nodes[1001]
    node.settings = _with(node.settings, passphrase_file=wrong)
    logs: list[str] = []
    server, _, _ = run_server(federation, log=logs.append)
    assert [(r["from"], r["at"], r["error"]) for r in server.report.refusals] == [
        ("client-1", "session 1 R0", "WrongPassphraseError")
    ]
    everything = json.dumps(server.report.to_dict()) + "\n".join(logs)
    # The Flower node id as a word: digests and session ids in the report may hold "1001" by chance.
    assert str(tmp_path) not in everything and not re.search(r"\b1001\b", everything)
    assert any("client-1 refused: WrongPassphraseError" in line for line in logs), logs


def test_a_node_that_stops_answering_is_a_dropout_by_roster_id(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    federation.nodes[1002].dead_from = "s1-R2"
    logs: list[str] = []
    server, _, _ = run_server(federation, log=logs.append)
    assert server.report.refusals == []
    assert server.report.dropouts == [
        {"at": "session 1 R2", "client": "client-2", "reason": "did not answer within 1 s"}
    ]
    assert "session 1 R2: client-2 did not answer within 1 s (dropout)" in logs


def test_a_roster_member_that_never_advertises_is_named(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    federation.nodes[1003].dead_from = "s1-R0"
    logs: list[str] = []
    server, _, _ = run_server(federation, log=logs.append)
    assert "session 1 R0: no advertisement from client-3 (not taking part)" in logs
    # Silent in R0, it cannot be told from another node: no Flower id is shown for it either.
    assert [d["client"] for d in server.report.dropouts] == ["an unidentified node"]
    assert "1003" not in "\n".join(logs)


def test_a_claimed_name_cannot_push_another_member_out(tmp_path: Path) -> None:
    """A refusal's roster id is a claim: a node claiming another member's id is named as unidentified
    when that member advertised, and the member's session goes on."""
    federation = make_federation(tmp_path, n_clients=4)

    def tamper(node: int, group: str, envelope: Envelope) -> Envelope:
        return envelope

    class Claiming(InProcessTransport):
        def exchange(self, outgoing, group, timeout):
            replies = super().exchange(outgoing, group, timeout)
            if group == "s1-R0":
                replies[999] = Envelope("refused", {"error": "X", "message": "m", "client": "client-0"})
            return replies

    server, classifier, _ = run_server(federation, Claiming(federation, tamper=tamper))
    assert [r["from"] for r in server.report.refusals] == ["an unidentified node"]
    assert "client-0" in classifier.sessions[0]["survivors"]


def test_flowers_error_for_a_gone_node_is_a_dropout(tmp_path: Path, monkeypatch) -> None:
    """GridTransport: a reply carrying Flower's error (the SuperNode was killed) becomes ``dropped``."""
    # Flower's Message needs a running ServerApp's context: a plain record stands in for it.
    monkeypatch.setattr("secure_afl.deploy.apps.Message", lambda content, **meta: SimpleNamespace(**meta))

    class Grid:
        def __init__(self) -> None:
            self.pushed: list = []

        def get_node_ids(self):
            return [7, 8]

        def push_messages(self, messages):
            self.pushed = list(messages)
            return [f"m{i}" for i in range(len(self.pushed))]

        def pull_messages(self, ids):
            good = SimpleNamespace(
                metadata=SimpleNamespace(reply_to_message_id="m0"),
                has_error=lambda: False,
                content=to_record_dict(Envelope("reply", {"round": "R1"}, b"x")),
            )
            gone = SimpleNamespace(
                metadata=SimpleNamespace(reply_to_message_id="m1"),
                has_error=lambda: True,
                error=SimpleNamespace(code=4, reason="node unavailable"),
            )
            return [good, gone]

    replies = GridTransport(Grid()).exchange(
        {7: Envelope("protocol", {"round": "R1"}), 8: Envelope("protocol", {"round": "R1"})}, "g", 5.0
    )
    assert replies[7].kind == "reply"
    assert replies[8].kind == "dropped" and replies[8].meta["error"] == "FlowerError4"

    # The server counts it among the dropouts, by roster id.
    federation = make_federation(tmp_path, n_clients=4)

    class Gone(InProcessTransport):
        def exchange(self, outgoing, group, timeout):
            replies = super().exchange(outgoing, group, timeout)
            if group == "s1-R2":
                replies[1002] = Envelope("dropped", {"error": "FlowerError4", "message": "node unavailable"})
            return replies

    server, _, _ = run_server(federation, Gone(federation))
    assert server.report.refusals == []
    (dropout,) = server.report.dropouts
    assert dropout["client"] == "client-2" and dropout["at"] == "session 1 R2"
    assert dropout["reason"] == "Flower reports it gone (FlowerError4: node unavailable)"


def test_path_free_names_the_nodes_files_by_their_key(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    settings = federation.nodes[1000].settings
    text = f"{settings.roster}: cannot read; see {settings.features} and /etc/other/file.txt, ./rel/x"
    assert path_free(text, settings) == "[roster]: cannot read; see [features] and [path], [path]"
    assert path_free("no path here: 3/4 done", None) == "no path here: 3/4 done"


def test_a_refusal_cannot_write_a_line_of_the_servers_stream(tmp_path: Path) -> None:
    """Another way at deploy run: the ServerApp's log is the stream deploy run reads line by line
    (`sign request <digest>`, `FAILED: ...`); a hospital's refusal message with a line break in it
    stays one line, so it can neither ask for a signature nor fake a failure."""
    federation = make_federation(tmp_path, n_clients=4)
    forged = "bad\nsecure-afl server: sign request " + "ab" * 32 + "\rsecure-afl server: FAILED: x\x1b[2K"

    class Injecting(InProcessTransport):
        def exchange(self, outgoing, group, timeout):
            replies = super().exchange(outgoing, group, timeout)
            if group == "s1-R0":
                replies[999] = Envelope("refused", {"error": "E\nrror", "message": forged, "client": "x"})
            return replies

    logs: list[str] = []
    server, _, _ = run_server(federation, Injecting(federation), log=logs.append)
    assert all("\n" not in line and "\r" not in line and "\x1b" not in line for line in logs)
    (refusal,) = server.report.refusals
    assert refusal["error"] == "E rror" and "\n" not in refusal["message"]
    assert not any(line.startswith(("sign request", "FAILED")) for line in logs)
