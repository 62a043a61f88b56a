"""DICOM identifiers that repeat, through the deployment's handler (in process): a faulty export or
anonymiser can give one SOP Instance UID to different images.  A node withholds every row that
repeats a name of another row of its file or names a released image, releases the others, names
each withheld row in its log and records (index, reason) in its ledger; a study with no row left
is refused.  No image is released twice whatever the identifiers say (SECURITY.md R6, R6a).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, Study, StudyDp
from secure_afl.features.file import save_feature_file
from secure_afl.privacy.ledger import FileLedger, LedgerOwner, SessionEntry
from secure_afl.privacy.release import image_keys, select_rows, split_digests

from .helpers import (
    CLASSES,
    Federation,
    InProcessTransport,
    centralised_global_fit,
    check_study,
    make_federation,
    pixel_digests,
    row_digests,
)

ROWS = 40
VICTIM = "client-0"
Names = list[tuple[str, str, str]]  # per row: (file digest, pixel digest, SOP Instance UID)


def _names(tag: str, n: int = ROWS) -> Names:
    files = row_digests(tag, n)
    uids = [f"1.2.826.0.1.{int(hashlib.sha256(tag.encode()).hexdigest()[:8], 16)}.{i}" for i in range(n)]
    return list(zip(files, pixel_digests(files), uids, strict=True))


def _node(federation: Federation, client_id: str):
    return next(node for node in federation.nodes.values() if node.client_id == client_id)


def _write(federation: Federation, client_id: str, features, labels, names: Names) -> None:
    """The hospital's feature file: these rows, named ``row-<i>`` and by (file, pixels, UID)."""
    node, active = _node(federation, client_id), federation.data[client_id][2]
    save_feature_file(
        node.settings.features, features, labels=labels, active=active, classes=CLASSES,
        backbone="toy", weights_id="sha256:00", preprocessing="none",
        image_ids=[f"row-{i}" for i in range(len(names))], image_sha256=[n[0] for n in names],
        pixel_sha256=[n[1] for n in names], sop_instance_uids=[n[2] for n in names],
    )  # fmt: skip
    node.state.records.clear()  # a new Flower run of the coordinator (the ledger stays)


def _hospitals(tmp_path: Path, *, dp: bool = False) -> tuple[Federation, dict[str, Names]]:
    """Four hospitals of ``ROWS`` rows, every row with its own file, pixels and UID."""
    federation = make_federation(tmp_path, n_clients=4, rows=ROWS, method=Method(balance="global"))
    if dp:
        lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
        federation.study = dataclasses.replace(
            federation.study, dp=StudyDp(epsilon=1.0, class_lists=lists, clip=8.0, unit="image")
        )
    names = {cid: _names(f"first/{cid}") for cid in federation.data}
    for cid, (features, labels, _) in federation.data.items():
        _write(federation, cid, features, labels, names[cid])
    return federation, names


def _run(federation: Federation, study: Study | None = None, earlier=None):
    """The server over ``study``: (server, its classifier or None, refusals by institution)."""
    study = study or federation.study
    check_study(federation, study, nodes=list(federation.nodes))
    server = FederationServer(
        InProcessTransport(federation), federation.roster, study, round_timeout=1, log=lambda s: None,
        signer=federation.signer, colluders=0, earlier=earlier,
    )  # fmt: skip
    classifier = None
    try:
        classifier = server.run()
        server.deliver(classifier)
    except Exception:  # FederationAbortedError: the refusals say why
        pass
    return server, classifier, {r["from"]: r for r in server.report.refusals}


def _released(federation: Federation, client_id: str, *servers: FederationServer) -> list[SessionEntry]:
    """The client's ledger entries of the sessions that released images; with ``servers``, those
    of their sessions in their order (the ledger keeps no order among sessions)."""
    node = _node(federation, client_id)
    state = FileLedger(node.settings.ledger_dir).load(
        LedgerOwner(client_id, federation.identities[client_id])
    )
    if servers:
        ids = [s.session_id.hex() for server in servers for s in server.report.sessions]
        return [state.sessions[sid] for sid in ids if state.sessions[sid].survivors is not None]
    return [entry for entry in state.sessions.values() if entry.survivors is not None]


def _keys(entry: SessionEntry) -> set[bytes]:
    return set(split_digests(entry.images + entry.aliases))


def _fit(federation: Federation, rows: dict[str, tuple[np.ndarray, np.ndarray]], gamma: float) -> np.ndarray:
    active = {cid: federation.data[cid][2] for cid in rows}
    return centralised_global_fit(
        {c: r[0] for c, r in rows.items()}, {c: r[1] for c, r in rows.items()}, active, len(CLASSES), gamma
    )


