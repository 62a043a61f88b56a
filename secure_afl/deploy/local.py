"""``secure-afl deploy local``: a whole federation on one machine, as child processes on loopback.

In a temporary directory it writes every institution's identity key and passphrase file, the
roster, (with ``tls``) a CA, the SuperLink's certificate and one ECDSA SuperNode-authentication
key per node in OpenSSH format (all with ``cryptography``), a Flower app directory and
``$FLWR_HOME/config.toml``; then it starts a SuperLink, registers the nodes' keys
(``flwr supernode register``), starts one SuperNode per institution and runs the federation with
``flwr run APP local --stream``.  It kills a named SuperNode when that node receives the named
protocol round's message.  Every child runs in its own process group (``flower-superexec`` and the
app processes it spawns included), and every group is stopped on success, on failure and on Ctrl-C.

The data are not this module's business: the caller writes each institution's feature file
(:mod:`secure_afl.features.file`) and passes the paths.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from secure_afl.keys.roster import Roster

from .classifier import Classifier
from .errors import LocalDeploymentError
from .processes import (
    CHILD_ENV,
    READY_SUPERLINK,
    READY_SUPERNODE,
    Child,
    ProcessGroups,
    flower_bin,
    free_port,
    raise_interrupt,
    wait_for_log,
)
from .study import Study, format_class_lists, round1_layout
from .writers import write_app, write_identities, write_node_auth_key, write_tls_certificates

CONNECTION = "local"
DROP_ROUNDS = ("R1", "R2", "R3", "R4")  # both backends' rounds after R0 (CKKS: R3 the signed view)
DROP_ROUNDS_BY_PROTECTION = {"mask": DROP_ROUNDS, "ckks": DROP_ROUNDS}

Say = Callable[[str], None]


class Network(Protocol):
    """Where ``deploy local``'s nodes run and how they reach the SuperLink, for a bench that puts
    each hospital in its own network namespace behind a fault proxy (bench/bench_faults.py).
    Without one, every process runs on this host's loopback."""

    certificate_ips: Sequence[str]  # the SuperLink certificate's further addresses (the proxies')
    persistent_superlink: bool  # give the SuperLink a --database, so that it may be restarted

    def node_route(self, client_id: str, superlink_port: int) -> tuple[Sequence[str], str]:
        """The node's argv prefix (e.g. ``ip netns exec NS``) and the SuperLink address it dials."""
        ...

    def on_poll(self, nodes: Mapping[str, Child]) -> None:
        """Called about ten times a second while a run goes on (faults timed on rounds)."""
        ...

    def between_sessions(self, k: int, restart_superlink: Callable[[], None]) -> None:
        """Called before run k > 0 of a federation that grows."""
        ...

    def close(self) -> None:
        """Called once the run ends, passed or failed, before its processes are stopped."""
        ...


@dataclass
class LocalResult:
    classifier: Classifier
    report: dict
    seconds: dict[str, float]
    node_classifiers: dict[str, Path]
    work_dir: Path
    killed: dict[str, str] = field(default_factory=dict)
    classifier_path: Path | None = None  # the signed file the ServerApp wrote (under work_dir)
    roster_path: Path | None = None  # the roster that verifies it (names the coordinator)
    abort_rehearsal: Any = None  # with rehearse_abort: the second run's RunOutcome (it must fail)
    # sessions > 1 (a federation that grows): per session its classifier and report, the last first
    # in ``classifier`` and ``report`` as for one session
    sessions: list[tuple[Classifier, dict]] = field(default_factory=list)


# --- the run -------------------------------------------------------------------------------------


