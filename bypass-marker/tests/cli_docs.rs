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
    "--path",
    "--root",
];

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
    let page = variables(PAGE);
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
