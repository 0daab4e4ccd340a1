# Process handling shared by the end-to-end suites, sourced by tests/support/preamble.sh, which
# sets `work` (a scratch directory, removed at exit), `LIFETIME` (seconds any process it starts
# may live) and `python`. Every process runs in a group of its own, led by
# `timeout`, so that the exit trap stops all of them, on success and on failure.

# Process groups started here, each led by its own `timeout`: servers, and clients.
groups=()
clients=()
stop_all() {
  local g i alive
  for g in "${clients[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done
  for g in "${groups[@]}"; do
    kill -CONT -- "-$g" 2>/dev/null || true
    kill -TERM -- "-$g" 2>/dev/null || kill -TERM "$g" 2>/dev/null || true
  done
  for ((i = 0; i < 50; i++)); do
    alive=0
    for g in "${groups[@]}"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for g in "${groups[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done
  for g in "${groups[@]}"; do wait "$g" 2>/dev/null || true; done
}
cleanup() {
  stop_all
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Starts "$@" in a process group of its own, output to $work/$name.log; the group's id (its
# leader, `timeout`) goes in `groups` and `last_group`. (Not called in a command substitution:
# that subshell would keep the id from the cleanup.)
start() {
  local name="$1"
  shift
  : >"$work/$name.log"
  setsid timeout -s TERM "$LIFETIME" "$@" >"$work/$name.log" 2>&1 &
  last_group=$!
  groups+=("$last_group")
}

# Waits up to $2 tenths of a second for "$3..." to succeed; fails if the leader $1 has ended.
wait_for() {
  local leader="$1" tries="$2" i
  shift 2
  for ((i = 0; i < tries; i++)); do
    "$@" && return 0
    kill -0 "$leader" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

free_port() {
  "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Sets `url` from the `listening on http://...` line of $work/$1.log.
listening() { url="$(sed -n 's#^listening on \(http://.*\)$#\1#p' "$work/$1.log")" && [[ -n "$url" ]]; }

# Whether something accepts connections on 127.0.0.1:$1.
accepts() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
