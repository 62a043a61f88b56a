#!/usr/bin/env bash
# docs/how-to-three-hospitals.md's table (H1-H5, C1-C5), run literally on one machine: three hospitals
# and a coordinator, each in its own directory with its own HOME (hence ~/.secure-afl) and passphrase
# file, a SuperLink behind its Fleet-only front and three SuperNodes, on 127.0.0.1 with free ports.
# Every party command is that page's, run from that party's directory; only these differ:
#   - addresses and ports (--host localhost --ip 127.0.0.1 --port, --listen, --control-port, --node-port),
#   - the fingerprints the page writes as 'SHA256:…' are the ones each party's `keys init` printed
#     (what the others hear read aloud),
#   - the "agreed weight file" is a randomly initialised ResNet-18 saved here (no download),
#   - each hospital's images are random PNGs with random labels: training images and held-out ones.
# Files "sent" between parties are copied (cp) in the order of the page's table. Then each hospital
# evaluates its received classifier on its held-out features (its predict must say the node verified it
# against the session's sums, SECURITY.md 5.1, after each classifier), and, as a hospital, `flwr ls`,
# `flwr run` and `flwr supernode register` against the hospitals' address must fail. Then the page's section 5:
# hospital-d joins (roster version 2, its kit from collect, its SuperNode) and takes part in the second
# classifier, hospital-b rotates its key, hospital-c leaves, and every party's audit log must verify (an
# edited copy must not). Any failing step exits non-zero.
# Usage: bash docs/three-hospitals.sh [WORK_DIR]   (with the project's venv on PATH)
set -euo pipefail
W=$(realpath -m "${1:-$(mktemp -d)}")
mkdir -p "$W"
cd "$W"
started=$(date +%s)
pids=()
cleanup() {  # SIGTERM every process group, wait up to 20 s for them to stop, then SIGKILL the rest
  for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
  for _ in $(seq 100); do
    alive=0; for pid in "${pids[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return; sleep 0.2
  done
  for pid in "${pids[@]}"; do kill -9 -- "-$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
LINK_PORT=${LINK_PORT:-$(free_port)}
CONTROL_PORT=${CONTROL_PORT:-$(free_port)}
HOSPITALS=(hospital-a hospital-b hospital-c)
declare -A NAME=([hospital-a]="Hospital A" [hospital-b]="Hospital B" [hospital-c]="Hospital C")
declare -A PASS=([hospital-a]="alpha correct horse battery" [hospital-b]="bravo staple lamp cactus"
                 [hospital-c]="charlie river nine window" [coordinator]="delta orbit salt meadow")

# party NAME 'COMMAND': COMMAND as the how-to page writes it, in NAME's directory with NAME's HOME, stopped
# after STEP_TIMEOUT seconds (900).
party() {
  local who=$1; shift
  mkdir -p "$W/$who/home"
  (cd "$W/$who" && env -u FLWR_HOME HOME="$W/$who/home" SECURE_AFL_HOME="$W/$who/home/.secure-afl" \
      timeout -k 10 "${STEP_TIMEOUT:-900}" bash -c "set -euo pipefail; $*")
}
# party_bg NAME LOG 'COMMAND': the same, in the background in its own process group (stopped at exit).
party_bg() {
  local who=$1 log=$2; shift 2
  mkdir -p "$W/$who/home"
  (cd "$W/$who" && exec env -u FLWR_HOME HOME="$W/$who/home" SECURE_AFL_HOME="$W/$who/home/.secure-afl" \
      setsid bash -c "exec $*" > "$log" 2>&1) &
  pids+=($!)
}
wait_for() {  # wait_for FILE PATTERN SECONDS: until FILE has a line matching PATTERN (bounded)
  local deadline=$(( $(date +%s) + $3 ))
  until grep -q "$2" "$1" 2>/dev/null; do
    [ "$(date +%s)" -lt "$deadline" ] || { cat "$1" 2>/dev/null; echo "FAILED: no '$2' in $1 after $3 s"; exit 1; }
    sleep 0.2
  done
}

echo "== stand-ins: the agreed weight file, each hospital's images (training and held-out), passphrases"
mkdir -p coordinator "${HOSPITALS[@]}"
python3 - <<'PY'
import csv, os, random
import numpy as np, torch, torchvision
from PIL import Image
torch.manual_seed(0)
torch.save(torchvision.models.resnet18().state_dict(), "resnet18-agreed.pth")
rng = random.Random(0)
# The classes each hospital labels: every class by at least two.
labels = {"hospital-a": "Atelectasis,Cardiomegaly,Effusion,Infiltration,Mass",
          "hospital-b": "Effusion,Infiltration,Mass,Nodule,Pneumonia,Pneumothorax",
          "hospital-c": "Atelectasis,Cardiomegaly,Nodule,Pneumonia,Pneumothorax"}
for h, classes in labels.items():
    classes = classes.split(",")
    for part, count in (("images", 24), ("held-out", 12)):
        os.makedirs(f"{h}/data/{part}", exist_ok=True)
        rows = [[rng.randint(0, 1) for _ in classes] for _ in range(count)]
        for c in range(len(classes)):  # every class both positive and negative, so AUC is defined
            rows[0][c], rows[1][c] = 1, 0
        with open(f"{h}/data/{part}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["image", *classes])
            for i, row in enumerate(rows):
                pixels = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (64, 64), dtype=np.uint8)
                Image.fromarray(pixels).save(f"{h}/data/{part}/{part[0]}{i:03d}.png")
                w.writerow([f"{part[0]}{i:03d}.png", *row])
PY
for h in "${HOSPITALS[@]}"; do cp resnet18-agreed.pth "$h/"; done  # each party holds the agreed file
cp resnet18-agreed.pth coordinator/
for who in "${HOSPITALS[@]}" coordinator; do (umask 077; printf '%s\n' "${PASS[$who]}" > "$who/pass"); done

# FP[ID]: the fingerprint `keys init` printed for ID, as the others hear it read aloud (the script
# takes it from that party's own output, never from a file that travelled).
declare -A FP
fingerprint_of() {  # fingerprint_of ID OUTPUT_FILE: the "fingerprint:" line keys init printed
  FP[$1]=$(sed -n 's/^fingerprint: *//p' "$2")
  [[ "${FP[$1]}" =~ ^SHA256:[0-9a-f\ ]+$ ]] || { cat "$2"; echo "FAILED: no fingerprint for $1"; exit 1; }
}

echo "== H1. key (each hospital): send ~/.secure-afl/identity.pub.json to the coordinator, read the fingerprint aloud"
for h in "${HOSPITALS[@]}"; do
  party "$h" "secure-afl keys init --id $h --name \"${NAME[$h]}\" --passphrase-file pass" > "$h/keys.out"
  fingerprint_of "$h" "$h/keys.out"
  mkdir -p "coordinator/$h"
  cp "$h/home/.secure-afl/identity.pub.json" "coordinator/$h/"
  echo "$h: ${FP[$h]}"
done

echo "== C1. key (coordinator): read its fingerprint aloud to each hospital"
party coordinator 'secure-afl keys init --id coordinator --name "Coordinator" --passphrase-file pass' \
    > coordinator/keys.out
fingerprint_of coordinator coordinator/keys.out
echo "coordinator: ${FP[coordinator]}"

echo "== C2. provision (coordinator): send fed/kits/ID/ to each hospital"
party coordinator "secure-afl deploy provision --federation-dir fed/ --hospital hospital-a/ --hospital hospital-b/ \
    --hospital hospital-c/ --expect hospital-a='${FP[hospital-a]}' \
    --expect hospital-b='${FP[hospital-b]}' --expect hospital-c='${FP[hospital-c]}' \
    --passphrase-file pass --host localhost --ip 127.0.0.1 --port $LINK_PORT \
    --backbone resnet18 --weights resnet18-agreed.pth" > coordinator/provision.out
grep -E "^ok  roster entries" coordinator/provision.out
for h in "${HOSPITALS[@]}"; do cp -r "coordinator/fed/kits/$h" "$h/kit"; done

echo "== C3. SuperLink (coordinator; keep it running)"
party_bg coordinator "$W/coordinator/superlink.out" "secure-afl deploy superlink --tls-dir fed/tls \
    --listen 127.0.0.1:$LINK_PORT --control-port $CONTROL_PORT --state-dir fed/superlink"
wait_for coordinator/superlink.out "^ready: " 60

echo "== H2. features (each hospital): its training images, and held-out ones for the evaluation"
for h in "${HOSPITALS[@]}"; do
  party "$h" 'secure-afl features extract --images data/images --labels data/images.csv --backbone resnet18 \
      --weights resnet18-agreed.pth --out features.npz' > "$h/features.out" 2>&1 \
      || { cat "$h/features.out"; echo "FAILED: $h features extract"; exit 1; }
  echo "$h: $(grep -E '^wrote ' "$h/features.out")"
  # The held-out set H5 evaluates on (the page: "on held-out images").
  party "$h" 'secure-afl features extract --images data/held-out --labels data/held-out.csv --backbone resnet18 \
      --weights resnet18-agreed.pth --out held-out.npz' > "$h/held-out.out" 2>&1 \
      || { cat "$h/held-out.out"; echo "FAILED: $h held-out features extract"; exit 1; }
done

echo "== as hospital-a: a join that expects another key for hospital-b is refused, and signs nothing"
if party hospital-a "secure-afl deploy join kit/ --features features.npz --passphrase-file pass \
    --expect hospital-b='${FP[hospital-c]}' --expect hospital-c='${FP[hospital-c]}' \
    --expect coordinator='${FP[coordinator]}' --no-connect" > hospital-a/join-mismatch.out 2>&1; then
  cat hospital-a/join-mismatch.out; echo "FAILED: a join with a wrong fingerprint co-signed"; exit 1
fi
grep -q "FINGERPRINT MISMATCH for 'hospital-b'" hospital-a/join-mismatch.out \
    || { cat hospital-a/join-mismatch.out; echo "FAILED: not refused for the fingerprint"; exit 1; }
[ ! -e hospital-a/kit/hospital-a.reply.json ] && [ ! -e hospital-a/kit/state ] \
    || { echo "FAILED: the refused join wrote into the kit"; exit 1; }
echo "refused: $(grep -m1 "FINGERPRINT MISMATCH" hospital-a/join-mismatch.out | sed 's/^ *//')"

echo "== H3. join (each hospital): send kit/ID.reply.json to the coordinator"
declare -A START
for h in "${HOSPITALS[@]}"; do
  node_port=$(free_port)
  expect=""  # every other entry, as heard from that party (its own entry is checked by its key)
  for who in "${HOSPITALS[@]}" coordinator; do
    [ "$who" = "$h" ] || expect+=" --expect $who='${FP[$who]}'"
  done
  code=0
  party "$h" "secure-afl deploy join kit/ --features features.npz --passphrase-file pass$expect \
      --node-port $node_port" > "$h/join.out" 2>&1 || code=$?
  # 3: the kit is sound, the other hospitals have not co-signed yet (nobody has, at this point).
  [ "$code" = 3 ] || { cat "$h/join.out"; echo "FAILED: $h join exited $code, not 3 (waiting)"; exit 1; }
  grep -E "^ok  roster entries|^ok  recorded study|^WAITING" "$h/join.out"
  START[$h]=$(grep -E "^  .*flower-supernode " "$h/join.out" | sed 's/^  //')
  [ -n "${START[$h]}" ] || { cat "$h/join.out"; echo "FAILED: $h join printed no start command"; exit 1; }
  cp "$h/kit/$h.reply.json" coordinator/
done

echo "== C4. collect (coordinator): send fed/kits/ID/roster.json back to each hospital"
party coordinator 'secure-afl deploy collect --federation-dir fed/ hospital-a.reply.json hospital-b.reply.json hospital-c.reply.json'
for h in "${HOSPITALS[@]}"; do cp "coordinator/fed/kits/$h/roster.json" "$h/kit/roster.json"; done

echo "== H4. start (each hospital): the command join printed"
for h in "${HOSPITALS[@]}"; do
  echo "$h: ${START[$h]}"
  party_bg "$h" /dev/null "${START[$h]}"
done

echo "== C5. run (coordinator; it signs the classifier, here)"
party coordinator 'secure-afl deploy run --app-dir fed/app --federation federation --flwr-home fed/superlink/flwr \
    --key-dir ~/.secure-afl --passphrase-file pass'

echo "== each hospital verifies the classifier it received and evaluates it on held-out features"
for h in "${HOSPITALS[@]}"; do
  party "$h" 'secure-afl predict --model kit/state/out/classifier.json --roster kit/roster.json \
      --features held-out.npz --evaluate' > "$h/predict.out" 2>&1 \
      || { cat "$h/predict.out"; echo "FAILED: $h predict"; exit 1; }
  grep -E "^verified|^classifier check|^metrics" "$h/predict.out"
  cmp -s "$h/kit/state/out/classifier.json" coordinator/fed/server/classifier.json \
      || { echo "FAILED: $h received another classifier than the coordinator's"; exit 1; }
done
echo "every hospital holds the coordinator's classifier, byte for byte"
verified_by_every() {  # verified_by_every ID...: each node's predict says it verified its classifier against
  # the session's sums (SECURITY.md 5.1: stored as verified), and the coordinator's report names the same nodes
  for h in "$@"; do
    grep -q "^classifier check: verified by this node" "$h/predict.out" \
        || { cat "$h/predict.out"; echo "FAILED: $h did not store the classifier as verified"; exit 1; }
  done
  python3 - "$@" <<'PY' || { echo "FAILED: the coordinator's report.json does not list every node as verified"; exit 1; }
import json, sys
verified = json.load(open("coordinator/fed/server/report.json")).get("verified")
print(f"report.json: verified by {verified}")
sys.exit(sorted(verified or []) != sorted(sys.argv[1:]))
PY
}
verified_by_every "${HOSPITALS[@]}"
echo "every hospital stored the classifier as verified against the sums (predict: classifier check: verified)"
sed 's/"decision_threshold": 0.5/"decision_threshold": 0.1/' hospital-a/kit/state/out/classifier.json \
    > hospital-a/tampered.json
cmp -s hospital-a/tampered.json hospital-a/kit/state/out/classifier.json \
    && { echo "FAILED: the tampering changed nothing"; exit 1; }
if party hospital-a 'secure-afl predict --model tampered.json --roster kit/roster.json --features held-out.npz \
    --out /dev/null' 2> hospital-a/tampered.err; then
  echo "FAILED: a tampered threshold was accepted"; exit 1
fi
echo "a changed threshold is refused: $(tail -1 hospital-a/tampered.err)"

echo "== as a hospital: flwr ls, flwr run and flwr supernode register against the hospitals' address must fail"
mkdir -p hospital-a/home/.flwr
printf '[superlink]\ndefault = "c"\n\n[superlink.c]\naddress = "127.0.0.1:%s"\nroot-certificates = "%s"\n' \
    "$LINK_PORT" "$W/hospital-a/kit/ca.crt" > hospital-a/home/.flwr/config.toml
if party hospital-a 'FLWR_HOME=~/.flwr flwr ls c' > hospital-a/flwr-ls.out 2>&1; then
  cat hospital-a/flwr-ls.out; echo "FAILED: a hospital listed the coordinator's runs"; exit 1
fi
if party hospital-a 'FLWR_HOME=~/.flwr flwr run kit/app c' > hospital-a/flwr-run.out 2>&1; then
  cat hospital-a/flwr-run.out; echo "FAILED: a hospital started a run at the coordinator"; exit 1
fi
# And registering a SuperNode key of its own making (node authentication's bypass).
party hospital-a 'secure-afl deploy node-key rogue-auth' > /dev/null
if party hospital-a 'FLWR_HOME=~/.flwr flwr supernode register rogue-auth.pub c' \
    > hospital-a/flwr-register.out 2>&1; then
  cat hospital-a/flwr-register.out; echo "FAILED: a hospital registered a SuperNode key"; exit 1
fi
for out in hospital-a/flwr-ls.out hospital-a/flwr-run.out hospital-a/flwr-register.out; do
  # refused by the front, not for another reason
  grep -q "404" "$out" || { cat "$out"; echo "FAILED: $out is not the front's refusal"; exit 1; }
done
echo "refused by the front (404): flwr ls, flwr run and flwr supernode register from a hospital"

# Membership and keys after the first classifier (the page's section 4): roster versions 2-4, each co-signed
# by every institution it lists and pinned by each node with `keys roster update` (its kit/roster.json).
# sign_in FILE ID...: each ID co-signs FILE in turn (the file travels from party to party), expecting every
# other entry's fingerprint as heard from that party.
sign_in() {
  local file=$1; shift
  for who in "$@"; do
    local expect=""
    for other in "${MEMBERS[@]}" coordinator; do [ "$other" = "$who" ] || expect+=" --expect $other='${FP[$other]}'"; done
    cp "$file" "$who/roster.next.json"
    party "$who" "secure-afl keys roster sign --roster roster.next.json --passphrase-file pass$expect" \
        > "$who/sign.out" || { cat "$who/sign.out"; echo "FAILED: $who keys roster sign"; exit 1; }
    cp "$who/roster.next.json" "$file"
  done
}
# update_at FILE [OPTIONS] ID...: each ID (a hospital: its kit/roster.json and ledger; the coordinator:
# fed/roster.json) moves to roster FILE; OPTIONS (--expect ...) go to every update.
update_at() {
  local file=$1 options=$2; shift 2
  for who in "$@"; do
    cp "$file" "$who/roster.new.json"
    if [ "$who" = coordinator ]; then
      party coordinator "secure-afl keys roster update --roster fed/roster.json --new roster.new.json $options"
    else
      party "$who" "secure-afl keys roster update --roster kit/roster.json --new roster.new.json \
          --ledger-dir kit/state/ledger $options"
    fi > "$who/update.out" || { cat "$who/update.out"; echo "FAILED: $who keys roster update"; exit 1; }
    grep -E "^ok  |is now roster version" "$who/update.out" | sed "s/^/$who: /"
  done
}
node_check() {  # node_check ID: the node's own checks (roster and its pin, key, ledger) on its node config
  party "$1" 'secure-afl deploy check --config kit/node-config.toml' > "$1/check.out" 2>&1 \
      || { cat "$1/check.out"; echo "FAILED: $1 deploy check"; exit 1; }
  grep -E "^ok  (roster|identity key|ledger) " "$1/check.out" | sed "s/^/$1: /"
}

echo "== D1. a fourth hospital joins: key (hospital-d), added to roster version 2, co-signed by all four"
mkdir -p hospital-d
(umask 077; printf '%s\n' "delta four river lantern" > hospital-d/pass)
party hospital-d 'secure-afl keys init --id hospital-d --name "Hospital D" --passphrase-file pass' > hospital-d/keys.out
fingerprint_of hospital-d hospital-d/keys.out
mkdir -p coordinator/hospital-d && cp hospital-d/home/.secure-afl/identity.pub.json coordinator/hospital-d/
party coordinator "secure-afl keys roster next --roster fed/roster.json --out roster.v2.json && secure-afl keys \
    roster add --roster roster.v2.json --entry hospital-d/identity.pub.json --expect hospital-d='${FP[hospital-d]}'"
MEMBERS=(hospital-a hospital-b hospital-c hospital-d)
sign_in coordinator/roster.v2.json "${MEMBERS[@]}"
update_at coordinator/roster.v2.json "--expect hospital-d='${FP[hospital-d]}'" hospital-a hospital-b hospital-c coordinator
node_check hospital-a

echo "== a node refuses to go back: roster version 1 again is refused by update, and by the node if copied"
cp coordinator/fed/kits/hospital-a/roster.json hospital-a/roster.v1.json
if party hospital-a 'secure-afl keys roster update --roster kit/roster.json --new roster.v1.json \
    --ledger-dir kit/state/ledger' > hospital-a/rollback.out 2>&1; then
  cat hospital-a/rollback.out; echo "FAILED: a rollback to version 1 was accepted"; exit 1
fi
grep -q "RosterSuccessionError" hospital-a/rollback.out || { cat hospital-a/rollback.out; echo "FAILED: rollback"; exit 1; }
cp hospital-a/kit/roster.json hospital-a/roster.pinned.json && cp hospital-a/roster.v1.json hospital-a/kit/roster.json
if party hospital-a 'secure-afl deploy check --config kit/node-config.toml' > hospital-a/copied.out 2>&1; then
  cat hospital-a/copied.out; echo "FAILED: the node accepted a roster copied back by hand"; exit 1
fi
grep -q "RosterNotPinnedError" hospital-a/copied.out || { cat hospital-a/copied.out; echo "FAILED: not the pin"; exit 1; }
mv hospital-a/roster.pinned.json hospital-a/kit/roster.json
echo "refused: RosterSuccessionError (update), RosterNotPinnedError (the node)"

echo "== D2. kits at roster version 2 (coordinator): collect issues hospital-d's, and renews the members'"
code=0
party coordinator 'secure-afl deploy collect --federation-dir fed/ --passphrase-file pass' \
    > coordinator/collect-v2.out 2>&1 || code=$?
# 3: every kit is issued; hospital-d's reply (its SuperNode key) is still to come.
[ "$code" = 3 ] || { cat coordinator/collect-v2.out; echo "FAILED: collect at version 2 exited $code, not 3"; exit 1; }
grep -E "^wrote |^WAITING" coordinator/collect-v2.out
cp -r coordinator/fed/kits/hospital-d hospital-d/kit

echo "== D3. hospital-d: the agreed weights, its features (H2), join (H3: every other entry expected)"
cp resnet18-agreed.pth hospital-d/
python3 - <<'PY'
import csv, os, random
import numpy as np
from PIL import Image
rng = random.Random(1)
# hospital-d labels every class the others label; A, B and C each add new images (their first ones are
# released: a node releases only images its ledger has not released, whatever the study).
every = "Atelectasis,Cardiomegaly,Effusion,Infiltration,Mass,Nodule,Pneumonia,Pneumothorax"
parts = {"hospital-d": [("images", "i", 24, every), ("held-out", "h", 12, every)]}
for h in ("hospital-a", "hospital-b", "hospital-c"):
    with open(f"{h}/data/images.csv", newline="") as f:
        parts[h] = [("images", "n", 24, ",".join(next(csv.reader(f))[1:]))]
for h, batches in parts.items():
    for part, prefix, count, classes in batches:
        classes = classes.split(",")
        os.makedirs(f"{h}/data/{part}", exist_ok=True)
        rows = [[rng.randint(0, 1) for _ in classes] for _ in range(count)]
        for c in range(len(classes)):
            rows[0][c], rows[1][c] = 1, 0
        new = not os.path.exists(f"{h}/data/{part}.csv")
        with open(f"{h}/data/{part}.csv", "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["image", *classes])
            for i, row in enumerate(rows):
                pixels = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (64, 64), dtype=np.uint8)
                Image.fromarray(pixels).save(f"{h}/data/{part}/{prefix}{i:03d}.png")
                w.writerow([f"{prefix}{i:03d}.png", *row])
PY
party hospital-d 'secure-afl features extract --images data/images --labels data/images.csv --backbone resnet18 \
    --weights resnet18-agreed.pth --out features.npz' > hospital-d/features.out 2>&1 \
    || { cat hospital-d/features.out; echo "FAILED: hospital-d features extract"; exit 1; }
party hospital-d 'secure-afl features extract --images data/held-out --labels data/held-out.csv --backbone resnet18 \
    --weights resnet18-agreed.pth --out held-out.npz' > hospital-d/held-out.out 2>&1 \
    || { cat hospital-d/held-out.out; echo "FAILED: hospital-d held-out features extract"; exit 1; }
expect=""
for who in hospital-a hospital-b hospital-c coordinator; do expect+=" --expect $who='${FP[$who]}'"; done
party hospital-d "secure-afl deploy join kit/ --features features.npz --passphrase-file pass$expect \
    --node-port $(free_port)" > hospital-d/join.out 2>&1 \
    || { cat hospital-d/join.out; echo "FAILED: hospital-d join (version 2 is co-signed: it must exit 0)"; exit 1; }
grep -E "^ok  roster entries|^ok  pinned roster version|ready" hospital-d/join.out
START[hospital-d]=$(grep -E "^  .*flower-supernode " hospital-d/join.out | sed 's/^  //')
[ -n "${START[hospital-d]}" ] || { cat hospital-d/join.out; echo "FAILED: hospital-d join printed no start command"; exit 1; }
cp hospital-d/kit/hospital-d.reply.json coordinator/

echo "== D4. collect (coordinator): hospital-d's reply, its SuperNode key registered"
party coordinator 'secure-afl deploy collect --federation-dir fed/ hospital-d.reply.json'

echo "== D5. start (hospital-d): the command join printed"
echo "hospital-d: ${START[hospital-d]}"
party_bg hospital-d /dev/null "${START[hospital-d]}"

echo "== D6. the second classifier: A, B and C extract again with their new images (H2), the coordinator runs (C5)"
for h in hospital-a hospital-b hospital-c; do
  party "$h" 'secure-afl features extract --images data/images --labels data/images.csv --backbone resnet18 \
      --weights resnet18-agreed.pth --out features.npz' > "$h/features.out" 2>&1 \
      || { cat "$h/features.out"; echo "FAILED: $h features extract (new images)"; exit 1; }
done
party coordinator 'secure-afl deploy run --app-dir fed/app --federation federation --flwr-home fed/superlink/flwr \
    --key-dir ~/.secure-afl --passphrase-file pass'
for h in "${MEMBERS[@]}"; do
  cmp -s "$h/kit/state/out/classifier.json" coordinator/fed/server/classifier.json \
      || { echo "FAILED: $h does not hold the second classifier"; exit 1; }
  party "$h" 'secure-afl predict --model kit/state/out/classifier.json --roster kit/roster.json \
      --features held-out.npz --evaluate' > "$h/predict.out" 2>&1 \
      || { cat "$h/predict.out"; echo "FAILED: $h predict (second classifier)"; exit 1; }
  grep -E "^verified|^classifier check|^metrics" "$h/predict.out" | sed "s/^/$h: /"
done
verified_by_every "${MEMBERS[@]}"
echo "all four hospitals hold the second classifier, byte for byte, each stored as verified"

echo "== R1. hospital-b rotates its key (its ledger moves to the new key); roster version 3 carries the statement"
party hospital-b 'secure-afl keys rotate --passphrase-file pass --ledger-dir kit/state/ledger' > hospital-b/rotate.out
grep -E "^ok  moved the ledger" hospital-b/rotate.out
FP[hospital-b]=$(sed -n 's/^fingerprint: *//p' hospital-b/rotate.out)
cp hospital-b/home/.secure-afl/rotation.json coordinator/hospital-b.rotation.json
party coordinator "secure-afl keys roster next --roster fed/roster.json --out roster.v3.json && secure-afl keys \
    roster rotate --roster roster.v3.json --statement hospital-b.rotation.json --expect hospital-b='${FP[hospital-b]}'"
sign_in coordinator/roster.v3.json "${MEMBERS[@]}"
update_at coordinator/roster.v3.json "" hospital-a hospital-b hospital-c hospital-d coordinator
node_check hospital-b

echo "== X1. hospital-c leaves: roster version 4 without it, co-signed by the three that stay"
party coordinator 'secure-afl keys roster next --roster fed/roster.json --out roster.v4.json && secure-afl keys \
    roster remove --roster roster.v4.json --id hospital-c'
MEMBERS=(hospital-a hospital-b hospital-d)
sign_in coordinator/roster.v4.json "${MEMBERS[@]}"
update_at coordinator/roster.v4.json "" hospital-a hospital-b hospital-d coordinator
# collect at version 4: kits for A, B and D, none for hospital-c, whose SuperNode key it unregisters.
party coordinator 'secure-afl deploy collect --federation-dir fed/ --passphrase-file pass' \
    > coordinator/collect-v4.out 2>&1 || { cat coordinator/collect-v4.out; echo "FAILED: collect at version 4"; exit 1; }
grep -q "^unregistered the SuperNode key of hospital-c" coordinator/collect-v4.out \
    || { cat coordinator/collect-v4.out; echo "FAILED: hospital-c's SuperNode key was not unregistered"; exit 1; }
grep -E "^renewed |^hospital-c is not|^unregistered " coordinator/collect-v4.out
for h in hospital-a hospital-b hospital-d; do
  node_check "$h"
  party "$h" "secure-afl keys ledger show --ledger-dir kit/state/ledger --client-id $h" | sed -n "1,2s/^/$h: /p"
done
party hospital-a 'secure-afl keys roster show --roster kit/roster.json' | grep -E "^hospital-|^version|^revoked|co-signed"

echo "== A1. audit (every party): its log verifies against its roster and the versions kept beside it"
for h in hospital-a hospital-b hospital-c hospital-d; do
  party "$h" "secure-afl audit verify --ledger-dir kit/state/ledger --roster kit/roster.json" \
      > "$h/audit.out" 2>&1 || { cat "$h/audit.out"; echo "FAILED: $h's audit log does not verify"; exit 1; }
  sed "s/^/$h: /" "$h/audit.out"
done
party coordinator 'secure-afl audit verify --log fed/server/audit.log --roster fed/roster.json' \
    > coordinator/audit.out 2>&1 || { cat coordinator/audit.out; echo "FAILED: the coordinator's audit log"; exit 1; }
sed "s/^/coordinator: /" coordinator/audit.out

echo "== as hospital-a's DPO: a copy of its log with one record edited by hand is refused, the record named"
sed '3s/"time":"20/"time":"19/' hospital-a/kit/state/ledger/audit.log > hospital-a/audit.edited.log
cmp -s hospital-a/audit.edited.log hospital-a/kit/state/ledger/audit.log && { echo "FAILED: the edit changed nothing"; exit 1; }
code=0
party hospital-a 'secure-afl audit verify --log audit.edited.log --roster kit/roster.json' \
    > hospital-a/audit-edited.out 2>&1 || code=$?
[ "$code" = 1 ] && grep -q "INVALID at line 3 (record 2): its signature does not verify" hospital-a/audit-edited.out \
    || { cat hospital-a/audit-edited.out; echo "FAILED: the edited record was not named (exit $code)"; exit 1; }
echo "refused: $(grep -m1 INVALID hospital-a/audit-edited.out)"
echo "done in $(( $(date +%s) - started )) s: $W"