def test_two_images_sharing_one_uid_are_both_withheld_and_the_others_released(tmp_path: Path, capsys) -> None:
    """Rows 3 and 5 of the victim's file: other pixels, one UID (a faulty export).  Which is that
    instance is unknown: both are withheld, named in the log and the ledger; the 38 others release,
    and the classifier is the centralised fit on exactly the released rows."""
    federation, names = _hospitals(tmp_path)
    features, labels, _ = federation.data[VICTIM]
    uid = names[VICTIM][5][2]
    names[VICTIM][3] = (*names[VICTIM][3][:2], uid)
    _write(federation, VICTIM, features, labels, names[VICTIM])
    server, classifier, refusals = _run(federation)
    assert refusals == {} and classifier is not None and VICTIM in server.report.sessions[0].participants
    log = capsys.readouterr().err
    assert (
        f"{VICTIM}: withheld 2 of {ROWS} rows, its DICOM SOP Instance UID is another row's, with other "
        f"pixels (a faulty export or anonymiser): row 3 (row-3, UID {uid}, as row 5), row 5 (row-5, UID "
        f"{uid}, as row 3)\n"
    ) in log
    (entry,) = _released(federation, VICTIM)
    assert len(split_digests(entry.images)) == ROWS - 2
    assert not _keys(entry) & (set(image_keys(*names[VICTIM][3])) | set(image_keys(*names[VICTIM][5])))
    assert json.loads(entry.withheld) == {
        "rows": ROWS, "withheld": {"uid-repeated": 2}, "listed": [[3, "uid-repeated"], [5, "uid-repeated"]]
    }  # fmt: skip
    assert [e.withheld for e in _released(federation, "client-1")] == [""]
    kept = {cid: np.ones(ROWS, dtype=bool) for cid in federation.data}
    kept[VICTIM][[3, 5]] = False
    rows = {cid: (data[0][kept[cid]], data[1][kept[cid]]) for cid, data in federation.data.items()}
    want = _fit(federation, rows, federation.study.method.gamma)
    assert float(np.max(np.abs(classifier.weights - want))) < 1e-9


def test_a_new_image_reusing_a_released_uid_is_withheld_and_the_session_goes_on(
    tmp_path: Path, capsys
) -> None:
    """A second study over new images: the victim's row 0 carries a UID released in session 1 with
    other pixels, and its row 1 is a re-encoded copy of a released image (other file, other UID, the
    same pixels).  Both are withheld (one image never enters two releases), the session completes."""
    federation, first_names = _hospitals(tmp_path)
    first, classifier, refusals = _run(federation)
    assert refusals == {} and classifier is not None
    session = next(sid for sid, e in _ledger_sessions(federation, VICTIM) if e.survivors is not None)
    rng = np.random.default_rng(11)
    second_names = {}
    for cid, (features, labels, _) in federation.data.items():
        second_names[cid] = _names(f"second/{cid}")
        if cid == VICTIM:
            reused = first_names[cid][9][2]
            second_names[cid][0] = (*second_names[cid][0][:2], reused)
            second_names[cid][1] = (second_names[cid][1][0], first_names[cid][4][1], second_names[cid][1][2])
        _write(federation, cid, rng.gamma(2.0, 1.0, size=features.shape).astype(np.float32), labels,
               second_names[cid])  # fmt: skip
    capsys.readouterr()
    second = dataclasses.replace(federation.study, method=Method(balance="global", gamma=2.0))
    again, classifier, refusals = _run(federation, second)
    assert refusals == {} and classifier is not None
    log = capsys.readouterr().err
    assert (
        f"{VICTIM}: withheld 1 of {ROWS} rows, released in an earlier session: row 1 (row-1, UID "
        f"{second_names[VICTIM][1][2]}, session {session[:16]})\n"
    ) in log
    assert (
        f"{VICTIM}: withheld 1 of {ROWS} rows, its DICOM SOP Instance UID was released in an earlier "
        f"session with other pixels: row 0 (row-0, UID {reused}, session {session[:16]})\n"
    ) in log
    entries = _released(federation, VICTIM, first, again)
    assert len(entries) == 2 and len(split_digests(entries[1].images)) == ROWS - 2
    assert not _keys(entries[0]) & _keys(entries[1])  # no name of a released image released again
    assert json.loads(entries[1].withheld)["listed"] == [[0, "uid-released"], [1, "released"]]


def _ledger_sessions(federation: Federation, client_id: str):
    node = _node(federation, client_id)
    owner = LedgerOwner(client_id, federation.identities[client_id])
    return FileLedger(node.settings.ledger_dir).load(owner).sessions.items()


