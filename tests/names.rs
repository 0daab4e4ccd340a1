//! Which annotation names a layer accepts, and that the guard recognises every accepted name in
//! exactly the forms it promises: `name`, `name:value`, any ASCII case, surrounding whitespace.

use proptest::prelude::*;
use test_support::body::{collect, data, response, through, Items};
use tower_bypass_marker::{BypassMarkerLayer, InvalidName, MAX_NAMES, MAX_NAME_LEN};

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn refused(name: &str) -> InvalidName {
    match BypassMarkerLayer::new().try_router_owned(name) {
        Ok(_) => panic!("{name:?} was accepted"),
        Err(e) => e,
    }
}

#[test]
fn names_the_guard_could_not_match_are_refused_with_a_reason() {
    let long = "a".repeat(MAX_NAME_LEN + 1);
    for (name, message) in [
        ("", "annotation name is empty".to_owned()),
        (
            "x-route:hint",
            r#"annotation name "x-route:hint" contains ':'"#.to_owned(),
        ),
        (":x", r#"annotation name ":x" contains ':'"#.to_owned()),
        (
            " x ",
            r#"annotation name " x " starts or ends with whitespace"#.to_owned(),
        ),
        (
            "x\t",
            r#"annotation name "x\t" contains a control character"#.to_owned(),
        ),
        (
            "\u{a0}x",
            r#"annotation name "\u{a0}x" starts or ends with whitespace"#.to_owned(),
        ),
        (
            "x\u{3000}",
            r#"annotation name "x\u{3000}" starts or ends with whitespace"#.to_owned(),
        ),
        (
            "a\nb",
            r#"annotation name "a\nb" contains a control character"#.to_owned(),
        ),
        (
            "a\rb",
            r#"annotation name "a\rb" contains a control character"#.to_owned(),
        ),
        (
            "a\0b",
            r#"annotation name "a\0b" contains a control character"#.to_owned(),
        ),
        (
            "a\u{7f}",
            r#"annotation name "a\u{7f}" contains a control character"#.to_owned(),
        ),
        (
            "a\u{85}b",
            r#"annotation name "a\u{85}b" contains a control character"#.to_owned(),
        ),
        (
            &long,
            format!("annotation name is 257 bytes long, more than {MAX_NAME_LEN}"),
        ),
    ] {
        let e = refused(name);
        assert_eq!(e.to_string(), message, "{name:?}");
        assert_eq!(e.name(), name);
    }
}

#[test]
fn every_fallible_setter_refuses_and_every_panicking_one_panics() {
    let layer = BypassMarkerLayer::new();
    assert!(layer.clone().try_opt_in("a:b").is_err());
    assert!(layer.clone().try_never_forward("a:b").is_err());
    assert!(layer.clone().try_router_owned("a:b").is_err());
    for setter in [
        BypassMarkerLayer::opt_in,
        BypassMarkerLayer::router_owned,
        BypassMarkerLayer::never_forward,
    ] {
        let layer = layer.clone();
        let panic =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || setter(layer, " x")))
                .unwrap_err();
        let message = panic.downcast_ref::<String>().unwrap();
        assert_eq!(
            message,
            r#"annotation name " x" starts or ends with whitespace"#
        );
    }
}

#[test]
fn the_error_is_a_std_error_with_a_lowercase_message_and_no_period() {
    let e: Box<dyn std::error::Error + Send + Sync> = Box::new(refused(""));
    let message = e.to_string();
    assert!(message.starts_with(char::is_lowercase) && !message.ends_with('.'));
}

#[test]
fn names_inside_the_rules_are_accepted() {
    for name in [
        "a",
        "request_id",
        "x y",
        "x\u{a0}y",
        "é",
        "\u{feff}x",
        "[]{}\"'\\/",
        &"a".repeat(MAX_NAME_LEN),
        &"é".repeat(MAX_NAME_LEN / 2),
    ] {
        let layer = BypassMarkerLayer::new()
            .try_router_owned(name)
            .unwrap_or_else(|e| panic!("{name:?}: {e}"));
        let mut annotations = strings(&[name]);
        layer.guard_annotations(&mut annotations);
        assert!(annotations.is_empty(), "{name:?}");
    }
}

