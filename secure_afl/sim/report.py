"""Reports of an experiment: a Table II-style console table, results.json and report.md."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from secure_afl.privacy.dp_config import DERIVABLE_RIDGES
from secure_afl.privacy.exposure import tensor_kind, value_family
from secure_afl.privacy.guarantees import ROUND_TWO, guarantee
from secure_afl.privacy.policy import active_threshold, majority_threshold, threat_model
from secure_afl.sim.audit import PrivacyAudit, trust_models
from secure_afl.sim.baselines import FAMILY
from secure_afl.sim.data import CLASSES
from secure_afl.sim.runner import FEDAVG, FEDNCA
from secure_afl.sim.setting import AFL_1, ExperimentResult, SettingResult, SimConfig

FIGURE = "figure.png"


def method_type(method: str) -> str:
    """Table II's "Type" column."""
    if method == FEDAVG:
        return "Base"
    if method == FEDNCA:
        return "Related"  # the seeds' related method, not one of Table II's
    return FAMILY.get(method, "Analytic")


def _fmt(metric: str, value: float) -> str:
    if value != value:  # NaN
        return "n/a"
    return f"{value:.4f}" if metric == "map" else f"{100 * value:.2f}"


def _methods(result: ExperimentResult) -> list[str]:
    seen: list[str] = []
    for setting in result.settings:
        for name in setting.metrics:
            if name not in seen:
                seen.append(name)
    return seen


def results_table_rows(result: ExperimentResult) -> tuple[list[str], list[list[str]]]:
    """Table II's layout: Type, Method, then BACC / AUC / mAP per missing setting."""
    header = ["Type", "Method"]
    for s in result.settings:
        header += [f"M{s.missing} BACC", f"M{s.missing} AUC", f"M{s.missing} mAP"]
    rows = []
    for method in _methods(result):
        row = [method_type(method), method]
        for s in result.settings:
            macro = s.metrics[method].macro if method in s.metrics else {}
            row += [_fmt(m, macro.get(m, float("nan"))) for m in ("bacc", "auc", "map")]
        rows.append(row)
    return header, rows


SHORT_NAMES = dict(zip(CLASSES, ("Atel", "Card", "Effu", "Infi", "Mass", "Nodu", "Pna", "Ptx"), strict=True))


def coverage_rows(setting: SettingResult, *, short: bool = False) -> tuple[list[str], list[list[str]]]:
    """Clients × classes, '✓' where the client labels the class, and |S_c| per class."""
    names = CLASSES[: setting.assignment.n_classes]
    header = ["Client", *(SHORT_NAMES.get(c, c) if short else c for c in names)]
    rows = [
        [f"client-{k}", *("✓" if c in active else "·" for c in range(setting.assignment.n_classes))]
        for k, active in enumerate(setting.assignment.active)
    ]
    rows.append(["|S_c|", *(str(len(s)) for s in setting.assignment.coverage())])
    return header, rows


def rich_table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 or name == "Method" else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _cost_rows(result: ExperimentResult) -> tuple[list[str], list[list[str]]]:
    header = ["Phase", "Seconds"]
    rows = [[phase, f"{seconds:.2f}"] for phase, seconds in result.seconds.items()]
    rows.append(["total", f"{sum(result.seconds.values()):.2f}"])
    return header, rows


def method_seconds_rows(result: ExperimentResult) -> tuple[list[str], list[list[str]]]:
    """Wall seconds of each gradient method per missing setting (baselines: in their worker)."""
    header = ["Method", *(f"M{s.missing} s" for s in result.settings)]
    names: list[str] = []
    for s in result.settings:
        names += [n for n in s.method_seconds if n not in names]
    rows = [
        [
            name,
            *(f"{s.method_seconds[name]:.1f}" if name in s.method_seconds else "-" for s in result.settings),
        ]
        for name in names
    ]
    return header, rows


def _upload_rows(setting: SettingResult) -> tuple[list[str], list[list[str]]]:
    return ["Client", "Upload (MB)"], [[c, f"{b / 1e6:.2f}"] for c, b in setting.upload_bytes.items()]


PROTOCOL_ROUNDS = ("R0", "R1", "R2", "R3", "R4")


def _rounds(costs: dict[str, object]) -> tuple[str, ...]:
    """The protocol's rounds as the costs list them (R0..R4 in both backends)."""
    server = costs.get("server_seconds") or {}
    return tuple(server) or PROTOCOL_ROUNDS  # type: ignore[arg-type]


def protocol_cost_rows(costs: dict[str, object]) -> tuple[list[str], list[list[str]]]:
    """Per round: bytes each client sent and received (mean and max over clients), and seconds."""
    header = ["Round", "sent kB (mean/max)", "received kB (mean/max)", "client s (mean/max)", "server s"]
    rows = []
    for r in _rounds(costs):
        sent = [per_round.get(r, 0) / 1e3 for per_round in costs["bytes_sent"].values()]
        received = [per_round.get(r, 0) / 1e3 for per_round in costs["bytes_received"].values()]
        seconds = [per_round.get(r, 0.0) for per_round in costs["client_seconds"].values()]
        rows.append(
            [
                r,
                f"{sum(sent) / len(sent):.1f} / {max(sent):.1f}",
                f"{sum(received) / len(received):.1f} / {max(received):.1f}",
                f"{sum(seconds) / len(seconds):.3f} / {max(seconds):.3f}",
                f"{costs['server_seconds'].get(r, 0.0):.3f}",
            ]
        )
    return header, rows


def protocol_cost_rows_per_party(costs: dict[str, object]) -> tuple[list[str], list[list[str]]]:
    """Per client and per round: bytes sent / received and seconds; then the server's seconds."""
    rounds = _rounds(costs)
    header = ["Party", *(f"{r} sent / received B, s" for r in rounds)]
    rows = []
    for client, sent in costs["bytes_sent"].items():
        received, seconds = costs["bytes_received"][client], costs["client_seconds"][client]
        rows.append(
            [
                client,
                *(f"{sent.get(r, 0):,} / {received.get(r, 0):,}, {seconds.get(r, 0.0):.3f}" for r in rounds),
            ]
        )
    server = costs["server_seconds"]
    rows.append(["server", *(f"{server.get(r, 0.0):.3f}" for r in rounds)])
    return header, rows


