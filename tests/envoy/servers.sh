# What the suites that run Envoy share (tests/envoy/*.sh, tests/soak/run.sh, tests/images/run.sh):
# Envoy's install (install.sh) and the bootstraps' rendering (render.sh), sourced here; the SDKs'
# install beside Envoy's, an Envoy started from a bootstrap, the upstreams they put behind Envoy,
# and the checks the module and the plugin pass alike. Source tests/support/preamble.sh first.

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

# Sets `streams` to $1, the concurrent streams a suite sends through Envoy, and raises the limit
# of open files for them: Envoy holds two descriptors per concurrent stream (client, upstream), the
# clients and the upstream one each.
concurrent_streams() {
  streams="$1"
  raise_open_files "$((2 * streams + 200))" "$streams concurrent streams"
}

# For the suites that stream the OpenAI SDKs through Envoy (run.sh, module.sh, wasm.sh): installs
# Envoy at each version "$@" (install_envoys; `envoy_bin` is the last one's), then the SDKs
# (tests/sdk/sdks.sh's install_sdks; sdks.sh also defines run_sdk_clients).
install_envoys_and_sdks() {
  install_envoys "$@"
  # shellcheck source=tests/sdk/sdks.sh
  source "$envoy_tests/../sdk/sdks.sh"
  install_sdks
  log "SDKs ready: python openai ${py_versions[*]}, node openai ${node_versions[*]}"
}

# Starts an Envoy named $1 at version $2 (installed by install_envoys), logging at level $3, from
# bootstrap $4 rendered (render.sh) with a free listener port, a free admin port and any further
# NAME=VALUE; waits until its admin says it is ready. Sets `url` to its listener and `admin_url`
# to its admin. For a dynamic module, run it with ENVOY_DYNAMIC_MODULES_SEARCH_PATH=DIR: Envoy
# inherits it.
start_envoy_from() {
  local name="$1" version="$2" level="$3" bootstrap="$4" listen admin
  shift 4
  listen="$(free_port)"
  admin="$(free_port)"
  render_bootstrap "$bootstrap" LISTEN_PORT="$listen" ADMIN_PORT="$admin" "$@" >"$work/$name.yaml" ||
    die "cannot render the bootstrap $bootstrap for $name"
  start "$name" "${envoys[$version]}" --disable-hot-restart --concurrency 1 --log-level "$level" \
    -c "$work/$name.yaml"
  wait_for "$last_group" 300 envoy_ready "$admin" ||
    die "Envoy $version ($name) did not get ready: $(tail -n 20 "$work/$name.log")"
  url="http://127.0.0.1:$listen"
  admin_url="http://127.0.0.1:$admin"
}

# client.py's checks that the dynamic module and the proxy-wasm plugin pass alike (module.sh,
# wasm.sh), with `--front $1` (module or wasm) through the Envoy at $2 with upstream.py behind it:
# the request side, streams in 1-9 byte pieces, $streams concurrent streams, a client that goes
# away, an upstream that resets, and an upstream that gzips an event stream although the filter
# asked for identity (issue 27, item 2: a 502 before any byte, the filter's local reply), and
# issue 48's upstreams (a transfer coding other than chunked: Envoy's own 502; a 204, a 304 and
# the answer to HEAD with body bytes after the head: the head alone). Then
# that Envoy's log, $4, must hold the encoded stream at error and a refusal at info (logged at
# most once a minute), each through the filter's own logger. $3 starts each check's name.
filter_checks() {
  local front="$1" name="$3" envoy_log="$4" logger=wasm ok
  local client=("$python" "$envoy_tests/client.py") to=(--front "$1" --envoy "$2" --upstream "$upstream")
  [[ "$front" == module ]] && logger=dynamic_modules
  run_client "${name}request side, pass-through, opt-ins" "${client[@]}" checks "${to[@]}"
  run_client "${name}streams in 1-9 byte pieces" "${client[@]}" pieces "${to[@]}" --streams 8
  run_client "$name$streams concurrent streams" "${client[@]}" concurrent "${to[@]}" --streams "$streams"
  run_client "${name}client disconnect" "${client[@]}" disconnect "${to[@]}"
  run_client "${name}upstream reset" "${client[@]}" reset "${to[@]}"
  run_client "${name}an encoded event stream" "${client[@]}" encoded "${to[@]}"
  run_client "${name}a transfer coding, bodies after heads without content" "${client[@]}" nocontent "${to[@]}"
  ok=0
  grep -Eq "\[error\]\[$logger\].*bypass_marker: answered an encoded event stream \(gzip\) with 502" \
    "$envoy_log" && ok=1
  count $ok "${name}an encoded event stream is logged through Envoy's logger at error"
  ok=0
  grep -Eq "\[info\]\[$logger\].*bypass_marker: refused a request with (400|413).*logged at most once a minute" \
    "$envoy_log" && ok=1
  count $ok "${name}a refusal is logged through Envoy's logger at info (at most once a minute)"
}

# Issue 48's HTTP/2 upstream (tests/envoy/h2_upstream.py): installs the `h2` package, pinned,
# into a venv beside Envoy's (kept across runs), and starts the upstream with it. Sets `h2_python`
# and `h2_upstream`.
H2_VERSION=4.3.0
start_h2_upstream() {
  local venv="${ENVOY_CACHE:-$HOME/.cache/tower-bypass-marker-envoy}/venv-h2-$H2_VERSION"
  h2_python="$venv/bin/python"
  if ! "$h2_python" -c "import h2, sys; sys.exit(h2.__version__ != '$H2_VERSION')" 2>/dev/null; then
    log "installing h2 $H2_VERSION from PyPI into $venv"
    rm -rf "$venv" "$venv.tmp"
    "$python" -m venv "$venv.tmp" >&2 || die "cannot make a venv at $venv.tmp"
    "$venv.tmp/bin/python" -m pip install --quiet --disable-pip-version-check "h2==$H2_VERSION" >&2 ||
      die "cannot install h2 $H2_VERSION"
    mv "$venv.tmp" "$venv"
    # A venv's python is a link to the interpreter, not a script: it works from its new place.
    "$h2_python" -c 'import h2' || die "h2 does not import from $venv"
  fi
  start h2-upstream "$h2_python" "$envoy_tests/h2_upstream.py" serve --lifetime "$LIFETIME"
  wait_for "$last_group" 100 listening h2-upstream || die "h2_upstream.py did not start: $(cat "$work/h2-upstream.log")"
  h2_upstream="$url"
}

# Bootstrap $1 with its upstream cluster on HTTP/2 (h2_upstream.py bootstrap), into $work/$2.yaml.
h2_bootstrap() {
  "$python" "$envoy_tests/h2_upstream.py" bootstrap "$1" >"$work/$2.yaml" || die "cannot write $work/$2.yaml"
}

# client.py's HTTP/2 upstream checks through the Envoy at $2 (`--front $1`), in front of
# h2_upstream.py; $3 starts each check's name.
h2_checks() {
  run_client "${3}an HTTP/2 upstream's 204 and 304 followed by DATA" "$python" "$envoy_tests/client.py" h2 \
    --front "$1" --envoy "$2" --upstream "$h2_upstream" --h2-python "$h2_python"
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

