"""An image keeps its identity across lossless re-encodings: a real chest radiograph (pydicom-data's
PA chest CR, MONOCHROME1, 1955 × 1841, 15 bits) uncompressed, JPEG 2000 lossless and JPEG 2000 lossy,
through the deployment's handler (in process): the release ledger, a growing study and the DP image
unit's budget count the lossless copies as one image (a node withholds the copy's row, or both rows
of a file listing one image twice, and releases the others), and the lossy copy is another image
(the documented near-duplicate limit, SECURITY.md).

The lossless pair carries different SOP Instance UIDs (pydicom-data's files, as a PACS export that
assigns new UIDs may): only the decoded pixels name them as one image; the lossy file shares neither
its pixels nor its UID with the original.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from pydicom.data import get_testdata_file

from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, StudyDp
from secure_afl.deploy.sums import load_sums, save_sums
from secure_afl.features.file import load_feature_file, save_feature_file
from secure_afl.features.images import image_sha256, load_grayscale, pixel_sha256, sop_instance_uid
from secure_afl.privacy.ledger import FileLedger, LedgerOwner
from secure_afl.privacy.release import image_keys, split_digests

from .helpers import (
    Federation,
    InProcessTransport,
    check_study,
    make_federation,
    pixel_digests,
    row_digests,
    run_server,
)
from .test_growing import _centralised

RADIOGRAPH = {"original": "RG1_UNCR.dcm", "j2k-lossless": "RG1_J2KR.dcm", "j2k-lossy": "RG1_J2KI.dcm"}
ROWS = 40
VICTIM = "client-0"


def radiograph(encoding: str) -> Path:
    """One encoding of pydicom-data's chest radiograph, from the installed package (never downloaded)."""
    found = get_testdata_file(RADIOGRAPH[encoding], download=False)
    if found is None:
        pytest.fail(
            f"pydicom-data's {RADIOGRAPH[encoding]} is not installed: these tests need the real chest "
            "radiograph in several encodings; install the test extra (pip install -e '.[test]', which "
            "holds pydicom-data)"
        )
    return Path(str(found))


def identity(encoding: str) -> tuple[str, str, str]:
    """(file digest, pixel digest, SOP Instance UID) of an encoding, as `features extract` records them."""
    path = radiograph(encoding)
    return image_sha256(path), pixel_sha256(load_grayscale(path)), sop_instance_uid(path)


@pytest.fixture(scope="module")
def identities() -> dict[str, tuple[str, str, str]]:
    found = {encoding: identity(encoding) for encoding in RADIOGRAPH}
    original, lossless, lossy = found["original"], found["j2k-lossless"], found["j2k-lossy"]
    # what makes the tests below mean something: the lossless copy shares only its pixels with the
    # original (other bytes, another UID); the lossy copy shares nothing
    assert original[0] != lossless[0] and original[2] != lossless[2] and original[1] == lossless[1]
    assert len({original[0], lossy[0]}) == 2 and original[1] != lossy[1] and original[2] != lossy[2]
    assert all(uid for _, _, uid in found.values())
    return found


def _one_ulp(features: np.ndarray, seed: int) -> np.ndarray:
    """A re-extraction on another machine: about half the float32 entries one ulp off."""
    moved = np.random.default_rng(seed).random(features.shape) < 0.5
    out = features.astype(np.float32)
    out[moved] = np.nextafter(out[moved], np.float32(np.inf))
    return out


def _write(node, features, labels, active, names: list[tuple[str, str, str]]) -> None:
    """The node's feature file: these rows, each named by (file digest, pixel digest, UID)."""
    save_feature_file(
        node.settings.features, features, labels=labels, active=active, classes=("A", "B", "C"),
        backbone="toy", weights_id="sha256:00", preprocessing="none",
        image_ids=[f"row-{i}" for i in range(len(names))],
        image_sha256=[n[0] for n in names], pixel_sha256=[n[1] for n in names],
        sop_instance_uids=[n[2] for n in names],
    )  # fmt: skip
    node.state.records.clear()  # a new Flower run of the coordinator (the ledger stays)


def _names(tag: str, n: int) -> list[tuple[str, str, str]]:
    files = row_digests(tag, n)
    return [(f, p, "") for f, p in zip(files, pixel_digests(files), strict=True)]