def run_local(
    work_dir: Path,
    feature_files: Mapping[str, Path],
    study: Study,
    *,
    tls: bool = True,
    drops: Mapping[str, str] | None = None,
    round_timeout: float = 30.0,
    statistics_timeout: float = 180.0,
    connect_timeout: float = 120.0,
    start_timeout: float = 120.0,
    run_timeout: float = 900.0,
    colluders: str = "n-t",
    coordinator: str = "active",
    say: Say = print,
    server_dir: Path | None = None,
    logs_dir: Path | None = None,
    rehearse_abort: bool = False,
    sessions: int = 1,
    arrive: Callable[[int], None] | None = None,
    metrics: tuple[str, int] | None = None,
    network: Network | None = None,
) -> LocalResult:
    """Start the federation under ``work_dir``, run it, stop every process; return the classifier.

    ``server_dir`` (default ``work_dir/out/server``) is the ServerApp's out-dir (report.json,
    classifier.json) and ``logs_dir`` (default ``work_dir/logs``) holds every process's log: give
    directories outside ``work_dir`` to keep them after it is deleted.  Every node's config passes
    ``secure-afl deploy check`` before its SuperNode starts, and the federation runs through
    ``secure-afl deploy run``'s code (:func:`~secure_afl.deploy.coordinator.run_federation`).
    ``rehearse_abort``: then kill SuperNodes until too few remain and run again (see
    :func:`_rehearse_abort`); the second run's outcome is ``LocalResult.abort_rehearsal``.
    ``sessions`` > 1: a federation that grows.  Before run k (0, 1, ...) ``arrive(k)`` rewrites the
    feature files (the images arrived so far); run k > 0 is a study that extends run k - 1's
    (run config ``extends``), over the same SuperNodes, ledgers and server out-dir.  ``network``:
    where the nodes run and which address each dials (see :class:`Network`); default loopback.
    ``metrics``: (host, port) where the coordinator's metrics are served while the federation runs
    (``deploy run --metrics``); after the last run they are scraped there and must match the reports.
    """
    drops = dict(drops or {})
    client_ids = sorted(feature_files)
    for cid, round_name in drops.items():
        if cid not in feature_files:
            raise LocalDeploymentError(f"--drop {cid}@{round_name}: no institution {cid!r} ({client_ids})")
        rounds = DROP_ROUNDS_BY_PROTECTION[study.protection]
        if round_name not in rounds:
            raise LocalDeploymentError(
                f"--drop {cid}@{round_name}: with {study.protection} the round must be one of {rounds}"
            )
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    keys_dir, logs = work_dir / "keys", logs_dir or work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    passphrase_file, roster_written, coordinator_key = write_identities(keys_dir, client_ids)
    roster_path = keys_dir / "roster.json"
    flwr_home = work_dir / "flwr-home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    superlink_port = free_port()
    if tls:
        ips = () if network is None else network.certificate_ips
        ca, certificate, private_key = write_tls_certificates(work_dir / "tls", ips)
        auth_keys = {cid: write_node_auth_key(work_dir / "tls" / f"auth-{cid}") for cid in client_ids}
    connection = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]"]
    connection.append(f'address = "127.0.0.1:{superlink_port}"')
    connection.append(f'root-certificates = "{ca}"' if tls else "insecure = true")
    (flwr_home / "config.toml").write_text("\n".join(connection) + "\n", encoding="utf-8")
    out_dir = work_dir / "out"
    server_dir = server_dir or out_dir / "server"
    app_dir = write_app(
        work_dir / "app",
        {
            "roster": str(roster_path),
            "colluders": colluders,  # the server forms round 2's groups as the nodes will check them
            "out-dir": str(server_dir),
            "classes": ",".join(study.classes),
            "dim": study.dim,
            "backbone": study.backbone["name"],
            "weights-id": study.backbone["weights_id"],
            "preprocessing": study.backbone["preprocessing"],
            "gamma": study.method.gamma,
            "balance": study.method.balance,
            "gram": study.method.gram,
            "rounds": study.method.rounds,
            "threshold": study.threshold,
            "min-group-size": study.min_group_size,
            "frac-bits": study.frac_bits,
            "protection": study.protection,
            "ckks-degree": study.ckks_degree,
            "ckks-moduli": ",".join(str(b) for b in study.ckks_coeff_mod_bit_sizes),
            "ckks-scale-bits": study.ckks_scale_bits,
            "extends": study.extends,  # a growing run overrides it with the previous study's digest
            "round-timeout": round_timeout,
            "round-limit": 10 * round_timeout,  # a node Flower reports online (the abort rehearsal sets it)
            "statistics-timeout": statistics_timeout,
            "connect-timeout": connect_timeout,
            **_dp_run_config(study),
        },
    )
    seconds["keys, roster, certificates"] = time.perf_counter() - started

    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, **CHILD_ENV, "FLWR_HOME": str(flwr_home)}
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")  # SuperNodes start flower-superexec from PATH
    # Every Flower process (flwr run's app check, ServerApp, ClientApps) imports this same secure_afl.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    children = ProcessGroups(env)
    killed: dict[str, str] = {}
    endpoint: Any = None  # with metrics: the coordinator's /metrics, served until the end
    previous_term = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_interrupt)  # a terminated parent still stops its children
    try:
        stage = time.perf_counter()
        mode = "TLS, node authentication" if tls else "insecure"
        say(f"starting the SuperLink on 127.0.0.1:{superlink_port} ({mode})")
        link_args = [flower_bin("flower-superlink"), "--disable-runtime-dependency-installation"]
        link_args += ["--host", "127.0.0.1", "--port", str(superlink_port)]
        if tls:
            link_args += ["--ssl-ca-certfile", str(ca), "--ssl-certfile", str(certificate)]
            link_args += ["--ssl-keyfile", str(private_key), "--enable-supernode-auth"]
        else:
            link_args += ["--insecure"]
        if network is not None and network.persistent_superlink:
            link_args += ["--database", str(work_dir / "superlink.db")]
        superlink = children.start("superlink", link_args, logs / "superlink.log")
        wait_for_log(superlink, READY_SUPERLINK, start_timeout, "the SuperLink")
        restarts = [superlink]

        def restart_superlink() -> None:
            """Stop the SuperLink (and the processes it started) and start it again, same state."""
            children.kill_tree(restarts[-1])
            log = logs / f"superlink-{len(restarts) + 1}.log"
            restarts.append(children.start("superlink", link_args, log))
            wait_for_log(restarts[-1], READY_SUPERLINK, start_timeout, "the restarted SuperLink")
            say(f"  restarted the SuperLink ({log.name})")

        seconds["SuperLink start"] = time.perf_counter() - stage
        say(f"  SuperLink ready ({seconds['SuperLink start']:.1f} s)")
        if tls:
            stage = time.perf_counter()
            say(f"registering {len(client_ids)} SuperNode authentication keys (flwr supernode register)")
            registrations = [
                children.start(
                    f"register {cid}",
                    [flower_bin("flwr"), "supernode", "register", str(auth_keys[cid]), CONNECTION],
                    logs / f"register-{cid}.log",
                )
                for cid in client_ids
            ]
            for registration in registrations:
                try:
                    code = registration.process.wait(timeout=start_timeout)
                except subprocess.TimeoutExpired:
                    raise LocalDeploymentError(
                        f"{registration.name} did not finish; see {registration.log}"
                    ) from None
                if code != 0:
                    raise LocalDeploymentError(
                        f"{registration.name} failed (exit {code}):\n{registration.tail()}"
                    )
            seconds["node registration"] = time.perf_counter() - stage
            say(f"  registered ({seconds['node registration']:.1f} s)")
        stage = time.perf_counter()
        nodes: dict[str, Child] = {}
        node_configs: dict[str, str] = {}  # each node's config (a growing run checks each study with it)
        for cid in client_ids:
            node_config = {
                "identity-key": str(keys_dir / f"{cid}.key"),
                "passphrase-file": str(passphrase_file),
                "roster": str(roster_path),
                "features": str(feature_files[cid]),
                "ledger-dir": str(work_dir / "ledgers" / cid),
                "out-dir": str(out_dir / cid),
                "protection": study.protection,  # each institution agreed to the study's protection
                "colluders": colluders,  # each institution's own colluder bound (SECURITY.md §3)
                "coordinator": coordinator,  # what each assumes of the coordinator (SECURITY.md §3.6)
            }
            if study.dp is not None:  # each hospital insists on the study's privacy itself
                limit = node_dp_epsilon(study, len(client_ids), cid, sessions)
                node_config.update({"dp-epsilon": str(limit), "dp-delta": str(study.dp.delta)})
                if sessions > 1 and limit > study.dp.epsilon:
                    say(
                        f"  {cid}: dp-epsilon {limit:.4g} covers the chain's {sessions} sessions (patient "
                        f"unit: their ε compose), not one session's {study.dp.epsilon:g}"
                    )
            node_config_text = " ".join(f"{k}={json.dumps(v)}" for k, v in node_config.items())
            node_configs[cid] = node_config_text
            _check_node(cid, node_config_text, study, f"127.0.0.1:{superlink_port}", ca if tls else None, say)
            prefix, dial = [], f"127.0.0.1:{superlink_port}"
            if network is not None:
                prefix, dial = list((route := network.node_route(cid, superlink_port))[0]), route[1]
            node_args = [*prefix, flower_bin("flower-supernode"), "--superlink", dial]
            node_args += ["--host", "127.0.0.1", "--port", str(free_port())]
            node_args += ["--node-config", node_config_text]
            if tls:
                node_args += [
                    "--root-certificates",
                    str(ca),
                    "--auth-supernode-private-key",
                    str(work_dir / "tls" / f"auth-{cid}"),
                ]
            else:
                node_args += ["--insecure"]
            node_env = {**env, "FLWR_HOME": str(work_dir / f"flwr-home-{cid}")}
            nodes[cid] = children.start(cid, node_args, logs / f"supernode-{cid}.log", env=node_env)
        say(f"starting {len(nodes)} SuperNodes")
        for cid, child in nodes.items():
            wait_for_log(child, READY_SUPERNODE, start_timeout, f"the SuperNode of {cid}")
            say(f"  {cid} connected ({time.perf_counter() - stage:.1f} s)")
        seconds["SuperNodes start"] = time.perf_counter() - stage
        seconds["startup"] = time.perf_counter() - started

        stage = time.perf_counter()
        say("running the federation (flwr run, as `secure-afl deploy run` runs it)")
        run_log = logs / "flwr-run.log"
        pending = dict(drops)

        def kill_dropped() -> None:
            if network is not None:
                network.on_poll(nodes)
            for cid, round_name in list(pending.items()):
                if f"ROUND s1-{round_name}]" in nodes[cid].log.read_text(errors="replace"):
                    children.kill(nodes[cid])
                    killed[cid] = round_name
                    del pending[cid]
                    say(f"  killed the SuperNode of {cid} as it received round {round_name}")

        from .classifier import ClassifierSigner
        from .coordinator import run_federation

        # deploy run's own signing: this process holds the coordinator's key, the ServerApp does not.
        signer = ClassifierSigner.for_roster(roster_written, coordinator_key)
        grown: list[tuple[Classifier, dict]] = []
        roster = Roster.from_json(roster_path.read_text(encoding="utf-8"))
        classifier_path = server_dir / "classifier.json"
        before = None
        if metrics is not None:
            from .metrics import METRICS_NAME, file_registry, scrape, serve

            endpoint = serve(file_registry(server_dir / METRICS_NAME, "coordinator"), *metrics)
            before = scrape(endpoint.url)  # the out-dir's counters of earlier runs, if any
            say(f"serving the coordinator's metrics on {endpoint.url}")
        for k in range(sessions):
            if k:
                stage = time.perf_counter()
                if network is not None:
                    network.between_sessions(k, restart_superlink)
                if arrive is not None:
                    arrive(k)
                run_log = logs / f"flwr-run-{k + 1}.log"
                earlier = grown[-1][0].study_digest
                say(f"session {k + 1} of {sessions}: a study that extends {earlier[:16]}...")
                # each hospital checks the new study (deploy check --study pins it) before it runs
                extended = dataclasses.replace(study, extends=earlier)
                for cid, text in node_configs.items():
                    _check_node(cid, text, extended, f"127.0.0.1:{superlink_port}", ca if tls else None, say)
            elif arrive is not None:
                arrive(0)
            outcome = run_federation(
                app_dir, CONNECTION, children=children, log_path=run_log, run_timeout=run_timeout, say=say,
                on_poll=kill_dropped, signer=signer,
                run_config=[f"extends={json.dumps(grown[-1][0].study_digest)}"] if k else (),
            )  # fmt: skip
            seconds["flwr run" if not k else f"flwr run {k + 1}"] = time.perf_counter() - stage
            if not outcome.ok or outcome.report is None:
                raise LocalDeploymentError(
                    f"the federation failed: {outcome.error}; see {outcome.report_path}, flwr run's output "
                    f"{run_log} and the nodes' logs in {logs}"
                )
            # signed by the coordinator
            grown.append((Classifier.load(classifier_path, roster=roster), outcome.report))
        classifier, report = grown[-1]
        if endpoint is not None:
            _check_metrics(endpoint.url, [r for _, r in grown], before, say)
        node_files = {
            cid: out_dir / cid / "classifier.json"
            for cid in client_ids
            if (out_dir / cid / "classifier.json").exists()
        }
        result = LocalResult(
            classifier, report, seconds, node_files, work_dir, killed, classifier_path, roster_path,
            sessions=grown if sessions > 1 else [],
        )  # fmt: skip
        if rehearse_abort:
            result.abort_rehearsal = _rehearse_abort(
                app_dir, children, nodes, killed, study, server_dir, logs, say, run_timeout, signer=signer
            )
        return result
    finally:
        if network is not None:
            network.close()
        children.stop_all()
        if endpoint is not None:
            endpoint.close()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous_term)
        left = children.alive()
        if left:  # pragma: no cover
            say(f"WARNING: processes still running in process groups {left}")


