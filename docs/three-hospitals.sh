#!/usr/bin/env bash
# README's "Three hospitals" section, run literally on one machine: three hospital directories with
# their own passphrases, a coordinator directory, a TLS SuperLink and three SuperNodes on distinct
# ports, from keys to a verified classifier and its metrics. Every command below is the one README
# shows; only the paths ($W/...), the ports and the stand-ins for real data differ:
#   - the "agreed weight file" is a randomly initialised ResNet-18 saved here (no download), and
#   - each hospital's images are a few random PNGs with a random labels CSV.
# Usage: bash docs/three-hospitals.sh [WORK_DIR]   (with the project's venv active)
set -euo pipefail
W=$(realpath -m "${1:-$(mktemp -d)}")
mkdir -p "$W"
cd "$W"
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
HOSPITALS=(hospital-a hospital-b hospital-c)
declare -A NAME=([hospital-a]="Hospital A" [hospital-b]="Hospital B" [hospital-c]="Hospital C")
# The classes (indices into secure-afl's 8) each hospital labels: every class by at least two.
declare -A LABELS=([hospital-a]="Atelectasis,Cardiomegaly,Effusion,Infiltration,Mass"
                   [hospital-b]="Effusion,Infiltration,Mass,Nodule,Pneumonia,Pneumothorax"
                   [hospital-c]="Atelectasis,Cardiomegaly,Nodule,Pneumonia,Pneumothorax")

echo "== stand-ins: the agreed weight file and each hospital's images"
python3 - <<'PY'
import csv, os, random
import numpy as np, torch, torchvision
from PIL import Image
torch.manual_seed(0)
torch.save(torchvision.models.resnet18().state_dict(), "resnet18-agreed.pth")
rng = random.Random(0)
labels = {"hospital-a": "Atelectasis,Cardiomegaly,Effusion,Infiltration,Mass",
          "hospital-b": "Effusion,Infiltration,Mass,Nodule,Pneumonia,Pneumothorax",
          "hospital-c": "Atelectasis,Cardiomegaly,Nodule,Pneumonia,Pneumothorax"}
for h, classes in labels.items():
    os.makedirs(f"{h}/images", exist_ok=True)
    with open(f"{h}/labels.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", *classes.split(",")])
        for i in range(24):
            pixels = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (64, 64), dtype=np.uint8)
            Image.fromarray(pixels).save(f"{h}/images/{i:03d}.png")
            w.writerow([f"{i:03d}.png", *(rng.randint(0, 1) for _ in classes.split(","))])
PY

echo "== 1. identity keys (each hospital, and the coordinator)"
export HOSPITAL_A_PASS="alpha correct horse battery" HOSPITAL_B_PASS="bravo staple lamp cactus"
export HOSPITAL_C_PASS="charlie river nine window" COORDINATOR_PASS="delta orbit salt meadow"
for h in "${HOSPITALS[@]}"; do
  var=$(echo "${h^^}_PASS" | tr - _)
  secure-afl keys init --id "$h" --name "${NAME[$h]}" --dir "$h/keys" --passphrase-env "$var"
done
secure-afl keys init --id coordinator --name "Coordinator" --dir coordinator/keys --passphrase-env COORDINATOR_PASS

echo "== 2. the roster (coordinator), pinned and checked by each hospital"
for h in "${HOSPITALS[@]}"; do
  secure-afl keys roster add --roster coordinator/roster.json --entry "$h/keys/identity.pub.json" \
      --fingerprint "$(jq -r .fingerprint "$h/keys/identity.pub.json")"   # the fingerprint heard on the call
done
secure-afl keys roster add --roster coordinator/roster.json --coordinator \
    --entry coordinator/keys/identity.pub.json --fingerprint "$(jq -r .fingerprint coordinator/keys/identity.pub.json)"
for h in "${HOSPITALS[@]}"; do
  cp coordinator/roster.json "$h/roster.json"
  secure-afl keys roster show --roster "$h/roster.json" --dir "$h/keys" | tail -1
done

echo "== 3. features (each hospital)"
for h in "${HOSPITALS[@]}"; do
  secure-afl features extract --images "$h/images" --labels "$h/labels.csv" \
      --backbone resnet18 --weights resnet18-agreed.pth --out "$h/features.npz" --no-progress | tail -3
done
secure-afl features show hospital-a/features.npz | tail -6