def _node(federation: Federation, client_id: str):
    return next(node for node in federation.nodes.values() if node.client_id == client_id)


def _ledger(federation: Federation, client_id: str):
    node = _node(federation, client_id)
    owner = LedgerOwner(client_id, federation.identities[client_id])
    return FileLedger(node.settings.ledger_dir).load(owner)


def _released(federation: Federation, client_id: str, *studies) -> list:
    """The client's ledger entries of the sessions that released something, in the order of ``studies``."""
    entries = [e for e in _ledger(federation, client_id).sessions.values() if e.survivors is not None]
    by_study = {e.scope.split("/")[0]: e for e in entries}
    assert len(by_study) == len(entries) == len(studies)
    return [by_study[f"study:{study.digest()}"] for study in studies]


def _federation(tmp_path: Path, identities, *, dp: bool = False) -> tuple[Federation, dict]:
    """Four hospitals of ``ROWS`` rows; the victim's row 0 is the original radiograph."""
    federation = make_federation(tmp_path, n_clients=4, rows=ROWS, method=Method(balance="global"))
    if dp:
        lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
        federation.study = dataclasses.replace(
            federation.study, dp=StudyDp(epsilon=1.0, class_lists=lists, clip=8.0, unit="image")
        )
    names = {}
    for cid, (features, labels, active) in federation.data.items():
        names[cid] = _names(f"first/{cid}", ROWS)
        if cid == VICTIM:
            names[cid][0] = identities["original"]
        _write(_node(federation, cid), features, labels, active, names[cid])
    return federation, names


def _refusals(federation: Federation, study=None, earlier=None) -> tuple[FederationServer, dict[str, dict]]:
    study = study or federation.study
    check_study(federation, study, nodes=list(federation.nodes))
    server = FederationServer(
        InProcessTransport(federation), federation.roster, study, round_timeout=1, log=lambda s: None,
        signer=federation.signer, colluders=0, earlier=earlier,
    )  # fmt: skip
    try:
        classifier = server.run()
        server.deliver(classifier)
        server.classifier = classifier  # type: ignore[attr-defined]
    except Exception as exc:  # FederationAbortedError: the refusals say why
        server.aborted = exc  # type: ignore[attr-defined]
    return server, {r["from"]: r for r in server.report.refusals}


# ------------------------------------------------------------------------------ the release ledger


@pytest.mark.parametrize("encoding", ["j2k-lossless", "j2k-lossy"])
def test_a_second_release_of_the_re_encoded_radiograph_is_the_same_image_only_if_lossless(
    tmp_path: Path, identities, encoding: str, capsys
) -> None:
    """The same study again, with every peer's images new and the victim's radiograph re-exported and
    re-extracted (features one ulp off): the lossless copy's row is withheld as already released and
    the others release; the lossy copy is another image to every exact name, and enters (the
    documented limit)."""
    federation, _ = _federation(tmp_path, identities)
    first, _, _ = run_server(federation)
    released = first.report.sessions[0].session_id.hex()[:16]
    rng = np.random.default_rng(3)
    for cid, (features, labels, active) in federation.data.items():
        new = rng.gamma(2.0, 1.0, size=features.shape).astype(np.float32)
        names = _names(f"second/{cid}", ROWS)
        if cid == VICTIM:
            new[0], names[0] = _one_ulp(features[:1], 0)[0], identities[encoding]
        _write(_node(federation, cid), new, labels, active, names)
    before = _ledger(federation, VICTIM)
    server, refusals = _refusals(federation)
    assert refusals == {} and server.classifier is not None
    assert len(_ledger(federation, VICTIM).sessions) == len(before.sessions) + 1
    # The second session's entry, by its id (the ledger keeps no order among sessions).
    entry = _ledger(federation, VICTIM).sessions[server.report.sessions[0].session_id.hex()]
    copy = set(image_keys(*identities[encoding]))
    if encoding == "j2k-lossless":
        assert not copy & set(split_digests(entry.images + entry.aliases))
        assert len(split_digests(entry.images)) == ROWS - 1
        assert json.loads(entry.withheld)["listed"] == [[0, "released"]]
        uid = identities[encoding][2]
        assert f"released in an earlier session: row 0 (row-0, UID {uid}, session {released})" in (
            capsys.readouterr().err
        )
    else:
        assert copy <= set(split_digests(entry.images + entry.aliases)) and entry.withheld == ""