def backend_comparison_rows(setting: SettingResult) -> tuple[list[str], list[list[str]]]:
    """Per AFL aggregation and protection: bytes up/down per client and seconds, beside plaintext.

    Bytes and client seconds are means over clients; plaintext is each client's float64 upload
    (symmetric matrices as triangles) with nothing received and no protocol time.
    """
    header = ["Aggregation", "Protection", "Round", "up kB/client", "down kB/client", "client s", "server s"]
    clients = max(1, len(setting.upload_bytes))
    rows = [
        ["all", "plaintext", "-", f"{sum(setting.upload_bytes.values()) / clients / 1e3:.1f}", "0", "0", "0"]
    ]
    for name, costs in (setting.protocol_costs or {}).items():
        if not costs:
            continue
        protection = str(costs.get("protection", ""))
        n = max(1, len(costs["bytes_sent"]))  # type: ignore[arg-type]
        for r in (*_rounds(costs), "total"):

            def mean(key: str, r: str = r, costs: dict = costs, n: int = n) -> float:
                per_client = costs[key].values()
                if r == "total":
                    return sum(sum(v.values()) for v in per_client) / n
                return sum(v.get(r, 0) for v in per_client) / n

            server = costs["server_seconds"]  # type: ignore[index]
            rows.append(
                [
                    name.split(" (")[0],
                    protection,
                    r,
                    f"{mean('bytes_sent') / 1e3:.1f}",
                    f"{mean('bytes_received') / 1e3:.1f}",
                    f"{mean('client_seconds'):.3f}",
                    f"{(sum(server.values()) if r == 'total' else server.get(r, 0.0)):.3f}",  # type: ignore[attr-defined]
                ]
            )
    return header, rows


def _several_protections(setting: SettingResult) -> bool:
    return len({str(c.get("protection")) for c in (setting.protocol_costs or {}).values() if c}) > 1


def _protocol_tables(setting: SettingResult) -> list[tuple[str, list[str], list[list[str]]]]:
    if not setting.protocol_costs:
        return []
    return [
        (f"Protocol costs, missing {setting.missing}, {name}", *protocol_cost_rows(costs))
        for name, costs in setting.protocol_costs.items()
        if costs
    ]


def _pseudo_label_lines(setting: SettingResult) -> list[str]:
    lines = []
    for what, pairs in (
        ("paper's τ on σ(h·w)", setting.pseudo_labels),
        ("rescaled τ: ±1 = mean training score of S_c's positives/negatives", setting.pseudo_labels_rescaled),
    ):
        reports = [r for _, r in pairs]
        if not reports:
            continue
        qualified = sum(r.qualified for r in reports)
        lines.append(
            f"Round 2 ({what}), missing {setting.missing}: {qualified} of {len(reports)} (client, missing "
            f"class) pairs qualified for pseudo-labels; largest counts: "
            f"{max(r.n_pseudo_pos for r in reports)} pseudo-positive, "
            f"{max(r.n_pseudo_neg for r in reports)} pseudo-negative"
        )
    return lines


def _undefined_balance_lines(setting: SettingResult) -> list[str]:
    """Loud lines for every labelled class where Eq. 9 is undefined (see analytic.py's convention)."""
    lines = []
    for client, c, why in setting.undefined_balance:
        name = CLASSES[c] if c < len(CLASSES) else str(c)
        if client == "S_c":
            lines.append(
                f"WARNING: missing {setting.missing}: {name} has {why} sample across all its annotating "
                f"clients: Eq. 9 is undefined, the empty side is dropped"
                + (" and AFL predicts it all-negative" if why == "no positive" else "")
            )
        else:
            lines.append(
                f"WARNING: missing {setting.missing}: {client} labels {name} but has {why} sample there: "
                "Eq. 9 is undefined for it, its empty side is dropped"
            )
    return lines


def coverage_title(setting: SettingResult) -> str:
    draws = {
        "diagonal": "client i labels class i",
        "permutation": "withheld classes a random permutation",
        "random": "random classes per client, redrawn until every class is covered",
    }
    draw = setting.assignment.draw
    return f"Class coverage, missing {setting.missing} ({draws.get(draw, draw)})"


def method_exposure_rows(setting: SettingResult) -> tuple[list[str], list[list[str]]]:
    """Per method: its single-member groups, and what overlapping groups expose, had it run alone."""
    header = ["Method", "single-member groups", "individual values exposed by overlapping groups"]
    rows = []
    for method, audit in setting.method_audits.items():
        if audit.protection == "none":
            rows.append([method, "-", "everything (plaintext)"])
            continue
        alone = [g.group for g in audit.single_member_groups()]
        overlap = audit.exposed_by_overlap()
        tensors = sorted({t.split("/")[0] for t in overlap})
        clients = sorted({c for cs in overlap.values() for c in cs})
        rows.append(
            [
                method,
                str(len(alone)),
                f"{', '.join(tensors)} of {len(clients)} client(s)" if overlap else "none",
            ]
        )
    for method in setting.metrics:
        if method_type(method) != "Analytic":
            rows.append([method, "-", gradient_method_exposure(method)])
    return header, rows


def _privacy_lines(setting: SettingResult) -> list[str]:
    if not setting.privacy:
        return []
    from secure_afl.sim.private import privacy_lines

    return privacy_lines(setting.privacy)


def threat_model_line(config: SimConfig) -> str:
    """Which server this run's parameters defend against (its clients use the simulator's policy)."""
    n = config.n_clients
    t = majority_threshold(n) if config.threshold is None else config.threshold
    model = threat_model(n, t, config.min_group_size, refuse_exposure=False)
    return (
        f"Threat model these parameters defend: {model} server (t = {t} of {n}, minimum group size "
        f"{config.min_group_size}, clients report exposures instead of refusing). An active server needs "
        f"t >= {active_threshold(n)}, groups of at least 2 and clients that refuse exposing sessions "
        f"(ClientPolicy.deployment(); --client-policy deployment shows what they would refuse)."
    )


