# What the Envoy suites (tests/envoy/run.sh, tests/envoy/module.sh) share: the upstreams they put
# behind Envoy, and the SDK clients they run through it. Source tests/support/preamble.sh first;
# the sourcing script also sets `here` (tests/envoy).

# Whether the Envoy whose admin listens on port $1 says it is LIVE.
envoy_ready() {
  "$python" -c "import urllib.request, sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$1/ready', timeout=1).read().strip() != b'LIVE')" 2>/dev/null
}

# Builds examples/router.rs (the simulated Dynamo); sets `router`.
build_router() {
  log "building the router example"
  (cd "$root" && cargo build --quiet --example router)
  router="$target/debug/examples/router"
  [[ -x "$router" ]] || die "no router binary at $router"
}

# Starts upstream.py (the scriptable upstream) and two simulated routers without the layer (one to
# put behind Envoy, one for the control straight to it); sets `upstream`, `router_behind` and
# `router_direct`.
start_upstreams() {
  start upstream "$python" "$here/upstream.py" --lifetime "$LIFETIME"
  wait_for "$last_group" 100 listening upstream || die "upstream.py did not start: $(cat "$work/upstream.log")"
  upstream="$url"
  start router-envoy "$router" --addr 127.0.0.1:0 --no-layer --shutdown-after "$LIFETIME"
  wait_for "$last_group" 100 listening router-envoy || die "the router did not start: $(cat "$work/router-envoy.log")"
  router_behind="$url"
  start router-direct "$router" --addr 127.0.0.1:0 --no-layer --shutdown-after "$LIFETIME"
  wait_for "$last_group" 100 listening router-direct || die "the router did not start: $(cat "$work/router-direct.log")"
  router_direct="$url"
}

# The OpenAI SDKs (every version tests/sdk/sdks.sh installed) and the raw client: through Envoy at
# $1 (to a router behind it) they must pass; straight to the router at $2 every stream must fail
# (the control). $3 names the front door in the labels.
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
  # The raw client's "with layer" checks run through Envoy, its "without layer" ones (the
  # control) straight to the other router.
  run_client "raw HTTP client" "$python" "$sdk_client" raw --layer-url "$through" --no-layer-url "$direct"
}