def test_the_ledger_records_every_name_and_matches_any(tmp_path: Path, identities) -> None:
    federation, _ = _federation(tmp_path, identities)
    run_server(federation)
    (entry,) = [e for e in _ledger(federation, VICTIM).sessions.values() if e.survivors is not None]
    file_key, pixel_key, uid_key = image_keys(*identities["original"])
    assert file_key in split_digests(entry.images)
    assert {pixel_key, uid_key} <= set(split_digests(entry.aliases))
    lossless = image_keys(*identities["j2k-lossless"])
    assert set(lossless) & set(split_digests(entry.images + entry.aliases)) == {pixel_key}


# ------------------------------------------------------------------------------ a growing study


@pytest.mark.parametrize("encoding", ["j2k-lossless", "j2k-lossy"])
def test_a_growing_study_counts_the_re_encoded_radiograph_as_already_used(
    tmp_path: Path, identities, encoding: str
) -> None:
    """Session 1 releases each hospital's first 20 rows (the victim's row 0: the original radiograph);
    session 2 extends it over 40 rows, the victim's row 0 now the re-exported, re-extracted copy.
    Lossless: the copy is not new, the classifier is the centralised fit on the 40 original rows of
    each (the radiograph once).  Lossy: the copy enters again, as a new image (the limit)."""
    federation, names = _federation(tmp_path, identities)
    full = {}
    for cid, (features, labels, active) in federation.data.items():
        _write(_node(federation, cid), features[:20], labels[:20], active, names[cid][:20])
        full[cid] = load_feature_file(_node(federation, cid).settings.features)
    first, refusals = _refusals(federation)
    assert refusals == {}
    coordinator = tmp_path / "coordinator"
    save_sums(coordinator, first.accumulated)
    for cid, (features, labels, active) in federation.data.items():
        rows, listed = features.copy(), list(names[cid])
        if cid == VICTIM:
            rows[0], listed[0] = _one_ulp(features[:1], 1)[0], identities[encoding]
        _write(_node(federation, cid), rows, labels, active, listed)
        full[cid] = dataclasses.replace(full[cid], features=features, labels=labels)  # the original rows
    extended = dataclasses.replace(federation.study, extends=federation.study.digest())
    second, refusals = _refusals(federation, extended, load_sums(coordinator, federation.study.digest()))
    assert refusals == {}
    want = _centralised(federation, full, dict.fromkeys(full, ROWS), federation.study.method.gamma)
    error = float(np.max(np.abs(second.classifier.weights - want)))
    # the victim's session-2 release: 20 new rows (lossless) or 21 (lossy: the copy again)
    entries = _released(federation, VICTIM, federation.study, extended)
    released = [len(split_digests(e.images)) for e in entries]
    if encoding == "j2k-lossless":
        assert error < 1e-9, error
        assert released == [20, 20]
    else:
        assert error > 1e-6  # the radiograph's row is in the sums twice
        assert released == [20, 21]


# ------------------------------------------------------------------------------ the DP image unit


