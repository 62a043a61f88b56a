"""Which honest layouts still run round 2: the pseudo groups the server forms (deploy/study.py's
``round2_classes``) against the size rule alone, and the nodes that would refuse what it forms.

Usage: ``python bench/round2_layouts.py RESULTS.json ...`` with the results.json of
``secure-afl sim --missing N --client-policy deployment --out DIR`` (its ``active_classes``), then
a seed-0 draw of three hospitals over 8 classes.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from secure_afl.deploy.study import round2_classes
from secure_afl.privacy.policy import ClientPolicy, layout_refusals


def row(tag: str, active: dict[str, tuple[int, ...]], n_classes: int) -> str:
    n = len(active)
    members = {c: sorted(cid for cid, a in active.items() if c not in a) for c in range(n_classes)}
    minimum = max(2, n - ((2 * n) // 3 + 1) + 2)
    by_size = tuple(c for c, ids in members.items() if len(ids) >= minimum)
    kept = round2_classes(members, minimum)
    groups = {f"pseudo/{c}": members[c] for c in kept}
    tensors = {f"pseudo/{c}": (f"b_pseudo/{c}",) for c in kept}
    refusing = sorted({r.client for r in layout_refusals(groups, tensors, policy=ClientPolicy.deployment())})
    return f"| {tag} | {minimum} | {list(by_size)} | {list(kept)} | {refusing or 'none'} |"


def main(paths: list[str]) -> None:
    print("| layout | min group | size rule alone | formed now | nodes refusing it |")
    print("|---|---|---|---|---|")
    for path in paths:
        with open(path, encoding="utf-8") as file:
            setting = json.load(file)["settings"][0]
        active = setting["active_classes"]
        if isinstance(active, list):
            active = {f"client-{k}": tuple(a) for k, a in enumerate(active)}
        print(row(f"sim n = 8, missing {setting['missing']}", active, 8))
    rng = np.random.default_rng(0)
    for m in (1, 3, 5, 7):
        active = {
            f"h{k}": tuple(sorted(set(range(8)) - set(rng.choice(8, m, replace=False).tolist())))
            for k in range(3)
        }
        print(row(f"3 hospitals, missing {m}", active, 8))


if __name__ == "__main__":
    main(sys.argv[1:])