def guarantee_lines(config: SimConfig) -> list[str]:
    """What each protection of the run guarantees (privacy.guarantees, the one source): under the
    simulator policy its clients ran, under the deployment policy too with ``--client-policy
    deployment``; and, with round 2 under a protection, what a coordinator choosing the teacher learns."""
    protections = config.secure.split(",")
    lines = [guarantee(p, "simulator").line() for p in protections]
    if config.client_policy == "deployment":
        where = "for the layouts deployed clients accept"
        lines += [guarantee(p, "deployment").line(where) for p in protections]
    if config.rounds == 2 and config.secure != "none":
        lines.append(ROUND_TWO)
    return lines


# The deployment's classifier check (SECURITY.md §5.1) as bench/bench_verify.py measured it in process
# (the deployment's server and node handler, no Flower): 8 clients × 5,889 rows, 8 classes, masking,
# one round, at 968e87f on 2026-12-07, this process's CPU seconds; bench/README.md's bench_verify.py
# section holds the runs (tests/test_sim_classifier_check.py keeps the two equal).  The simulator
# does not run the check: the simulation sits below the deployment in pyproject's layers, and
# a run's Grams go as they are sent (bench_large.py's peak), so none is left once the classifier exists.
CHECK_RUNS = {
    1024: ((0.271, 5.239), (0.269, 5.894)),
    2048: ((0.423, 10.590), (0.489, 11.813)),
}  # (check, session)
CHECK_COMMAND = "python bench/bench_verify.py --dims {dim} --clients 8 --classes 8 --rows 5889"
CHECK_STAMP = "commit 968e87f, 2026-12-07"
# Through Flower at the paper's size (the first of two runs per d, d5784a7, 2026-12-07, this 2-core host): the
# check's one relay round and the session, wall seconds (report.json's "seconds": "verify", "federation").
CHECK_FLOWER = {1024: (12.5, 77.98), 2048: (14.47, 75.88)}
CHECK_FLOWER_COMMAND = "secure-afl deploy local --clients 8 --seed 2 --no-tls --fraction 1.0 --dim {dim}"
CHECK_FLOWER_STAMP = "commit d5784a7, 2026-12-07, one run on a shared 2-core host"


def classifier_check(config: SimConfig) -> dict[str, object]:
    """What the deployment's classifier check would cost beside the session of a run like this one
    (results.json's ``classifier_check``; its ``line`` is report.md's), or why it is not offered."""
    head = "Classifier check (SECURITY.md §5.1)"
    protection = config.secure.split(",")[0]  # the protection whose sums fit the reported models
    reason = None
    if protection == "ckks":
        reason = "not offered under CKKS (its sums carry the scheme's noise, beyond the check's tolerance)"
    elif protection == "none":
        reason = "not offered without secure aggregation (--protection none; a deployment masks or encrypts)"
    elif config.dp is not None and config.dp.ridge not in DERIVABLE_RIDGES:
        reason = (
            f"not offered with the {config.dp.ridge} DP ridge (sized from the noisy Gram's smallest "
            "eigenvalue, which no hospital holds, so no hospital can derive it; --dp-ridge bound or adassp "
            "are checked)"
        )
    if reason is not None:
        return {"offered": False, "reason": reason, "measured": None, "line": f"{head}: {reason}."}
    dim = min(CHECK_RUNS, key=lambda d: (abs(d - config.dim), d))
    runs = CHECK_RUNS[dim]
    shares = sorted(100 * check / session for check, session in runs)
    where = f"d = {dim}" if dim == config.dim else f"d = {dim} (this run's d = {config.dim} was not measured)"
    if config.rounds == 2:
        head = "Classifier check (SECURITY.md §5.1; AFL (1 round) only: a two-round study is not checked)"
    command, flower = CHECK_COMMAND.format(dim=dim), CHECK_FLOWER_COMMAND.format(dim=dim)
    line = (
        f"{head}: not run by the simulator (it may not import the deployment, and its clients' "
        f"Grams go as they are sent); measured in process at {where}, 8 clients × 5,889 rows, 8 classes: "
        f"{shares[0]:.1f}–{shares[-1]:.1f} % of the session's CPU seconds (`{command}`, {CHECK_STAMP}); "
        f"through Flower its one relay round took {CHECK_FLOWER[dim][0]} s beside the session's "
        f"{CHECK_FLOWER[dim][1]} s (`{flower}`, {CHECK_FLOWER_STAMP})."
    )
    measured = {
        "dim": dim,
        "check_cpu_s": [check for check, _ in runs],
        "session_cpu_s": [session for _, session in runs],
        "command": command,
        "flower": {"check_s": CHECK_FLOWER[dim][0], "session_s": CHECK_FLOWER[dim][1], "command": flower},
    }
    return {"offered": True, "reason": None, "measured": measured, "line": line}


def client_refusal_rows(setting: SettingResult) -> tuple[list[str], list[list[str]]]:
    """Per method: whether clients under the deployment policy would take part, and if not why."""
    header = ["Method", "deployed clients", "why (first refusal)"]
    rows = []
    for method, refusals in setting.client_refusals.items():
        if not refusals:
            rows.append([method, "accept", "-"])
            continue
        first = refusals[0]
        who = sorted({r.client for r in refusals})
        rows.append([method, f"{len(who)} refuse ({first.round})", f"{first.client}: {first.reason}"])
    return header, rows


def gradient_method_exposure(method: str) -> str:
    """What a gradient baseline reveals in this simulator: no secure aggregation protects it."""
    exposure = (
        "IN THE CLEAR: every client's head (C×(d+1) weights) after every one of its rounds; "
        "this simulator does not run gradient methods through secure aggregation"
    )
    if method == FEDNCA:
        exposure = (
            "IN THE CLEAR: every client's attention head (about 4d² weights, logit scale, class biases) "
            "after every one of its rounds; this simulator does not run gradient methods through "
            "secure aggregation"
        )
    if method == "FedIRM":
        exposure += "; also each client's C×C class relation matrix from round 19"
    return exposure


