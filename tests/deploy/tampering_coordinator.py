"""A tampering coordinator, for tests: ``python tests/deploy/tampering_coordinator.py deploy local ...``
runs secure-afl's ``deploy local`` with its app directory's ServerApp replaced by this module: the
coordinator's own server, which changes one weight of the solved classifier (by a millionth of its
column's norm) before the coordinator signs and delivers it.  The ClientApps stay secure-afl's: every
honest node must refuse to store the classifier (SECURITY.md §5.1)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from secure_afl.deploy import apps, server

server_app = apps.server_app  # the ServerApp Flower loads from this module (an assignment: flwr checks it)

HONEST = '"secure_afl.deploy.apps:server_app"'
TAMPERING = '"tampering_coordinator:server_app"'


def _tampered(solve: Any) -> Any:
    def run(self: server.FederationServer, *args: Any, **kwargs: Any) -> Any:
        classifier = solve(self, *args, **kwargs)
        weights = classifier.weights.copy()
        weights[5, 1] += 1e-6 * float(np.linalg.norm(weights[:, 1]))
        return dataclasses.replace(classifier, weights=weights)

    return run


def main() -> None:
    """``deploy local`` whose app directory carries this module as its ServerApp."""
    from secure_afl.cli import main as cli
    from secure_afl.deploy import local

    write = local.write_app

    def write_app(directory: Path, run_config: Any) -> Path:
        path = write(directory, run_config)
        shutil.copy(__file__, path / "tampering_coordinator.py")
        toml = path / "pyproject.toml"
        text = toml.read_text(encoding="utf-8")
        assert HONEST in text, "secure-afl's app directory no longer names its ServerApp this way"
        toml.write_text(text.replace(HONEST, TAMPERING), encoding="utf-8")
        return path

    local.write_app = write_app
    cli()


if __name__ == "__main__":
    main()
else:  # loaded by Flower's ServerApp process from the app directory: the coordinator tampers
    server.FederationServer.run = _tampered(server.FederationServer.run)
