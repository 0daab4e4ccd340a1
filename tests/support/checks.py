"""What the Python clients of the end-to-end suites share: their `PASS what` and `FAIL what: why`
lines, which tests/support/checks.sh's `run_client` counts, the event-stream framing they
check bytes against, and the `sdk` mode of those that stream with the openai package. Each client
puts this folder on `sys.path` (they run under the SDKs' own interpreters too, so this is a file,
not an installed package)."""

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


def sdk_mode(modes, expectations):
    """Adds the `sdk` mode to a client's subparsers `modes`: a client that streams with the openai
    package of the interpreter it runs under, as the suites run it for each SDK they install
    (--base-url, --expect one of `expectations`, --label its lines start with, --version the
    openai release that interpreter must import). Returns the mode's parser."""
    sdk = modes.add_parser("sdk")
    sdk.add_argument("--base-url", required=True)
    sdk.add_argument("--expect", choices=expectations, required=True)
    sdk.add_argument("--label", required=True)
    sdk.add_argument("--version", required=True)
    return sdk


def openai_client(args, **options):
    """An `openai.OpenAI` for the `sdk` mode's --base-url, with no retries and `options`; None,
    and a failed check, if the interpreter imports another openai release than --version (the
    suite installed a release in each interpreter: any other would test the wrong SDK)."""
    import openai

    if openai.__version__ != args.version:
        report(False, args.label, f"expected openai {args.version}, imported {openai.__version__}")
        return None
    return openai.OpenAI(base_url=args.base_url, max_retries=0, **options)
