#!/bin/bash
# Builds real kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2 from Debian
# bookworm's `kubernetes` SOURCE package (no registry here ships a kube-apiserver binary), plus
# installs etcd 3.4.23 from Debian. No network beyond deb.debian.org. ~7 min on 2 cores.
# Usage: build.sh [OUTBIN]   (default: $K8S_TESTBED_BIN or ~/.cache/k8s-testbed/v1.20.2/bin)
# Idempotent: exits at once when the binaries are already there. Needs root (apt-get) like the
# rest of this machine's setup.
set -euo pipefail
OUT=${1:-${K8S_TESTBED_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/k8s-testbed/v1.20.2/bin}}
if [ -x "$OUT/kube-apiserver" ] && [ -x "$OUT/kube-controller-manager" ] && [ -x "$OUT/kube-scheduler" ] \
   && command -v etcd >/dev/null; then
  echo "k8s testbed binaries present in $OUT"; exit 0
fi
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
EXTRA=""
mkdir -p "$W/apt/lists/partial" "$W/apt/cache/archives/partial" "$W/src" "$OUT"
# private apt config that only adds deb-src (the machine's sources have no deb-src lines)
cat > "$W/apt/sources.list" <<EOF
deb-src http://deb.debian.org/debian bookworm main
EOF
cat > "$W/apt/apt.conf" <<EOF
Dir::Etc::SourceList "$W/apt/sources.list";
Dir::Etc::SourceParts "/nonexistent";
Dir::State::Lists "$W/apt/lists";
Dir::Cache "$W/apt/cache";
EOF
APT_CONFIG="$W/apt/apt.conf" apt-get update -qq
(cd "$W/src" && APT_CONFIG="$W/apt/apt.conf" apt-get source -qq --download-only \
   kubernetes=1.20.5+really1.20.2-1.1+deb12u1)
apt-get update -qq
# kubectl from Debian's kubernetes-client only where none is installed (a kubectl from another
# package owns /usr/bin/kubectl, and dpkg refuses to overwrite it).
dpkg --configure -a >/dev/null 2>&1 || true  # finish what an interrupted install left unpacked
pkgs=(golang-go etcd-server make rsync jq openssl bc)
command -v kubectl >/dev/null || pkgs+=(kubernetes-client)
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
tar -C "$W/src" -xzf "$W/src/kubernetes_1.20.5+really1.20.2.orig.tar.gz"
cd "$W/src/kubernetes-1.20.2"
# k8s 1.20 builds in GOPATH mode (hack/lib/init.sh sets GO111MODULE=off); `make` also runs the
# code generators (openapi-gen etc.): plain `go build ./cmd/kube-apiserver` fails with
# "undefined: openapi.GetOpenAPIDefinitions". Do NOT pass MAKEFLAGS=-j2 (races on _output/bin).
HOME="$W/home" CGO_ENABLED=0 KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean \
  KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20 KUBE_BUILD_PLATFORMS=linux/amd64 \
  make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler $EXTRA" GOLDFLAGS="-s -w"
mkdir -p "$OUT.tmp"
cp _output/bin/kube-apiserver _output/bin/kube-controller-manager _output/bin/kube-scheduler "$OUT.tmp/"
rm -rf "$OUT"; mv "$OUT.tmp" "$OUT"
"$OUT/kube-apiserver" --version
