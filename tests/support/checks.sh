# The checks' bookkeeping shared by the end-to-end suites (tests/envoy/run.sh,
# tests/envoy/module.sh, tests/dynamo/run.sh, tests/versions_check.sh): PASS/FAIL counting, clients
# run in groups of their own, and the final check that nothing started is left. `run_client` and
# the final check need tests/support/procs.sh sourced first.

passed=0
failed=0
count() {
  if (($1)); then
    printf 'PASS %s\n' "$2"
    passed=$((passed + 1))
  else
    printf 'FAIL %s\n' "$2"
    failed=$((failed + 1))
  fi
}

# Runs a client ("$@") for at most $CLIENT_TIMEOUT seconds (default 180) and counts its PASS and
# FAIL lines; a client that fails without saying which check failed counts as one failure.
run_client() {
  local name="$1" out="$work/client.out" err="$work/client.err" status=0 p f
  shift
  # In the background and in a group of its own, so that a signal to this script ends it at once.
  setsid timeout "${CLIENT_TIMEOUT:-180}" "$@" >"$out" 2>"$err" &
  clients+=($!)
  # (stderr: bash reports there a server of ours that a check killed on purpose)
  { wait $! || status=$?; } 2>/dev/null
  cat "$out"
  p="$(grep -c '^PASS ' "$out" || true)"
  f="$(grep -c '^FAIL ' "$out" || true)"
  if ((status != 0 && f == 0)); then
    printf 'FAIL %s: exited with status %d\n' "$name" "$status"
    f=1
  fi
  if ((f > 0 || status != 0)); then
    log "$name: stderr follows"
    sed 's/^/    /' "$err" >&2
  fi
  passed=$((passed + p))
  failed=$((failed + f))
}

# Stops every server and client, then counts whether any process is left behind. Zombies (state
# Z) are not counted: they hold nothing but a process-table entry.
nothing_left() {
  local left i ok
  stop_all
  for ((i = 0; i < 50; i++)); do
    left="$(leftovers)"
    [[ -z "$left" ]] && break
    sleep 0.1
  done
  ok=0
  [[ -z "$left" ]] && ok=1
  count $ok "no process left behind after stopping ${#groups[@]} servers and ${#clients[@]} clients${left:+: $left}"
  groups=()
  clients=()
}
leftovers() {
  ps -eo pid=,pgid=,stat=,args= | awk -v groups=" ${groups[*]} ${clients[*]} " -v work="$work" \
    '$3 !~ /^Z/ && (index(groups, " " $2 " ") || index($0, work))' | grep -v -e awk -e grep || true
}

# Counts whether every listening socket of the process groups "$@" (default: every server started
# here) is on 127.0.0.1; $also_listening, if set, names the others in the check.
only_loopback() {
  local listeners ok=0
  (($#)) || set -- "${groups[@]}"
  listeners="$("$python" "$root/tests/support/listeners.py" "$@")"
  [[ -n "$listeners" ]] && ! grep -qv '^127\.0\.0\.1:' <<<"$listeners" && ok=1
  count $ok "every process listens on 127.0.0.1 only${also_listening:+ ($also_listening)}: $(tr '\n' ' ' <<<"$listeners")"
}
