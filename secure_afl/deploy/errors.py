"""Deployment errors, named after what went wrong and at which party."""

from __future__ import annotations


class DeploymentError(Exception):
    """Base class of the deployment's own errors (protocol errors keep their own classes)."""


class ConfigurationError(DeploymentError):
    """A node or run setting that is missing or invalid (names the setting and how to fix it)."""


class StudyParameterError(ConfigurationError):
    """A study's method or protocol parameter (γ, τ, α, δ⁺, δ⁻, rounds, threshold, minimum group size,
    fractional bits, dimension) of the wrong type or outside its range: names it, its value, the
    range and how to fix it.  Raised wherever a study is made: ``deploy app``, ``check --study``,
    ``provision``, and at a node on the study the server sent (R0, before anything is computed)."""


class IdentityNotInRosterError(DeploymentError):
    """This institution's identity key is not in the roster it pinned (raised at that institution)."""


class RosterMismatchError(DeploymentError):
    """The server's roster differs from the one this institution pinned (raised at the client)."""


class StudyMismatchError(DeploymentError):
    """The run's study (classes, dimension, backbone, method) does not match this client's data or policy."""


class UncheckedStudyError(StudyMismatchError):
    """The run's study is not the one this institution checked with ``deploy check --study`` (or it
    checked none): names both digests (raised at the client, before anything is computed)."""


class ChainBudgetExceededError(StudyMismatchError):
    """A DP session that would take this institution's ε over its recorded releases past its
    node's ``dp-epsilon`` (the patient unit composes every release, of any study or chain): names the
    ε spent, the session's, the total and the limit (raised at the client in R0, before anything is
    computed)."""


class RoundNotInStudyError(StudyMismatchError):
    """A session labelled with a round the pinned study does not run (round 2 of a one-round study)."""


class CoordinatorChoiceRefusedError(StudyMismatchError):
    """A study whose uploads would be a function the coordinator chooses of this node's data (round 2's
    teacher), refused under the deployment policy before anything is computed; a node opts in only by
    declaring an honest-but-curious coordinator (node config ``coordinator``)."""


class SessionReplayError(DeploymentError):
    """A session message that belongs to another run, or a session started twice in one run."""


class FederationAbortedError(DeploymentError):
    """The server could not finish: too few clients, a group too small, or every client refused."""


class ModelMismatchError(DeploymentError):
    """``predict``: the features do not come from the model's backbone, weights or preprocessing."""


class ClassifierFileError(DeploymentError):
    """A classifier file that is malformed or fails its integrity digest."""


class ClassifierTamperedError(ClassifierFileError):
    """A classifier file whose content (threshold, weights, classes, ...) does not match its digest."""


class UnsignedClassifierError(ClassifierFileError):
    """A classifier file that carries no coordinator signature (or an old, unsigned format)."""


class ClassifierSignatureError(ClassifierFileError):
    """A classifier file signed by someone other than the roster's coordinator, or not verifying."""


class ClassifierNotOfStudyError(ClassifierFileError):
    """A signed classifier file whose study-decided fields (classes, threshold, backbone, method, DP
    settings, study digest) are not those of the study the node took part in."""


class ClassifierAuditMisstatedError(ClassifierFileError):
    """A signed classifier file whose audit states a session's groups (members, survivors, tensors,
    derivations) other than the node derived them from the session it took part in."""


class LocalDeploymentError(DeploymentError):
    """``deploy local``: a child process failed to start or exited early (its log is named)."""


class SuperLinkSetupError(DeploymentError):
    """``deploy superlink``: a bad argument, a missing TLS file or front binary, a failed start."""