def test_the_dp_image_unit_spends_nothing_more_on_the_re_encoded_radiograph(
    tmp_path: Path, identities
) -> None:
    """Under the image unit a chain's ε is the max over its sessions, because each image enters one
    session.  The re-encoded copy in a later session is recognised as released: the session's
    release leaves it out (no second spend on that image), in a growing study and in a study that
    does not extend the first alike."""
    federation, names = _federation(tmp_path, identities, dp=True)
    for cid, (features, labels, active) in federation.data.items():
        _write(_node(federation, cid), features[:20], labels[:20], active, names[cid][:20])
    first, refusals = _refusals(federation)
    assert refusals == {} and first.classifier is not None
    coordinator = tmp_path / "coordinator"
    save_sums(coordinator, first.accumulated)
    lossless = identities["j2k-lossless"]
    for cid, (features, labels, active) in federation.data.items():
        rows, listed = features.copy(), list(names[cid])
        if cid == VICTIM:
            rows[0], listed[0] = _one_ulp(features[:1], 2)[0], lossless
        _write(_node(federation, cid), rows, labels, active, listed)
    extended = dataclasses.replace(federation.study, extends=federation.study.digest())
    second, refusals = _refusals(federation, extended, load_sums(coordinator, federation.study.digest()))
    assert refusals == {} and second.classifier is not None
    growth = second.classifier.privacy["growth"]
    assert growth["composition"] == "parallel"
    spent = [s["epsilon_spent"][VICTIM] for s in growth["sessions"]]
    assert growth["epsilon_chain"][VICTIM] == max(spent)
    entries = _released(federation, VICTIM, federation.study, extended)
    assert all(e.spend for e in entries)
    copy = set(image_keys(*lossless))
    in_session = [copy & set(split_digests(e.images + e.aliases)) for e in entries]
    assert in_session == [{image_keys(*lossless)[1]}, set()]  # by its pixels in session 1 only
    assert [len(split_digests(e.images)) for e in entries] == [20, 20]
    # a new study (no extends) over the copy and new images: the victim withholds the copy, released
    rng = np.random.default_rng(4)
    for cid, (features, labels, active) in federation.data.items():
        rows, listed = (
            rng.gamma(2.0, 1.0, size=features.shape).astype(np.float32),
            _names(f"third/{cid}", ROWS),
        )
        if cid == VICTIM:
            rows[0], listed[0] = _one_ulp(features[:1], 5)[0], lossless
        _write(_node(federation, cid), rows, labels, active, listed)
    fresh = dataclasses.replace(federation.study, min_group_size=3)
    _, refusals = _refusals(federation, fresh)
    assert refusals == {}
    entry = _released(federation, VICTIM, federation.study, extended, fresh)[2]
    assert entry.spend and not copy & set(split_digests(entry.images + entry.aliases))
    assert len(split_digests(entry.images)) == ROWS - 1
    assert json.loads(entry.withheld)["listed"] == [[0, "released"]]


# ------------------------------------------------------------------------------ one image, two rows


@pytest.mark.parametrize("dp", [False, True])
def test_a_file_listing_the_radiograph_twice_withholds_both_rows(
    tmp_path: Path, identities, dp: bool, capsys
) -> None:
    """The original and its lossless copy as two rows of one file: the image would count twice (under
    DP: twice the sensitivity the noise was sized for).  Which row's labels are right is the
    hospital's to say: the node withholds both, names them in its log and ledger, releases the rest."""
    federation, names = _federation(tmp_path, identities, dp=dp)
    features, labels, active = federation.data[VICTIM]
    listed = list(names[VICTIM])
    listed[7] = identities["j2k-lossless"]
    _write(_node(federation, VICTIM), features, labels, active, listed)
    server, refusals = _refusals(federation)
    assert refusals == {} and VICTIM in server.report.sessions[0].participants
    log = capsys.readouterr().err
    assert (
        f"{VICTIM}: withheld 2 of {ROWS} rows, the same image (its file or decoded pixels) is another " in log
    )
    assert f"row 0 (row-0, UID {identities['original'][2]}, as row 7), row 7 (row-7, UID " in log
    (entry,) = _released(federation, VICTIM, federation.study)
    assert len(split_digests(entry.images)) == ROWS - 2 and bool(entry.spend) == dp
    assert not set(image_keys(*identities["original"])) & set(split_digests(entry.images + entry.aliases))
    assert json.loads(entry.withheld)["listed"] == [[0, "listed-twice"], [7, "listed-twice"]]


def test_a_feature_file_without_pixel_digests_is_refused_with_re_extract_advice(
    tmp_path: Path, identities
) -> None:
    """A file written before pixel digests were recorded would name its images by their bytes only,
    which a lossless re-export changes: no node releases it."""
    federation, names = _federation(tmp_path, identities)
    features, labels, active = federation.data[VICTIM]
    node = _node(federation, VICTIM)
    save_feature_file(
        node.settings.features, features, labels=labels, active=active, classes=("A", "B", "C"),
        backbone="toy", weights_id="sha256:00", preprocessing="none",
        image_sha256=[n[0] for n in names[VICTIM]],
    )  # fmt: skip
    server, refusals = _refusals(federation)
    refusal = refusals[VICTIM]
    assert refusal["error"] == "FeatureFileError" and refusal["at"] == "session 1 R0"
    assert "no pixel digests" in refusal["message"]
    assert "re-extract with `secure-afl features extract`" in refusal["message"]
    assert VICTIM not in server.report.sessions[0].participants
