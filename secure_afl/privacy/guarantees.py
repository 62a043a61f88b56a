"""What each protection guarantees, per backend and client policy: the one source of the report's words.

Every sentence the simulator's report (terminal, report.md, results.json) or a backend's
``trust_model`` prints about security comes from :data:`GUARANTEES`, which says in words what
SECURITY.md §1.4 (the guarantee matrix), §3.1-§3.2 (the policies and the colluder bound) and
§7.1-§7.2 (CKKS) specify:

* ``mask`` under the simulator policy defends an honest-but-curious server only: T - 1 colluders
  rebuild no mask, but the sums are not checked (a sum that determines a value is reported);
* ``mask`` under the deployment policy defends an active server with up to c = n - t colluders,
  t = floor(2n/3) + 1;
* ``ckks`` under either policy: one colluding client reads every upload (one shared secret key);
* ``none``: the server receives every value.

:data:`ROUND_TWO` says what round 2 (a teacher the coordinator chooses) gives an active coordinator,
whatever the policy.  ``tests/test_guarantees.py`` checks the table and that the report prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from secure_afl.privacy.policy import ClientPolicy

Backend = Literal["mask", "ckks", "none"]
PolicyName = Literal["simulator", "deployment"]
BACKENDS: tuple[str, ...] = get_args(Backend)
POLICIES: tuple[str, ...] = get_args(PolicyName)


@dataclass(frozen=True, slots=True)
class Guarantee:
    """What one backend under one client policy guarantees, in three clauses."""

    backend: Backend
    policy: PolicyName
    server_learns: str  # what the server learns
    defended_against: str  # which server (honest-but-curious or active) is defended, and how
    colluders: str  # the colluder bound

    @property
    def text(self) -> str:
        """The three clauses as one sentence (a backend's ``trust_model``, the report's line)."""
        return f"{self.server_learns}; {self.defended_against}; {self.colluders}."

    def line(self, where: str = "") -> str:
        """The report's line: which backend and policy (and ``where``, if given), then :attr:`text`."""
        return f"Guarantee ({self.backend}, {self.policy} policy{', ' + where if where else ''}): {self.text}"


_SUMS_REPORTED = "sums that determine a value (one-member groups, overlaps) are reported, not refused"
_SUMS_REFUSED = "a client refuses sums that would determine its value (SECURITY.md §3.3 R5)"
_ONE_KEY = (
    "one colluding client reads every upload, and any client given a ciphertext reads it: every client "
    "holds the one secret key (TenSEAL has no threshold decryption)"
)
_PLAINTEXT = "the server receives every client's statistics individually"
_UNDEFENDED = "defended: nothing (no protection)"

GUARANTEES: dict[tuple[str, str], Guarantee] = {
    (g.backend, g.policy): g
    for g in (
        Guarantee(
            "mask",
            "simulator",
            f"the server learns the group sums over survivors; {_SUMS_REPORTED}",
            "defended: an honest-but-curious server, not an active one",
            "T − 1 colluding clients rebuild no honest client's mask, but the sums are not checked",
        ),
        Guarantee(
            "mask",
            "deployment",
            f"the server learns only group sums over survivors; {_SUMS_REFUSED}",
            "defended: an active server (signed survivor sets, one view, no double reveal, the ledger)",
            "up to c = n − t colluding clients, t = ⌊2n/3⌋ + 1, so c < n/3 (fewer where a node's config "
            "lowers its colluders); beyond c nothing is claimed",
        ),
        Guarantee(
            "ckks",
            "simulator",
            f"the server learns the group sums over survivors, rounded to 2^-24; {_SUMS_REPORTED}",
            "defended: an honest-but-curious server colluding with no client, not an active one",
            _ONE_KEY,
        ),
        Guarantee(
            "ckks",
            "deployment",
            f"the server learns only group sums over survivors, rounded to 2^-24; {_SUMS_REFUSED}",
            "defended: an active server colluding with no client (clients decrypt only sums they verified, "
            "under one signed view, each chunk once: SECURITY.md §7.1 C1–C4)",
            _ONE_KEY,
        ),
        Guarantee("none", "simulator", _PLAINTEXT, _UNDEFENDED, "no colluder is needed"),
        Guarantee("none", "deployment", _PLAINTEXT, _UNDEFENDED, "no colluder is needed"),
    )
}

ROUND_TWO = (
    "Round 2's uploads are computed with a teacher the coordinator chooses; an honest-but-curious "
    "coordinator learns the pseudo-label sums as listed; an active one can choose the teacher to read a "
    "hospital's round-2 values exactly (SECURITY.md §3.6); a deployed node refuses round 2 unless its "
    'node config declares an honest coordinator (coordinator = "honest-but-curious").'
)


def policy_name(policy: ClientPolicy) -> PolicyName:
    """The table's row for a client policy: ``"deployment"`` only for one that refuses what the
    deployment policy refuses (exposure, groups below 2, t below ⌊2n/3⌋ + 1, a second release);
    any other policy claims no more than the simulator's."""
    deployed = ClientPolicy.deployment()
    if (
        policy.refuse_exposure
        and policy.threshold_rule == deployed.threshold_rule
        and policy.min_group_size >= deployed.min_group_size
        and policy.one_contribution
        and policy.assume_colluders
    ):
        return "deployment"
    return "simulator"


def guarantee(backend: str, policy: str | ClientPolicy) -> Guarantee:
    """The entry for ``backend`` ("mask", "ckks" or "none") under ``policy`` (a name or a policy)."""
    name = policy_name(policy) if isinstance(policy, ClientPolicy) else policy
    if backend not in BACKENDS:
        raise ValueError(f"unknown protection {backend!r}: use one of {', '.join(BACKENDS)}")
    if name not in POLICIES:
        raise ValueError(f"unknown client policy {name!r}: use one of {', '.join(POLICIES)}")
    return GUARANTEES[(backend, name)]
