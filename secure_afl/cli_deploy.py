"""``secure-afl deploy local`` and ``secure-afl predict``: the command layer that may import both the
simulator (data partition, the in-process reference) and the deployment (which never imports sim).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

from secure_afl.cli_options import (
    DeprecatedArgument,
    DeprecatedOption,
    LibraryErrorsGroup,
    check_dp_mechanism_options,
    ckks_degree_option,
    deprecation_note,
    dp_options,
    identity_key_alias,
    identity_key_file,
    key_dir_option,
    positional_or_option,
    renamed_option,
    split_pair,
)
from secure_afl.deploy.errors import ConfigurationError, DeploymentError

FAULT_ROUNDS = ("R0", "R1", "R2", "R3", "R4")  # deploy local --fault-*: session 1's rounds


def _metrics_address(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, int] | None:
    return None if value is None else _address(value, "--metrics")


def _address(value: str, option: str) -> tuple[str, int]:
    """A metrics endpoint's HOST:PORT; a note on stderr when it is not loopback."""
    from secure_afl.deploy.metrics import is_loopback, parse_address

    try:
        host, port = parse_address(value, option=option)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc)) from None
    if not is_loopback(host):
        click.echo(
            f"note: the metrics endpoint on {host} has no TLS and no authentication; it shows counts, never "
            "data, but restrict who reaches that port (firewall) or keep it on loopback",
            err=True,
        )
    return host, port


METRICS_HELP = (
    "Serve the coordinator's Prometheus metrics at HOST:PORT/metrics while the federation runs "
    "(a port alone: on 127.0.0.1; 0: a free port, printed). Off when absent; `deploy status` reads "
    "the same counters from the out-dir's metrics.json."
)


def _click_errors(exc: Exception) -> click.ClickException:
    return click.ClickException(f"{type(exc).__name__}: {exc}")


class _PorcelainGroup(LibraryErrorsGroup):
    """``deploy --help`` lists the walk-through's steps in their order, then the building blocks."""

    WALK_THROUGH = ("provision", "superlink", "join", "collect", "run", "check", "local")
    SECTIONS = (
        ("Walk-through (in this order; `local` rehearses it on one machine)", WALK_THROUGH),
        ("Building blocks (what the walk-through runs for you)", ("tls", "node-key", "app")),
        ("Monitoring", ("status", "node-metrics")),
    )

    def list_commands(self, ctx: click.Context) -> list[str]:
        listed = [name for _, names in self.SECTIONS for name in names if name in self.commands]
        return listed + sorted(set(self.commands) - set(listed))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(name) for name in self.commands)
        shown: set[str] = set()
        for title, names in self.SECTIONS:
            width = formatter.width - 6 - max(len(n) for n in names)  # each section aligns its own
            rows = [(n, self.commands[n].get_short_help_str(width)) for n in names if n in self.commands]
            shown.update(n for n, _ in rows)
            with formatter.section(title):
                formatter.write_dl(rows)
        rest = [(n, c.get_short_help_str(limit)) for n, c in sorted(self.commands.items()) if n not in shown]
        if rest:
            with formatter.section("Other commands"):
                formatter.write_dl(rest)


@click.group(cls=_PorcelainGroup)
def deploy() -> None:
    """Deploy among institutions over Flower (SuperLink, SuperNodes)."""
    from secure_afl.deploy.requirements import missing_deployment_packages

    missing = missing_deployment_packages()
    if missing:
        raise click.ClickException(
            f"the deployment stack is not installed ({', '.join(missing)} missing): install the deploy "
            "extra, `pip install -e '.[deploy]'` in a clone (or `pip install 'secure-afl[deploy]'`)"
        )


@deploy.command("tls")
@click.option("--host", "hosts", multiple=True, metavar="NAME",
              help="A DNS name SuperNodes use to reach the SuperLink (repeatable).")  # fmt: skip
@click.option("--ip", "ips", multiple=True, metavar="ADDR",
              help="An IPv4/IPv6 address SuperNodes use to reach the SuperLink (repeatable).")  # fmt: skip
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="Directory for ca.crt, ca.key, superlink.pem and superlink.key (created if absent).",
)
@click.option("--days", type=click.IntRange(1, 3650), default=365, show_default=True,
              help="Validity of the CA and of the SuperLink certificate, in days.")  # fmt: skip
@click.option("--force", is_flag=True, help="Replace those files if they exist (the old CA is lost).")
def deploy_tls(hosts: tuple[str, ...], ips: tuple[str, ...], out_dir: Path, days: int, force: bool) -> None:
    """Write a CA and the SuperLink's TLS certificate (ECDSA P-384, made with `cryptography`).

    \b
    Writes under --out:
      ca.crt         the CA certificate: give it to every hospital
      ca.key         the CA's private key (0600): keep it offline, nobody needs it at run time
      superlink.pem  the SuperLink's certificate, signed by the CA
      superlink.key  its private key (0600): stays on the coordinator host
    \b
    What takes them:
      secure-afl deploy superlink --tls-dir DIR ...   (the coordinator: its front serves superlink.pem)
      flower-supernode --root-certificates ca.crt   (each hospital)

    The certificate's subjectAltName lists every --host and --ip: it must cover the exact name or IP
    address hospitals put in --superlink, or their TLS handshake fails.  Existing files are never
    overwritten without --force.
    """
    from secure_afl.deploy.tls import (
        TlsError,
        TlsFilesExistError,
        parse_host_name,
        parse_ip_address,
        write_tls_material,
    )

    try:
        names = [*(parse_host_name(h) for h in hosts), *(str(parse_ip_address(a)) for a in ips)]
        files = write_tls_material(out_dir, hosts=hosts, ips=ips, days=days, force=force)
    except TlsFilesExistError as exc:
        raise click.ClickException(str(exc)) from None
    except TlsError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"wrote {files.ca_certificate} (give it to every hospital), {files.certificate},")
    click.echo(f"      {files.key} (0600) and {files.ca_key} (0600, keep it offline)")
    click.echo(f"valid for {days} days for: {', '.join(names)}")
    target = f"[{names[0]}]" if ":" in names[0] else names[0]  # an IPv6 address needs brackets
    click.echo(
        f"SuperLink: secure-afl deploy superlink --tls-dir {out_dir} --listen ADDR:9092 --state-dir DIR"
    )
    click.echo(f"SuperNode: flower-supernode --root-certificates ca.crt --superlink {target}:9092 ...")


@deploy.command("superlink")
@renamed_option("--tls-dir", "tls_dir", old_names=("--tls",), required=True, metavar="DIR",
                type=click.Path(path_type=Path, file_okay=False, exists=True),
                help="The directory `deploy tls` wrote (ca.crt, superlink.pem, superlink.key).")  # fmt: skip
@click.option("--listen", required=True, metavar="ADDR:PORT",
              help="The hospitals' address: the Fleet API only (e.g. 10.0.0.5:9092; 0.0.0.0:9092 for "
                   "every address).")  # fmt: skip
@click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="The SuperLink's state (0700): database, logs, the coordinator's flwr home.")  # fmt: skip
@click.option("--control-port", type=click.IntRange(1, 65535), default=9093, show_default=True,
              help="The SuperLink's own port on 127.0.0.1: Control API (flwr run/ls/supernode) and "
                   "Runtime API.")  # fmt: skip
@click.option(
    "--federation",
    default="federation",
    show_default=True,
    help="The connection's name in STATE_DIR/flwr/config.toml (`deploy run --app-dir DIR --federation "
    "NAME`).",
)
@click.option("--front", type=click.Choice(["caddy", "nginx"]), default="caddy", show_default=True,
              help="The reverse proxy on --listen: Caddy (installed with the deploy extra) or the "
                   "site's own nginx.")  # fmt: skip
@click.option("--front-binary", default=None, metavar="PATH",
              help="The front's executable (default: the one beside this Python, then PATH; for nginx "
                   "also /usr/sbin/nginx).")  # fmt: skip
@click.option("--nginx", "nginx_path", cls=DeprecatedOption, replacement="--front nginx --front-binary PATH",
              default=None, metavar="PATH")  # fmt: skip
def deploy_superlink(
    tls_dir: Path, listen: str, state_dir: Path, control_port: int, federation: str, front: str,
    front_binary: str | None, nginx_path: str | None,
) -> None:  # fmt: skip
    """Run the coordinator's SuperLink: TLS, node authentication, a persistent database (keep it running).

    \b
    Flower serves its Control API (flwr run, flwr ls, flwr supernode register: anyone who reaches
    it runs code as this user) on the same port as the Fleet API.  So the SuperLink listens on
    127.0.0.1:--control-port only, and a reverse-proxy front on --listen (Caddy, or nginx with
    --front nginx) serves the Fleet API alone (what SuperNodes call) with the certificate of
    --tls-dir; every other path gets 404.
    \b
    Writes under --state-dir (0700, files 0600):
      superlink.db       node registrations and runs (kept across restarts)
      flwr/config.toml   [superlink.FEDERATION] at 127.0.0.1:--control-port: export
                         FLWR_HOME=STATE_DIR/flwr for `flwr supernode register` and `deploy run`
      loopback-tls/      the SuperLink's own certificate for 127.0.0.1 (new at every start)
      front/             caddy.json (or nginx.conf), error.log, access.log;  logs/superlink.log
    The SuperLink's environment keeps only PATH, HOME, locale, PYTHONPATH and the like: no
    passphrase variable reaches it or the ServerApps it starts.  Stops both on Ctrl-C or
    SIGTERM; exits 1 if either exits on its own.
    """
    from secure_afl.deploy.errors import SuperLinkSetupError
    from secure_afl.deploy.superlink import plan_superlink, serve_superlink

    if nginx_path is not None:  # the old name, with its note
        front, front_binary = "nginx", front_binary or nginx_path
    try:
        plan = plan_superlink(tls_dir, listen, state_dir, control_port=control_port, front=front,
                              front_binary=front_binary, federation=federation)  # fmt: skip
        code = serve_superlink(plan, say=click.echo)
    except SuperLinkSetupError as exc:
        raise click.ClickException(f"SuperLinkSetupError: {exc}") from None
    raise SystemExit(code)


