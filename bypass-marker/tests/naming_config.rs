//! One configuration, parsed twice (issue 49, item 7): the naming flags of `bypass-marker proxy`
//! and `bypass-marker ext-proc` (`NamingArgs`, bypass-marker/src/args.rs) and the keys of the
//! dynamic module's `filter_config` and the plugin's `configuration` (`FilterConfig`,
//! bypass-marker-envoy-adapter/src/config.rs) must not drift apart in name, default or meaning.
//!
//! - The adapter's keys are the flags' long names, in the same order, but for the deliberate
//!   exceptions of [`FLAGS_WITHOUT_A_KEY`].
//! - The same configuration written both ways gives the same layer (the names, each with its
//!   role), the same guard (its largest body, its verdict on a `text/plain` request head and on a
//!   `text/plain` body that looks like JSON and names a router-owned marker) and the same filter
//!   (an event stream through it, byte for byte, with a frame that has no `data` line); nothing
//!   written gives the same defaults; a name one refuses the other refuses, naming the same key.

use bypass_marker::NamingArgs;
use bypass_marker_envoy_adapter::config::FilterConfig;
use clap::{Args, Parser};
use http::{HeaderMap, Method, StatusCode};
use tower_bypass_marker::annotations::RequestedAnnotations;
use tower_bypass_marker::sans_io::RequestGuard;
use tower_bypass_marker::BypassMarkerLayer;

/// Flags of `NamingArgs` that the module and the plugin have no key for, each with its reason.
const FLAGS_WITHOUT_A_KEY: &[(&str, &str)] = &[(
    "max-buffered-bytes",
    "a budget over every request body the process holds at once (its default from the \
     process's cgroup); the module and the plugin hold bodies in Envoy's buffers, which Envoy's \
     per-connection buffer limit and overload manager bound (docs/envoy.md, \"Failures\")",
)];

/// The naming flags alone, as `bypass-marker ext-proc` and `proxy` flatten them.
#[derive(Parser, Debug)]
struct Naming {
    #[command(flatten)]
    naming: NamingArgs,
}

/// The environment variables of the naming flags: a test run with one set would not parse what
/// it says.
const VARIABLES: [&str; 8] = [
    "BYPASS_MARKER_PRESET",
    "BYPASS_MARKER_OPT_IN",
    "BYPASS_MARKER_ROUTER_OWNED",
    "BYPASS_MARKER_NEVER_FORWARD",
    "BYPASS_MARKER_SDK_SAFE",
    "BYPASS_MARKER_NON_JSON_BODIES",
    "BYPASS_MARKER_MAX_BODY",
    "BYPASS_MARKER_MAX_BUFFERED_BYTES",
];

fn flags(argv: &[&str]) -> NamingArgs {
    for variable in VARIABLES {
        std::env::remove_var(variable);
    }
    Naming::try_parse_from(std::iter::once("naming").chain(argv.iter().copied()))
        .unwrap_or_else(|err| panic!("{argv:?}: {err}"))
        .naming
}

/// The long names of `NamingArgs`' flags, in their order.
fn flag_names() -> Vec<String> {
    NamingArgs::augment_args(clap::Command::new("naming"))
        .get_arguments()
        .filter_map(|arg| arg.get_long().map(str::to_owned))
        .collect()
}

