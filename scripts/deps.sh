#!/usr/bin/env bash
# Installs the Debian packages llmem needs to build and test, and any named as arguments (`make
# fuzz`: clang and its sanitizer/libFuzzer runtimes). Idempotent: when every package is already
# present it only checks and returns (no apt-get update, no network).
set -euo pipefail

packages=(
    cmake make gcc pkg-config
    libcjson-dev
    libcmocka-dev
    libpcre2-dev
    libxxhash-dev
    libssl-dev
    libsqlite3-dev
    libmicrohttpd-dev
    curl
)
packages+=("$@")

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$p")
    fi
done

if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi

echo "deps.sh: installing ${missing[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        sudo="sudo"
    else
        echo "deps.sh: missing packages (${missing[*]}) and not root; install them as root" >&2
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
