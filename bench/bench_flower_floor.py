"""`secure-afl deploy local` against a bare Flower app that sends the same messages.

The floor is a Flower 1.42 app (a ServerApp and a ClientApp, generated in a temporary directory) that
sends, round after round, as many messages of the same sizes as `deploy local` does, to the same
number of SuperNodes, through the same runtime: one SuperLink, one SuperNode per institution (each
with its SuperExec and one ClientApp process per message), ``flwr run APP local --stream``, the same
environment (``secure_afl.deploy.processes.CHILD_ENV``), insecure as `deploy local`'s default.  Its
ClientApp imports Flower and nothing of secure-afl; it answers each message with bytes of the size
the real client answered.  Its ServerApp polls for replies as secure-afl's does (0.2 s).

Two steps:

1. ``--probe``: one `deploy local` whose ServerApp records every message it sends and every reply
   (round, node, bytes: the payload, the arrays and the metadata of the envelope) in a plan file
   (the app is secure-afl's own, wrapped by a recording module; nothing else changes).
2. ``--pairs K``: K interleaved pairs, floor then `deploy local`, each timed from the SuperLink's
   start to the end of ``flwr run`` (what both do), and `deploy local`'s whole command wall time.

    PYTHONPATH=. python bench/bench_flower_floor.py --probe --plan runs/floor-plan.json
    PYTHONPATH=. python bench/bench_flower_floor.py --pairs 3 --plan runs/floor-plan.json --json out.json

Both use ``--clients 5 --fraction 0.08 --dim 32`` unless told otherwise (``--deploy-args``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPLOY_ARGS = ["--clients", "5", "--fraction", "0.08", "--dim", "32"]

PROBE_MODULE = '''
"""Records every envelope secure-afl's ServerApp sends and receives (bench_flower_floor --probe)."""
import json, os
from secure_afl.deploy import apps
from secure_afl.deploy.wire import to_record_dict

PLAN = os.environ["SECURE_AFL_FLOOR_PLAN"]
_exchange = apps.GridTransport.exchange


def _size(envelope):
    return len(envelope.payload) + sum(int(a.nbytes) for a in envelope.arrays.values()) + len(
        json.dumps(envelope.meta, default=str))


def exchange(self, outgoing, group, timeout):
    nodes = sorted(outgoing)
    replies = _exchange(self, outgoing, group, timeout)
    with open(PLAN, "a") as handle:
        handle.write(json.dumps({
            "group": group,
            "sent": [_size(outgoing[n]) for n in nodes],
            "replies": [_size(replies[n]) if n in replies else None for n in nodes],
        }) + "\\n")
    return replies


apps.GridTransport.exchange = exchange
server_app = apps.server_app
client_app = apps.client_app
'''

FLOOR_MODULE = '''
"""A bare Flower app: the ServerApp sends the plan's messages, the ClientApp answers with bytes."""
import json, time
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    plan = json.loads(open(str(context.run_config["plan"])).read())
    nodes_wanted = int(context.run_config["nodes"])
    for _ in range(3000):
        nodes = sorted(int(n) for n in grid.get_node_ids())
        if len(nodes) >= nodes_wanted:
            break
        time.sleep(0.2)
    for step in plan:
        messages = []
        for node, sent, reply in zip(nodes, step["sent"], step["replies"]):
            content = RecordDict({"m": ConfigRecord({"blob": b"x" * sent, "reply": reply or 0})})
            messages.append(Message(content, dst_node_id=node, message_type="query", group_id=step["group"]))
        pending = set(grid.push_messages(messages))
        for _ in range(3000):
            for reply in grid.pull_messages(list(pending)):
                pending.discard(reply.metadata.reply_to_message_id)
            if not pending:
                break
            time.sleep(0.2)
        print(f"floor: {step['group']} done", flush=True)


@client_app.query()
def query(message: Message, context: Context) -> Message:
    size = int(message.content["m"]["reply"])
    return Message(RecordDict({"m": ConfigRecord({"blob": b"y" * size})}), reply_to=message)
