#!/usr/bin/env bash
# docs/envoy.md's "Try it end to end without Dynamo", run exactly as written: the lines of its
# code block, taken from the page, in one shell from the repository's root, with Envoy 1.40.0 on
# the PATH (the page says to install it) and, after each line that starts a server in the
# background, a wait until that server's port accepts (a person waits by reading). Then the
# page's counter line and its `kill %1 %2`.
#
#   bash tests/envoy/try_it.sh
#
# Checks: the router straight starts its stream with `event: request_id` and ends with
# `data: [DONE]`; through Envoy with the module, the same prompt (now a cache hit) reaches the
# client with no event frame at all, chunks and `data: [DONE]`; the page's stats line shows the
# marker removed once; `kill %1 %2` stops both. The block uses the ports the bootstraps name
# (8000, 10000, 9901): the script fails at once if any is taken.
# Ends with `envoy try it: N passed, M failed`; exits non-zero if anything failed.
set -euo pipefail

SUITE="envoy try it" LIFETIME=900
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
# shellcheck source=tests/envoy/servers.sh
source "$here/servers.sh"
install_envoys "$ENVOY_LATEST"
envoy_dir="$(dirname "${envoys[$ENVOY_LATEST]}")"

page="$root/docs/envoy.md"
# The first sh block after the paragraph's title.
awk '/^\*\*Try it end to end without Dynamo\.\*\*/ {found = 1} found && /^```sh$/ {inside = 1; next}
  inside && /^```$/ {exit} inside {print}' "$page" >"$work/block.sh"
mapfile -t lines <"$work/block.sh"
stats_line="$(awk '/^\*\*Try it end to end without Dynamo\.\*\*/ {found = 1} found' "$page" |
  grep -o '`curl -s 127.0.0.1:9901/stats/prometheus[^`]*`' | head -n 1 | tr -d '`')"
kill_line="$(awk '/^\*\*Try it end to end without Dynamo\.\*\*/ {found = 1} found' "$page" |
  grep -o '`kill %1 %2`' | head -n 1 | tr -d '`')"
count "$(( ${#lines[@]} == 6 && ${#stats_line} > 0 && ${#kill_line} > 0 ))" \
  "docs/envoy.md's block has its 6 lines, the stats line and the kill line: ${#lines[@]} lines"
((${#lines[@]} == 6)) || die "the block is not the one this script knows: $(cat "$work/block.sh")"

for port in 8000 10000 9901; do
  accepts "$port" && die "port $port on 127.0.0.1 is taken: the block needs it free (the bootstraps' defaults)"
done

# The runner: the page's lines as written, numbered in the output; a wait after each background
# line for the port that server listens on.
{
  printf 'set -e\ncd %q\nexport PATH=%q:"$PATH"\n' "$root" "$envoy_dir"
  printf 'up() { local i; for ((i = 0; i < 1200; i++)); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.5; done; echo "nothing on port $1" >&2; return 1; }\n'
  printf 'down() { local i; for ((i = 0; i < 100; i++)); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null || return 0; sleep 0.1; done; return 1; }\n'
  for i in "${!lines[@]}"; do
    printf 'echo "=== line %d"\n%s\n' "$((i + 1))" "${lines[$i]}"
    case "${lines[$i]}" in
    *"--addr 127.0.0.1:8000"*"&") printf 'up 8000\n' ;;
    *"envoy "*"&") printf 'up 10000\n' ;;
    esac
  done
  printf 'echo "=== stats"\n%s\n' "$stats_line"
  printf 'echo "=== kill"\n%s\ndown 8000 && down 10000 && echo "both stopped"\n' "$kill_line"
} >"$work/runner.sh"

start runner bash "$work/runner.sh"
runner_group="$last_group"
status=0
wait "$runner_group" || status=$?
out="$work/runner.log"
section() { awk -v want="=== $1" '$0 == want {on = 1; next} /^=== / {on = 0} on' "$out"; }

count "$((status == 0))" "the page's lines run to the end (status $status)$( ((status)) && printf ': %s' "$(tail -n 3 "$out" | tr '\n' ' ')")"
direct="$(section 'line 5')"
behind="$(section 'line 6')"
ok=0
[[ "$direct" == "event: request_id"* && "$direct" == *"data: [DONE]" ]] && ok=1
count $ok "straight from the router (line 5), the stream starts with event: request_id and ends with data: [DONE]: $(head -c 120 <<<"$direct" | tr '\n' ' ')"
ok=0
grep -q '^data: {' <<<"$behind" && ! grep -q '^event:' <<<"$behind" && [[ "$behind" == *"data: [DONE]" ]] && ok=1
count $ok "through Envoy with the module (line 6), the cache hit reaches the client with no event frame, chunks then data: [DONE]: $(head -c 120 <<<"$behind" | tr '\n' ' ')"
ok=0
grep -Eq '^envoy_dynamicmodulescustom_bypass_marker_frames_removed\{annotation="x-bypass-remote-prefill"\} 1$' <<<"$(section stats)" && ok=1
count $ok "the page's stats line shows the marker removed once: $(section stats | grep frames_removed | tr '\n' ' ')"
ok=0
grep -qx 'both stopped' <<<"$(section kill)" && ok=1
count $ok "kill %1 %2 stops the router and Envoy"

nothing_left
echo "envoy try it: $passed passed, $failed failed"
((failed == 0 && passed > 0))
