//! docs/sidecar.md against `bypass-marker proxy --help`: every flag and `BYPASS_MARKER_*`
//! variable the page names exists, and every one the help lists is on the page; and every page
//! (README.md, docs/, examples/envoy/README.md) installs the binary with the same command.

use std::collections::BTreeSet;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_bypass-marker");
const PAGE: &str = include_str!("../../docs/sidecar.md");

/// Flags of other commands that the page shows (`cargo install`, Dynamo's frontend).
const OTHER_COMMANDS: &[&str] = &[
    "--features",
    "--http-host",
    "--http-port",
    "--locked",
    "--now",
    "--offline",
    "--path",
    "--root",
];

/// Variables the page names that the build reads, not the program (`bypass_marker_build_info`).
const BUILD_VARIABLES: &[&str] = &["BYPASS_MARKER_REVISION"];

/// Every `--name` in `text` (a lowercase letter after the dashes, then letters, digits, dashes).
fn flags(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("--") {
        let start = i + at;
        let mut end = start + 2;
        let preceded_by_dash = start > 0 && bytes[start - 1] == b'-';
        if !preceded_by_dash && end < bytes.len() && bytes[end].is_ascii_lowercase() {
            while end < bytes.len()
                && (bytes[end].is_ascii_lowercase()
                    || bytes[end].is_ascii_digit()
                    || bytes[end] == b'-')
            {
                end += 1;
            }
            found.insert(text[start..end].trim_end_matches('-').to_owned());
        }
        i = end.max(start + 2);
    }
    found
}

/// Every `BYPASS_MARKER_NAME` in `text` (the bare prefix, `BYPASS_MARKER_`, is not a variable).
fn variables(text: &str) -> BTreeSet<String> {
    const PREFIX: &str = "BYPASS_MARKER_";
    let mut found = BTreeSet::new();
    let mut i = 0;
    while let Some(at) = text[i..].find(PREFIX) {
        let start = i + at;
        let mut end = start + PREFIX.len();
        let bytes = text.as_bytes();
        while end < bytes.len()
            && (bytes[end].is_ascii_uppercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'_')
        {
            end += 1;
        }
        let name = text[start..end].trim_end_matches('_');
        if name.len() > PREFIX.len() {
            found.insert(name.to_owned());
        }
        i = end;
    }
    found
}

fn help() -> String {
    let out = Command::new(BIN)
        .args(["proxy", "--help"])
        .env_remove("RUST_LOG")
        .output()
        .expect("the binary runs");
    assert!(out.status.success(), "proxy --help failed: {out:?}");
    String::from_utf8(out.stdout).expect("the help is UTF-8")
}

#[test]
fn every_flag_on_the_page_is_in_the_help_and_back() {
    let help = flags(&help());
    let page: BTreeSet<String> = flags(PAGE)
        .into_iter()
        .filter(|flag| !OTHER_COMMANDS.contains(&flag.as_str()))
        .collect();
    assert!(
        help.contains("--upstream"),
        "no flags found in the help: {help:?}"
    );
    let undocumented: Vec<_> = help.difference(&page).collect();
    let unknown: Vec<_> = page.difference(&help).collect();
    assert!(
        undocumented.is_empty(),
        "flags missing from docs/sidecar.md: {undocumented:?}"
    );
    assert!(
        unknown.is_empty(),
        "docs/sidecar.md names flags the proxy lacks: {unknown:?}"
    );
}

#[test]
fn every_variable_on_the_page_is_in_the_help_and_back() {
    let help = variables(&help());
    let page: BTreeSet<String> = variables(PAGE)
        .into_iter()
        .filter(|v| !BUILD_VARIABLES.contains(&v.as_str()))
        .collect();
    assert!(
        help.contains("BYPASS_MARKER_UPSTREAM"),
        "no variables found in the help: {help:?}"
    );
    let undocumented: Vec<_> = help.difference(&page).collect();
    let unknown: Vec<_> = page.difference(&help).collect();
    assert!(
        undocumented.is_empty(),
        "variables missing from docs/sidecar.md: {undocumented:?}"
    );
    assert!(
        unknown.is_empty(),
        "docs/sidecar.md names variables the proxy lacks: {unknown:?}"
    );
}

#[test]
fn the_scanners_find_what_they_should() {
    assert_eq!(
        flags("`--a-b X`, |---|, --sdk-safe. ---no"),
        BTreeSet::from(["--a-b".to_owned(), "--sdk-safe".to_owned()])
    );
    assert_eq!(
        variables("`BYPASS_MARKER_` and BYPASS_MARKER_OPT_IN=a, BYPASS_MARKER_LISTEN."),
        BTreeSet::from([
            "BYPASS_MARKER_LISTEN".to_owned(),
            "BYPASS_MARKER_OPT_IN".to_owned()
        ])
    );
}

/// The one command the docs give to install the binary, and the line after it.
const INSTALL: &str =
    "cargo install --locked --path bypass-marker --root ~/.local   # from a clone: ~/.local/bin/bypass-marker";
const PATH_NOTE: &str =
    "export PATH=\"$HOME/.local/bin:$PATH\"    # if ~/.local/bin is not on your PATH yet";