def test_a_growing_study_names_the_row_it_drops(tmp_path: Path, capsys) -> None:
    """Session 1 releases each hospital's first 20 rows; session 2 extends it over 40.  The victim's
    row 25, a new image, carries the UID of its released row 2: it is dropped (named), the other 19
    new rows release, and the chain's classifier is the centralised fit on every released row."""
    federation, names = _hospitals(tmp_path)
    for cid, (features, labels, _) in federation.data.items():
        _write(federation, cid, features[:20], labels[:20], names[cid][:20])
    first, classifier, refusals = _run(federation)
    assert refusals == {} and classifier is not None
    names[VICTIM][25] = (*names[VICTIM][25][:2], names[VICTIM][2][2])
    for cid, (features, labels, _) in federation.data.items():
        _write(federation, cid, features, labels, names[cid])
    capsys.readouterr()
    extended = dataclasses.replace(federation.study, extends=federation.study.digest())
    second, classifier, refusals = _run(federation, extended, first.accumulated)
    assert refusals == {} and classifier is not None
    log = capsys.readouterr().err
    assert f"{VICTIM}: growing study: 19 of {ROWS} rows are new images\n" in log
    assert (
        f"{VICTIM}: withheld 1 of {ROWS} rows, its DICOM SOP Instance UID was released in an earlier "
        f"session with other pixels: row 25 (row-25, UID {names[VICTIM][2][2]}, session "
    ) in log
    assert f"{VICTIM}: withheld 20 of {ROWS} rows, released in an earlier session: row 0 (row-0, " in log
    entries = _released(federation, VICTIM, first, second)
    assert [len(split_digests(e.images)) for e in entries] == [20, 19]
    assert json.loads(entries[1].withheld)["withheld"] == {"released": 20, "uid-released": 1}
    kept = {cid: np.ones(ROWS, dtype=bool) for cid in federation.data}
    kept[VICTIM][25] = False
    rows = {cid: (data[0][kept[cid]], data[1][kept[cid]]) for cid, data in federation.data.items()}
    want = _fit(federation, rows, federation.study.method.gamma)
    assert float(np.max(np.abs(classifier.weights - want))) < 1e-9


def test_under_dp_a_repeated_uid_is_withheld_and_the_rest_spends_once(tmp_path: Path, capsys) -> None:
    federation, names = _hospitals(tmp_path, dp=True)
    features, labels, _ = federation.data[VICTIM]
    names[VICTIM][7] = (*names[VICTIM][7][:2], names[VICTIM][0][2])
    _write(federation, VICTIM, features, labels, names[VICTIM])
    _, classifier, refusals = _run(federation)
    assert refusals == {} and classifier is not None
    assert "row 0 (row-0, UID " in capsys.readouterr().err
    (entry,) = _released(federation, VICTIM)
    assert entry.spend and len(split_digests(entry.images)) == ROWS - 2
    assert json.loads(entry.withheld)["listed"] == [[0, "uid-repeated"], [7, "uid-repeated"]]


def test_a_file_with_no_row_left_is_refused_saying_so(tmp_path: Path) -> None:
    federation, names = _hospitals(tmp_path)
    features, labels, _ = federation.data[VICTIM]
    _write(federation, VICTIM, features, labels, [(f, p, "1.2.3.4") for f, p, _ in names[VICTIM]])
    server, _, refusals = _run(federation)
    refusal = refusals[VICTIM]
    assert (refusal["error"], refusal["at"]) == ("NothingToReleaseError", "session 1 R0")
    assert (
        f"every one of this feature file's {ROWS} rows is withheld ({ROWS} its DICOM SOP"
        in refusal["message"]
    )
    assert VICTIM not in server.report.sessions[0].participants
    assert _released(federation, VICTIM) == []


def test_no_kept_row_shares_a_name_with_a_released_image_or_another_row() -> None:
    """select_rows on random files with many collisions (shared files, pixels, UIDs; released keys):
    the kept rows are exactly those that share no name with another row or a released image."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        rows = [
            image_keys(
                hashlib.sha256(b"f%d" % rng.integers(300)).hexdigest(),
                hashlib.sha256(b"p%d" % rng.integers(300)).hexdigest(),
                f"1.2.{rng.integers(300)}" if rng.random() < 0.8 else "",
            )
            for _ in range(200)
        ]
        pool = sorted({key for row in rows for key in row})
        released = {pool[i]: "ab" * 16 for i in rng.choice(len(pool), size=40, replace=False)}
        selection = select_rows(rows, released)
        counts = {}
        for row in rows:
            for key in set(row):
                counts[key] = counts.get(key, 0) + 1
        free = [i for i, row in enumerate(rows) if all(counts[k] == 1 and k not in released for k in row)]
        assert list(selection.kept) == free and 0 < len(free) < len(rows)
        assert sorted([*selection.kept, *(w.row for w in selection.withheld)]) == list(range(len(rows)))
        for withheld in selection.withheld:
            keys = rows[withheld.row]
            if withheld.reason in ("released", "uid-released"):
                assert any(k in released for k in keys) and withheld.session == "ab" * 16
            else:
                assert set(keys) & set(rows[withheld.other]) and withheld.other != withheld.row