#[test]
fn one_name_past_max_names_is_an_error_and_known_names_still_update() {
    let mut layer = BypassMarkerLayer::new();
    for i in 1..MAX_NAMES {
        layer = layer.try_opt_in(&format!("name-{i}")).unwrap();
    }
    let e = layer.clone().try_opt_in("one-more").unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"cannot add annotation name "one-more": a layer takes at most 64 names"#
    );
    // Names it knows can still change role.
    let layer = layer.try_never_forward("name-1").unwrap();
    assert!(format!("{layer:?}").contains(r#"never_forward: ["name-1"]"#));
}

/// An opt-in the application grants in another ASCII case than the configured name is that name,
/// as names compare everywhere else (`role`, the guard's stripping, `CaseConflict`): by
/// `RequestedAnnotations` in the extensions and by `opt_in_from` alike.
#[tokio::test]
async fn an_opt_in_in_another_ascii_case_grants_the_configured_name() {
    let stream = "event: request_id\n: \"r-1\"\n\ndata: {}\n\n";
    let asked: tower_bypass_marker::RequestedAnnotations = ["Request_ID"].into_iter().collect();
    let layer = BypassMarkerLayer::new().opt_in("request_id");
    let res = through(
        &layer,
        Some(asked.clone()),
        response("text/event-stream", Items::new([data(stream)])),
    )
    .await;
    assert_eq!(collect(res.into_body()).await.data, stream.as_bytes());
    let layer = layer.opt_in_from(move |_| asked.clone());
    let res = through(
        &layer,
        None,
        response("text/event-stream", Items::new([data(stream)])),
    )
    .await;
    assert_eq!(collect(res.into_body()).await.data, stream.as_bytes());
    // Another name is not: the frame goes.
    let other: tower_bypass_marker::RequestedAnnotations = ["request-id"].into_iter().collect();
    let layer = BypassMarkerLayer::new().opt_in("request_id");
    let res = through(
        &layer,
        Some(other),
        response("text/event-stream", Items::new([data(stream)])),
    )
    .await;
    assert_eq!(collect(res.into_body()).await.data, b"data: {}\n\n");
}

/// A frame of the longest accepted name is recognised at every split, so the scanner keeps
/// enough of a line that spans chunks.
#[tokio::test]
async fn a_frame_named_by_the_longest_name_is_removed_at_every_split() {
    let name = "n".repeat(MAX_NAME_LEN);
    let layer = BypassMarkerLayer::new().opt_in(&name);
    let input = format!("data: 1\n\nevent: {name}\ndata: x\n\ndata: 2\n\n");
    for at in 0..=input.len() {
        let (a, b) = input.as_bytes().split_at(at);
        let items = [data(a.to_vec()), data(b.to_vec())];
        let res = through(
            &layer,
            None,
            response("text/event-stream", Items::new(items)),
        )
        .await;
        let out = collect(res.into_body()).await;
        assert_eq!(
            out.data,
            "data: 1\n\ndata: 2\n\n".as_bytes(),
            "split at {at}"
        );
    }
}

/// The forms of `name` the guard promises to strip: bare, with a value, any ASCII case,
/// surrounding whitespace.
fn forms(name: &str, value: &str, mask: &[bool]) -> Vec<String> {
    let mixed: String = name
        .chars()
        .zip(mask.iter().cycle())
        .map(|(c, &up)| {
            if up {
                c.to_ascii_uppercase()
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect();
    vec![
        name.to_owned(),
        format!("{name}:"),
        format!("{name}:{value}"),
        format!(" {name} "),
        format!("\t{name}\t:{value}"),
        format!("\u{a0}{name}\u{3000}"),
        name.to_ascii_uppercase(),
        name.to_ascii_lowercase(),
        format!("{}:{value}", name.to_ascii_uppercase()),
        format!(" {mixed}:{value} "),
        mixed,
    ]
}

/// The near-miss rule (the security model's table): `entry`, without leading whitespace, holds a
/// control or non-ASCII character, and what comes before the first one begins `name` in some
/// ASCII case.
fn near_miss(entry: &str, name: &str) -> bool {
    let entry = entry.trim_start();
    let Some(at) = entry.find(|c: char| !c.is_ascii() || c.is_ascii_control()) else {
        return false;
    };
    name.len() >= at && name.as_bytes()[..at].eq_ignore_ascii_case(&entry.as_bytes()[..at])
}

/// Checks the guard's rule for router-owned `owned` exactly: every form of `owned` is stripped,
/// every form of `other` is stripped only when `other` is `owned` in another ASCII case or the
/// form is a near miss of it, and only the exact bare `owned` is granted.
fn check_rule(owned: &str, other: &str, value: &str, mask: &[bool]) -> Result<(), TestCaseError> {
    let layer = BypassMarkerLayer::new()
        .try_router_owned(owned)
        .map_err(|e| TestCaseError::fail(format!("{owned:?} refused: {e}")))?;
    for form in forms(owned, value, mask) {
        let mut annotations = vec![form.clone()];
        let granted = layer.guard_annotations(&mut annotations);
        prop_assert!(annotations.is_empty(), "{form:?} of {owned:?} kept");
        prop_assert_eq!(granted.contains(owned), form == owned, "{:?}", form);
    }
    let same = other.eq_ignore_ascii_case(owned)
        || other.eq_ignore_ascii_case(tower_bypass_marker::BYPASS_REMOTE_PREFILL);
    for form in forms(other, value, mask) {
        let mut annotations = vec![form.clone()];
        layer.guard_annotations(&mut annotations);
        let near =
            near_miss(&form, owned) || near_miss(&form, tower_bypass_marker::BYPASS_REMOTE_PREFILL);
        prop_assert_eq!(
            annotations.is_empty(),
            same || near,
            "{:?} (a form of {:?}) with {:?} router-owned",
            form,
            other,
            owned
        );
    }
    Ok(())
}

/// Characters a valid name is built from: letters in both cases, digits, punctuation (no `:`),
/// non-ASCII letters, a space and a no-break space (inside only), a BOM.
fn name_char() -> impl Strategy<Value = char> {
    prop_oneof![
        8 => prop::char::range('!', '9'),
        8 => prop::char::range(';', '~'),
        1 => Just(' '),
        1 => Just('\u{a0}'),
        1 => Just('é'),
        1 => Just('É'),
        1 => Just('\u{212a}'), // KELVIN SIGN: folds to `k` in Unicode, not in ASCII
        1 => Just('ß'),
        1 => Just('\u{feff}'),
    ]
}

fn valid_name() -> impl Strategy<Value = String> {
    (
        name_char(),
        prop::collection::vec(name_char(), 0..12),
        name_char(),
    )
        .prop_filter_map("leading or trailing whitespace", |(first, middle, last)| {
            let name: String = std::iter::once(first).chain(middle).chain([last]).collect();
            let edges = [name.chars().next()?, name.chars().last()?];
            (!edges.iter().any(|c| c.is_whitespace())).then_some(name)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(512)
    ))]

    #[test]
    fn every_accepted_name_is_stripped_in_every_form_and_no_other_name_is(
        owned in valid_name(),
        other in valid_name(),
        value in "[ -~]{0,8}",
        mask in prop::collection::vec(any::<bool>(), 1..6),
    ) {
        check_rule(&owned, &other, &value, &mask)?;
        // A name that differs from `owned` only in ASCII case.
        let flipped: String = owned
            .chars()
            .map(|c| if c.is_ascii_uppercase() { c.to_ascii_lowercase() } else { c.to_ascii_uppercase() })
            .collect();
        check_rule(&owned, &flipped, &value, &mask)?;
    }
}

/// Every name of one or two ASCII characters: accepted exactly when the rules say, and then
/// stripped in every form.
#[test]
fn every_one_and_two_byte_ascii_name_follows_the_rules() {
    let mut accepted = 0;
    for a in 0u8..128 {
        for b in std::iter::once(None).chain((0u8..128).map(Some)) {
            let name: String = [Some(a), b].into_iter().flatten().map(char::from).collect();
            let valid = !name.contains(':')
                && !name.chars().any(|c| c.is_control())
                && !name.starts_with(' ')
                && !name.ends_with(' ');
            let result = BypassMarkerLayer::new().try_router_owned(&name);
            assert_eq!(result.is_ok(), valid, "{name:?}");
            if valid {
                accepted += 1;
                check_rule(&name, "x-bypass-remote-prefilL", "v", &[true, false]).unwrap();
                check_rule(&name, "zz", "v:w", &[false, true]).unwrap();
            }
        }
    }
    // The 93 printable ASCII characters other than `:` and space can start and end a name; a space
    // fits only in the middle of a longer one.
    assert_eq!(accepted, 93 + 93 * 93);
}