# What a pair of groups one member apart gives a server with side knowledge (privacy.exposure).
ONE_MEMBER_APART = (
    "larger = smaller + member, over survivors, carrying tensors of the kinds named: a server that knows "
    "the other members' values are equal across the two reads the member's value from the difference of "
    "the sums; such knowledge counts as colluding peers, and nodes do not refuse it"
)


def audit_lines(setting: SettingResult) -> list[str]:
    """report.md's privacy audit: every group, what the server learns, every client's own check."""
    audit = setting.audit
    lines = [f"protection: {audit.protection}"]
    lines += [
        f"trust model ({name}): {model}"
        for name, model in trust_models(audit.protection, audit.client_policy).items()
    ]
    for group in audit.groups:
        lines.append(
            f"{group.group}: members {len(group.members)}, survivors {len(group.survivors)}"
            f" ({', '.join(group.survivors)}); learns sums of {', '.join(group.tensors)}"
        )
    if setting.sent_by_difference:
        derived = "; ".join(
            f"{tensor} of {group} = {derivation}"
            for group, tensors in setting.sent_by_difference.items()
            for tensor, derivation in tensors.items()
        )
        lines.append(
            f"derived from the sums as sent ({_gram_copies(setting)}; the same sums, bit for bit, and "
            f"the wire sums determine exactly what the method's would, SECURITY.md §4): {derived}"
        )
    lines += [f"WARNING: {w}" for w in audit.warnings()]
    for client, findings in sorted(audit.client_findings.items()):
        determined: dict[str, set[str]] = {}
        for finding in findings:
            determined.setdefault(finding.tensor, set()).update(finding.clients)
        seen = "; ".join(f"{t} of {', '.join(sorted(c))}" for t, c in sorted(determined.items()))
        lines.append(
            f"{client}'s own check saw values the sums determine (went on: simulator policy): {seen}"
        )
    if audit.protection != "none":
        lines.append(client_checks_line(audit, setting.dropped))
        apart = "; ".join(p.describe() for p in audit.one_member_apart) or "none"
        lines.append(f"groups one member apart ({ONE_MEMBER_APART}): {apart}")
    if setting.dropped:
        lines.append(f"dropped clients: {', '.join(setting.dropped)}")
    return lines


def chance_line(result: ExperimentResult) -> str:
    """What the table's numbers are against: BACC and AUC 50 %, and a random ranking's mAP, the mean
    prevalence of the classes scored on the run's test labels (per missing level where they differ)."""
    levels: dict[str, list[int]] = {}
    for setting in result.settings:
        chance = next(iter(setting.metrics.values())).chance if setting.metrics else {"map": float("nan")}
        levels.setdefault(_fmt("map", chance["map"]), []).append(setting.missing)
    if len(levels) <= 1:
        maps = next(iter(levels), "n/a")
    else:
        maps = ", ".join(f"{value} at missing {','.join(map(str, m))}" for value, m in levels.items())
    return f"Chance: BACC 50, AUC 50, mAP {maps} (the test labels' mean class prevalence)"


def label_source_name(source: object) -> str:
    """The label table's name without this machine's directories: the path inside its installed
    package (``torchxrayvision/data/…``), or else the file's name."""
    path = Path(str(source))
    if not path.is_absolute():
        return str(source)
    parts = path.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1 :])
    return path.name


def _print_results_table(result: ExperimentResult, console: Console, width: int | None = None) -> None:
    header, rows = results_table_rows(result)
    title = "Results (BACC and AUC in %, mAP as a fraction)"
    if len(header) <= 8:
        console.print(rich_table(title, header, rows), width=width)
    else:  # side by side the settings would not fit a terminal: one block of columns per setting
        for start in range(2, len(header), 3):
            block = [0, 1, start, start + 1, start + 2]
            console.print(
                rich_table(title, [header[i] for i in block], [[row[i] for i in block] for row in rows]),
                width=width,
            )
            title = ""
    console.print(chance_line(result), markup=False, highlight=False, width=width)


# ----------------------------------------------------------------------------------------------
# The terminal's default report: the table, then each fact once, aggregated (--verbose: all of it)
# ----------------------------------------------------------------------------------------------

SUMMARY_WIDTH = 80  # the short report's columns, whatever the terminal's


def _names(names: list[str], most: int = 3) -> str:
    """``a, b, c`` or, for more, the first and last: ``class/0 … class/7``."""
    return ", ".join(names) if len(names) <= most else f"{names[0]} … {names[-1]}"


def _whose(clients: list[str]) -> str:
    """``client-4's``, ``client-1's and client-2's`` or ``6 clients'``."""
    if len(clients) == 1:
        return f"{clients[0]}'s"
    if len(clients) == 2:
        return f"{clients[0]}'s and {clients[1]}'s"
    return f"{len(clients)} clients'"


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 1e6:.2f} MB" if n_bytes >= 1e6 else f"{n_bytes / 1e3:.1f} kB"


def coverage_line(setting: SettingResult) -> str:
    """The class coverage table in one line: the draw and |S_c| per class."""
    sizes = [len(s) for s in setting.assignment.coverage()]
    names = list(SHORT_NAMES.values())
    per_class = ", ".join(f"{names[c] if c < len(names) else c} {n}" for c, n in enumerate(sizes))
    return f"{coverage_title(setting)}: |S_c| {per_class}"


def pseudo_label_summary(setting: SettingResult) -> str | None:
    """Round 2's two pseudo-label counts in one line (None without round 2)."""
    parts = []
    for what, pairs in (
        ("the paper's τ", setting.pseudo_labels),
        ("the rescaled τ", setting.pseudo_labels_rescaled),
    ):
        reports = [r for _, r in pairs]
        if reports:
            parts.append(f"{sum(r.qualified for r in reports)} of {len(reports)} under {what}")
    if not parts:
        return None
    return (
        f"Round 2, missing {setting.missing}: (client, missing class) pairs qualified for "
        f"pseudo-labels: {'; '.join(parts)}"
    )