@deploy.command("node-key")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--force", is_flag=True, help="Replace an existing key (its registration is then lost).")
def deploy_node_key(path: Path, force: bool) -> None:
    """Write a SuperNode authentication key pair: PATH (private, 0600) and PATH.pub (OpenSSH).

    \b
    Each hospital makes one, keeps PATH for `flower-supernode --auth-supernode-private-key PATH`,
    and sends PATH.pub to the coordinator, who registers it:
      FLWR_HOME=... flwr supernode register PATH.pub FEDERATION
    An unregistered SuperNode is refused by a SuperLink started with --enable-supernode-auth.
    (Flower's own transport identity, distinct from the roster's identity key.)
    """
    from secure_afl.deploy.writers import write_node_auth_key

    public = path.with_name(path.name + ".pub")
    existing = [str(p) for p in (path, public) if p.exists()]
    if existing and not force:
        raise click.ClickException(f"{', '.join(existing)} already exist(s): pass --force to replace")
    for old in (path, public):
        old.unlink(missing_ok=True)  # --force (the key is written with O_EXCL)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_node_auth_key(path)
    click.echo(
        f"wrote {path} (0600, stays on this SuperNode's host) and {public} (send it to the coordinator)"
    )


@deploy.command("app")
@renamed_option("--app-dir", "app_dir", old_names=("--out",), required=True, metavar="DIR",
                type=click.Path(path_type=Path, file_okay=False),
                help="The coordinator's Flower app directory to write: DIR/pyproject.toml (give it to "
                     "`deploy run --app-dir`).")  # fmt: skip
@click.option(
    "--roster",
    "roster_path",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    required=True,
    help="The roster every hospital pinned; it must name the coordinator.",
)
@key_dir_option("The coordinator's key directory (`keys init --id coordinator`; default: $SECURE_AFL_HOME or "
                "~/.secure-afl): its identity.key signs the classifier.", old_names=())  # fmt: skip
@identity_key_alias
@click.option(
    "--passphrase-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The key's passphrase file (0600): checked here; give it to deploy run too.",
)
@click.option(
    "--passphrase-env",
    metavar="VAR",
    default=None,
    help="Or: the environment variable holding it (checked here; deploy run reads it, never the SuperLink).",
)
@click.option(
    "--out-dir",
    "server_out",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="Where the ServerApp writes classifier.json and report.json.",
)
@click.option(
    "--features",
    "features_path",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    default=None,
    help="Take classes, dim, backbone, weights-id and preprocessing from this feature "
    "file (one made with the agreed backbone; only its header is read).",
)
@click.option("--backbone", default=None, help="Or: the agreed backbone's name (with --weights).")
@click.option(
    "--weights",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="With --backbone: the agreed weight file (its SHA-256 is the study's weights-id).",
)
@click.option(
    "--rounds", type=click.IntRange(1, 2), default=1, show_default=True, help="2 adds the pseudo-label round."
)
@click.option(
    "--gram",
    type=click.Choice(["global", "class"]),
    default="global",
    show_default=True,
    help="global (paper Eq. 8) or one Gram per class (nodes must allow-class-gram).",
)
@click.option(
    "--balance",
    type=click.Choice(["client", "global"]),
    default=None,
    help="b_c's balancing: per hospital (paper Eq. 9) or global. [default: client; global with DP]",
)
@click.option("--gamma", type=float, default=1.0, show_default=True, help="The ridge γ of the solve.")
@click.option(
    "--protection",
    type=click.Choice(["mask", "ckks"]),
    default="mask",
    show_default=True,
    help="Pairwise masking or CKKS (sim's and deploy local's --protection); every hospital's node "
    "config must agree (protection=...).",
)
@click.option(
    "--round-timeout",
    type=click.FloatRange(1),
    default=120.0,
    show_default=True,
    help="Seconds a round waits for a hospital's answer; one Flower still reports online (heartbeats) is "
    "waited for up to round-limit (default 10 times this), one Flower reports gone is a dropout at once.",
)
@click.option(
    "--colluders",
    default="n-t",
    show_default=True,
    help="The colluders the hospitals' nodes assume (their node config's colluders): round 2 "
    "forms only groups they accept.",
)
@click.option(
    "--set",
    "extra",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any other run-config key (repeatable): e.g. dp-epsilon=1, class-lists=..., "
    "statistics-timeout=600, min-nodes=3 (secure_afl/deploy/apps.py lists them).",
)
@click.option(
    "--superlink",
    metavar="HOST:PORT",
    default=None,
    help="Also write FLWR_HOME/config.toml: the federation's SuperLink address, as `flwr run` "
    "and `flwr supernode register` read it.",
)
@click.option(
    "--root-certificates",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    default=None,
    help="With --superlink: ca.crt (`deploy tls`); stored as an absolute path.",
)
@click.option("--insecure", is_flag=True, help="With --superlink: no TLS (a test on one machine only).")
@click.option(
    "--flwr-home",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    envvar="FLWR_HOME",
    show_envvar=True,
    help="Where config.toml goes (default ~/.flwr). Export the same FLWR_HOME for flwr commands.",
)
@click.option(
    "--federation",
    default="federation",
    show_default=True,
    help="The federation's name in config.toml (`deploy run --app-dir DIR --federation NAME`).",
)
@click.option(
    "--force", is_flag=True, help="Replace an existing DIR/pyproject.toml (--app-dir) or config.toml."
)
def deploy_app(
    app_dir: Path,
    roster_path: Path,
    key_dir: Path | None,
    identity_key: Path | None,
    passphrase_file: Path | None,
    passphrase_env: str | None,
    server_out: Path,
    features_path: Path | None,
    backbone: str | None,
    weights: Path | None,
    rounds: int,
    gram: str,
    balance: str | None,
    gamma: float,
    protection: str,
    round_timeout: float,
    colluders: str,
    extra: tuple[str, ...],
    superlink: str | None,
    root_certificates: Path | None,
    insecure: bool,
    flwr_home: Path | None,
    federation: str,
    force: bool,
) -> None:
    """Write the coordinator's Flower app: the study and the roster (the key is checked, not written).

    \b
    Reads:  --roster, --key-dir's identity.key (decrypted once, to check it is the roster's coordinator),
            the study's backbone record from --features or --backbone/--weights.
    Writes: --app-dir's pyproject.toml ([tool.flwr.app.config]: the run config the ServerApp reads) and,
            with --superlink, FLWR_HOME/config.toml ([superlink.FEDERATION]).
    Every value is checked as the ServerApp will check it (the study, the coordinator's key and
    passphrase), so a run does not fail minutes later on a typo.
    """
    from secure_afl.deploy.coordinator_app import (
        SuperLinkConnection,
        plan_coordinator_app,
        write_coordinator_app,
    )
    from secure_afl.keys.store import load_roster_file

    if (features_path is None) == (backbone is None):
        raise click.UsageError("give --features FILE, or --backbone NAME with --weights FILE")
    if (passphrase_file is None) == (passphrase_env is None):
        raise click.UsageError("give exactly one of --passphrase-file and --passphrase-env")
    if superlink is None and (root_certificates is not None or insecure):
        raise click.UsageError("--root-certificates and --insecure go with --superlink HOST:PORT")
    if superlink is not None and (root_certificates is None) == (not insecure):
        raise click.UsageError("with --superlink give --root-certificates ca.crt (TLS) or --insecure")
    identity_key = identity_key_file(key_dir, identity_key)
    record = _backbone_record(features_path, backbone, weights)
    signing = {
        "identity-key": str(identity_key.resolve()),
        **({"passphrase-file": str(passphrase_file.resolve())} if passphrase_file else {}),
        **({"passphrase-env": passphrase_env} if passphrase_env else {}),
    }
    study = {**record, "gamma": gamma, "gram": gram, "rounds": rounds, "protection": protection,
             "round-timeout": round_timeout, "colluders": colluders,
             **({"balance": balance} if balance is not None else {}),
             **_key_value_pairs(extra, "--set")}  # fmt: skip
    home = (flwr_home or Path.home() / ".flwr").resolve()
    connection = None
    if superlink is not None:
        connection = SuperLinkConnection(superlink, federation, home, root_certificates)
    try:
        app = plan_coordinator_app(app_dir, load_roster_file(roster_path), roster_path, signing,
                                   server_out, study, connection=connection, force=force)  # fmt: skip
    except ConfigurationError as exc:
        raise click.ClickException(f"ConfigurationError: {exc}") from None
    write_coordinator_app(app)
    click.echo(f"wrote {app.pyproject}: {app.study.describe_protection()}, {rounds} round(s), "
               f"{len(app.roster)} hospitals")  # fmt: skip
    click.echo(f"  backbone {record['backbone']} ({record['weights-id']}), dim {record['dim']}")
    click.echo(f"  signed by {app.signer.coordinator_id} ({app.signer.key.fingerprint})")
    if connection is not None:
        click.echo(f"wrote {connection.path} (export FLWR_HOME={home} for flwr supernode register)")
    secret = " ".join(f"--{k} {v}" for k, v in signing.items() if k != "identity-key")
    click.echo(f"next: secure-afl deploy run --app-dir {app_dir} --federation {federation} "
               f"--flwr-home {home} --key-dir {identity_key.resolve().parent} {secret}")  # fmt: skip


def _run_config_value(text: str) -> object:
    """A --set value as TOML types it: an integer, a float, true/false, else a string."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _backbone_record(features: Path | None, backbone: str | None, weights: Path | None) -> dict[str, object]:
    """The study's classes, dim, backbone, weights-id and preprocessing (run-config keys)."""
    from secure_afl.deploy.provision import backbone_record
    from secure_afl.sim.data import CLASSES

    if backbone is not None and weights is None:
        raise click.UsageError(
            "--backbone needs --weights FILE (the agreed weight file; nothing is downloaded)"
        )
    try:
        return backbone_record(features, backbone, weights, CLASSES)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None


