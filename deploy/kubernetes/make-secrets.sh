#!/usr/bin/env bash
# Makes the Secrets deploy/kubernetes expects, in OUT_DIR/secrets.yaml (nothing is sent to a
# cluster: `kubectl apply -f OUT_DIR/secrets.yaml` does that):
#   kvbridge-auth           tokens: the token table of the registry and router (hashed entries)
#   kvbridge-client-tokens  router, gateway, prefill, decode: each component's own token
#   kvbridge-api-keys       api-keys: the gateway's 'API_KEY TENANT' lines (one key, tenant
#                           "default"; add your own)
#   kvbridge-tls            ca.crt, tls.crt, tls.key: a CA and a certificate for the registry,
#                           router and gateway Services (openssl)
# OUT_DIR also keeps what you need yourself: admin-token (role admin, for `kvbridge leases
# ...` through a port-forward), api-key, and the CA's key (ca.key), to keep apart.
# Usage: deploy/kubernetes/make-secrets.sh [-n NAMESPACE] OUT_DIR
# Tokens come from `kvbridge auth token`; set KVBRIDGE to run it some other way, e.g.
# KVBRIDGE="docker run --rm kvbridge:latest".
set -euo pipefail
namespace=kvbridge
if [ "${1:-}" = "-n" ]; then namespace="$2"; shift 2; fi
if [ $# -ne 1 ]; then
  echo "usage: $0 [-n NAMESPACE] OUT_DIR" >&2
  exit 2
fi
out="$1"
kvbridge="${KVBRIDGE:-kvbridge}"
for tool in openssl kubectl; do
  command -v "$tool" >/dev/null || { echo "$0: needs $tool" >&2; exit 1; }
done
mkdir -p "$out"
umask 077
: > "$out/tokens"

# token NAME ARGS...: appends the hashed table line, writes the token itself to $out/NAME.
token() {
  local name="$1"; shift
  $kvbridge auth token --hashed --name "$name" "$@" >>"$out/tokens" 2>"$out/$name.stderr"
  awk '{print $NF}' "$out/$name.stderr" | tr -d '\n' > "$out/$name"
  rm "$out/$name.stderr"
}
token router --role router
token gateway --role gateway
token prefill --role reader
# Decode pods are named kvbridge-decode-<hash>-<id>, and their engine id is the pod's name.
token decode --role holder --holder 'kvbridge-decode-*'
token admin --role admin
mv "$out/admin" "$out/admin-token"
$kvbridge auth check "$out/tokens" >/dev/null

api_key="sk-kvb-$(openssl rand -hex 24)"
printf '%s' "$api_key" > "$out/api-key"
printf '%s default\n' "$api_key" > "$out/api-keys"

# One certificate for the three gRPC/HTTPS Services, under every name a client may dial.
sans="DNS:localhost,IP:127.0.0.1"
for svc in kvbridge-registry kvbridge-router kvbridge-gateway; do
  sans="$sans,DNS:$svc,DNS:$svc.$namespace,DNS:$svc.$namespace.svc"
  sans="$sans,DNS:$svc.$namespace.svc.cluster.local"
done
openssl req -x509 -newkey rsa:2048 -nodes -days 825 -subj "/CN=kvbridge CA" \
  -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=kvbridge" \
  -keyout "$out/tls.key" -out "$out/tls.csr" 2>/dev/null
openssl x509 -req -in "$out/tls.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
  -CAcreateserial -days 825 -out "$out/tls.crt" \
  -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$sans") \
  2>/dev/null
rm -f "$out/tls.csr" "$out/ca.srl"

secret() {
  kubectl create secret generic "$@" --namespace "$namespace" --dry-run=client -o yaml
  echo "---"
}
{
  secret kvbridge-auth --from-file=tokens="$out/tokens"
  secret kvbridge-client-tokens --from-file=router="$out/router" \
    --from-file=gateway="$out/gateway" --from-file=prefill="$out/prefill" \
    --from-file=decode="$out/decode"
  secret kvbridge-api-keys --from-file=api-keys="$out/api-keys"
  secret kvbridge-tls --from-file=ca.crt="$out/ca.crt" --from-file=tls.crt="$out/tls.crt" \
    --from-file=tls.key="$out/tls.key"
} > "$out/secrets.yaml"
rm "$out/router" "$out/gateway" "$out/prefill" "$out/decode"
echo "wrote $out/secrets.yaml (namespace $namespace); apply it with:"
echo "  kubectl apply -f $out/secrets.yaml"
echo "admin token: $out/admin-token, API key: $out/api-key (keep $out/ca.key apart)"