#[test]
fn every_page_installs_the_binary_with_the_same_command_and_the_path_note() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let mut pages = vec![
        format!("{root}/README.md"),
        format!("{root}/examples/envoy/README.md"),
    ];
    for entry in std::fs::read_dir(format!("{root}/docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path.display().to_string());
        }
    }
    let mut seen = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            // The binary's install (a page may install tools, such as cargo-deny, too).
            if line.trim_start().starts_with("cargo install") && line.contains("bypass-marker") {
                assert_eq!(line.trim(), INSTALL, "{page}, line {}", i + 1);
                assert_eq!(
                    lines.get(i + 1).map(|l| l.trim()),
                    Some(PATH_NOTE),
                    "{page}, line {}: the PATH note must follow",
                    i + 2
                );
                seen += 1;
            }
        }
    }
    assert!(seen >= 4, "only {seen} install commands found in {pages:?}");
}

/// Issue 42: the unit docs/sidecar.md shows is dist/bypass-marker.service, line for line (the one
/// tests/systemd/check.sh verifies and rates).
#[test]
fn the_unit_on_the_page_is_the_shipped_unit() {
    let unit = include_str!("../../dist/bypass-marker.service");
    let block = PAGE
        .split("```ini\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("an ini block on the page");
    assert_eq!(block, unit);
    assert!(unit.contains("\nRestartPreventExitStatus=2\n"), "{unit}");
}

/// Issue 42: the page's figure for the default `--max-connections` is the code's.
#[test]
fn the_max_connections_figure_is_the_codes() {
    let n = bypass_marker::default_max_connections(Some(20_000), 1);
    assert_eq!(n, 9983);
    assert!(
        PAGE.contains(&format!("{n} for a limit of 20,000 and one thread")),
        "docs/sidecar.md does not give {n} for 20,000"
    );
    assert!(help().contains(&format!("{n} for 20000 and one thread")));
}

/// Issue 42: the startup line the page tells operators to check is the one the binary logs.
#[test]
fn the_startup_line_on_the_page_is_the_programs() {
    assert!(include_str!("../src/main.rs").contains("\"names in force: {names}\""));
    assert!(PAGE.contains("startup log line `names in force:"));
    assert!(!PAGE.contains("`filtering:"));
}

/// Every `bypass_marker_*` metric name in `text`, without the `_total`, `_bucket`, `_sum` and
/// `_count` suffixes of its samples.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("bypass_marker_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(tail.len());
        let mut name = &tail[..end];
        for suffix in ["_total", "_bucket", "_sum", "_count"] {
            name = name.strip_suffix(suffix).unwrap_or(name);
        }
        found.insert(name.trim_end_matches('_').to_owned());
        rest = &tail[end..];
    }
    found
}

/// Issue 42: every metric the proxy serves is on the page, and the page names no metric the proxy
/// or the processor lacks (the processor's own are on docs/envoy.md) (a `bypass_marker_` word that is not a metric is in `NOT_METRICS`).
#[test]
fn every_metric_is_on_the_page_and_back() {
    const NOT_METRICS: &[&str] = &["bypass_marker", "bypass_marker", "bypass_marker_so"];
    let proxy = bypass_marker::Metrics::new(["x"], true).encode();
    let ext_proc = bypass_marker::Metrics::frames_only(["x"], true).encode();
    let served = metric_names(&proxy);
    let known: BTreeSet<String> = served.union(&metric_names(&ext_proc)).cloned().collect();
    for name in [
        "bypass_marker_requests",
        "bypass_marker_build_info",
        "bypass_marker_time_to_first_byte_seconds",
        "bypass_marker_connections_open",
        "bypass_marker_shutdown_streams_cut",
    ] {
        assert!(served.contains(name), "{name} is not served: {served:?}");
    }
    let page: BTreeSet<String> = metric_names(PAGE)
        .into_iter()
        .filter(|n| !NOT_METRICS.contains(&n.as_str()))
        .collect();
    let undocumented: Vec<_> = served.difference(&page).collect();
    let unknown: Vec<_> = page.difference(&known).collect();
    assert!(
        undocumented.is_empty(),
        "metrics missing from docs/sidecar.md: {undocumented:?}"
    );
    assert!(
        unknown.is_empty(),
        "docs/sidecar.md names metrics nobody serves: {unknown:?}"
    );
    // Each new one has a PromQL line.
    let promql = PAGE
        .split("```promql\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a promql block");
    for name in [
        "bypass_marker_requests_total",
        "bypass_marker_build_info",
        "bypass_marker_time_to_first_byte_seconds_bucket",
        "bypass_marker_connections_open",
        "bypass_marker_shutdown_streams_cut_total",
    ] {
        assert!(promql.contains(name), "no PromQL line for {name}");
    }
}

/// Issue 42: the exit codes the page's table gives are the ones the binary documents.
#[test]
fn the_exit_code_table_has_every_code() {
    for code in ["| 0 |", "| 1 |", "| 2 |", "| 3 |"] {
        assert!(PAGE.contains(code), "no {code} row on docs/sidecar.md");
    }
    let main = include_str!("../src/main.rs");
    assert!(
        main.contains("const CUT: u8 = 3;"),
        "the binary's code for cut streams moved"
    );
}

/// Issue 42: the boolean spellings the page gives are the ones the switches take.
#[test]
fn the_boolean_spellings_are_on_the_page() {
    assert!(PAGE.contains(
        "take `true`, `1`, `yes`, `on` (also `y`,\n`t`) or `false`, `0`, `no`, `off` (also `n`, `f`), in any case"
    ));
}