def undefined_balance_summary(setting: SettingResult) -> str | None:
    """Every labelled class where Eq. 9 is undefined, as one WARNING line (None if there is none)."""
    if not setting.undefined_balance:
        return None
    cases = [
        f"{CLASSES[c] if c < len(CLASSES) else c} at {client} ({why})"
        for client, c, why in setting.undefined_balance
    ]
    return (
        f"WARNING: missing {setting.missing}: Eq. 9 is undefined for {len(cases)} labelled class(es), "
        f"the empty side dropped: {_names(cases, most=2)}"
    )


def _tensor_key(label: str) -> str:
    """A tensor, or several, as the audit and the clients' checks both name it: the names of one
    server-parameterised family (round 2's pseudo tensors, examined together under the adversarial
    rule) are one key, whichever of them a client sends; any other label is itself."""
    families = {value_family(name) for name in label.split(" + ")}
    if len(families) == 1 and next(iter(families)).startswith("family:"):
        return next(iter(families))
    return label


def client_checks_agreement(audit: PrivacyAudit) -> tuple[list[str], list[str], list[str]]:
    """The session's clients by how their own exposure checks compare with the audit, in one
    vocabulary: each client's own values, named as :func:`_tensor_key` names them (a tensor, or a
    server-parameterised family as one value).  (Found exactly the values of its own the audit lists
    as determined, found nothing where the audit lists some (a client that dropped out never checked),
    found something else.)  A client's check decides only whether its own values are determined, so
    what it found of peers is not compared; a finding that needs colluders' values is not in the
    audit's terms (the audit assumes none)."""
    clients = sorted({c for g in audit.groups for c in g.members})
    agree: list[str] = []
    silent: list[str] = []
    other: list[str] = []
    for client in clients:
        listed = {_tensor_key(t) for t, cs in audit.exposed.items() if client in cs}
        findings = audit.client_findings.get(client, ())
        found = {
            _tensor_key(f.tensor) if not f.colluders else f"{f.tensor} (colluders)"
            for f in findings
            if client in f.clients
        }
        survived = any(client in g.survivors for g in audit.groups)
        if not found and (not survived or listed):  # dropped out before its check, or saw nothing
            silent.append(client)
        elif found == listed:
            agree.append(client)
        else:
            other.append(client)
    return agree, silent, other


def client_checks_line(audit: PrivacyAudit, dropped_clients: tuple[str, ...] = ()) -> str:
    """report.md's list of the comparison the terminal counts (:func:`client_checks_agreement`)."""
    agree, silent, other = client_checks_agreement(audit)
    dropped = [c for c in silent if c in dropped_clients]
    parts = [
        ("agree", agree),
        ("dropped out before checking", dropped),
        ("found nothing", [c for c in silent if c not in dropped]),
        ("found other values", other),
    ]
    listed = "; ".join(f"{label}: {', '.join(names)}" for label, names in parts if names)
    return (
        f"clients' own exposure checks against this audit (each client's own values, a round-2 family "
        f"as one value): {listed}"
    )


def _client_checks_sentence(audit: PrivacyAudit, dropped_clients: tuple[str, ...]) -> str:
    agree, silent, other = client_checks_agreement(audit)
    total = len(agree) + len(silent) + len(other)
    text = f" {len(agree)} of {total} clients' own exposure checks agree with this audit"
    dropped = [c for c in silent if c in dropped_clients]
    if dropped:
        text += f"; {len(dropped)} dropped out before theirs"
    if len(silent) > len(dropped):
        text += f"; {len(silent) - len(dropped)} found nothing"
    if other:
        names = f" ({', '.join(other)})" if len(other) <= 3 else ""
        text += f"; {len(other)} found other values{names}, listed in report.md"
    found = len(audit.client_findings)
    return text + (f" ({found} saw exposures and went on: simulator policy)." if found else ".")


def _overlap_sentences(overlap: Mapping[str, tuple[str, ...]]) -> str:
    """What overlapping group sums determine, in at most two WARNING sentences: the individual values
    by kind, and round 2's values (server-parameterised families) by family; how many tensors and
    how many clients (report.md names every tensor)."""
    sentences = []
    for linked in (False, True):
        kinds: dict[str, set[str]] = {}  # kind -> its tensors
        whose: set[str] = set()
        for label, clients in overlap.items():
            key = _tensor_key(label)
            if key.startswith("family:") != linked:
                continue
            kinds.setdefault(key.removeprefix("family:") if linked else tensor_kind(label), set()).update(
                label.split(" + ")
            )
            whose.update(clients)
        if not kinds:
            continue
        named = ", ".join(
            f"{kind} ({len(tensors)} tensors)" if len(tensors) > 1 else next(iter(tensors))
            for kind, tensors in sorted(kinds.items())
        )
        if linked:
            sentences.append(
                f"WARNING: for a server that chose round 2's teacher adversarially, the sums determine "
                f"the round-2 values {named} of {len(whose)} client(s) (report.md names them)."
            )
        else:
            sentences.append(
                f"WARNING: overlapping group sums determine the individual {named} of {len(whose)} "
                "client(s) (sum such a tensor in one all-clients group: gram='global')."
            )
    return "".join(f" {sentence}" for sentence in sentences)