@deploy.command("local")
@click.option(
    "--clients",
    type=click.IntRange(3, 8),
    default=5,
    show_default=True,
    help="SuperNodes (institutions). 5 is the fewest at which every class group of the default seed keeps "
    "the 3 members that one assumed colluder requires.",
)
@click.option("--tls/--no-tls", default=False, show_default=True, help="TLS and SuperNode authentication.")
@click.option(
    "--drop",
    "drops",
    multiple=True,
    metavar="CLIENT@ROUND",
    help="Kill that SuperNode at that protocol round (R1..R4; with ckks R3 is the signed view and R4 "
    "reaches only decryptors; a key holder killed at R1 is replaced by a re-election). Repeatable. "
    "(sim --dropout N --dropout-stage R instead drops N clients drawn from --seed at round R1..R3.)",
)
@renamed_option(
    "--protection",
    old_names=("--secure",),
    type=click.Choice(["mask", "ckks"]),
    default="mask",
    show_default=True,
    help="How the statistics are protected: pairwise masking or CKKS encryption (TenSEAL); every "
    "institution's node config agrees to it.",
)
@ckks_degree_option
@click.option(
    "--missing", type=click.IntRange(0, 7), default=1, show_default=True, help="Classes withheld per client."
)
@click.option(
    "--rounds", type=click.IntRange(1, 2), default=1, show_default=True, help="2 adds the pseudo-label round."
)
@click.option(
    "--gram",
    type=click.Choice(["global", "class"]),
    default="global",
    show_default=True,
    help="global: one Gram summed over all institutions (paper Eq. 8); class: one per class, "
    "summed over the institutions labelling it (needs allow-class-gram in every node config).",
)
@click.option("--balance", type=click.Choice(["client", "global"]), default=None,
              help="How b_c balances positives and negatives: per institution (paper Eq. 9) or from the "
              "global counts. [default: client; global under --dp-epsilon, which needs it]")  # fmt: skip
@click.option("--gamma", type=float, default=1.0, show_default=True,
              help="The ridge γ of the closed-form solve (W = (G + γI)^-1 B).")  # fmt: skip
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seeds the split, which classes each institution labels, and the synthetic features.",
)
@click.option(
    "--fraction",
    type=click.FloatRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="Share of the embedded cohort to use (0.1: a tenth of the images, a faster run).",
)
@click.option(
    "--dim", type=click.IntRange(min=1), default=1024, show_default=True, help="Synthetic feature dimension."
)
@click.option("--round-timeout", type=click.FloatRange(1), default=30.0, show_default=True,
              help="Seconds a round waits for a node's answer; a node Flower still reports online (a busy "
              "host) is waited for up to 10 times this, one Flower reports gone (no heartbeat for 60 s) "
              "is a dropout at once. Shorter than provision's and app's 120: nodes on one machine answer "
              "within seconds.")  # fmt: skip
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=Path("runs/deploy"),
    show_default=True,
    help="Writes here, also when the run fails: report.json, classifier.json (signed), roster.json (verifies "
    "it), test-features.npz (the held-out images, labelled: predict --evaluate) and logs/ (every process's "
    "log; replaced each run).",
)
@click.option(
    "--colluders",
    default="n-t",
    show_default=True,
    help='How many other institutions each one assumes may collude with the coordinator ("n-t", the '
    "active model's bound, or a number): its exposure check refuses any group that this many "
    "colluders would reduce to one honest member. 0 weakens the check; a dropout can otherwise leave "
    "a class group too small and abort the session (SECURITY.md §3).",
)
@click.option(
    "--coordinator",
    type=click.Choice(["active", "honest-but-curious"]),
    default="active",
    show_default=True,
    help="What every institution's node config declares of the coordinator. Under active (the deployment "
    "policy) nodes refuse a study whose uploads depend on a coordinator's choice they cannot check: "
    "--rounds 2 needs honest-but-curious (SECURITY.md §3.6).",
)
@click.option("--keep", is_flag=True, help="Keep the temporary directory (keys, logs, certificates).")
@click.option("--rehearse-abort", is_flag=True,
              help="After the run, kill SuperNodes until too few remain and run again: the session must "
              "abort, the coordinator's command exit 1 and the earlier classifier be moved aside "
              "(written to OUT/abort-rehearsal/).")  # fmt: skip
@click.option("--sessions", type=click.IntRange(1, 10), default=1, show_default=True,
              help="A federation that grows: each institution's images arrive in K batches; session k "
              "extends session k - 1's study and releases only the new images (global balance, one "
              "round). Each session's classifier is compared with the centralised fit on every image "
              "released so far (under --dp-epsilon reported, not checked: the sums are noisy; each "
              "node's dp-epsilon then covers the chain's K sessions).")  # fmt: skip
@click.option("--metrics", default=None, metavar="HOST:PORT", callback=_metrics_address,
              help=METRICS_HELP + " After the run it is scraped and must match the report.")  # fmt: skip
@click.option("--fault-delay", type=click.FloatRange(0), default=0.0, metavar="SECONDS",
              help="Put each node behind a TCP fault proxy on its link to the SuperLink that delays every "
              "chunk this long each way (jitter ±20 %; secure_afl/deploy/faults.py).")  # fmt: skip
@click.option("--fault-reset", "fault_resets", multiple=True, type=click.Choice(FAULT_ROUNDS),
              help="Reset each node's connections to the SuperLink as session 1's ROUND reaches it "
              "(repeatable; through the fault proxies).")  # fmt: skip
@click.option("--fault-pause", metavar="CLIENT@ROUND:SECONDS",
              help="Pause (SIGSTOP) CLIENT's SuperNode and its processes as session 1's ROUND reaches it, "
              "resume them (SIGCONT) SECONDS later: alive for Flower (heartbeats within 60 s), so not a "
              "dropout even past --round-timeout.")  # fmt: skip
@dp_options
def deploy_local(
    protection: str, drops: tuple[str, ...], out_dir: Path, fault_delay: float, fault_resets: tuple[str, ...],
    fault_pause: str | None, **options: Any,
) -> None:  # fmt: skip
    """A federation of N SuperNodes on this machine, compared with the in-process simulation.

    With --dp-epsilon the institutions noise their statistics before masking (SECURITY.md §9): the
    classifier then differs from any rerun, so it is compared with the simulation's non-private one
    (the price of privacy) instead of bit for bit.  The simulation is the masked one (exact to
    2^-32): with --protection mask the weights must be equal bit for bit, with ckks within CKKS
    precision (CKKS_RELATIVE_WEIGHT_TOLERANCE).
    """
    from rich.console import Console

    from secure_afl.rehearsal import (
        RehearsalError,
        RehearsalFailed,
        RehearsalOptions,
        plan_rehearsal,
        rehearse,
    )

    check_dp_mechanism_options(
        options["dp_epsilon"] is not None, options["dp_dim"], options["dp_ridge"],
        options["dp_projection_seed"], options["dp_class_sums"], options["dp_row_centre"],
    )  # fmt: skip
    for item in drops:
        split_pair(item, "--drop", "CLIENT@ROUND", "client-2@R2")
    console = Console()
    say = console.print if console.is_terminal else (lambda text: click.echo(text))
    try:
        plan = plan_rehearsal(RehearsalOptions(secure=protection, drops=drops, **options))
    except RehearsalError as exc:
        if exc.option is None:
            raise click.UsageError(str(exc)) from None
        raise click.BadParameter(str(exc), param_hint=exc.option or None) from None
    network = _fault_plan(fault_delay, fault_resets, fault_pause, plan.client_ids, say)
    try:
        report = rehearse(plan, out_dir, say=say, network=network)
    except (DeploymentError, RehearsalFailed) as exc:
        raise click.ClickException(
            f"{type(exc).__name__}: {exc}" if isinstance(exc, DeploymentError) else str(exc)
        ) from None
    if report.reference is not None:
        _render_rehearsal(report, console, say, out_dir.resolve())
    failure = report.failure()
    if failure:
        raise click.ClickException(failure)


def _fault_plan(
    delay: float,
    resets: tuple[str, ...],
    pause: str | None,
    client_ids: Sequence[str],
    say: Callable[[str], None],
) -> Any:
    """deploy local's --fault-* options as a fault plan (None: no proxy, the nodes dial the SuperLink)."""
    if not delay and not resets and pause is None:
        return None
    from secure_afl.deploy.fault_plan import FaultPlan

    paused = None
    if pause is not None:
        cid, _, rest = pause.partition("@")
        round_name, _, seconds = rest.partition(":")
        try:
            length = float(seconds)
        except ValueError:
            length = -1.0
        if cid not in client_ids or round_name not in FAULT_ROUNDS or not 0 < length <= 600:
            raise click.BadParameter(
                f"{pause!r}: expected CLIENT@ROUND:SECONDS with CLIENT in {client_ids[0]}..{client_ids[-1]}, "
                f"ROUND one of {', '.join(FAULT_ROUNDS)} and 0 < SECONDS <= 600 (e.g. client-1@R1:15)",
                param_hint="--fault-pause",
            )
        paused = (cid, f"s1-{round_name}", length)
    return FaultPlan(
        delay=delay, jitter=0.2 * delay, node_resets=tuple(f"s1-{r}" for r in resets), pause=paused, say=say
    )


