"""``secure-afl deploy app`` as a library: the coordinator's Flower app, checked as the ServerApp
will check it, then written.

The app directory's ``pyproject.toml`` carries the run config (the study, the roster, where the
server writes); the coordinator's identity key is checked (it must be the roster's coordinator and
its passphrase must open it) but never written there: ``deploy run`` signs, the ServerApp never
sees the key.  With a SuperLink address, ``FLWR_HOME/config.toml`` names the connection.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from secure_afl.keys.roster import Roster

from .apps import coordinator_signer, study_from_run_config
from .errors import ConfigurationError
from .study import Study, parse_colluders
from .writers import write_app

__all__ = ["CoordinatorApp", "SuperLinkConnection", "plan_coordinator_app", "write_coordinator_app"]


@dataclass(frozen=True)
class SuperLinkConnection:
    """``[superlink.FEDERATION]`` in ``FLWR_HOME/config.toml``: TLS with a CA, or insecure."""

    address: str
    federation: str
    flwr_home: Path
    root_certificates: Path | None  # None: insecure

    @property
    def path(self) -> Path:
        return self.flwr_home / "config.toml"

    def text(self) -> str:
        lines = ["[superlink]", f'default = "{self.federation}"', "", f"[superlink.{self.federation}]"]
        lines.append(f'address = "{self.address}"')
        if self.root_certificates is not None:
            lines.append(f"root-certificates = {json.dumps(str(self.root_certificates.resolve()))}")
        else:
            lines.append("insecure = true")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CoordinatorApp:
    """A checked app: what :func:`write_coordinator_app` writes, and what was checked."""

    app_dir: Path
    run_config: Mapping[str, object]
    study: Study
    roster: Roster
    signer: Any  # deploy.classifier.ClassifierSigner: the roster's coordinator, its key opened
    signing: Mapping[str, str]  # identity-key and passphrase-file or passphrase-env (deploy run's)
    connection: SuperLinkConnection | None

    @property
    def pyproject(self) -> Path:
        return self.app_dir / "pyproject.toml"


def plan_coordinator_app(
    app_dir: Path,
    roster: Roster,
    roster_path: Path,
    signing: Mapping[str, str],
    server_out: Path,
    study_config: Mapping[str, object],
    *,
    connection: SuperLinkConnection | None = None,
    force: bool = False,
) -> CoordinatorApp:
    """Check everything the ServerApp and ``deploy run`` will check (the study, the coordinator's key
    and passphrase, the colluders), and that nothing would be overwritten without ``force``; raises
    :class:`ConfigurationError` naming what to change.  Nothing is written."""
    config: dict[str, object] = {
        "roster": str(roster_path.resolve()),
        "out-dir": str(server_out.resolve()),
        **study_config,
    }
    study = study_from_run_config(config)
    signer = coordinator_signer(signing, roster)
    parse_colluders(str(config.get("colluders", "n-t")), len(roster), study.threshold_for(len(roster)))
    app = CoordinatorApp(app_dir, config, study, roster, signer, dict(signing), connection)
    if app.pyproject.exists() and not force:
        raise ConfigurationError(f"{app.pyproject} exists: choose another --out or pass --force")
    if connection is not None and connection.path.exists() and not force:
        raise ConfigurationError(
            f"{connection.path} exists: pass --force to replace it, or another --flwr-home"
        )
    return app


def write_coordinator_app(app: CoordinatorApp) -> None:
    """Write the app's ``pyproject.toml`` and, with a connection, ``FLWR_HOME/config.toml``."""
    write_app(app.app_dir, app.run_config)
    if app.connection is not None:
        app.connection.flwr_home.mkdir(parents=True, exist_ok=True)
        app.connection.path.write_text(app.connection.text(), encoding="utf-8")