def privacy_verdict(setting: SettingResult) -> str:
    """One paragraph: what the server learns at this setting, aggregated over the audit's groups."""
    audit = setting.audit
    private = bool(setting.privacy)  # --dp-epsilon: every client noised its values before sending
    exactly = "with only that client's own DP noise on them" if private else "exactly"
    head = f"Privacy, missing {setting.missing} ({audit.protection}): "
    if audit.protection == "none":
        text = head + "WARNING: plaintext run: the server receives every client's statistics individually"
        text += " (each noised: differential privacy above)." if private else "."
    else:
        groups = list(audit.groups)
        clients = sorted({c for g in groups for c in g.members})
        alone = audit.single_member_groups()
        carriers = audit.single_member_complements()  # counted with the overlap below
        classes = [g for g in groups if g.group.startswith("class/")]
        if alone:
            lone = sorted({g.survivors[0] for g in alone})
            if [g.group for g in alone] == [g.group for g in classes]:
                what = "every class group has one member"
            else:
                verb = "has" if len(alone) == 1 else "have"
                what = f"{len(alone)} of {len(groups)} groups {verb} one surviving member"
            whose = "each client's" if lone == clients else _whose(lone)
            scope = "class statistics" if all(g in classes for g in alone) else "statistics in them"
            text = (
                head + f"WARNING: {what} ({_names([g.group for g in alone])}): the server learns "
                f"{whose} {scope} {exactly}; no aggregation can hide them."
            )
            rest = [g for g in groups if len(g.survivors) > 1]
            if rest:
                sizes = sorted({len(g.survivors) for g in rest})
                span = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}–{sizes[-1]}"
                others = "other " if not carriers else ""
                text += f" The {others}{len(rest)} groups of two or more sum over {span} clients each."
        else:
            fewest = min(len(g.survivors) for g in groups)
            text = head + f"every one of the {len(groups)} groups sums over at least {fewest} clients."
        overlap = audit.exposed_by_overlap()
        if overlap:
            text += _overlap_sentences(overlap)
            if carriers:
                text += (
                    f" {len(carriers)} complement group(s) ({_names([g.group for g in carriers])}) carry one "
                    "client's Gram each, sent by difference, which those sums determine anyway."
                )
        else:
            text += " No combination of overlapping group sums singles out any other value."
        text += _client_checks_sentence(audit, setting.dropped)
        apart = audit.one_member_apart
        if apart:
            text += (
                f" {len(apart)} pair(s) of groups are one member apart (report.md names them): a server "
                "that knows the other members' values are equal across a pair reads that member's value."
            )
    if setting.dropped:
        text += f" Dropped: {', '.join(setting.dropped)}."
    clear = [m for m in setting.metrics if method_type(m) != "Analytic"]
    if clear:
        who = _names(clear, most=2) if len(clear) <= 2 else f"{clear[0]} and {len(clear) - 1} other methods"
        text += f" {who}: every client's head goes to the server in the clear, every round."
    return text


def refusal_summary(setting: SettingResult) -> str | None:
    """--client-policy deployment: which methods' layouts deployed clients would refuse (one line)."""
    if not setting.client_refusals:
        return None
    refused = [m for m, r in setting.client_refusals.items() if r]
    if not refused:
        return f"Deployed clients (missing {setting.missing}) accept every method's layout."
    first = setting.client_refusals[refused[0]][0]
    reason = first.reason if len(first.reason) <= 100 else first.reason[:99] + "…"
    return (
        f"Deployed clients (missing {setting.missing}) refuse {len(refused)} of "
        f"{len(setting.client_refusals)} methods' layouts (report.md says why); first: {refused[0]}, "
        f"{first.client}: {reason}"
    )


def cost_summary(setting: SettingResult) -> str:
    """Bytes and protocol seconds of one setting, as means over clients, in one line."""
    uploads = list(setting.upload_bytes.values())
    text = (
        f"Costs, missing {setting.missing}: each client would upload "
        f"{_size(sum(uploads) / max(1, len(uploads)))} unprotected"
    )
    sessions = []
    for name, costs in (setting.protocol_costs or {}).items():
        if not costs:
            continue
        n = max(1, len(costs["bytes_sent"]))  # type: ignore[arg-type]

        def mean(key: str, costs: dict = costs, n: int = n) -> float:
            return sum(sum(v.values()) for v in costs[key].values()) / n

        server = sum(costs["server_seconds"].values())  # type: ignore[attr-defined]
        plan = f" ({_gram_copies(setting)})" if name == "round1" and setting.sent_by_difference else ""
        sessions.append(
            f"{name}{plan} {_size(mean('bytes_sent'))} sent, {_size(mean('bytes_received'))} received, "
            f"{mean('client_seconds'):.2f} s per client, {server:.2f} s at the server"
        )
    return text + ("; " + "; ".join(sessions) if sessions else "") + "."


def _gram_copies(setting: SettingResult) -> str:
    copies = setting.gram_copies
    sent = f"{copies['sent']:g} cop{'y' if copies['sent'] == 1 else 'ies'}"
    return f"the Gram: {sent} per client, not {copies['method']:g}"


def seconds_summary(result: ExperimentResult) -> str:
    total = sum(result.seconds.values())
    longest = sorted(result.seconds.items(), key=lambda kv: -kv[1])[:3]
    text = f"Seconds: {total:.1f} s of phases ({', '.join(f'{p} {s:.1f}' for p, s in longest)})"
    per_method: dict[str, float] = {}
    for setting in result.settings:
        for name, seconds in setting.method_seconds.items():
            per_method[name] = per_method.get(name, 0.0) + seconds
    if per_method:
        name, seconds = max(per_method.items(), key=lambda kv: kv[1])
        which = name if len(per_method) == 1 else f"the longest of {len(per_method)}, {name}"
        text += f"; gradient methods train beside them ({which}: {seconds:.1f} s)"
    return text + "."


DETAILS_LINE = (
    "report.md and results.json hold the full audit (every group, every client's own check), the "
    "costs per round and party, and the seconds; --verbose prints them here."
)


def print_summary(result: ExperimentResult, console: Console) -> None:
    """The default terminal report: the results table, then per setting each fact once, aggregated;
    at most :data:`SUMMARY_WIDTH` columns."""
    width = min(console.width, SUMMARY_WIDTH)

    def say(text: str, style: str = "") -> None:
        console.print(text, style=style, markup=False, highlight=False, width=width)

    _print_results_table(result, console, width)
    if result.notice:
        say(result.notice, "bold yellow")
    for setting in result.settings:
        say(coverage_line(setting))
        for line in (pseudo_label_summary(setting), undefined_balance_summary(setting)):
            if line:
                say(line, "bold red" if line.startswith("WARNING") else "")
        for line in _privacy_lines(setting):
            say(line)
        if _several_protections(setting):
            h, r = backend_comparison_rows(setting)
            console.print(
                rich_table(f"Protections side by side, missing {setting.missing}", h, r), width=width
            )
        verdict = privacy_verdict(setting)
        say(verdict, "bold red" if "WARNING" in verdict else "")
        refusals = refusal_summary(setting)
        if refusals:
            say(refusals)
        say(cost_summary(setting))
    say(threat_model_line(result.config))
    for line in guarantee_lines(result.config):
        say(line)
    say(seconds_summary(result))
    say(DETAILS_LINE, "dim")