'''


def _pyproject(name: str, module: str, config: dict[str, object]) -> str:
    lines = [
        "[build-system]", 'requires = ["setuptools>=68"]', 'build-backend = "setuptools.build_meta"', "",
        "[project]", f'name = "{name}"', 'version = "1.0.0"', 'license = "Apache-2.0"',
        "dependencies = []", "", "[tool.flwr.app]", 'publisher = "bench"', "",
        "[tool.flwr.app.components]", f'serverapp = "{module}:server_app"',
        f'clientapp = "{module}:client_app"', "", "[tool.flwr.app.config]",
    ]  # fmt: skip
    lines += [f"{key} = {json.dumps(value)}" for key, value in config.items()]
    return "\n".join(lines) + "\n"


def probe(plan_path: Path, deploy_args: list[str]) -> None:
    """One deploy local whose ServerApp is wrapped by the recording module."""
    from secure_afl.deploy import local

    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        module_dir = Path(tmp)
        (module_dir / "floor_probe.py").write_text(PROBE_MODULE)
        write_app = local.write_app

        def probing_app(directory: Path, run_config):  # type: ignore[no-untyped-def]
            path = write_app(directory, run_config)
            toml = path / "pyproject.toml"
            toml.write_text(toml.read_text().replace("secure_afl.deploy.apps:", "floor_probe:"))
            return path

        local.write_app = probing_app
        os.environ["PYTHONPATH"] = os.pathsep.join([str(module_dir), os.environ.get("PYTHONPATH", "")])
        os.environ["SECURE_AFL_FLOOR_PLAN"] = str(plan_path) + ".lines"
        from secure_afl.cli import main

        try:
            main(["deploy", "local", *deploy_args, "--out", str(module_dir / "out")], standalone_mode=False)
        finally:
            local.write_app = write_app
    lines = Path(str(plan_path) + ".lines").read_text().splitlines()
    plan = [json.loads(line) for line in lines]
    plan_path.write_text(json.dumps(plan, indent=1))
    Path(str(plan_path) + ".lines").unlink()
    sent = sum(len(step["sent"]) for step in plan)
    print(f"plan: {len(plan)} rounds, {sent} messages, {sum(sum(s['sent']) for s in plan)} bytes sent, "
          f"{sum(sum(r or 0 for r in s['replies']) for s in plan)} bytes back -> {plan_path}")  # fmt: skip


def floor(plan_path: Path, clients: int) -> dict[str, float]:
    """The bare app through SuperLink + SuperNodes + flwr run, as deploy local starts them."""
    from secure_afl.deploy.processes import (
        CHILD_ENV,
        READY_SUPERLINK,
        READY_SUPERNODE,
        ProcessGroups,
        flower_bin,
        free_port,
        wait_for_log,
    )

    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        app = work / "app"
        app.mkdir()
        (app / "floor_app.py").write_text(FLOOR_MODULE)
        (app / "pyproject.toml").write_text(
            _pyproject("flower-floor", "floor_app", {"plan": str(plan_path), "nodes": clients})
        )
        home = work / "flwr-home"
        home.mkdir()
        port = free_port()
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        env = {**os.environ, **CHILD_ENV, "FLWR_HOME": str(home)}
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = os.pathsep.join([str(app), env.get("PYTHONPATH", "")])
        children = ProcessGroups(env)
        started = time.perf_counter()
        try:
            link = children.start(
                "superlink",
                [flower_bin("flower-superlink"), "--disable-runtime-dependency-installation", "--insecure",
                 "--host", "127.0.0.1", "--port", str(port)],
                work / "superlink.log",
            )  # fmt: skip
            wait_for_log(link, READY_SUPERLINK, 120, "the SuperLink")
            nodes = [
                children.start(
                    f"node-{k}",
                    [
                        flower_bin("flower-supernode"),
                        "--superlink",
                        f"127.0.0.1:{port}",
                        "--insecure",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(free_port()),
                        "--node-config",
                        f"index={k}",
                    ],
                    work / f"supernode-{k}.log",
                    env={**env, "FLWR_HOME": str(work / f"home-{k}")},
                )
                for k in range(clients)
            ]
            for node in nodes:
                wait_for_log(node, READY_SUPERNODE, 120, node.name)
            seconds["startup"] = time.perf_counter() - started
            stage = time.perf_counter()
            run = children.start("flwr run", [flower_bin("flwr"), "run", str(app), "local", "--stream"],
                                 work / "flwr-run.log")  # fmt: skip
            code = run.process.wait(timeout=900)
            seconds["flwr run"] = time.perf_counter() - stage
            text = run.log.read_text(errors="replace")
            if code != 0 or text.count("floor: ") < len(json.loads(plan_path.read_text())):
                raise SystemExit(f"the floor run failed (exit {code}):\n{run.tail(30)}")
        finally:
            children.stop_all()
    seconds["total"] = seconds["startup"] + seconds["flwr run"]
    return seconds


def deploy_local(deploy_args: list[str]) -> dict[str, float]:
    """The real command, as a user runs it; stages from its own printed timings."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            str(Path(sys.executable).parent / "secure-afl"),
            "deploy",
            "local",
            *deploy_args,
            "--out",
            tmp,
        ]
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=os.environ.copy())
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"deploy local failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    seconds = {}
    for line in done.stdout.splitlines():  # the command's "Seconds per stage" table
        cells = [c.strip() for c in re.split(r"[│|┃]", line) if c.strip()]
        if len(cells) == 2 and re.fullmatch(r"[0-9.]+", cells[1]):
            seconds[cells[0]] = float(cells[1])
    if "flwr run" not in seconds or "startup" not in seconds:
        raise SystemExit(f"no stage seconds in deploy local's output:\n{done.stdout[-3000:]}")
    seconds["command wall"] = wall
    seconds["total"] = seconds.get("startup", 0.0) - seconds.get("keys, roster, certificates", 0.0)
    seconds["total"] += seconds.get("flwr run", 0.0)
    return seconds


def _children_cpu() -> float:
    """CPU seconds of this process's finished, waited-for descendants (each reaps its own)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(side, *args):  # type: ignore[no-untyped-def]
    before = _children_cpu()
    seconds = side(*args)
    seconds["cpu"] = _children_cpu() - before
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", type=Path, default=Path(tempfile.gettempdir()) / "flower-floor-plan.json")
    parser.add_argument("--probe", action="store_true", help="record the plan from one deploy local")
    parser.add_argument("--pairs", type=int, default=0, help="interleaved floor / deploy local pairs")
    parser.add_argument("--deploy-args", default=" ".join(DEPLOY_ARGS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    deploy_args = args.deploy_args.split()
    if not args.probe and not args.pairs:
        parser.error("nothing to do: give --probe (record the plan), --pairs K (measure), or both")
    if args.pairs and not args.probe and not args.plan.is_file():
        parser.error(f"no plan at {args.plan}: record one first with --probe --plan {args.plan}")
    if args.probe:
        probe(args.plan, deploy_args)
    clients = int(deploy_args[deploy_args.index("--clients") + 1]) if "--clients" in deploy_args else 5
    runs: list[dict[str, dict[str, float]]] = []
    for k in range(args.pairs):
        pair = {"floor": timed(floor, args.plan, clients), "deploy local": timed(deploy_local, deploy_args)}
        runs.append(pair)
        f, d = pair["floor"], pair["deploy local"]
        print(f"pair {k + 1}: floor {f['startup']:.1f} + {f['flwr run']:.1f} s; deploy local "
              f"{d['total'] - d.get('flwr run', 0):.1f} + {d.get('flwr run', 0):.1f} s "
              f"(command {d['command wall']:.1f} s); ratio {d['total'] / f['total']:.2f}x, flwr run "
              f"{d.get('flwr run', 0) / f['flwr run']:.2f}x; CPU {f['cpu']:.1f} s against {d['cpu']:.1f} s "
              f"(the command's, data and reference simulation included)", flush=True)  # fmt: skip
    if runs:
        ratios = [r["deploy local"]["total"] / r["floor"]["total"] for r in runs]
        run_ratios = [r["deploy local"]["flwr run"] / r["floor"]["flwr run"] for r in runs]
        cpu_ratios = [r["deploy local"]["cpu"] / r["floor"]["cpu"] for r in runs]
        print(f"median ratio (SuperLink start to end of flwr run): {statistics.median(ratios):.2f}x; "
              f"flwr run alone {statistics.median(run_ratios):.2f}x; "
              f"CPU {statistics.median(cpu_ratios):.2f}x")  # fmt: skip
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {"runs": runs, "ratios": ratios, "run_ratios": run_ratios, "cpu_ratios": cpu_ratios},
                    indent=1,
                )
            )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