def _render_rehearsal(report: Any, console: Any, say: Callable[[str], None], out_dir: Path) -> None:
    """The comparison, the protection, the weights, the copies and the seconds, as tables and lines."""
    from rich.table import Table

    from secure_afl.rehearsal import CKKS_METRIC_TOLERANCE, CKKS_RELATIVE_WEIGHT_TOLERANCE

    study, result, reference = report.plan.study, report.result, report.reference
    private = study.dp is not None
    table = Table(title=f"Deployment vs simulation over the same survivors {list(reference.survivors)}")
    table.add_column("metric")
    table.add_column(f"deployment (Flower{', DP' if private else ''})", justify="right")
    table.add_column(f"simulation (in-process{', no DP' if private else ''})", justify="right")
    for key, label, scale in (("bacc", "BACC %", 100), ("auc", "AUC %", 100), ("map", "mAP", 1)):
        table.add_row(label, f"{scale * report.deployed[key]:.4f}", f"{scale * report.simulated[key]:.4f}")
    console.print(table)
    digest = report.weights_digest
    say(f"protection: {study.describe_protection()}")
    if private:
        for line in result.classifier.privacy_lines():
            say(line)
        say(f"weights (sha256 {digest}...): noisy, so not compared bit for bit with the simulation")
    elif study.protection == "mask":
        say(f"weights bit for bit equal: {'yes' if report.identical else 'NO'} (sha256 {digest}...)")
    else:  # CKKS rounds the decrypted sums: equal within its precision, not bit for bit
        say(
            f"weights equal within CKKS precision: {'yes' if report.within_ckks_precision else 'NO'} "
            f"(max |Δw| {report.weight_error:.3g}, {report.relative_error:.3g} of max |w|, "
            f"tolerance {CKKS_RELATIVE_WEIGHT_TOLERANCE:g}; "
            f"max |Δ metric| {report.metric_error:.3g}, tolerance {CKKS_METRIC_TOLERANCE:g})"
        )
        session1 = result.report["sessions"][0]
        say(f"key holder: {session1.get('key_holder')}; decryptors: {session1.get('decryptors')}")
    say(f"killed: {result.killed or 'none'}; dropouts seen by the server: {report.dropouts or 'none'}")
    say(f"classifier stored by {sorted(report.copies)}; identical copies: {all(report.copies.values())}")
    checked = result.report.get("verified") or []  # each node's check against the sums (SECURITY.md §5.1)
    if checked:
        say(f"classifier verified against the sums by {checked}")
    else:
        from secure_afl.deploy.verify import not_offered

        why = not_offered(study, ()) or "offered, but every node refused the classifier or dropped out"
        say(f"classifier verified against the sums by no node: {why}")
    seconds = Table(title="Seconds per stage")
    seconds.add_column("stage")
    seconds.add_column("s", justify="right")
    seconds.add_row("data (embedded cohort, partition)", f"{report.data_seconds:.1f}")
    for name, value in result.seconds.items():
        seconds.add_row(name, f"{value:.1f}")
    for session in result.report["sessions"]:
        for round_name, value in session["round_seconds"].items():
            seconds.add_row(f"  session {session['label']} {round_name}", f"{value:.1f}")
    for name in ("solve", "deliver", "verify"):  # verify: the classifier check (§5.1)
        if name in result.report["seconds"]:
            seconds.add_row(f"  {name} (server)", f"{result.report['seconds'][name]:.2f}")
    seconds.add_row("simulation (in-process reference)", f"{reference.seconds:.1f}")
    console.print(seconds)
    say(f"wrote {out_dir / 'classifier.json'} and {out_dir / 'report.json'}")
    rehearsal = result.abort_rehearsal
    if rehearsal is not None:
        moved = [p for p in rehearsal.moved if p.name.startswith("classifier.")]
        code = 0 if rehearsal.ok else 1
        say(f"abort rehearsal: `secure-afl deploy run` exits {code}: {rehearsal.error}")
        say(f"  earlier classifier moved aside: {moved[0] if moved else 'NO'}")
        say(f"  report: {rehearsal.report_path}")


# --- secure-afl deploy check / deploy run ----------------------------------------------------------


