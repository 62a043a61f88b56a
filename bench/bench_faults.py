"""A federation on bad networks and loaded hosts: the fault matrix of issue 54.

The coordinator (SuperLink, ServerApp, ``flwr run``, this script's inner half) runs in one network
namespace and each hospital's SuperNode in its own, joined by a veth pair (10.54.K.1 the coordinator's
end, 10.54.K.2 hospital K's).  Each hospital reaches the SuperLink through a TCP fault proxy
(secure_afl/deploy/faults.py) listening on 10.54.K.1 in the coordinator's namespace; TLS and node
authentication as ``deploy local --tls`` (the certificate names the proxies' addresses).  The run is
``deploy local``'s own (secure_afl/rehearsal.py, secure_afl/deploy/local.py with a ``Network``).

Per fault: completed or aborted with the reason, wall time, whether the classifier equals the
fault-free run's bit for bit (and the in-process simulation's over the same survivors), and whether
every ledger and file is consistent: no image released twice in a node's ledger, every survivor the
server names holds the release in its ledger (nothing lost), every node holding a classifier holds
the coordinator's exact file and an aborted run left none (no partial classifier).

    sudo python bench/bench_faults.py                 # the whole matrix (about 30 min on 2 loaded cores)
    sudo python bench/bench_faults.py --only pause    # one fault (and the baseline it compares with)

Needs root (CAP_NET_ADMIN) and iproute2's ``ip netns``; without them it stops with a message saying
what is missing.  Each fault runs in a child process with a time limit; its namespaces and every
process in them are removed afterwards, whether it passed, failed or ran out of time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CLIENTS = 4
VICTIM = "client-1"  # the hospital a partition or a pause hits
SUBNET = "10.54"  # the project's own test addresses: 10.54.K.1 coordinator, 10.54.K.2 hospital K
ROUND_TIMEOUT = 10.0  # shorter than the pause and the partition: only liveness keeps those nodes in


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    sessions: int = 1
    baseline: str = "baseline"


MATRIX = [
    Fault("baseline", "no fault (1 session)"),
    Fault("latency", "every link 100 ms ± 20 ms each way, per chunk"),
    Fault("slow-link", "every link capped at 1 MB/s each way"),
    Fault("resets", "every link's connections reset as R1, R2 and R3 reach the nodes"),
    Fault("partition", f"{VICTIM}'s link cut for 10 s as R2 reaches it"),
    Fault(
        "pause", f"{VICTIM}'s SuperNode (and its ClientApp) SIGSTOPped as R1 reaches it, SIGCONT 20 s later"
    ),
    Fault("baseline-2", "no fault (2 sessions, a federation that grows)", sessions=2, baseline="baseline-2"),
    Fault("restart", "the SuperLink restarted between the 2 sessions", sessions=2, baseline="baseline-2"),
]
BY_NAME = {f.name: f for f in MATRIX}


class Missing(SystemExit):
    pass


# --- namespaces (outer half, root) ---------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def preflight() -> None:
    """Stop with what is missing when namespaces cannot be made (never skip silently)."""
    missing = []
    if shutil.which("ip") is None:
        missing.append("iproute2's `ip` command (apt-get install iproute2)")
    if os.geteuid() != 0:
        missing.append("root (CAP_NET_ADMIN and CAP_SYS_ADMIN, to create network namespaces): run with sudo")
    if not missing:
        probe = f"saf54-probe-{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        _ip("netns", "del", probe, check=False)
        if made.returncode != 0:
            missing.append(f"`ip netns add` works here ({made.stderr.strip() or 'it failed'})")
    if missing:
        raise Missing("bench_faults.py needs " + "; ".join(missing))


@dataclass
class Namespaces:
    prefix: str
    clients: int
    made: list[str] = field(default_factory=list)

    @property
    def coordinator(self) -> str:
        return f"{self.prefix}c"

    def hospital(self, k: int) -> str:
        return f"{self.prefix}h{k}"

    def create(self) -> None:
        for name in [self.coordinator, *(self.hospital(k) for k in range(self.clients))]:
            _ip("netns", "add", name)
            self.made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        for k in range(self.clients):
            near, far = f"{self.prefix}v{k}c", f"{self.prefix}v{k}h"  # at most 15 characters
            _ip("link", "add", near, "netns", self.coordinator, "type", "veth", "peer", "name", far,
                "netns", self.hospital(k))  # fmt: skip
            _ip("-n", self.coordinator, "addr", "add", f"{SUBNET}.{k}.1/30", "dev", near)
            _ip("-n", self.hospital(k), "addr", "add", f"{SUBNET}.{k}.2/30", "dev", far)
            _ip("-n", self.coordinator, "link", "set", near, "up")
            _ip("-n", self.hospital(k), "link", "set", far, "up")

    def destroy(self) -> list[str]:
        """Kill every process left in the namespaces and delete them; return what could not be."""
        problems = []
        for name in self.made:
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            if _ip("netns", "del", name, check=False).returncode != 0:
                problems.append(name)
        self.made.clear()
        return problems


# --- the plan of one fault (inner half, in the coordinator's namespace) ---------------------------


def fault_plan(fault: Fault, prefix: str, client_ids: Sequence[str]) -> Any:
    """The fault as secure_afl/deploy/fault_plan.py's plan: each hospital in its namespace, dialling
    its proxy on the coordinator's end of its veth pair."""
    from secure_afl.deploy.fault_plan import FaultPlan

    where = {
        "prefix": {cid: ["ip", "netns", "exec", f"{prefix}h{k}"] for k, cid in enumerate(client_ids)},
        "listen": {cid: f"{SUBNET}.{k}.1" for k, cid in enumerate(client_ids)},
    }
    faults: dict[str, Any] = {
        "latency": {"delay": 0.1, "jitter": 0.02},
        "slow-link": {"rate": 1_000_000},
        "resets": {"resets": ("s1-R1", "s1-R2", "s1-R3")},
        "partition": {"partition": (VICTIM, "s1-R2", 10.0)},
        "pause": {"pause": (VICTIM, "s1-R1", 20.0)},
        "restart": {"restart_superlink": True},
    }
    return FaultPlan(**faults.get(fault.name, {}), **where)