/// The adapter's keys, as its error for an unknown key lists them.
fn key_names() -> Vec<String> {
    let err = FilterConfig::parse(br#"{"no-such-key": 1}"#).expect_err("an unknown key");
    assert_eq!(err.key(), Some("no-such-key"), "{err}");
    let list = err
        .message()
        .strip_prefix("unknown key; the keys are ")
        .unwrap_or_else(|| panic!("the unknown key's message lists no keys: {err}"));
    list.split(", ").map(str::to_owned).collect()
}

#[test]
fn the_keys_are_the_naming_flags_but_for_the_listed_exceptions() {
    let flags = flag_names();
    for (flag, reason) in FLAGS_WITHOUT_A_KEY {
        assert!(
            flags.iter().any(|f| f == flag),
            "--{flag} is listed as a flag without a key ({reason}), but NamingArgs has no such flag: {flags:?}"
        );
    }
    let expected: Vec<String> = flags
        .into_iter()
        .filter(|f| !FLAGS_WITHOUT_A_KEY.iter().any(|(flag, _)| f == flag))
        .collect();
    assert_eq!(
        key_names(),
        expected,
        "the module's and the plugin's keys (bypass-marker-envoy-adapter/src/config.rs, KEYS) are not \
         the naming flags of bypass-marker/src/args.rs, in order, less FLAGS_WITHOUT_A_KEY"
    );
}

/// What one configuration does, as far as a client can tell.
#[derive(Debug, PartialEq)]
struct Behaviour {
    names: Vec<(String, String)>,
    max_body: usize,
    text_head: String,
    text_body: String,
    stream: Vec<u8>,
}

const TEXT_BODY: &str =
    r#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill","request_id"]}}"#;

/// An event stream with a marker, an opt-in frame, a frame with no `data` line and a data frame.
const STREAM: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\nevent: request_id\n: r1\n\n\
    event: custom\n\ndata: {\"id\":\"c1\"}\n\ndata: [DONE]\n\n";

fn behaviour(layer: &BypassMarkerLayer, guard: &RequestGuard) -> Behaviour {
    let names = layer
        .names()
        .map(|name| (name.to_owned(), format!("{:?}", layer.role(name))))
        .collect();
    let mut text = HeaderMap::new();
    text.insert(http::header::CONTENT_TYPE, "text/plain".parse().unwrap());
    let text_head = format!("{:?}", guard.check_head(&text, false));
    let text_body = format!(
        "{:?}",
        guard.check_body_for(&text, bytes::Bytes::from_static(TEXT_BODY.as_bytes()))
    );
    let mut events = HeaderMap::new();
    events.insert(
        http::header::CONTENT_TYPE,
        "text/event-stream".parse().unwrap(),
    );
    let asked = RequestedAnnotations::new();
    let stream = match layer.response_filter(&Method::POST, StatusCode::OK, &events, &asked) {
        Some(filter) => filter
            .filter_all(STREAM.chunks(7))
            .expect("frames under the limit"),
        None => STREAM.to_vec(),
    };
    Behaviour {
        names,
        max_body: guard.max_body(),
        text_head,
        text_body,
        stream,
    }
}

/// The processor's layer and guard, as `bypass-marker ext-proc` builds them (src/ext_proc.rs).
fn from_flags(argv: &[&str]) -> Behaviour {
    let naming = flags(argv);
    let layer = naming
        .layer()
        .unwrap_or_else(|err| panic!("{argv:?}: {err}"));
    let guard = layer.request_guard().max_body_bytes(naming.max_body);
    behaviour(&layer, &guard)
}

fn from_keys(json: &str) -> Behaviour {
    let config = FilterConfig::parse(json.as_bytes()).unwrap_or_else(|err| panic!("{json}: {err}"));
    behaviour(config.layer(), config.guard())
}

#[test]
fn nothing_written_means_the_same_both_ways() {
    let defaults = from_flags(&[]);
    assert_eq!(defaults, from_keys("{}"), "the defaults differ");
    assert_eq!(defaults, from_keys(""), "an empty filter_config");
    assert!(
        defaults.names.iter().any(|(n, _)| n == "request_id"),
        "the Dynamo preset"
    );
    assert_eq!(defaults.max_body, 32 << 20);
}

#[test]
fn the_same_configuration_written_both_ways_does_the_same() {
    let cases: &[(&[&str], &str)] = &[
        (&["--preset", "dynamo"], r#"{"preset":"dynamo"}"#),
        (&["--preset", "none"], r#"{"preset":"none"}"#),
        (
            &["--preset", "none", "--opt-in", "a,b", "--opt-in", "c"],
            r#"{"preset":"none","opt-in":["a","b","c"]}"#,
        ),
        (
            &["--router-owned", "x-mine", "--never-forward", "secret"],
            r#"{"router-owned":["x-mine"],"never-forward":["secret"]}"#,
        ),
        // A name given twice, in two roles: the later role wins both ways.
        (
            &["--opt-in", "twice", "--never-forward", "twice"],
            r#"{"opt-in":["twice"],"never-forward":["twice"]}"#,
        ),
        (&["--sdk-safe"], r#"{"sdk-safe":true}"#),
        (&[], r#"{"sdk-safe":false}"#),
        (
            &["--non-json-bodies", "forward"],
            r#"{"non-json-bodies":"forward"}"#,
        ),
        (
            &["--non-json-bodies", "judge"],
            r#"{"non-json-bodies":"judge"}"#,
        ),
        (
            &["--non-json-bodies", "refuse"],
            r#"{"non-json-bodies":"refuse"}"#,
        ),
        (&["--max-body", "1024"], r#"{"max-body":1024}"#),
        // Under the body: the judged text/plain body is refused with 413 both ways.
        (
            &["--non-json-bodies", "judge", "--max-body", "16"],
            r#"{"non-json-bodies":"judge","max-body":16}"#,
        ),
        (
            &[
                "--preset",
                "none",
                "--opt-in",
                "a",
                "--router-owned",
                "b",
                "--never-forward",
                "c",
                "--sdk-safe",
                "--non-json-bodies",
                "refuse",
                "--max-body",
                "4096",
            ],
            r#"{"preset":"none","opt-in":["a"],"router-owned":["b"],"never-forward":["c"],
                "sdk-safe":true,"non-json-bodies":"refuse","max-body":4096}"#,
        ),
    ];
    let mut seen = Vec::new();
    for (argv, json) in cases {
        let flags = from_flags(argv);
        assert_eq!(flags, from_keys(json), "{argv:?} and {json} differ");
        seen.push(flags);
    }
    // The cases tell the settings apart, so an equality above is not two defaults agreeing.
    for (what, differs) in [
        ("sdk-safe", seen[5].stream != seen[6].stream),
        (
            "non-json-bodies judge",
            seen[8].text_head != seen[7].text_head,
        ),
        (
            "non-json-bodies refuse",
            seen[9].text_body != seen[8].text_body,
        ),
        ("max-body", seen[10].max_body != seen[0].max_body),
        ("preset", seen[1].names != seen[0].names),
    ] {
        assert!(differs, "the cases do not show what {what} changes");
    }
}

#[test]
fn a_name_one_refuses_the_other_refuses_for_the_same_key() {
    for (key, name) in [
        ("opt-in", "bad:name"),
        ("router-owned", " padded"),
        ("never-forward", "also:bad"),
    ] {
        let flag = format!("--{key}");
        let naming = flags(&[flag.as_str(), name]);
        let err = naming.layer().expect_err("a bad name");
        assert_eq!(err.flag(), flag, "{err}");
        let json = serde_json::json!({ key: [name] }).to_string();
        let err = FilterConfig::parse(json.as_bytes()).expect_err("a bad name");
        assert_eq!(err.key(), Some(key), "{err}");
    }
}
