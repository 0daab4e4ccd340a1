# The start every end-to-end suite shares (tests/envoy/{run,module,wasm,concurrency}.sh,
# tests/soak/run.sh, tests/images/run.sh, tests/dynamo/run.sh, tests/sdk/run.sh). The suite sets
# `SUITE` (the name its log lines start with) and `LIFETIME` (the seconds any process it starts may
# live: each stops by itself after it, even if the suite is killed without its trap), then sources
# this file after `set -euo pipefail`.
#
# It sets `root` (the repository), `here` (the suite's folder), `python` ($PYTHON, default python3), `sdk_cache` ($SDK_CACHE),
# `target` ($CARGO_TARGET_DIR) and `work` (a scratch directory, removed at exit with every
# process started by `start`), defines `log`, `die`, `raise_open_files`, `build_bypass_marker`
# and `build_module`, and sources tests/versions.sh, tests/support/procs.sh and
# tests/support/checks.sh.

: "${SUITE:?set SUITE before sourcing tests/support/preamble.sh}"
: "${LIFETIME:?set LIFETIME before sourcing tests/support/preamble.sh}"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# The suite's own folder.
here="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"
python="${PYTHON:-python3}"
sdk_cache="${SDK_CACHE:-$HOME/.cache/tower-bypass-marker-sdk}"
target="${CARGO_TARGET_DIR:-$root/target}"

log() { printf '%s: %s\n' "$SUITE" "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

# Raises the soft limit of open files to the hard one for everything started from here, and dies
# unless it reaches $1 ($2 says what needs them).
raise_open_files() {
  local need="$1" what="$2" hard
  hard="$(ulimit -Hn)"
  [[ "$hard" == unlimited ]] && hard=65536
  ulimit -n "$hard" 2>/dev/null || true
  [[ "$(ulimit -n)" == unlimited ]] || (($(ulimit -n) >= need)) ||
    die "$what need $need open files, the limit is $(ulimit -n)"
}

# The bypass-marker binary (the sidecar and the processor): $BYPASS_MARKER_BIN, or built here.
# Sets `bin`.
build_bypass_marker() {
  if [[ -n "${BYPASS_MARKER_BIN:-}" ]]; then
    bin="$BYPASS_MARKER_BIN"
  else
    log "building bypass-marker (cargo build --release -p bypass-marker)"
    (cd "$root" && cargo build --quiet --release -p bypass-marker) ||
      die "cannot build the bypass-marker binary; set BYPASS_MARKER_BIN to one"
    bin="$target/release/bypass-marker"
  fi
  [[ -x "$bin" ]] || die "no bypass-marker binary at $bin"
}

# The dynamic module, built here: $target/release/libbypass_marker_envoy_module.so.
build_module() {
  log "building the module (cargo build --release -p bypass-marker-envoy-module)"
  (cd "$root" && cargo build --quiet --release -p bypass-marker-envoy-module) ||
    die "cannot build the module"
  [[ -f "$target/release/libbypass_marker_envoy_module.so" ]] || die "no $target/release/libbypass_marker_envoy_module.so"
}

work="$(mktemp -d "${TMPDIR:-/tmp}/tower-bypass-marker-${SUITE// /-}.XXXXXX")"
# shellcheck source=tests/versions.sh
source "$root/tests/versions.sh"
# shellcheck source=tests/support/procs.sh
source "$root/tests/support/procs.sh"
# shellcheck source=tests/support/checks.sh
source "$root/tests/support/checks.sh"