# --- checks after a run ------------------------------------------------------------------------------


def check_files(work_dir: Path, out_dir: Path, client_ids: Sequence[str], completed: bool) -> dict[str, Any]:
    """Ledgers and classifier files: released twice, lost, partial."""
    from secure_afl.keys.files import load_identity_key
    from secure_afl.keys.store import read_passphrase
    from secure_afl.privacy.ledger import FileLedger, LedgerOwner

    keys = work_dir / "keys"
    passphrase = read_passphrase(keys / "passphrase")
    report_path = out_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    problems: list[str] = []
    released: dict[str, set[str]] = {}
    for cid in client_ids:
        owner = LedgerOwner(cid, load_identity_key(keys / f"{cid}.key", passphrase))
        state = FileLedger(work_dir / "ledgers" / cid).load(owner)
        seen: set[bytes] = set()
        released[cid] = set()
        for sid, entry in state.sessions.items():
            if entry.survivors is None:
                continue
            released[cid].add(sid)
            images = {entry.images[i : i + 32] for i in range(0, len(entry.images), 32)}
            if images & seen:
                problems.append(f"{cid}: {len(images & seen)} image(s) released twice")
            seen |= images
    for session in report.get("sessions", []) if completed else []:
        for cid in session["survivors"]:
            if session["session_id"] not in released.get(cid, set()):
                problems.append(f"{cid}: survivor of session {session['label']} without its release")
    server_file = out_dir / "classifier.json"
    holders = [cid for cid in client_ids if (work_dir / "out" / cid / "classifier.json").is_file()]
    if completed:
        data = server_file.read_bytes()
        for cid in holders:
            if (work_dir / "out" / cid / "classifier.json").read_bytes() != data:
                problems.append(f"{cid} holds a classifier other than the coordinator's")
        acknowledged = set(report.get("acknowledged", []))
        if acknowledged - set(holders):
            problems.append(f"acknowledged but not held: {sorted(acknowledged - set(holders))}")
    else:  # aborted: a node may hold only what an earlier completed run delivered (moved aside by the next)
        earlier = {p.read_bytes() for p in out_dir.glob("classifier.before-*.json")}
        if server_file.is_file():
            problems.append("an aborted run left the coordinator a classifier")
        for cid in holders:
            if (work_dir / "out" / cid / "classifier.json").read_bytes() not in earlier:
                problems.append(f"{cid} holds a classifier of the aborted run")
    return {"problems": problems, "holders": holders, "released": {c: len(s) for c, s in released.items()}}


# --- one fault (inner half) -----------------------------------------------------------------------