echo "== 4. TLS and the SuperLink (coordinator)"
secure-afl deploy tls --host localhost --ip 127.0.0.1 --out coordinator/tls
# The SuperLink gets no passphrase variable (deploy superlink scrubs its environment): a 0600 file.
(umask 077; printf '%s\n' "$COORDINATOR_PASS" > coordinator/passphrase)
secure-afl deploy app --out coordinator/app --roster coordinator/roster.json \
    --identity-key coordinator/keys/identity.key --passphrase-file coordinator/passphrase --out-dir coordinator/out \
    --backbone resnet18 --weights resnet18-agreed.pth --round-timeout 60
CONTROL_PORT=${CONTROL_PORT:-$(free_port)}
setsid secure-afl deploy superlink --tls coordinator/tls --listen "${LINK_HOST:-127.0.0.1}:$LINK_PORT" \
    --control-port "$CONTROL_PORT" --state-dir coordinator/superlink > coordinator/superlink.log 2>&1 &
pids+=($!)
for _ in $(seq 300); do grep -q "^ready: " coordinator/superlink.log 2>/dev/null && break; sleep 0.2; done
grep -q "^ready: " coordinator/superlink.log || { cat coordinator/superlink.log; echo "FAILED: no SuperLink"; exit 1; }
export FLWR_HOME="$W/coordinator/superlink/flwr"   # the coordinator's Control API, on 127.0.0.1 only

echo "== 5. SuperNode authentication keys (each hospital), registered by the coordinator"
for h in "${HOSPITALS[@]}"; do
  secure-afl deploy node-key "$h/supernode-auth"
  flwr supernode register "$h/supernode-auth.pub" federation
done

echo "== 6. each hospital checks its node, then starts its SuperNode"
port=$((LINK_PORT + 1))
for h in "${HOSPITALS[@]}"; do
  var=$(echo "${h^^}_PASS" | tr - _)
  config="identity-key=\"$W/$h/keys/identity.key\" passphrase-env=\"$var\" roster=\"$W/$h/roster.json\" features=\"$W/$h/features.npz\" ledger-dir=\"$W/$h/ledger\" out-dir=\"$W/$h/out\""
  secure-afl deploy check --node-config "$config" --study coordinator/app \
      --superlink "127.0.0.1:$LINK_PORT" --root-certificates coordinator/tls/ca.crt | tail -1
  port=$((port + 1))
  setsid flower-supernode --superlink "127.0.0.1:$LINK_PORT" --root-certificates coordinator/tls/ca.crt \
      --auth-supernode-private-key "$h/supernode-auth" --port "$port" --node-config "$config" > "$h/supernode.log" 2>&1 &
  pids+=($!)
done

echo "== 7. the run (coordinator)"
secure-afl deploy run coordinator/app federation --tick 10

echo "== 8. each hospital verifies and evaluates the classifier it received"
for h in "${HOSPITALS[@]}"; do
  secure-afl predict --model "$h/out/classifier.json" --roster "$h/roster.json" --features "$h/features.npz" \
      --out "$h/predictions.csv" --evaluate | grep -E "verified|metrics"
done
sed 's/"decision_threshold": 0.5/"decision_threshold": 0.1/' hospital-a/out/classifier.json > hospital-a/tampered.json
if secure-afl predict --model hospital-a/tampered.json --roster hospital-a/roster.json \
    --features hospital-a/features.npz --out /dev/null 2> hospital-a/tampered.err; then
  echo "FAILED: a tampered threshold was accepted"; exit 1
fi
echo "a changed threshold is refused: $(tail -1 hospital-a/tampered.err)"

echo "== 9. as a hospital: flwr ls and flwr run against the hospitals' address must fail"
mkdir -p hospital-a/flwr
printf '[superlink]\ndefault = "c"\n\n[superlink.c]\naddress = "127.0.0.1:%s"\nroot-certificates = "%s"\n' \
    "$LINK_PORT" "$W/coordinator/tls/ca.crt" > hospital-a/flwr/config.toml
if FLWR_HOME="$W/hospital-a/flwr" flwr ls c > hospital-a/flwr-ls.out 2>&1; then
  cat hospital-a/flwr-ls.out; echo "FAILED: a hospital listed the coordinator's runs"; exit 1
fi
if FLWR_HOME="$W/hospital-a/flwr" flwr run coordinator/app c > hospital-a/flwr-run.out 2>&1; then
  cat hospital-a/flwr-run.out; echo "FAILED: a hospital started a run at the coordinator"; exit 1
fi
for out in hospital-a/flwr-ls.out hospital-a/flwr-run.out; do  # refused by the front, not for another reason
  grep -q "404 Not Found" "$out" || { cat "$out"; echo "FAILED: $out is not the front's refusal"; exit 1; }
done
echo "refused by the front (404 Not Found): flwr ls and flwr run from a hospital"
echo "done: $W"