def _check_metrics(url: str, reports: Sequence[dict], before: Any, say: Say) -> None:
    """Scrape the coordinator's endpoint while the federation still runs: its counters must have
    grown by what the runs' reports record."""
    from .metrics import mismatches, scrape

    wrong = mismatches(scrape(url), reports, before)
    if wrong:
        raise LocalDeploymentError(
            f"the metrics scraped from {url} differ from the report: {'; '.join(wrong)}"
        )
    say(f"metrics scraped from {url}: the counters match the report{'s' if len(reports) > 1 else ''}")


def _rehearse_abort(
    app_dir: Path,
    children: ProcessGroups,
    nodes: Mapping[str, Child],
    killed: dict[str, str],
    study: Study,
    server_dir: Path,
    logs: Path,
    say: Say,
    run_timeout: float,
    timeout: float = 10.0,
    *,
    signer: Any = None,
) -> Any:
    """A second run after killing SuperNodes until fewer than the session needs remain.

    It must fail: the server aborts (too few nodes, or too few answers within ``timeout`` s: a killed
    node stays online in Flower's eyes for up to a minute, so ``round-limit`` is ``timeout`` too) and
    ``deploy run``'s code must say so, and move aside the classifier that its out-dir,
    ``server_dir/abort-rehearsal``, holds from the first run.
    """
    from .coordinator import run_federation

    live = [cid for cid in sorted(nodes) if cid not in killed]
    needed = study.threshold_for(len(nodes)) if study.protection == "mask" else study.min_group_size
    victims = live[: max(0, len(live) - needed + 1)]
    for cid in victims:
        children.kill(nodes[cid])
        killed[cid] = "abort rehearsal"
    say(
        f"rehearsing an abort: killed the SuperNodes of {victims}; {len(live) - len(victims)} of "
        f"{len(nodes)} remain, fewer than the {needed} a session needs; running the federation again"
    )
    directory = server_dir / "abort-rehearsal"
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(server_dir / "classifier.json", directory / "classifier.json")
    overrides = [
        f"out-dir={json.dumps(str(directory))} connect-timeout={timeout:.1f} "
        f"statistics-timeout={timeout:.1f} round-timeout={timeout:.1f} round-limit={timeout:.1f}"
    ]
    return run_federation(
        app_dir, CONNECTION, children=children, run_config=overrides, run_timeout=run_timeout,
        log_path=logs / "flwr-run-abort-rehearsal.log", say=lambda text: say("  " + text), signer=signer,
    )  # fmt: skip