def print_report(result: ExperimentResult, console: Console, *, verbose: bool = False) -> None:
    """The terminal report: :func:`print_summary`, or with ``verbose`` every table and audit line."""
    if not verbose:
        print_summary(result, console)
        return
    if result.notice:
        console.print(f"[bold yellow]{result.notice}[/]")
    _print_results_table(result, console)
    for setting in result.settings:
        for line in _pseudo_label_lines(setting):
            console.print(line, markup=False, highlight=False)
        for line in _undefined_balance_lines(setting):
            console.print(line, style="bold red", markup=False, highlight=False)
        h, r = coverage_rows(setting, short=True)
        console.print(rich_table(coverage_title(setting), h, r))
        legend = ", ".join(f"{short} = {name}" for name, short in SHORT_NAMES.items())
        console.print(legend, style="dim", markup=False, highlight=False)
        h, r = _upload_rows(setting)
        console.print(
            rich_table(
                "Bytes each client would upload unprotected (all compared methods), missing "
                f"{setting.missing}",
                h,
                r,
            )
        )
        for title, h, r in _protocol_tables(setting):
            console.print(rich_table(title, h, r))
        for line in _privacy_lines(setting):
            console.print(line, markup=False, highlight=False)
        if _several_protections(setting):
            h, r = backend_comparison_rows(setting)
            console.print(rich_table(f"Protections side by side, missing {setting.missing}", h, r))
        h, r = method_exposure_rows(setting)
        console.print(rich_table(f"What each method alone reveals, missing {setting.missing}", h, r))
        if setting.client_refusals:
            h, r = client_refusal_rows(setting)
            console.print(rich_table(f"Layouts a deployed client refuses, missing {setting.missing}", h, r))
        console.print(
            f"[bold]Privacy audit of this run (all methods' statistics), missing {setting.missing}[/]"
        )
        for line in audit_lines(setting):
            style = "bold red" if line.startswith("WARNING") else ""
            console.print(f"  {line}", style=style, markup=False, highlight=False)
    console.print(threat_model_line(result.config), markup=False, highlight=False)
    for line in guarantee_lines(result.config):
        console.print(line, markup=False, highlight=False)
    h, r = _cost_rows(result)
    console.print(rich_table("Seconds per phase", h, r))
    h, r = method_seconds_rows(result)
    console.print(rich_table("Seconds per gradient method", h, r))


def result_dict(result: ExperimentResult) -> dict[str, object]:
    config = result.config
    return {
        "notice": result.notice,
        "dataset": dict(result.dataset),
        "config": {
            "missing": list(config.missing),
            "rounds": config.rounds,
            "seed": config.seed,
            "gamma": config.gamma,
            "n_clients": config.n_clients,
            "split": config.split,
            "missing1": config.missing1,
            "fraction": config.fraction,
            "secure": config.secure,
            "dropout": config.dropout,
            "dropout_stage": config.dropout_stage,
            "client_policy": config.client_policy,
            "threat_model": threat_model_line(config),
            "guarantees": guarantee_lines(config),
            "ckks_poly_degree": config.ckks_poly_degree,
            "pseudo": asdict(config.pseudo),
            "fedavg": asdict(config.fedavg),
            "baselines": list(config.baselines),
            "baseline": asdict(config.baseline),
        },
        "classes": list(CLASSES),
        "classifier_check": classifier_check(config),
        "seconds_per_phase": dict(result.seconds),
        "settings": [
            {
                "missing": s.missing,
                "assignment_draw": s.assignment.draw,
                "active_classes": [list(a) for a in s.assignment.active],
                "coverage": [list(c) for c in s.assignment.coverage()],
                "metrics": {name: m.to_dict() for name, m in s.metrics.items()},
                "dropped": list(s.dropped),
                "upload_bytes": dict(s.upload_bytes),
                "privacy_audit": s.audit.to_dict(),
                "privacy_by_method": {
                    method: {
                        "single_member_groups": [g.group for g in a.single_member_groups()],
                        "exposed_by_overlapping_groups": {
                            t: list(c) for t, c in a.exposed_by_overlap().items()
                        },
                    }
                    for method, a in s.method_audits.items()
                },
                "pseudo_labels": [
                    {
                        "client": client,
                        "class": CLASSES[r.cls],
                        "pseudo_positive": r.n_pseudo_pos,
                        "pseudo_negative": r.n_pseudo_neg,
                        "qualified": r.qualified,
                    }
                    for client, r in s.pseudo_labels
                ],
                "pseudo_labels_rescaled": [
                    {
                        "client": client,
                        "class": CLASSES[r.cls],
                        "pseudo_positive": r.n_pseudo_pos,
                        "pseudo_negative": r.n_pseudo_neg,
                        "qualified": r.qualified,
                    }
                    for client, r in s.pseudo_labels_rescaled
                ],
                "seconds_per_method": dict(s.method_seconds),
                "undefined_balance": [
                    {"client": client, "class": CLASSES[c], "reason": why}
                    for client, c, why in s.undefined_balance
                ],
                "protocol_costs": s.protocol_costs,
                "sent_by_difference": {
                    g: {t: d.to_dict() for t, d in ts.items()} for g, ts in s.sent_by_difference.items()
                },
                "gram_copies_per_client": dict(s.gram_copies),
                "differential_privacy": s.privacy,
                "deployed_client_refusals": {
                    method: [asdict(r) for r in refusals] for method, refusals in s.client_refusals.items()
                },
            }
            for s in result.settings
        ],
    }


