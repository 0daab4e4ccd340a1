# What the suites that run Envoy share (tests/envoy/*.sh, tests/soak/run.sh, tests/images/run.sh):
# Envoy's install (install.sh) and the bootstraps' rendering (render.sh), sourced here; the
# upstreams they put behind Envoy. Source tests/support/preamble.sh first.

envoy_tests="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tests/envoy/install.sh
source "$envoy_tests/install.sh"
# shellcheck source=tests/envoy/render.sh
source "$envoy_tests/render.sh"

# Installs Envoy at each version "$@" (install.sh); sets envoys[VERSION] to its binary.
declare -A envoys
install_envoys() {
  local version
  for version in "$@"; do
    ENVOY_VERSION="$version" install_envoy || die "cannot install Envoy $version"
    envoys[$version]="$envoy_bin"
  done
}

# The counters the module and the plugin both keep, checked once a suite's other checks have run:
# each is above 0 in the /stats/prometheus of the Envoy whose admin is at $1 (a URL), under the
# name prefix $2 (Envoy's for the module's custom stats; none for the plugin's, whose labels come
# from the bootstrap's stats_tags). $3 starts each check's line.
check_counters() {
  local admin="$1" prefix="$2" label="$3" stats series value ok
  stats="$("$python" -c "import urllib.request; print(urllib.request.urlopen('$admin/stats/prometheus', timeout=5).read().decode())")"
  for series in \
    'bypass_marker_frames_removed{annotation="x-bypass-remote-prefill"}' \
    'bypass_marker_frames_removed{annotation="llm_metrics"}' \
    'bypass_marker_frames_forwarded{annotation="x-bypass-remote-prefill"}' \
    'bypass_marker_frames_forwarded{annotation="request_id"}' \
    'bypass_marker_requests_refused{status="400"}' \
    'bypass_marker_requests_refused{status="413"}' \
    'bypass_marker_encoded_streams_refused{coding="gzip"}'; do
    value="$(grep -F "$prefix$series " <<<"$stats" | awk '{print $2}')"
    ok=0
    [[ -n "$value" && "$value" -gt 0 ]] && ok=1
    count $ok "$label/stats/prometheus: $prefix$series ${value:-missing}"
  done
}

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
  start upstream "$python" "$envoy_tests/upstream.py" --lifetime "$LIFETIME"
  wait_for "$last_group" 100 listening upstream || die "upstream.py did not start: $(cat "$work/upstream.log")"
  upstream="$url"
  start router-envoy "$router" --addr 127.0.0.1:0 --no-layer --shutdown-after "$LIFETIME"
  wait_for "$last_group" 100 listening router-envoy || die "the router did not start: $(cat "$work/router-envoy.log")"
  router_behind="$url"
  start router-direct "$router" --addr 127.0.0.1:0 --no-layer --shutdown-after "$LIFETIME"
  wait_for "$last_group" 100 listening router-direct || die "the router did not start: $(cat "$work/router-direct.log")"
  router_direct="$url"
}