def _check_node(cid: str, node_config: str, study: Study, superlink: str, ca: Path | None, say: Say) -> None:
    """``secure-afl deploy check`` on the node config its SuperNode is about to be given."""
    from .check import NodeCheckError, check_node, parse_node_config

    try:
        check_node(parse_node_config(node_config), study=study, superlink=superlink, root_certificates=ca,
                   say=lambda text: None)  # fmt: skip
    except NodeCheckError as exc:
        raise LocalDeploymentError(f"deploy check failed: {exc}") from None
    say(f"  {cid}: deploy check passed (key, roster, features against the study, ledger, SuperLink)")


def node_dp_epsilon(study: Study, roster_size: int, client_id: str, sessions: int = 1) -> float:
    """The ``dp-epsilon`` a local node is given: the study's ε, or over a growing chain of
    ``sessions`` DP sessions of the study what the chain spends at this node (the max over sessions
    under the image unit, so the study's ε; every session composed under the patient unit), so the
    node takes part in those sessions and refuses a further one (SECURITY.md §9)."""
    from secure_afl.privacy.dp_growth import NodeSpend, chain_spend

    from .study import noise_plan

    if study.dp is None:
        raise LocalDeploymentError("the study asks for no differential privacy: a node needs no dp-epsilon")
    if sessions <= 1:
        return study.dp.epsilon
    spend = NodeSpend.of(noise_plan(study, roster_size), client_id)
    total = chain_spend([spend] * (sessions - 1), spend, study.dp.delta).total
    return max(study.dp.epsilon, total * (1 + 1e-9))  # the node recomposes the same events