class _NodeConfigKeysCommand(click.Command):
    """A command whose help ends with every node-config key and what it means."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from secure_afl.deploy.check import NODE_CONFIG_KEYS

        with formatter.section("Node-config keys (flower-supernode --node-config, and this command's)"):
            formatter.write_dl(list(NODE_CONFIG_KEYS.items()))
        super().format_epilog(ctx, formatter)


@deploy.command("check", cls=_NodeConfigKeysCommand)
@click.option("--node-config", "node_config", default=None, metavar="'KEY=\"VALUE\" ...'",
              help="The SuperNode's --node-config, exactly as it will be given to flower-supernode "
              "(or the path of a .toml file with the same keys).")  # fmt: skip
@click.option("--config", "config_file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Read the node config from this file: a .toml file, or KEY=\"VALUE\" pairs.")  # fmt: skip
@click.option("--study", type=click.Path(path_type=Path, exists=True), default=None,
              help="The coordinator's Flower app directory (or its pyproject.toml): check the feature "
              "file and this node's policy (protection, DP, per-class Gram) against its study.")  # fmt: skip
@click.option("--superlink", default=None, metavar="HOST:PORT",
              help="The SuperLink address given to flower-supernode --superlink: connect to it.")  # fmt: skip
@click.option("--root-certificates", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="With --superlink: the CA certificate (ca.crt); the SuperLink's certificate must verify "
              "against it and name HOST.")  # fmt: skip
@click.option("--insecure", is_flag=True, help="With --superlink: the SuperLink has no TLS (TCP only).")
@click.option("--timeout", type=click.FloatRange(0.1), default=10.0, show_default=True,
              help="Seconds to wait for the SuperLink.")  # fmt: skip
def deploy_check(
    node_config: str | None,
    config_file: Path | None,
    study: Path | None,
    superlink: str | None,
    root_certificates: Path | None,
    insecure: bool,
    timeout: float,
) -> None:
    """Check a hospital's node before the coordinator starts (run it on the hospital's machine).

    Loads the identity key with its passphrase, the roster and this hospital's entry in it, the
    feature file (against the study with --study), the ledger and the output directory, with the
    ClientApp's own code: a failure here is the refusal the SuperNode would send during the run,
    with the same message, named by hospital.  With --study it also refuses values the ledger
    already released (as the run's R0 would), and when every check passes it records the study's
    digest in ledger-dir/checked-study.json (0600): the node takes part in that study only, and
    refuses a changed one until it is checked again.  With --superlink it connects to the SuperLink
    (TLS handshake with --root-certificates).  Writes nothing else.  Exit 0 when every check
    passes, 1 at the first that fails.
    """
    from secure_afl.deploy.check import NodeCheckError, check_node, parse_node_config, study_from_file

    if superlink is not None and (root_certificates is None) == (not insecure):
        raise click.UsageError("with --superlink give --root-certificates ca.crt (TLS) or --insecure")
    if superlink is None and (root_certificates is not None or insecure):
        raise click.UsageError("--root-certificates and --insecure go with --superlink HOST:PORT")
    try:
        config = parse_node_config(node_config, config_file)
        parsed_study = study_from_file(study) if study is not None else None
    except (ConfigurationError, click.ClickException) as exc:
        raise click.UsageError(getattr(exc, "message", None) or str(exc)) from None
    try:
        result = check_node(
            config, study=parsed_study, superlink=superlink, root_certificates=root_certificates,
            timeout=timeout, say=click.echo,
        )  # fmt: skip
    except NodeCheckError as exc:
        raise click.ClickException(f"FAILED {exc}") from None
    click.echo(f"{result.client_id}: every check passed; start its SuperNode with this node config")


@deploy.command("run")
@click.argument("app_positional", cls=DeprecatedArgument, replacement="--app-dir", metavar="APP_DIR",
                type=click.Path(path_type=Path))  # fmt: skip
@click.argument("federation_positional", cls=DeprecatedArgument, replacement="--federation",
                metavar="FEDERATION")  # fmt: skip
@click.option("--app-dir", "app_dir", type=click.Path(path_type=Path, file_okay=False, exists=True),
              default=None, metavar="DIR",
              help="The coordinator's Flower app directory (`deploy app --app-dir DIR`, or FED/app of "
                   "`deploy provision --federation-dir FED`).  [required]")  # fmt: skip
@click.option("--federation", default=None,
              help="The federation's name: its [superlink.NAME] in FLWR_HOME/config.toml (`deploy superlink "
                   "--federation`, `deploy provision --federation`).  [default: federation]")  # fmt: skip
@click.option("--flwr-home", type=click.Path(path_type=Path, file_okay=False), default=None,
              envvar="FLWR_HOME", show_envvar=True,
              help="Directory whose config.toml names the federation's SuperLink (address, CA).")  # fmt: skip
@click.option(
    "--run-config",
    "run_config",
    multiple=True,
    metavar="'KEY=VALUE ...'",
    help="Override run-config keys of --app-dir's pyproject.toml (passed to flwr run).",
)
@click.option("--timeout", type=click.FloatRange(1), default=24 * 3600.0, show_default=True,
              help="Stop waiting (and stop flwr run) after this many seconds.")  # fmt: skip
@click.option("--tick", type=click.FloatRange(0), default=10.0, show_default=True,
              help="While a round waits, print the elapsed time this often (0: never).")  # fmt: skip
@key_dir_option("The coordinator's key directory (`keys init --id coordinator`, the roster's coordinator; "
                "default: $SECURE_AFL_HOME or ~/.secure-afl): deploy run signs the classifier with its "
                "identity.key, in its own process.", old_names=())  # fmt: skip
@identity_key_alias
@click.option("--passphrase-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The key's passphrase file (0600).")  # fmt: skip
@click.option(
    "--passphrase-env",
    metavar="VAR",
    default=None,
    help="Or: an environment variable of this command that holds it (not passed to flwr run).",
)
@click.option("--metrics", default=None, metavar="HOST:PORT", callback=_metrics_address, help=METRICS_HELP)
@click.pass_context
def deploy_run(
    ctx: click.Context, app_positional: Path | None, federation_positional: str | None, app_dir: Path | None,
    federation: str | None, flwr_home: Path | None, run_config: tuple[str, ...], timeout: float, tick: float,
    key_dir: Path | None, identity_key: Path | None, passphrase_file: Path | None, passphrase_env: str | None,
    metrics: tuple[str, int] | None,
) -> None:  # fmt: skip
    """Run the federation (the coordinator): `flwr run DIR NAME --stream` (--app-dir, --federation), honestly.

    \b
    Reads DIR/pyproject.toml ([tool.flwr.app.config]: the study, roster, out-dir) and
    $FLWR_HOME/config.toml ([superlink.NAME]: address, root-certificates).
    Writes in the run config's out-dir: classifier.json and report.json (the ServerApp's),
    flwr-run.log (the whole stream); an earlier classifier.json or report.json there is first
    renamed classifier.before-<UTC time>.json (report.before-...), so a stale classifier is never
    taken for the new one.

    Signs the classifier here, not in the ServerApp: the ServerApp (a process the SuperLink starts)
    writes the unsigned record (classifier.unsigned.json) and asks for the signature; this command
    checks it is this run's study and roster, signs it into classifier.json with --key-dir's
    identity.key, and the ServerApp sends those bytes to the hospitals.  The key and passphrase never reach a
    process the SuperLink starts.

    Prints each round as the ServerApp logs it, with the hospitals addressed and answering, and the
    elapsed time while a round waits.  `flwr run` exits 0 even when the ServerApp fails; this
    command exits 1 when the session aborts, a hospital's refusals stop it, or the ServerApp fails
    (then report.json holds the error), and 0 only when a classifier was written.
    """
    import os

    from secure_afl.deploy.coordinator import load_signer, run_federation

    app_dir = positional_or_option(ctx, app_positional, app_dir, default=None, name="app_positional")
    if app_dir is None:
        raise click.UsageError(
            "give --app-dir DIR: the coordinator's app directory (`deploy app --app-dir DIR` wrote it, or "
            "`deploy provision --federation-dir FED` as FED/app)"
        )
    if not app_dir.is_dir():  # the old positional (the option checks this itself)
        raise click.BadParameter(f"{app_dir}: no such directory", param_hint="--app-dir")
    federation = positional_or_option(
        ctx, federation_positional, federation, default="federation", name="federation_positional"
    )
    identity_key = identity_key_file(key_dir, identity_key)
    if (passphrase_file is None) == (passphrase_env is None):
        raise click.UsageError("give exactly one of --passphrase-file and --passphrase-env")
    env = dict(os.environ)
    if passphrase_env is not None:
        env.pop(passphrase_env, None)  # flwr run, and whatever it starts, never sees the passphrase
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home.resolve())
    config_toml = Path(env.get("FLWR_HOME", Path.home() / ".flwr")) / "config.toml"
    if not config_toml.is_file():
        raise click.UsageError(
            f"{config_toml} does not exist: flwr run reads the federation's SuperLink from it; set "
            f"--flwr-home (or export FLWR_HOME) to the directory holding it"
        )
    try:
        signer = load_signer(app_dir, identity_key, passphrase_file, passphrase_env, run_config)
        click.echo(f"signing as {signer.coordinator_id} ({signer.key.fingerprint})")
        outcome = run_federation(
            app_dir.resolve(), federation, env=env, run_config=run_config, run_timeout=timeout, tick=tick,
            say=click.echo, signer=signer, metrics=metrics,
        )  # fmt: skip
    except (ConfigurationError, DeploymentError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    report = outcome.report or {}
    if not outcome.ok:
        raise click.ClickException(
            f"the federation failed after {outcome.seconds:.0f} s: {outcome.error}\n"
            f"report: {outcome.report_path}; flwr run's output: {outcome.log_path}; no classifier.json "
            f"was left in {outcome.out_dir}"
        )
    for session in report.get("sessions", []):
        click.echo(
            f"session {session['label']}: participants {session['participants']}, survivors "
            f"{session['survivors']}"
        )
    click.echo(f"classifier stored by {report.get('acknowledged', [])}")
    click.echo(f"wrote {outcome.classifier_path} and {outcome.report_path} ({outcome.seconds:.0f} s)")


# --- monitoring -------------------------------------------------------------------------------------


@deploy.command("status")
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False, exists=True), required=False)
@click.option("--url", default=None, metavar="URL",
              help="Or: scrape this metrics endpoint (deploy run --metrics, deploy node-metrics), e.g. "
              "http://127.0.0.1:9101/metrics.")  # fmt: skip
def deploy_status(directory: Path | None, url: str | None) -> None:
    """Print a party's counters for a person: sessions, rounds, refusals, dropouts, DP ε, the last success.

    \b
    DIRECTORY: the coordinator's out-dir (the run config's; the ServerApp keeps metrics.json there)
    or a hospital's ledger-dir (its ClientApp keeps metrics.json there).  The same numbers a
    monitoring system scrapes from `deploy run --metrics` and `deploy node-metrics`.
    """
    from secure_afl.deploy import metrics as m

    if (directory is None) == (url is None):
        raise click.UsageError("give a DIRECTORY (an out-dir or a ledger-dir) or --url, not both")
    try:
        if url is not None:
            samples = m.scrape(url)
            source = url
        else:
            path = directory / m.METRICS_NAME  # type: ignore[operator]
            samples = m.samples_of(m.registry_of(lambda: m.read_state(path)))
            source = str(path)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{source}:")
    for line in m.status_lines(samples):
        click.echo(line)


@deploy.command("node-metrics")
@click.option("--ledger-dir", type=click.Path(path_type=Path, file_okay=False, exists=True), required=True,
              help="The node config's ledger-dir (its ClientApp keeps metrics.json there; it must exist: "
                   "a mistyped one would serve zeros for ever).")  # fmt: skip
@click.option("--listen", default="127.0.0.1:9101", show_default=True, metavar="HOST:PORT",
              help="Where to serve /metrics (a port alone: on 127.0.0.1).")  # fmt: skip
@click.option("--textfile", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Instead: write the metrics once to this file, in node_exporter's textfile-collector "
              "format (name it *.prom in its --collector.textfile.directory; run it from a timer), and "
              "exit.")  # fmt: skip
def deploy_node_metrics(ledger_dir: Path, listen: str, textfile: Path | None) -> None:
    """Serve a hospital's Prometheus metrics (run it beside its SuperNode; Ctrl-C stops it).

    Flower starts the ClientApp once per message, so it cannot serve an endpoint itself: it counts
    each message into ledger-dir/metrics.json (sessions advertised in and released, messages
    answered, refusals by rule, classifiers stored, the ε its ledger records).  This process
    serves that file, read at each scrape; it reads nothing else and needs no key.
    """
    import threading

    from secure_afl.deploy import metrics as m

    registry = m.file_registry(ledger_dir / m.METRICS_NAME, "node")
    if textfile is not None:
        m.write_textfile(textfile, registry)
        click.echo(f"wrote {textfile}")
        return
    host, port = _address(listen, "--listen")
    try:
        endpoint = m.serve(registry, host, port)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"serving {ledger_dir / m.METRICS_NAME} on {endpoint.url} (Ctrl-C stops)")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        endpoint.close()


# --- provision, join, collect: the kits ------------------------------------------------------------


def _key_value_pairs(items: tuple[str, ...], hint: str) -> dict[str, object]:
    """``--set KEY=VALUE`` items as config keys, each value typed as TOML types it."""
    pairs = (split_pair(item, hint, "KEY=VALUE", "dp-epsilon=1", value_optional=True) for item in items)
    return {key: _run_config_value(value) for key, value in pairs}


@deploy.command("provision")
@renamed_option("--federation-dir", "out_dir", old_names=("--out",), type=click.Path(path_type=Path,
                file_okay=False), required=True, metavar="DIR",
                help="The federation directory to write: roster.json, tls/, app/, server/, "
                     "kits/.")  # fmt: skip
@click.option("--hospital", "hospitals", multiple=True, required=True,
              type=click.Path(path_type=Path, exists=True),
              help="A hospital's identity.pub.json (`keys init`), or the directory holding it; repeat per "
                   "hospital.")  # fmt: skip
@key_dir_option("The coordinator's key directory (`keys init --id coordinator`; default: "
                "$SECURE_AFL_HOME or ~/.secure-afl).", old_names=("--coordinator-keys",))  # fmt: skip
@click.option("--passphrase-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The coordinator key's passphrase file (0600).")  # fmt: skip
@click.option("--passphrase-env", metavar="VAR", default=None,
              help="Or: the environment variable that holds it.")  # fmt: skip
@click.option("--host", "hosts", multiple=True, metavar="NAME",
              help="A DNS name hospitals dial the SuperLink by (repeatable; kits dial the 1st).")  # fmt: skip
@click.option("--ip", "ips", multiple=True, metavar="ADDR",
              help="An IP address hospitals use to reach the SuperLink (repeatable).")  # fmt: skip
@click.option("--port", type=click.IntRange(1, 65535), default=9092, show_default=True,
              help="The Fleet API's port there (`deploy superlink --listen ADDR:PORT`).")  # fmt: skip
@click.option("--federation", default="federation", show_default=True,
              help="The federation's name (`deploy superlink`, `deploy run`).")  # fmt: skip
@click.option("--features", "features_path", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              default=None, help="The study's classes, dim and backbone: this file's header.")  # fmt: skip
@click.option("--backbone", default=None, help="Or: the agreed backbone's name (with --weights).")
@click.option("--weights", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="With --backbone: the agreed weight file (its SHA-256: weights-id).")  # fmt: skip
@click.option("--rounds", type=click.IntRange(1, 2), default=1, show_default=True,
              help="2 adds the pseudo-label round.")  # fmt: skip
@click.option("--gamma", type=float, default=1.0, show_default=True, help="The ridge γ of the solve.")
@click.option("--protection", type=click.Choice(["mask", "ckks"]), default="mask", show_default=True,
              help="The study's protection: pairwise masking or CKKS (each hospital accepts it at join: "
                   "--accept-protection).")  # fmt: skip
@click.option("--round-timeout", type=click.FloatRange(1), default=120.0, show_default=True,
              help="Seconds a round waits for a hospital's answer; one Flower still reports online is "
              "waited for up to round-limit (--set round-limit=S; default 10 times this).")  # fmt: skip
@click.option("--set", "extra", multiple=True, metavar="KEY=VALUE",
              help="Another run-config key (repeatable; secure_afl/deploy/apps.py).")  # fmt: skip
@click.option("--days", type=click.IntRange(1, 3650), default=365, show_default=True,
              help="Validity of the CA and the SuperLink certificate, in days.")  # fmt: skip
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing roster, app, TLS material and kits in --federation-dir.",
)
@renamed_option("--expect", "expected", old_names=("--fingerprint",), multiple=True, metavar="ID=FINGERPRINT",
              help="A hospital's fingerprint as you heard it from that hospital (`keys init`/`keys show` "
                   "print it; quote it): repeat for every --hospital. Any mismatch, or a --hospital "
                   "without one, refuses and writes nothing.")  # fmt: skip
@click.option("--yes", is_flag=True,
              help="Do not ask to confirm each hospital's fingerprint (a script that compared them "
                   "itself). Without --expect or --yes, provision asks at the terminal, and "
                   "refuses where there is none.")  # fmt: skip
def deploy_provision(
    out_dir: Path, hospitals: tuple[Path, ...], key_dir: Path | None, passphrase_file: Path | None,
    passphrase_env: str | None, hosts: tuple[str, ...], ips: tuple[str, ...], port: int, federation: str,
    features_path: Path | None, backbone: str | None, weights: Path | None, rounds: int, gamma: float,
    protection: str, round_timeout: float, extra: tuple[str, ...], days: int, force: bool,
    expected: tuple[str, ...], yes: bool,
) -> None:  # fmt: skip
    """Write the federation (the coordinator): roster, CA, app and one kit per hospital.

    \b
    Reads:  each --hospital's identity.pub.json, the coordinator's key (decrypted: it signs the
            kits' manifests and, in the run, the classifier), the study's backbone record.
    Checks: every hospital's fingerprint against --expect ID=FINGERPRINT (or a prompt at the
            terminal, or --yes), after every other check and before anything is written.
    Writes: DIR/roster.json (to be co-signed), DIR/tls/ (deploy tls's four files), DIR/app/
            (deploy app's pyproject.toml), DIR/server/, and DIR/kits/ID/ for every hospital (0700):
            ca.crt, roster.json, app/pyproject.toml, kit.json (signed manifest), node-config.toml,
            supernode.service, README.txt.
    Send each hospital its kit directory; it runs `secure-afl deploy join KIT`.
    """
    from secure_afl.cli_keys import load_key, recognition_from_options
    from secure_afl.deploy.provision import provision
    from secure_afl.keys.recognition import RosterNotRecognisedError
    from secure_afl.keys.store import PUBLIC_FILE, default_key_dir, read_entry_file

    if (passphrase_file is None) == (passphrase_env is None):
        raise click.UsageError(
            "give exactly one of --passphrase-file and --passphrase-env (the run reads it too)"
        )
    recognition = recognition_from_options(
        expected, yes, "--expect", "Provision a roster of these hospitals?"
    )
    directory = key_dir or default_key_dir()
    entries = [read_entry_file(p / PUBLIC_FILE if p.is_dir() else p) for p in hospitals]
    coordinator = read_entry_file(directory / PUBLIC_FILE)
    key = load_key(directory, passphrase_file, passphrase_env)
    secret = (
        f"--passphrase-file {passphrase_file}" if passphrase_file else f"--passphrase-env {passphrase_env}"
    )
    try:
        study = {
            **_backbone_record(features_path, backbone, weights), "gamma": gamma, "rounds": rounds,
            "protection": protection, "round-timeout": round_timeout, **_key_value_pairs(extra, "--set"),
        }  # fmt: skip
        result = provision(
            out_dir, entries, coordinator, key, study, hosts=hosts, ips=ips, port=port,
            federation=federation, days=days, force=force, recognition=recognition, say=click.echo,
        )  # fmt: skip
    except (ConfigurationError, DeploymentError, RosterNotRecognisedError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    out = result.out_dir
    click.echo(f"wrote {out / 'roster.json'}: {len(result.roster)} hospitals, {result.roster.fingerprint}")
    click.echo(
        f"wrote {out / 'tls'}: ca.crt, superlink.pem, superlink.key (0600), ca.key (0600: keep offline)"
    )
    click.echo(f"wrote {result.app_dir / 'pyproject.toml'} (the study) and {len(result.kits)} kits:")
    for cid, kit in result.kits.items():
        click.echo(f"  {kit}  -> send the whole directory to {cid}")
    click.echo(f"hospitals dial {result.superlink}. Next, on this host:")
    click.echo(f"  secure-afl deploy superlink --tls-dir {out / 'tls'} --listen ADDRESS:{port} "
               f"--state-dir {out / 'superlink'} --federation {federation}")  # fmt: skip
    click.echo(
        f"  secure-afl deploy collect --federation-dir {out} ID.reply.json ...   (the hospitals' replies)"
    )
    click.echo(
        f"  secure-afl deploy run --app-dir {result.app_dir} --federation {federation} --flwr-home "
        f"{out / 'superlink' / 'flwr'} --key-dir {directory} {secret}"
    )


@deploy.command("join")
@click.argument("kit_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option("--features", "features_path", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="This hospital's labelled feature file (`features extract`).")  # fmt: skip
@key_dir_option("This hospital's key directory (`keys init`; default $SECURE_AFL_HOME or ~/.secure-afl).",
                old_names=())  # fmt: skip
@click.option("--passphrase-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The key's passphrase file (0600): the node reads it too.")  # fmt: skip
@click.option("--passphrase-env", metavar="VAR", default=None,
              help="Or: the environment variable that holds it, where the node starts.")  # fmt: skip
@click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="The node's state: ledger/, out/, SuperNode key, supernode.log (default: "
                   "KIT/state; /var/lib/secure-afl-ID for a service).")  # fmt: skip
@renamed_option("--accept-protection", "protection", old_names=("--protection",), default="mask",
                show_default=True, metavar="mask|ckks|mask,ckks",
                help="The protections this hospital accepts (node config protection=): a study must use "
                     "one of them (mask,ckks: either).")  # fmt: skip
@click.option("--set", "extra", multiple=True, metavar="KEY=VALUE",
              help="Another node-config key (repeatable): dp-epsilon=1, colluders=0, ...")  # fmt: skip
@click.option("--node-port", type=click.IntRange(1, 65535), default=9094, show_default=True,
              help="The SuperNode's own local port (two SuperNodes on one host need two).")  # fmt: skip
@click.option("--user", default=None, help="The service's User= (default: the user running join).")
@click.option("--no-connect", is_flag=True, help="Do not check the SuperLink's address and certificate.")
@click.option("--timeout", type=click.FloatRange(0.1), default=10.0, show_default=True,
              help="Seconds to wait for the SuperLink.")  # fmt: skip
@click.option("--expect", "expected", multiple=True, metavar="ID=FINGERPRINT",
              help="An entry's fingerprint as you heard it from that institution (quote it): repeat for "
                   "every other hospital and the coordinator (yours is checked by your key). Any "
                   "mismatch, an entry not named, or a name not in the roster refuses: nothing is "
                   "signed or written.")  # fmt: skip
@click.option("--yes", is_flag=True,
              help="Do not ask to confirm each entry (a script that compared the fingerprints itself). "
                   "Without --expect or --yes, join asks at the terminal, and refuses where there is "
                   "none.")  # fmt: skip
def deploy_join(
    kit_dir: Path, features_path: Path, key_dir: Path | None, passphrase_file: Path | None,
    passphrase_env: str | None, state_dir: Path | None, protection: str, extra: tuple[str, ...],
    node_port: int, user: str | None, no_connect: bool, timeout: float, expected: tuple[str, ...],
    yes: bool,
) -> None:  # fmt: skip
    """Check this hospital's kit, co-sign its roster, and print the command that starts the node.

    \b
    Checks: the manifest's signature by the roster's coordinator, the CA and the app against it,
    this hospital's key in the roster, its feature file against the study, its ledger and
    out-dir, the SuperLink's TLS certificate against the kit's CA (unless --no-connect), the
    roster's co-signatures, and last every roster entry against --expect ID=FINGERPRINT (or a
    prompt at the terminal, or --yes): it co-signs only a roster whose every entry you recognise.
    Writes in KIT: ID.reply.json (send it to the coordinator: the roster co-signature and the
    SuperNode's key), node-config.toml and supernode.service; in --state-dir: the SuperNode's
    authentication key (0600, once).
    A newcomer to a running federation (a kit of a roster version after the first, which
    `deploy collect` issues): that version must already be co-signed by every institution
    (RosterNotCosignedError otherwise), and join pins it in the ledger directory, as `keys
    roster update` does: the node then refuses any other roster.
    Exit status: 0 ready to start; 3 the kit is sound but some hospitals have not co-signed the
    roster yet (put the co-signed roster.json the coordinator sends in KIT and run join again);
    1 a check failed (the message says which and what to do).
    """
    import getpass

    from secure_afl.cli_keys import recognition_from_options
    from secure_afl.deploy.check import NodeCheckError
    from secure_afl.deploy.kit import EXIT_WAITING, KitError, NodeLayout, join_kit
    from secure_afl.keys.recognition import RosterNotRecognisedError
    from secure_afl.keys.roster import RosterError
    from secure_afl.keys.store import KEY_FILE, default_key_dir, load_public_entry

    if (passphrase_file is None) == (passphrase_env is None):
        raise click.UsageError(
            "give exactly one of --passphrase-file and --passphrase-env (the node reads it)"
        )
    recognition = recognition_from_options(expected, yes, "--expect", "Co-sign this roster?")
    keys_dir = (key_dir or default_key_dir()).resolve()
    entry = load_public_entry(keys_dir)
    kit = kit_dir.resolve()
    layout = NodeLayout(
        client_id=entry.client_id, kit_dir=kit, identity_key=keys_dir / KEY_FILE,
        features=features_path.resolve(), state_dir=(state_dir or kit / "state").resolve(),
        passphrase_file=passphrase_file.resolve() if passphrase_file else None, passphrase_env=passphrase_env,
        user=user or getpass.getuser(), node_port=node_port, protection=protection,
        extra={k: str(v) for k, v in _key_value_pairs(extra, "--set").items()},
    )  # fmt: skip
    try:
        result = join_kit(
            layout, recognition=recognition, key_entry_public_key=entry.public_key, connect=not no_connect,
            timeout=timeout, say=click.echo,
        )  # fmt: skip
    except NodeCheckError as exc:
        raise click.ClickException(f"FAILED {exc}") from None
    except (KitError, ConfigurationError, DeploymentError, RosterNotRecognisedError, RosterError) as exc:
        raise click.ClickException(f"FAILED {type(exc).__name__}: {exc}") from None
    click.echo(f"wrote {result.reply_path}: send it to the coordinator (your co-signature and SuperNode key)")
    if not result.ready:
        click.echo(
            f"WAITING: the roster is not yet co-signed by {list(result.status.missing)}; the node would "
            f"refuse it. When the coordinator sends the co-signed roster.json, put it at "
            f"{kit / 'roster.json'}; then start its SuperNode (it refuses a roster that lacks a "
            f"co-signature), or run this join again first to check that roster:"
        )
        click.echo(f"  {result.start_command}")
        raise SystemExit(EXIT_WAITING)
    click.echo(f"{result.client_id}: ready. Start its SuperNode (keep it running):")
    click.echo(f"  {result.start_command}")
    click.echo(f"or as a service: sudo cp {result.unit_path} /etc/systemd/system/"
               f"secure-afl-supernode-{result.client_id}.service && sudo systemctl enable --now "
               f"secure-afl-supernode-{result.client_id}")  # fmt: skip


@deploy.command("collect")
@click.argument("replies", nargs=-1, type=click.Path(path_type=Path, exists=True))
@click.option("--federation-dir", "out_dir", type=click.Path(path_type=Path, file_okay=False, exists=True),
              default=None, metavar="DIR",
              help="The federation directory `deploy provision --federation-dir` wrote.  "
                   "[required]")  # fmt: skip
@click.option("--flwr-home", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="The coordinator's Flower config directory (default DIR/superlink/flwr, as "
                   "`deploy superlink --state-dir DIR/superlink` writes it).")  # fmt: skip
@click.option("--federation", default="federation", show_default=True, help="The federation's name.")
@click.option("--no-register", is_flag=True, help="Only merge the co-signatures; register no SuperNode key.")
@key_dir_option("The coordinator's key directory (default $SECURE_AFL_HOME or ~/.secure-afl): it signs the "
                "kits of a roster version after the first.", old_names=())  # fmt: skip
@click.option("--passphrase-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Its passphrase file (0600), when kits are to be signed.")  # fmt: skip
@click.option("--passphrase-env", metavar="VAR", default=None,
              help="Or: the environment variable that holds it.")  # fmt: skip
@click.pass_context
def deploy_collect(
    ctx: click.Context, replies: tuple[Path, ...], out_dir: Path | None, flwr_home: Path | None,
    federation: str, no_register: bool, key_dir: Path | None, passphrase_file: Path | None,
    passphrase_env: str | None,
) -> None:  # fmt: skip
    """Merge the hospitals' replies (the coordinator): co-signed roster, SuperNode registrations.

    \b
    Verifies each ID.reply.json against DIR/roster.json (its co-signature and its SuperNode
    key, both signed with that hospital's identity key), writes the co-signed roster to
    DIR/roster.json and to every DIR/kits/ID/roster.json, each SuperNode key to
    DIR/supernodes/ID.pub, and registers them (`flwr supernode register`) with the running
    SuperLink.  Then send each hospital its kits/ID/roster.json.
    A roster version after the first (DIR/roster.json moved there by `keys roster update`,
    co-signed by every institution): collect, with or without replies, first writes the kit
    of each institution whose kit is missing (a newcomer) or made for another roster, at that
    version, its manifest signed with the coordinator's key (--passphrase-file); send the
    newcomer its kits/ID/ (it runs `deploy join`), then collect its reply. A member the version
    removed gets no new kit (its kit is left as it was) and its SuperNode key is unregistered
    (`flwr supernode unregister`; with --no-register, or without the node id kept at its
    registration, the command is printed and it is not done).
    Exit status: 0 every hospital co-signed (after the first version: every institution has
    its kit and a SuperNode key, every removed member's key unregistered); 3 some have not yet
    (they are named); 1 an error.
    """
    from secure_afl.deploy.kit import EXIT_WAITING, KitError
    from secure_afl.deploy.processes import flower_bin
    from secure_afl.deploy.provision import collect

    out_dir, replies = _federation_dir_and_replies(ctx, out_dir, replies)
    if _roster_version(out_dir) > 1:
        _collect_at_version(out_dir, replies, no_register, flwr_home, federation, key_dir, passphrase_file,
                            passphrase_env)  # fmt: skip
        return
    try:
        result = collect(
            out_dir, replies, register=not no_register, flwr_home=flwr_home, federation=federation,
            flwr=flower_bin("flwr"), say=click.echo,
        )  # fmt: skip
    except (KitError, ConfigurationError, DeploymentError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    status = result.status
    click.echo(
        f"co-signed by {list(status.signed)}; wrote {out_dir / 'roster.json'} and each kit's roster.json"
    )
    if status.missing:
        click.echo(f"WAITING for {list(status.missing)}: run collect again with their replies")
        raise SystemExit(EXIT_WAITING)
    click.echo(f"every hospital co-signed ({status.roster.fingerprint}): send each its kits/ID/roster.json")


def _roster_version(out_dir: Path) -> int:
    """DIR/roster.json's version (1 when it cannot be read: collect's own checks name the problem)."""
    from secure_afl.keys.roster import Roster, RosterError

    try:
        return Roster.from_json((out_dir / "roster.json").read_text(encoding="utf-8")).version
    except (OSError, RosterError):
        return 1


def _collect_at_version(
    out_dir: Path, replies: tuple[Path, ...], no_register: bool, flwr_home: Path | None, federation: str,
    key_dir: Path | None, passphrase_file: Path | None, passphrase_env: str | None,
) -> None:  # fmt: skip
    """``collect`` at a roster version after the first: the replies (a newcomer's), then every kit at
    that version (a newcomer's written whole); waits (exit 3) for institutions without a SuperNode key."""
    from secure_afl.cli_keys import load_key
    from secure_afl.deploy.kit import EXIT_WAITING, KitError, issue_kits, kits_at_version
    from secure_afl.deploy.processes import flower_bin
    from secure_afl.deploy.provision import collect, retire_removed
    from secure_afl.keys.roster import RosterError
    from secure_afl.keys.store import default_key_dir

    try:
        if replies:
            collect(
                out_dir, replies, register=not no_register, flwr_home=flwr_home, federation=federation,
                flwr=flower_bin("flwr"), say=click.echo,
            )  # fmt: skip
        state = kits_at_version(out_dir)
        if state.stale:
            if (passphrase_file is None) == (passphrase_env is None):
                raise click.UsageError(
                    f"the kits of {list(state.stale)} are missing or made for another roster than "
                    f"{out_dir / 'roster.json'} (version {state.roster.version}): give --passphrase-file or "
                    "--passphrase-env (and --key-dir) of the coordinator's key, which signs them"
                )
            key = load_key(key_dir or default_key_dir(), passphrase_file, passphrase_env)
            issue_kits(out_dir, key, state.stale, say=click.echo)
        still_registered = retire_removed(
            out_dir, state.roster, register=not no_register, flwr_home=flwr_home, federation=federation,
            flwr="flwr" if no_register else flower_bin("flwr"), say=click.echo,
        )  # fmt: skip
    except (KitError, ConfigurationError, DeploymentError, RosterError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    roster = state.roster
    click.echo(f"roster version {roster.version} ({roster.fingerprint}): co-signed by every institution")
    new = [cid for cid in state.stale if cid in state.unregistered]
    for cid in new:
        click.echo(f"  {out_dir / 'kits' / cid}  -> send the whole directory to {cid} (it runs deploy join)")
    if still_registered:
        click.echo(f"NOT DONE: {list(still_registered)} left the roster but their SuperNode keys are still "
                   "registered: run the command(s) above")  # fmt: skip
    if state.unregistered:
        click.echo(f"WAITING for the replies of {list(state.unregistered)} (no SuperNode key yet): run "
                   "collect again with their ID.reply.json")  # fmt: skip
    if state.unregistered or still_registered:
        raise SystemExit(EXIT_WAITING)
    click.echo("every institution has its kit at this version and a registered SuperNode key")


def _federation_dir_and_replies(
    ctx: click.Context, out_dir: Path | None, replies: tuple[Path, ...]
) -> tuple[Path, tuple[Path, ...]]:
    """``collect --federation-dir DIR REPLY...``, or the old ``collect DIR REPLY...`` (with a note)."""
    if out_dir is None:
        if not replies or not replies[0].is_dir():
            raise click.UsageError(
                "give --federation-dir DIR: the directory `deploy provision` wrote", ctx=ctx
            )
        out_dir, replies = replies[0], replies[1:]
        deprecation_note(ctx, "the positional OUT_DIR", "--federation-dir", f"--federation-dir {out_dir}")
    for reply in replies:
        if reply.is_dir():
            raise click.BadParameter(f"{reply} is a directory, not an ID.reply.json", param_hint="REPLIES")
    return out_dir, replies


# --- secure-afl predict ----------------------------------------------------------------------------


@click.command()
@click.option("--model", "model_path", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="The classifier file (classifier.json, as the coordinator signed it).")  # fmt: skip
@click.option("--roster", "roster_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The roster this institution pinned (it names the coordinator): the classifier's "
                   "signature is verified against it. Required unless --no-verify.")  # fmt: skip
@click.option("--no-verify", "no_verify", is_flag=True,
              help="INSECURE: do not verify the coordinator's signature (the content digest is still "
                   "checked). Anyone could have written a file used this way.")  # fmt: skip
@click.option("--features", "features_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="A feature file (secure-afl-features/v1).")  # fmt: skip
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="Or: a directory of images, PNG, JPEG or DICOM (.png .jpg .jpeg .dcm .dicom), in "
                   "DIR itself, DIR/images/ or DIR/images_*/images/ (ChestXray14's layout); features "
                   "are extracted here with the model's backbone.")  # fmt: skip
@click.option("--weights", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The backbone's weight file (with --data-dir; default: the library cache).")  # fmt: skip
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="With --data-dir: where extracted features are cached, so a rerun on the same images "
    "reads them instead of running the backbone again (default: ~/.cache/secure-afl/features).",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="With --data-dir: where the backbone runs: auto (CUDA when available), cpu or cuda.",
)
@click.option("--out", "out_path", type=click.Path(path_type=Path, dir_okay=False),
              default=Path("predictions.csv"), show_default=True,
              help="The predictions CSV (see above).")  # fmt: skip
@click.option("--evaluate", is_flag=True,
              help="Also score the classifier on the labels of --features (a labelled feature file): "
                   "BACC, AUC and mAP over the classes the file labels, computed as the simulator "
                   "computes them.")  # fmt: skip
@click.option("--metrics-out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="With --evaluate: also write the metrics to this JSON file.")  # fmt: skip
def predict(
    model_path: Path,
    roster_path: Path | None,
    no_verify: bool,
    features_path: Path | None,
    data_dir: Path | None,
    weights: Path | None,
    cache_dir: Path | None,
    device: str,
    out_path: Path,
    evaluate: bool,
    metrics_out: Path | None,
) -> None:
    """Per-image scores and decisions of a signed classifier file, as CSV.

    \b
    Reads: --model (classifier.json), --roster (verifies the coordinator's signature), and either
    --features (a feature file) or --data-dir (PNG, JPEG or DICOM images, features extracted
    here; a file that cannot be read is named with why, and the command exits 1 after writing
    the others' rows; none found or none readable: nothing is written).
    Writes: --out, a CSV with one row per image: image_id, then score(CLASS) for every class (the
    linear score h·w: it ranks images; it is not a probability), then positive(CLASS) for every
    class (1 when score > logit of the file's signed threshold: score > 0 at its default 0.5).
    The decisions are the balanced rule: the weights are fit to class-balanced targets, so a
    decision weighs a class's positives and negatives equally, aiming at balanced sensitivity and
    specificity; it is not calibrated to prevalence (on a rare class it flags many more images
    than are positive). No probability is offered: none is calibrated.
    With --evaluate (labelled --features only): prints BACC, AUC and mAP; --metrics-out writes them.
    """

    from secure_afl.deploy.classifier import Classifier
    from secure_afl.deploy.errors import ClassifierFileError, ModelMismatchError, RosterMismatchError
    from secure_afl.features.file import FeatureFileError, load_feature_file
    from secure_afl.keys.store import load_roster_file

    if (features_path is None) == (data_dir is None):
        raise click.UsageError("give exactly one of --features FILE or --data-dir DIR")
    if roster_path is None and not no_verify:
        raise click.UsageError(
            "give --roster FILE, the roster your institution pinned: the classifier's signature is checked "
            "against its coordinator (or --no-verify to skip that check, at your own risk)"
        )
    if roster_path is not None and no_verify:
        raise click.UsageError("give --roster or --no-verify, not both")
    if metrics_out is not None and not evaluate:
        raise click.UsageError("--metrics-out needs --evaluate")
    if evaluate and features_path is None:
        raise click.UsageError("--evaluate needs a labelled --features file (images have no labels)")
    roster = load_roster_file(roster_path) if roster_path is not None else None
    labels, active, unreadable = None, (), None
    try:
        model = Classifier.load(model_path, roster=roster)
        if features_path is not None:
            data = load_feature_file(features_path, require_labels=evaluate)
            model.check_features(data.describe_backbone(), data.dim, data.classes)
            features, ids, labels, active = data.features, data.image_ids, data.labels, data.active
        else:
            assert data_dir is not None  # exactly one of the two, checked above
            found = _extract_directory(model, data_dir, weights, cache_dir, device, out_path)
            features, ids, unreadable = found
        scores = model.decision_function(features)
    except (ClassifierFileError, RosterMismatchError, ModelMismatchError, FeatureFileError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    if roster is not None:
        coordinator = roster.coordinator
        click.echo(f"verified: signed by the coordinator {model.signer} ({coordinator.fingerprint})")  # type: ignore[union-attr]
    else:
        click.echo("WARNING: --no-verify: the coordinator's signature was NOT checked", err=True)
    from secure_afl.deploy.verify import verification_status

    click.echo(verification_status(model_path))  # did this node check it against the session's sums
    decisions = model.decide(scores)
    model.write_predictions(out_path, ids, scores, decisions)
    for line in [*model.summary_lines(), *model.privacy_lines()]:
        click.echo(line)
    positives = decisions.sum(axis=0)
    counts = ", ".join(f"{c} {int(n)}" for c, n in zip(model.classes, positives, strict=True))
    click.echo(f"wrote {out_path}: {len(ids)} images; positives per class: {counts}")
    for line in model.prediction_legend():
        click.echo(f"  {line}")
    if evaluate and labels is not None and features_path is not None:  # require_labels: never None
        result = evaluate_classifier(model, scores, labels, active)
        _print_metrics(result, features_path)
        if metrics_out is not None:
            metrics_out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
            click.echo(f"wrote {metrics_out}")
    if unreadable is not None:  # the readable images' rows are written; the run still failed
        raise click.ClickException(f"{type(unreadable).__name__}: {unreadable}")


def evaluate_classifier(
    model: object, scores: np.ndarray, labels: np.ndarray, active: Collection[int]
) -> dict[str, object]:
    """The simulator's metrics (:func:`secure_afl.sim.metrics.evaluate`) of a classifier's scores on
    the classes a feature file labels (the others' columns are all zeros: unlabelled, not negative).

    AUC and AP rank the scores; BACC scores the file's own decisions (score > logit(threshold),
    which is the simulator's ``score > 0`` at the default threshold 0.5).
    """
    from secure_afl.sim.metrics import evaluate

    columns = sorted(int(c) for c in active)
    if not columns:
        raise click.ClickException("the feature file labels no class (its 'active' list is empty)")
    classes = [model.classes[c] for c in columns]  # type: ignore[attr-defined]
    decisions = model.decide(scores)  # type: ignore[attr-defined]
    try:
        metrics = evaluate(labels[:, columns], scores[:, columns], decisions[:, columns], kind="logits")
    except ValueError as exc:
        raise click.ClickException(f"cannot evaluate: {exc}") from None
    per_class = metrics.to_dict()["per_class"]
    return {
        "images": int(labels.shape[0]),
        "classes": classes,
        "decision_threshold": model.decision_threshold,  # type: ignore[attr-defined]
        "macro": metrics.macro,
        "per_class": {
            name: {key: per_class[key][i] for key in ("bacc", "auc", "ap")} for i, name in enumerate(classes)
        },
        "positives": {name: int(labels[:, c].sum()) for name, c in zip(classes, columns, strict=True)},
    }


def _print_metrics(result: Mapping[str, object], source: Path) -> None:
    macro = result["macro"]
    per_class = result["per_class"]
    assert isinstance(macro, dict) and isinstance(per_class, dict)
    click.echo(
        f"metrics on {source} ({result['images']} images, {len(per_class)} labelled classes; NaN: a class "
        "with only positives or only negatives here): "
        f"BACC {100 * macro['bacc']:.2f} %, AUC {100 * macro['auc']:.2f} %, mAP {macro['map']:.4f}"
    )
    for name, values in per_class.items():
        click.echo(
            f"  {name:<24} BACC {100 * values['bacc']:6.2f} %  AUC {100 * values['auc']:6.2f} %  "
            f"AP {values['ap']:.4f}  ({result['positives'][name]} positive)"  # type: ignore[index]
        )


def _extract_directory(
    model, data_dir: Path, weights: Path | None, cache_dir: Path | None, device: str, out_path: Path
):
    """The features and ids of the images :func:`~secure_afl.features.images.find_images` finds, and
    the error naming those that could not be read (None when all were): the caller raises it after
    writing the others' rows. None readable, or none found, raises here."""
    from secure_afl.deploy.errors import ModelMismatchError
    from secure_afl.features.backbones import UnknownBackboneError, WeightsError, load_backbone
    from secure_afl.features.extraction import extract_features
    from secure_afl.features.file import describe_preprocessing
    from secure_afl.features.images import CorruptImageError, NoImagesError, find_images

    try:
        backbone = load_backbone(model.backbone["name"], weights)
    except (UnknownBackboneError, WeightsError) as exc:
        raise ModelMismatchError(f"cannot load the model's backbone: {exc}") from None
    model.check_features(
        {"name": backbone.name, "weights_id": backbone.weights_id,
         "preprocessing": describe_preprocessing(backbone.preprocess)},
        backbone.feature_dim,
    )  # fmt: skip
    try:
        images = find_images(data_dir)  # the same rule as `features extract --images`
        names = sorted(images)
        cache = cache_dir or Path.home() / ".cache" / "secure-afl" / "features"
        result = extract_features([images[n] for n in names], backbone, cache_dir=cache, device=device)
    except (NoImagesError, CorruptImageError) as exc:  # CorruptImageError: an image changed meanwhile
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    unreadable = result.unreadable_error(out_path)
    if unreadable is not None and len(result.skipped) == len(names):
        raise click.ClickException(f"{type(unreadable).__name__}: {unreadable}")
    keep = [i for i in range(len(names)) if i not in set(result.skipped)]
    return result.features[keep], [names[i] for i in keep], unreadable
