"""What the Python clients of the end-to-end suites share: their `PASS what` and `FAIL what: why`
lines, which tests/support/checks.sh's `run_client` counts, and the event-stream framing they
check bytes against. Each client puts this folder on `sys.path` (they run under the SDKs' own
interpreters too, so this is a file, not an installed package)."""

failures = 0


def report(ok, what, why=""):
    """Prints the check's line, counts it if it failed; returns `ok`."""
    global failures
    if ok:
        print(f"PASS {what}", flush=True)
    else:
        failures += 1
        print(f"FAIL {what}: {why}", flush=True)
    return ok


def exit_status():
    """1 if any check failed, else 0."""
    return 1 if failures else 0


def frames(body):
    """Splits an event stream at blank lines, each frame with its terminator (the last one without,
    if the stream does not end in one)."""
    out, rest = [], body
    while rest:
        end = rest.find(b"\n\n")
        end = len(rest) if end < 0 else end + 2
        out.append(rest[:end])
        rest = rest[end:]
    return out