def _dp_run_config(study: Study) -> dict[str, object]:
    """The run config's DP keys (none without DP): what a coordinator writes for a real federation."""
    if study.dp is None:
        return {}
    dp = study.dp
    return {
        "dp-epsilon": dp.epsilon,
        "dp-delta": dp.delta,
        "clip": dp.clip,
        "dp-unit": dp.unit,
        "dp-max-images-per-patient": dp.max_images_per_patient,
        "class-lists": format_class_lists(dp.class_lists),
        "dp-ridge": dp.ridge,
        "dp-class-sums": dp.class_sums,
        "dp-row-centre": dp.row_centre,
        **(
            {}
            if dp.projection_dim is None
            else {"dp-dim": dp.projection_dim, "dp-projection-seed": dp.projection_seed}
        ),
    }


def exposing_layout_refusal(
    study: Study,
    active: Sequence[Collection[int]],
    client_ids: Sequence[str],
    summed: Sequence[int],
    assumed: int,
) -> str | None:
    """Why (before any process starts) a round-1 layout that every node's exposure check would
    refuse in R1, predicted with that same check (privacy/policy.py's ``layout_refusals``), or None.
    ``active[k]``: the classes institution ``k`` labels; ``summed``: the institutions whose inputs
    are summed; ``assumed``: the colluders the nodes assume.

    The case this catches: ``--balance global`` (and so ``--sessions``) with partial labels.  Each
    class group then sums its members' total ``feat_sum`` and ``n``, one value per institution sent to
    every class group it labels, so two class groups whose members differ by one institution hand
    the server that institution's feature sum and row count (their difference), whatever the number
    of institutions or colluders assumed.  ``--missing 0`` makes every class group the same set.
    """
    from secure_afl.privacy.policy import ClientPolicy, layout_refusals

    if study.dp is not None:  # DP's class groups carry per-class tensors only (and the noise)
        return None
    layout = round1_layout(study)
    members: dict[str, tuple[str, ...]] = {}
    for group in layout.groups:
        if group.startswith("class/"):
            c = int(group.split("/", 1)[1])
            members[group] = tuple(client_ids[k] for k in summed if c in active[k])
        else:  # the all-institutions group (the global Gram)
            members[group] = tuple(client_ids[k] for k in summed)
    policy = dataclasses.replace(ClientPolicy.deployment(), max_colluders=assumed)
    refusals = layout_refusals(members, {g: tuple(t) for g, t in layout.groups.items()}, policy=policy)
    if not refusals:
        return None
    first = refusals[0]
    return (
        f"every institution's exposure check would refuse this layout in {first.round} "
        f"({len(refusals)} of {len(client_ids)} would; {first.client}: {first.reason}). With "
        "--balance global (which --sessions needs) each class group sums its members' total feature "
        "sum and row count, so two class groups that differ by one institution give away that "
        "institution's: use --missing 0 (every institution labels every class), or for one session "
        "--balance client (one projection per class, nothing shared between class groups)"
    )
