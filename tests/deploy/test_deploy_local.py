"""``secure-afl deploy local`` over Flower's real runtime: SuperLink, 4 SuperNodes, TLS, node auth.

Masking: one run (about three minutes on 2 cores shared with other work; R1 waits the 30 s round timeout
for the killed node, and a shorter timeout let live nodes time out under load): client-2's
SuperNode is killed when it receives round R1; the deployed classifier must equal the in-process
simulation's over the 3 survivors bit for bit, every survivor must hold the same classifier, and no
process may be left behind.

CKKS: one run without TLS or dropouts, through fault proxies (a delay, resets, a node paused past
the round timeout: see CKKS below; about two minutes here; dropped clients and decryptors are
tested in process, tests/deploy/test_federation_ckks.py): the classifier must equal the masked
simulation's within CKKS precision (max |Δw| measured 1e-7 of max |w| at d = 32; the command checks
1e-4) and every institution must hold the same classifier.

The four federations (TLS with a dropout and an abort, CKKS, three growing sessions, a tampering
coordinator's ServerApp) mostly wait on Flower (its 3 s SuperNode poll, one process per message), so
the selected ones run beside the rest of the suite from its start, two at a time (the longest first;
tests/conftest.py starts the next as one ends), each in its own directory and its own process group
(and picking its own free loopback ports); each test then waits on and checks its own.
Every group is stopped when its test times out and at the module's end, passed or failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy.classifier import Classifier
from secure_afl.deploy.processes import Child, ProcessGroups
from secure_afl.deploy.writers import write_node_auth_key, write_tls_certificates
from secure_afl.keys import load_roster


def _processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line or environment holds ``text`` (our work directories)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            blob = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in blob:
            found.append(entry.name)
    return found


CLI = [sys.executable, "-c", "from secure_afl.cli import main; main()"]

# README's command for a federation that grows (section "A federation that grows"): every class group
# must hold the same institutions (--missing 0), see rehearsal.plan_rehearsal.
GROWING = ["deploy", "local", "--clients", "3", "--sessions", "3", "--missing", "0", "--fraction", "0.08",
           "--dim", "32"]  # fmt: skip

# 4 clients, seed 0: class 2 is labelled by client-0 and client-1 and missed by client-2 and client-3
# (round 2's only pseudo-label group): groups of two, which one assumed colluder (n = 4, t = 3) would
# forbid, so --colluders 0 (deploy local refuses the default up front).  --metrics: the coordinator's
# endpoint, on a port the kernel picks when it binds.
TLS = ["deploy", "local", "--clients", "4", "--tls", "--drop", "client-0@R4", "--colluders", "0",
       "--rounds", "2", "--coordinator", "honest-but-curious", "--rehearse-abort", "--fraction", "0.08",
       "--dim", "32",
       "--round-timeout", "30",
       "--metrics", "127.0.0.1:0"]  # fmt: skip

# seed 2: every class is labelled by 3 or more of the 4 (seed 0 leaves a class group of two, which the
# nodes' exposure check refuses with one colluder assumed; deploy local says so).  The cheapest faults
# ride on it (each node behind a loopback fault proxy): 50 ms ± 10 ms per chunk each way, each node's
# connections reset as R2 reaches it, and client-1 paused (SIGSTOP) for 15 s as R1 reaches it,
# past the 10 s round timeout: alive for Flower (heartbeats), so waited for, not a dropout.
CKKS = ["deploy", "local", "--clients", "4", "--seed", "2", "--no-tls", "--protection", "ckks",
        "--fraction", "0.08", "--dim", "32", "--round-timeout", "10", "--fault-delay", "0.05",
        "--fault-reset", "R2", "--fault-pause", "client-1@R1:15"]  # fmt: skip

# The test's ServerApp (tests/deploy/tampering_coordinator.py) changes one weight after the solve; three
# institutions that label every class (every group of three, one assumed colluder).
TAMPERING = ["deploy", "local", "--clients", "3", "--missing", "0", "--fraction", "0.08", "--dim", "32"]
TAMPERING_CLI = [sys.executable, str(Path(__file__).with_name("tampering_coordinator.py"))]


# A federation that writes nothing (output, logs) for this long is stuck; one that keeps writing is
# waited for up to HARD_LIMIT times its expected time (a host loaded by other work is slow, not stuck).
STALL_SECONDS = 300.0
HARD_LIMIT = 3.0
POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Spec:
    test: str  # the test that checks this federation
    args: list[str]  # the command's arguments but --out
    timeout: float  # its expected seconds on an idle host (HARD_LIMIT times this at most)
    cli: tuple[str, ...] = ()  # the command (secure-afl's CLI when empty)


FEDERATIONS = {
    "tls": Spec("test_deploy_local_tls_a_dropout_round2_and_an_abort_that_deploy_run_reports", TLS, 560),
    "ckks": Spec("test_deploy_local_with_ckks_equals_the_simulation_within_ckks_precision", CKKS, 420),
    "growing": Spec(
        "test_deploy_local_grows_over_three_sessions_to_the_centralised_fit", [*GROWING, "--keep"], 420
    ),
    "tampering": Spec(
        "test_a_tampering_coordinators_classifier_is_refused_by_every_node_through_flower",
        [*TAMPERING, "--keep"],
        300,
        tuple(TAMPERING_CLI),
    ),
}


@dataclass
class Federation:
    """One ``deploy local`` command running in its own directory (its TMPDIR) and process group."""

    name: str
    directory: Path
    timeout: float
    groups: ProcessGroups
    child: Child
    stdout: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def out(self) -> Path:
        return self.directory / "out"

    def wait(self) -> subprocess.CompletedProcess[str]:
        """The command's exit status and output, once it exits.  The limit follows progress, not the
        clock alone (a loaded host is slow, not stuck): it fails, after stopping every process group
        it started, when nothing the federation writes (its output, its processes' logs) has grown
        for ``STALL_SECONDS``, or when it is not done ``HARD_LIMIT`` times its expected time."""
        deadline = self.started + HARD_LIMIT * self.timeout
        seen, moved = -1, time.monotonic()
        for _ in range(int(HARD_LIMIT * self.timeout / POLL_SECONDS) + 2):  # bounded; the clock ends it first
            try:
                code = self.child.process.wait(timeout=POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                pass
            now, size = time.monotonic(), self.written()
            if size != seen:
                seen, moved = size, now
            if now - moved > STALL_SECONDS or now > deadline:
                self.groups.stop_all()
                why = f"wrote nothing for {STALL_SECONDS:.0f} s" if now <= deadline else "ran past its limit"
                took = now - self.started
                pytest.fail(f"deploy local ({self.name}) {why} after {took:.0f} s:\n{self.output()[-4000:]}")
        else:  # pragma: no cover - the deadline ends the loop first
            self.groups.stop_all()
            pytest.fail(f"deploy local ({self.name}) did not exit")
        print(f"deploy local ({self.name}) exited after {time.monotonic() - self.started:.0f} s")
        stdout = self.stdout.read_text(errors="replace")
        return subprocess.CompletedProcess(self.child.process.args, code, stdout, self.stderr())

    def written(self) -> int:
        """Bytes the federation has written so far: its output and every log under its directory."""
        total = 0
        for path in [self.stdout, self.child.log, *self.directory.rglob("*.log")]:
            try:
                total += path.stat().st_size
            except OSError:
                continue
        return total

    def stderr(self) -> str:
        return self.child.log.read_text(errors="replace")

    def output(self) -> str:
        return self.stdout.read_text(errors="replace") + self.stderr()


class Federations:
    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.running: dict[str, Federation] = {}
        self.queued: list[str] = []  # selected, not yet started (:meth:`advance` starts them)

    def advance(self) -> None:
        """Start queued federations while fewer than AT_ONCE run (tests/conftest.py calls it after
        each test): all at once they would crowd the suite's start on 2 cores and leave the second
        core idle at its end."""
        for _ in range(len(self.queued)):
            alive = sum(f.child.process.poll() is None for f in self.running.values())
            if alive >= AT_ONCE or not self.queued:
                return
            self.start(self.queued.pop(0))

    def start(self, name: str) -> Federation:
        if name in self.running:
            return self.running[name]
        if name in self.queued:  # its test came first: it starts now
            self.queued.remove(name)
        # deploy-local-tls-0, deploy-local-ckks-0, ...: no directory's path is a prefix of another's
        directory = self.tmp_path_factory.mktemp(f"deploy-local-{name}-")
        env = {**os.environ, "TMPDIR": str(directory)}  # the federation's work directory lands there
        groups = ProcessGroups(env)
        stdout, stderr = directory / "deploy-local.stdout", directory / "deploy-local.stderr"
        with open(stdout, "wb") as out_file, open(stderr, "wb") as err_file:
            process = subprocess.Popen(
                [*(FEDERATIONS[name].cli or CLI), *FEDERATIONS[name].args, "--out", str(directory / "out")],
                stdout=out_file,
                stderr=err_file,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group, as ProcessGroups.start makes them
            )
        child = Child(f"deploy local ({name})", process, stderr)
        groups.children.append(child)  # stop_all stops its group and its descendants' groups
        self.running[name] = Federation(name, directory, FEDERATIONS[name].timeout, groups, child, stdout)
        return self.running[name]

    def stop_all(self) -> None:
        for federation in self.running.values():
            federation.groups.stop_all()


EARLY = pytest.StashKey[Federations]()
AT_ONCE = 2  # federations running together, the longest first (FEDERATIONS' order)


def start_early(session: pytest.Session) -> None:
    """Queue the federations whose tests are selected and start the first AT_ONCE (tests/conftest.py
    calls it once collection is done; ``-k`` starts only what it selects).  They run for minutes,
    mostly waiting on Flower (heartbeats, round timeouts), so they run beside the rest of the suite,
    not after it; all at once they would crowd its start and leave a core idle at its end."""
    selected = {
        getattr(item, "originalname", item.name) for item in session.items if item.path == Path(__file__)
    }
    factory: pytest.TempPathFactory = session.config._tmp_path_factory  # type: ignore[attr-defined]
    started = session.stash.setdefault(EARLY, Federations(factory))
    try:
        started.queued = [name for name, spec in FEDERATIONS.items() if spec.test in selected]
        started.advance()
    except BaseException:
        started.stop_all()
        raise


def advance_early(session: pytest.Session) -> None:
    """Start the next queued federations if fewer than AT_ONCE still run (after each test)."""
    if EARLY in session.stash:
        session.stash[EARLY].advance()


def stop_early(session: pytest.Session) -> None:
    """Stop every federation :func:`start_early` started, finished or not (at the session's end)."""
    if EARLY in session.stash:
        session.stash[EARLY].stop_all()


@pytest.fixture(scope="module")
def federations(request: pytest.FixtureRequest) -> Iterator[Federations]:
    """The federations started with the suite (:func:`start_early`); stopped with this module."""
    if EARLY not in request.session.stash:  # a run that did not go through tests/conftest.py's hook
        start_early(request.session)
    started = request.session.stash[EARLY]
    try:
        yield started
    finally:
        started.stop_all()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find leftover processes")
def test_deploy_local_tls_a_dropout_round2_and_an_abort_that_deploy_run_reports(
    federations: Federations,
) -> None:
    """One real federation (the suite's slowest test, so it carries several things): TLS and node
    authentication; a SuperNode killed as it receives session 1's R4 (its masked input is already in
    the sums); round 2's pseudo-label group through Flower processes, equal bit for bit to the
    simulation's two rounds; the coordinator's metrics endpoint (--metrics) scraped during the run;
    then --rehearse-abort: SuperNodes killed until too few remain, and the coordinator's command
    (deploy run's code) must fail and move the earlier classifier aside. predict --evaluate then
    verifies and scores what --out holds."""
    import json

    from click.testing import CliRunner

    from secure_afl.cli import main

    federation = federations.start("tls")  # started with the module's other federations
    tmp_path, out = federation.directory, federation.out
    result = federation.wait()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "weights bit for bit equal: yes" in output  # against the simulation's two rounds
    assert "killed the SuperNode of client-0 as it received round R4" in output
    assert "round 2: no pseudo-label group for classes [0, 1, 3, 4, 5, 6, 7]" in output  # pseudo/2 runs
    assert "classifier stored by ['client-1', 'client-2', 'client-3']; identical copies: True" in output
    # Signed in deploy local's own process (deploy run's code), not by the ServerApp, which has no key.
    assert "sign request " in output and "signed the classifier " in output and " as coordinator (" in output
    # --metrics: deploy local scraped the coordinator's endpoint while the federation ran, and its
    # counters matched the report; the file the ServerApp kept (deploy status's) matches it too.
    from secure_afl.deploy.metrics import file_registry, mismatches, samples_of, value

    assert "metrics scraped from http://127.0.0.1:" in output
    assert "/metrics: the counters match the report" in output
    report = json.loads((out / "report.json").read_text())
    counters = samples_of(file_registry(out / "metrics.json", "coordinator"))
    assert mismatches(counters, [report]) == []
    assert value(counters, "secure_afl_sessions_finished_total") == 2
    assert value(counters, "secure_afl_dropouts_total") == len(report["dropouts"]) >= 1
    # signed by the coordinator; --out holds the roster that verifies it (predict --roster)
    classifier = Classifier.load(out / "classifier.json", roster=load_roster(out / "roster.json"))
    assert classifier.signer == "coordinator"
    everyone = ["client-0", "client-1", "client-2", "client-3"]
    assert classifier.sessions[0]["participants"] == everyone
    assert classifier.sessions[0]["survivors"] == everyone  # client-0's input was in before R4
    assert classifier.sessions[1]["participants"] == ["client-1", "client-2", "client-3"]
    assert classifier.method["gram"] == "global" and classifier.protocol["threshold"] == 3
    assert classifier.method["rounds"] == 2
    assert np.isfinite(classifier.weights).all() and classifier.weights.shape == (32, 8)
    # The rehearsal: deploy run's code exits 1 and leaves no classifier.json beside its report.
    assert "abort rehearsal: `secure-afl deploy run` exits 1" in output
    rehearsal = out / "abort-rehearsal"
    assert not (rehearsal / "classifier.json").exists()
    assert len(list(rehearsal.glob("classifier.before-*.json"))) == 1
    assert "error" in json.loads((rehearsal / "report.json").read_text())
    # Every process's log is in --out, and the labelled test features score the signed classifier.
    assert (out / "logs" / "flwr-run.log").is_file() and (out / "logs" / "superlink.log").is_file()
    metrics = tmp_path / "metrics.json"
    predicted = CliRunner().invoke(main, [
        "predict", "--model", str(out / "classifier.json"), "--roster", str(out / "roster.json"),
        "--features", str(out / "test-features.npz"), "--out", str(tmp_path / "p.csv"),
        "--evaluate", "--metrics-out", str(metrics),
    ])  # fmt: skip
    assert predicted.exit_code == 0, predicted.output
    assert "verified: signed by the coordinator coordinator" in predicted.output
    assert json.loads(metrics.read_text())["images"] > 0
    # No SuperLink, SuperNode, SuperExec or app process survives the command.
    assert _processes_mentioning(str(tmp_path)) == []
    took = time.monotonic() - federation.started
    print(f"deploy local --tls --rounds 2 --rehearse-abort took {took:.0f} s")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find leftover processes")
def test_deploy_local_with_ckks_equals_the_simulation_within_ckks_precision(federations: Federations) -> None:
    import json
    import re

    federation = federations.start("ckks")
    tmp_path, out = federation.directory, federation.out
    result = federation.wait()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "protection: ckks (N=8192, moduli [60, 40, 40, 60], scale 2^40)" in output
    match = re.search(r"weights equal within CKKS precision: yes \(max \|Δw\| (\S+), (\S+) of max", output)
    assert match, output[-4000:]
    assert float(match.group(2)) <= 1e-4  # what the command checks, read back
    everyone = "['client-0', 'client-1', 'client-2', 'client-3']"
    assert f"classifier stored by {everyone}; identical copies: True" in output
    classifier = Classifier.load(out / "classifier.json", roster=load_roster(out / "roster.json"))
    assert classifier.protocol["backend"] == "ckks" and classifier.protocol["poly_modulus_degree"] == 8192
    assert classifier.sessions[0]["survivors"] == ["client-0", "client-1", "client-2", "client-3"]
    report = json.loads((out / "report.json").read_text())
    session = report["sessions"][0]
    assert set(session["round_seconds"]) == {"R0", "R1", "R2", "R3", "R4"}  # R3: the signed view
    # the faults happened, and none made a dropout: client-1 was waited for past the 10 s timeout
    assert "fault: paused client-1's SuperNode" in output and "fault: resumed client-1" in output
    assert len(re.findall(r"fault: reset [1-9]\d* connection\(s\) of client-\d as s1-R2", output)) == 4, (
        output[-4000:]
    )
    assert report["dropouts"] == [] and session["round_seconds"]["R1"] >= 15
    assert session["key_holder"] in session["participants"]
    assert set(session["decryptors"].values()) <= set(session["survivors"])
    assert np.isfinite(classifier.weights).all() and classifier.weights.shape == (32, 8)
    assert _processes_mentioning(str(tmp_path)) == []
    print(f"deploy local --protection ckks took {time.monotonic() - federation.started:.0f} s")


def test_process_groups_stop_grandchildren_even_in_new_sessions(tmp_path: Path) -> None:
    groups = ProcessGroups(dict(os.environ))
    marker = f"secure-afl-test-{os.getpid()}"
    # A grandchild in the same group, and one that starts its own session (as the SuperLink's
    # flower-superexec does), which a process-group kill alone would miss.
    escapee = f"import os, time; os.setsid(); print('{marker}', flush=True); time.sleep(300)"
    script = f'sleep 300 & {sys.executable} -c "{escapee}" & wait'
    child = groups.start("shell", ["sh", "-c", script], tmp_path / "log")
    for _ in range(200):
        if marker in (tmp_path / "log").read_text():
            break
        time.sleep(0.05)
    assert os.getpgid(child.process.pid) == child.process.pid  # its own group, not ours
    assert len(groups.groups()) == 2  # the shell's group and the escapee's
    groups.stop_all(grace=1)
    assert groups.alive() == []
    with pytest.raises(ProcessLookupError):
        os.killpg(child.process.pid, 0)


def test_credentials_are_generated_with_cryptography(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    ca, certificate, key = write_tls_certificates(tmp_path / "tls")
    cert = x509.load_pem_x509_certificate(certificate.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert key.stat().st_mode & 0o077 == 0
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.read_bytes()))
    public = write_node_auth_key(tmp_path / "auth")
    private = load_ssh_private_key((tmp_path / "auth").read_bytes(), password=None)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert load_ssh_public_key(public.read_bytes()).public_numbers() == private.public_key().public_numbers()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find leftover processes")
def test_deploy_local_grows_over_three_sessions_to_the_centralised_fit(federations: Federations) -> None:
    """Three studies through Flower's processes, each extending the last and releasing only the
    images that arrived since: every session's signed classifier equals numpy's fit on
    the rows its institutions' ledgers record as released so far, to 1e-9; the coordinator's
    out-dir holds the chain; each image is released exactly once."""
    from secure_afl.deploy.sums import load_sums
    from secure_afl.features.file import load_feature_file
    from secure_afl.keys import load_identity_key
    from secure_afl.privacy.ledger import FileLedger, LedgerOwner
    from secure_afl.privacy.release import split_digests

    from .helpers import centralised_global_fit

    federation = federations.start("growing")  # --keep: the work directory lands in its directory
    tmp_path, out = federation.directory, federation.out
    result = federation.wait()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert _processes_mentioning(str(tmp_path)) == []
    # Sessions 1 and 2's classifiers were moved aside by the next run (named by UTC time, so in order).
    roster = load_roster(out / "roster.json")
    files = [*sorted(out.glob("classifier.before-*.json")), out / "classifier.json"]
    classifiers = [Classifier.load(path, roster=roster) for path in files]  # each signed by the coordinator
    digests = [c.study_digest for c in classifiers]
    assert len(classifiers) == 3 and len(set(digests)) == 3
    # The chain in the coordinator's out-dir: each study extends the one before.
    chain = load_sums(out, digests[-1]).chain
    assert [entry["study"] for entry in chain] == digests
    assert "growth" not in classifiers[0].protocol or classifiers[0].protocol["growth"]["extends"] is None
    for k in (1, 2):
        assert classifiers[k].protocol["growth"]["extends"] == digests[k - 1]
        assert [e["study"] for e in classifiers[k].protocol["growth"]["chain"]] == digests[: k + 1]
        assert load_sums(out, digests[k - 1]).chain == chain[:k]
    institutions = [entry.client_id for entry in roster]
    assert all(entry["survivors"] == institutions for entry in chain)
    # What each institution's ledger says each session released: new images only, all of them in the end.
    (work,) = tmp_path.glob("secure-afl-deploy-*")
    passphrase = (work / "keys" / "passphrase").read_bytes().strip()
    rows, labels, active, released = {}, {}, {}, {}
    for cid in institutions:
        features = load_feature_file(work / "data" / f"{cid}.npz", require_labels=True)
        identity = load_identity_key(work / "keys" / f"{cid}.key", passphrase)
        ledger = FileLedger(work / "ledgers" / cid).load(LedgerOwner(cid, identity))
        sessions = [ledger.sessions[entry["session_id"]] for entry in chain]
        assert all(s.scope.startswith(f"study:{d}") for s, d in zip(sessions, digests, strict=True))
        increments = [set(split_digests(s.images)) for s in sessions]
        assert all(increments) and sum(map(len, increments)) == len(set().union(*increments))  # disjoint
        every = [bytes.fromhex(h) for h in features.require_image_digests()]
        assert set().union(*increments) == set(every)  # after session 3: every image, once
        rows[cid], labels[cid], active[cid] = features.features, features.labels, features.active
        # per session, which rows of the (final) file had been released by then
        released[cid] = [np.isin(every, list(set().union(*increments[: k + 1]))) for k in range(3)]
    gamma, n_classes = classifiers[0].method["gamma"], classifiers[0].weights.shape[1]
    errors = []
    for k, classifier in enumerate(classifiers):
        so_far = {cid: rows[cid][released[cid][k]] for cid in institutions}
        want = centralised_global_fit(
            so_far, {cid: labels[cid][released[cid][k]] for cid in institutions}, active, n_classes, gamma
        )
        errors.append(float(np.max(np.abs(classifier.weights - want))))
    assert max(errors) < 1e-9, errors
    # ... and the sessions differ: each added images (the first is not the last's fit)
    assert np.max(np.abs(classifiers[0].weights - classifiers[2].weights)) > 1e-6
    # The classifier check (SECURITY.md §5.1) through Flower's processes: every study's classifier,
    # the later ones over the chain's sums (each node's term over the values it kept of every run,
    # in its ledger dir, across Flower runs), verified by every node before it stored it.
    from secure_afl.deploy.classifier import HISTORY_DIR, history_name
    from secure_afl.deploy.verify import verification_status

    for cid in institutions:
        kept = [work / "out" / cid / HISTORY_DIR / history_name(path.read_bytes()) for path in files]
        assert all(path.is_file() for path in kept), cid
        said = [verification_status(path) for path in kept]
        assert all(line.startswith("classifier check: verified by this node") for line in said), (cid, said)
    report = json.loads((out / "report.json").read_text())
    assert [r["study_digest"] for r in report["growth"]] == digests  # the command's own comparison
    assert all(r["max_abs_w_vs_centralised"] <= 1e-9 for r in report["growth"])
    took = time.monotonic() - federation.started
    print(f"deploy local --sessions 3 took {took:.0f} s; max |Δw| per session {errors}")


def test_a_tampering_coordinators_classifier_is_refused_by_every_node_through_flower(
    federations: Federations,
) -> None:
    """The classifier check through Flower's processes (SECURITY.md §5.1): the coordinator's ServerApp
    (the test's, tests/deploy/tampering_coordinator.py) changes one weight by a millionth of its column
    after the solve and the coordinator signs it; every node's ClientApp (secure-afl's) refuses it as
    failing the check, none stores it, and the command fails."""
    federation = federations.start("tampering")
    tmp_path = federation.directory
    result = federation.wait()
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert _processes_mentioning(str(tmp_path)) == []
    (work,) = tmp_path.glob("secure-afl-deploy-*")
    institutions = ["client-0", "client-1", "client-2"]
    for cid in institutions:
        assert not (work / "out" / cid / "classifier.json").exists(), cid
        log = (federation.out / "logs" / f"supernode-{cid}.log").read_text(errors="replace")
        assert (
            "ClassifierCheckFailedError: the classifier is not the solution of the session's sums" in log
        ), cid
    assert "classifier check: verified by no node" in output, output[-4000:]
    assert json.loads((federation.out / "report.json").read_text())["verified"] == []


def test_deploy_local_refuses_up_front_a_growth_that_partial_labels_would_expose(tmp_path: Path) -> None:
    """With partial labels the global-balance class groups differ by one institution, whose total
    sums their difference gives away: every node would refuse in R1, so the command refuses first."""
    from click.testing import CliRunner

    from secure_afl.cli import main

    missing_one = [arg for arg in GROWING if arg not in ("--missing", "0")]  # the default --missing 1
    result = CliRunner().invoke(main, [*missing_one, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "exposure check would refuse this layout in R1" in result.output
    assert "determine the individual value of 'feat_sum'" in result.output and "--missing 0" in result.output
    assert not (tmp_path / "logs").exists()  # before the work directory or any process