def markdown_report(result: ExperimentResult) -> str:
    parts = ["# secure-afl simulation report", ""]
    if result.notice:
        parts += [f"> **{result.notice}**", ""]
    dataset = dict(result.dataset)
    if "label_source" in dataset:
        dataset["label_source"] = label_source_name(dataset["label_source"])
    parts += [f"Dataset: {json.dumps(dataset)}", "", threat_model_line(result.config), ""]
    parts += [line for text in guarantee_lines(result.config) for line in (text, "")]
    parts += [str(classifier_check(result.config)["line"]), ""]
    header, rows = results_table_rows(result)
    parts += ["## Results (BACC and AUC in %, mAP as a fraction)", "", _md_table(header, rows), ""]
    parts += [chance_line(result), ""]
    if len(result.settings) > 1:
        parts += [f"![BACC and AUC against the number of missing classes, per method]({FIGURE})", ""]
    else:
        parts += [
            "(The figure of BACC and AUC against missing classes needs two or more missing levels.)",
            "",
        ]
    for setting in result.settings:
        h, r = coverage_rows(setting)
        parts += [f"## Missing {setting.missing}", ""]
        for line in _pseudo_label_lines(setting) + _undefined_balance_lines(setting):
            parts += [line, ""]
        parts += [f"### {coverage_title(setting)}", "", _md_table(h, r), ""]
        h, r = _upload_rows(setting)
        parts += [
            "### Bytes each client would upload unprotected (all compared methods)",
            "",
            _md_table(h, r),
            "",
        ]
        for title, h, r in _protocol_tables(setting):
            parts += [f"### {title}", "", _md_table(h, r), ""]
        if _several_protections(setting):
            h, r = backend_comparison_rows(setting)
            parts += ["### Protections side by side", "", _md_table(h, r), ""]
        for name, costs in (setting.protocol_costs or {}).items():
            if costs:
                h, r = protocol_cost_rows_per_party(costs)
                parts += [f"### Protocol costs per party, {name}", "", _md_table(h, r), ""]
        if setting.privacy:
            parts += (
                ["### Differential privacy", ""] + [f"- {line}" for line in _privacy_lines(setting)] + [""]
            )
        h, r = method_exposure_rows(setting)
        parts += ["### What each method alone reveals", "", _md_table(h, r), ""]
        if setting.client_refusals:
            h, r = client_refusal_rows(setting)
            parts += ["### Layouts a deployed client refuses", "", _md_table(h, r), ""]
        parts += (
            ["### Privacy audit of this run (all methods' statistics in one session)", ""]
            + [f"- {line}" for line in audit_lines(setting)]
            + [""]
        )
    h, r = _cost_rows(result)
    parts += ["## Seconds per phase", "", _md_table(h, r), ""]
    h, r = method_seconds_rows(result)
    parts += [
        "## Seconds per gradient method",
        "",
        "Wall seconds of each training.  They run beside the AFL pipeline (FedAvg alone on a thread,",
        "with baselines in worker processes), so they overlap it and each other; the phase",
        "'gradient methods (wait)' is only the time the report waited for them.  In worker processes",
        "a baseline trains all its levels together, and each level shows an equal share.",
        "",
        _md_table(h, r),
        "",
    ]
    return "\n".join(parts)


def write_reports(result: ExperimentResult, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    md_path = out_dir / "report.md"
    json_path.write_text(
        json.dumps(_nan_to_none(result_dict(result)), indent=2, default=_json_default, allow_nan=False) + "\n"
    )
    md_path.write_text(markdown_report(result))
    if len(result.settings) > 1:
        write_figure(result, out_dir / FIGURE)
    return json_path, md_path


def write_figure(result: ExperimentResult, path: Path) -> Path:
    """BACC and AUC (%) against the number of missing classes, one line per method (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot as plt

    levels = [s.missing for s in result.settings]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    styles = {
        "Analytic": "-",
        "Base": "--",
        "FSSL": ":",
        "FNLL": "-.",
        "FMLL": (0, (5, 1, 1, 1)),
        "Related": (0, (1, 3)),
    }
    colours = plt.get_cmap("tab20").colors  # 13 methods: more than the default cycle's 10 colours
    for i, method in enumerate(_methods(result)):
        for axis, metric in zip(axes, ("bacc", "auc"), strict=True):
            values = [
                100 * s.metrics[method].macro[metric] if method in s.metrics else float("nan")
                for s in result.settings
            ]
            axis.plot(
                levels,
                values,
                marker="o",
                linestyle=styles[method_type(method)],
                color=colours[(2 * i) % 20 + (2 * i) // 20],
                label=method,
            )
    for axis, title in zip(axes, ("BACC (%) at 0.5", "ROC AUC (%)"), strict=True):
        axis.set_xlabel("missing classes per client")
        axis.set_xticks(levels)
        axis.set_title(title)
        axis.axhline(50, color="grey", linewidth=0.8)
        axis.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if result.notice:
        fig.suptitle(
            "Synthetic features (embedded dataset): method behaviour, not X-ray accuracy", fontsize=9
        )
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _nan_to_none(value: object) -> object:
    """Strict JSON has no NaN: undefined metrics (a class absent from the test set) become null."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value


def _json_default(value: object) -> object:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "__dict__"):
        return vars(value)
    return str(value)


def backbone_table_rows(results: list[ExperimentResult]) -> tuple[list[str], list[list[str]]]:
    """Table III: one row per backbone, AFL (1 round) BACC / AUC / mAP per missing setting."""
    header = ["Backbone"]
    for s in results[0].settings:
        header += [f"M{s.missing} BACC", f"M{s.missing} AUC", f"M{s.missing} mAP"]
    rows = []
    for result in results:
        row = [str(result.dataset.get("backbone", "?"))]
        for s in result.settings:
            macro = s.metrics[AFL_1].macro
            row += [_fmt(m, macro[m]) for m in ("bacc", "auc", "map")]
        rows.append(row)
    return header, rows


def print_backbone_table(results: list[ExperimentResult], console: Console) -> None:
    header, rows = backbone_table_rows(results)
    console.print(rich_table("AFL (1 round) per backbone (Table III layout)", header, rows))


def write_backbone_table(results: list[ExperimentResult], out_dir: Path) -> Path:
    header, rows = backbone_table_rows(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "table3.md"
    path.write_text("# AFL (1 round) per backbone (Table III layout)\n\n" + _md_table(header, rows) + "\n")
    (out_dir / "table3.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n")
    return path
