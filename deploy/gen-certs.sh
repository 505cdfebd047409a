#!/usr/bin/env bash
# Writes a development CA, a server certificate (SANs: localhost, 127.0.0.1, every
# compose service name, and the epp Service and worker pods of deploy/k8s, e.g.
# prefill-0.prefill), a client certificate for mTLS, and one certificate per local
# worker (prefill-0 ... decode-1: SANs its name, localhost, 127.0.0.1) into DIR (default
# ./certs).
# For local clusters and tests only: production certificates come from your own PKI.
set -euo pipefail
dir=${1:-certs}
mkdir -p "$dir"
cd "$dir"
san="DNS:localhost,IP:127.0.0.1,DNS:gossip,DNS:slot-broker,DNS:cost-oracle,DNS:scheduler-1,DNS:scheduler-2,DNS:router,DNS:prober,DNS:prefill-0,DNS:prefill-1,DNS:decode-0,DNS:decode-1,DNS:epp,DNS:*.prefill,DNS:*.decode"
openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=kvrs-dev-ca" \
  -keyout ca.key -out ca.pem 2>/dev/null
issue() {
  local name=$1 ext=$2
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kvrs-$name" \
    -keyout "$name.key" -out "$name.csr" 2>/dev/null
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 365 \
    -extfile <(printf '%s\n' "$ext") -out "$name.pem" 2>/dev/null
  rm -f "$name.csr"
}
issue server "subjectAltName=$san
extendedKeyUsage=serverAuth,clientAuth"
issue client "extendedKeyUsage=clientAuth"
# One certificate per worker: with mTLS, gossip lets an instance register and heartbeat
# only as an id its certificate names, so each worker can speak only for itself.
instances="prefill-0 prefill-1 decode-0 decode-1"
for instance in $instances; do
  issue "$instance" "subjectAltName=DNS:$instance,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth"
done
chmod 600 ./*.key
echo "wrote $(pwd)/{ca,server,client,${instances// /,}}.{pem,key}"