def run_inner(name: str, out_dir: Path, prefix: str) -> dict[str, Any]:
    from secure_afl.deploy.errors import DeploymentError
    from secure_afl.rehearsal import RehearsalOptions, plan_rehearsal, rehearse

    fault = BY_NAME[name]
    options = RehearsalOptions(
        clients=CLIENTS, sessions=fault.sessions, tls=True, missing=0, balance="global", fraction=0.08,
        dim=32, seed=0, round_timeout=ROUND_TIMEOUT, keep=True,
    )  # fmt: skip
    plan = plan_rehearsal(options)
    network = fault_plan(fault, prefix, plan.client_ids)
    started = time.monotonic()
    result: dict[str, Any] = {"fault": name, "what": fault.what}
    report = None
    try:
        report = rehearse(plan, out_dir, network=network)
        result.update(outcome="completed", reason="")
    except (DeploymentError, Exception) as exc:  # the run's own failure is this fault's outcome
        result.update(outcome="aborted", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    result["seconds"] = round(time.monotonic() - started, 1)
    result["events"] = network.events
    # every byte between a hospital and the coordinator went through its proxy
    result["proxies"] = {cid: vars(proxy.stats) for cid, proxy in network.proxies.items()}
    if report is not None:
        weights = report.result.classifier.weights  # signed by the coordinator, verified on loading
        result["weights_sha256"] = hashlib.sha256(weights.tobytes()).hexdigest()
    if report is not None and fault.sessions == 1:
        result["identical_to_simulation"] = bool(report.identical)
    server_report = out_dir / "report.json"
    if server_report.is_file():
        data = json.loads(server_report.read_text())
        result["dropouts"] = data.get("dropouts", [])
        result["survivors"] = [s["survivors"] for s in data.get("sessions", [])]
    work = sorted((out_dir / "tmp").glob("secure-afl-deploy-*"))
    if work:
        result["files"] = check_files(work[-1], out_dir, plan.client_ids, result["outcome"] == "completed")
        shutil.rmtree(work[-1], ignore_errors=True)
    return result


# --- the matrix (outer half) ------------------------------------------------------------------------


def run_one(name: str, out: Path, limit: float) -> dict[str, Any]:
    prefix = f"s{os.getpid() % 100000}"
    spaces = Namespaces(prefix, CLIENTS)
    directory = out / name
    shutil.rmtree(directory, ignore_errors=True)
    (directory / "tmp").mkdir(parents=True)
    started = time.monotonic()
    child = None
    try:
        spaces.create()
        env = {**os.environ, "TMPDIR": str(directory / "tmp"), "PYTHONPATH": str(ROOT)}
        argv = ["ip", "netns", "exec", spaces.coordinator, sys.executable, __file__, "--inner", name]
        argv += ["--out", str(directory), "--prefix", prefix]
        with open(directory / "run.log", "wb") as log:
            child = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                child.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(timeout=30)
                return {"fault": name, "what": BY_NAME[name].what, "outcome": "aborted",
                        "reason": f"the bench's limit of {limit:.0f} s passed", "seconds": limit}  # fmt: skip
        path = directory / "result.json"
        if not path.is_file():
            return {"fault": name, "what": BY_NAME[name].what, "outcome": "aborted",
                    "reason": f"the inner run exited {child.returncode}, no result ({directory}/run.log)",
                    "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
        return json.loads(path.read_text())
    finally:
        if child is not None and child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
        left = spaces.destroy()
        if left:
            print(f"WARNING: could not delete namespaces {left}", flush=True)


def table(results: Sequence[dict[str, Any]]) -> str:
    digests = {r["fault"]: r.get("weights_sha256") for r in results}
    lines = [
        "| fault | outcome | wall s | = fault-free, bit for bit | = simulation | dropouts | ledgers, files |",
        "|---|---|---:|---|---|---|---|",
    ]
    for r in results:
        fault = BY_NAME[r["fault"]]
        base = digests.get(fault.baseline)
        same = "—" if r.get("weights_sha256") is None or base is None else (
            "yes" if r["weights_sha256"] == base else "no")  # fmt: skip
        if r["fault"] == fault.baseline:
            same = "(reference)"
        sim = {True: "yes", False: "no"}.get(r.get("identical_to_simulation"), "—")  # type: ignore[arg-type]
        drops = ", ".join(f"{d['client']} {d['at'].split()[-1]}" for d in r.get("dropouts", [])) or "none"
        files = r.get("files")
        checked = (
            "not checked"
            if files is None
            else ("consistent" if not files["problems"] else "; ".join(files["problems"]))
        )
        outcome = r["outcome"] + (f": {r['reason']}" if r.get("reason") else "")
        lines.append(
            f"| {r['fault']}: {r['what']} | {outcome} | {r['seconds']:.0f} | {same} | {sim} | {drops} "
            f"| {checked} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", action="append", choices=[f.name for f in MATRIX], help="run only these faults"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out-faults")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds one fault's run may take")
    parser.add_argument("--inner", choices=[f.name for f in MATRIX], help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        result = run_inner(args.inner, args.out.resolve(), args.prefix)
        (args.out / "result.json").write_text(json.dumps(result, indent=1))
        return 0
    preflight()
    names = args.only or [f.name for f in MATRIX]
    for name in list(names):
        base = BY_NAME[name].baseline
        if base not in names:
            names.insert(0, base)
    names = [f.name for f in MATRIX if f.name in names]
    out = args.out.resolve()
    results = []
    for name in names:
        print(f"== {name}: {BY_NAME[name].what}", flush=True)
        results.append(run_one(name, out, args.limit))
        r = results[-1]
        print(f"   {r['outcome']} in {r['seconds']:.0f} s {r.get('reason', '')}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
