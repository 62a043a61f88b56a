"""secure-afl: privacy-hardened one-round analytic federated learning."""

__version__ = "0.1.0"
