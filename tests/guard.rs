//! The request-side guard and the layer's configuration.

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};

use tower_bypass_marker::{
    BypassMarkerLayer, RequestedAnnotations, BYPASS_REMOTE_PREFILL, MAX_NAMES,
};

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn guard_strips_every_form_of_a_router_owned_name() {
    let layer = BypassMarkerLayer::new();
    for form in [
        "x-bypass-remote-prefill",
        "x-bypass-remote-prefill:true",
        "x-bypass-remote-prefill:",
        "x-bypass-remote-prefill: 1",
        " x-bypass-remote-prefill ",
        "X-Bypass-Remote-Prefill",
        "X-BYPASS-REMOTE-PREFILL:true",
        "x-bypass-remote-prefill\t:yes",
    ] {
        let mut annotations = strings(&["request_id", form, "query_instance_id"]);
        layer.guard_annotations(&mut annotations);
        assert_eq!(
            annotations,
            ["request_id", "query_instance_id"],
            "form {form:?}"
        );
    }
}

#[test]
fn guard_keeps_names_that_only_look_alike() {
    let layer = BypassMarkerLayer::new();
    let mut annotations = strings(&[
        "x-bypass-remote-prefill-x",
        "x-bypass",
        "prefill:x-bypass-remote-prefill",
    ]);
    let before = annotations.clone();
    let granted = layer.guard_annotations(&mut annotations);
    assert_eq!(annotations, before);
    assert!(granted.is_empty());
}

#[test]
fn guard_grants_only_exact_bare_opt_in_names() {
    let layer = BypassMarkerLayer::new()
        .opt_in("request_id")
        .never_forward("llm_metrics");
    let mut annotations = strings(&[
        "x-bypass-remote-prefill",
        "request_id",
        "llm_metrics",
        "unknown",
        "Request_Id",
    ]);
    let granted = layer.guard_annotations(&mut annotations);
    assert_eq!(
        granted.iter().collect::<Vec<_>>(),
        ["request_id", BYPASS_REMOTE_PREFILL]
    );
    // Opt-in names the router serves stay; so do names the layer does not know.
    assert_eq!(
        annotations,
        ["request_id", "llm_metrics", "unknown", "Request_Id"]
    );
}

#[test]
fn a_value_form_is_stripped_but_is_not_an_opt_in() {
    let layer = BypassMarkerLayer::new();
    let mut annotations = strings(&["x-bypass-remote-prefill:true"]);
    let granted = layer.guard_annotations(&mut annotations);
    assert!(annotations.is_empty());
    assert!(!granted.contains(BYPASS_REMOTE_PREFILL));
}

#[test]
fn router_owned_names_can_be_added_and_survive_never_forward() {
    let layer = BypassMarkerLayer::new()
        .router_owned("x-route-hint")
        .never_forward(BYPASS_REMOTE_PREFILL);
    let mut annotations = strings(&[
        "x-route-hint:worker-3",
        "x-bypass-remote-prefill",
        "x-route-hint",
    ]);
    let granted = layer.guard_annotations(&mut annotations);
    assert!(annotations.is_empty(), "still stripped: {annotations:?}");
    // The marker is never forwarded now, so asking for it grants nothing.
    assert_eq!(granted.iter().collect::<Vec<_>>(), ["x-route-hint"]);
}

#[test]
fn requested_annotations_is_a_set() {
    let mut set: RequestedAnnotations = ["a", "b", "a"].into_iter().collect();
    assert_eq!(set.len(), 2);
    assert!(!set.insert("b"));
    assert!(set.insert("c"));
    assert!(set.remove("a"));
    assert!(!set.remove("a"));
    assert_eq!(set.iter().collect::<Vec<_>>(), ["b", "c"]);
    let owned: RequestedAnnotations = vec!["x".to_owned()].into_iter().collect();
    assert!(owned.contains("x") && !owned.contains("X"));
    assert!(RequestedAnnotations::default().is_empty());
    assert_eq!(format!("{set:?}"), r#"{"b", "c"}"#);
}

#[test]
fn requested_annotations_are_equal_and_hash_alike_whatever_the_order() {
    let ab: RequestedAnnotations = ["a", "b"].into_iter().collect();
    let ba: RequestedAnnotations = ["b", "a"].into_iter().collect();
    let bab: RequestedAnnotations = ["b", "a", "b"].into_iter().collect();
    assert_eq!(ab, ba);
    assert_eq!(ab, bab);
    assert_ne!(ab, ["a"].into_iter().collect());
    assert_ne!(ab, ["a", "B"].into_iter().collect());
    let state = RandomState::new();
    assert_eq!(state.hash_one(&ab), state.hash_one(&ba));
    let sets: HashSet<RequestedAnnotations> = [ab, ba, bab].into_iter().collect();
    assert_eq!(sets.len(), 1);
}

#[test]
fn requested_annotations_iterate_in_byte_order_borrowed_and_owned() {
    let names = ["b", "é", "a", "B", "aa", "", "a"];
    let set: RequestedAnnotations = names.into_iter().collect();
    let sorted = ["", "B", "a", "aa", "b", "é"];
    assert_eq!(set.iter().collect::<Vec<_>>(), sorted);
    assert_eq!((&set).into_iter().rev().collect::<Vec<_>>(), {
        let mut r = sorted;
        r.reverse();
        r
    });
    assert_eq!(set.iter().len(), 6);
    let owned: Vec<String> = set.clone().into_iter().collect();
    assert_eq!(owned, sorted);
    // Owned names go back in without a copy and come out equal.
    let again: RequestedAnnotations = owned.into_iter().collect();
    assert_eq!(again, set);
    assert_eq!(format!("{set:?}"), r#"{"", "B", "a", "aa", "b", "é"}"#);
}

/// A client's list of 40,000 names. Insertion and lookup are O(log n) (a `BTreeSet`), so
/// building the set is O(n log n); this test pins the behaviour at that size, not its time.
#[test]
fn forty_thousand_names_make_a_set_of_forty_thousand() {
    let names: Vec<String> = (0..40_000).map(|i| format!("name-{i}")).collect();
    let forward: RequestedAnnotations = names.iter().map(String::as_str).collect();
    let backward: RequestedAnnotations = names.iter().rev().cloned().collect();
    assert_eq!(forward.len(), 40_000);
    assert_eq!(forward, backward);
    assert!(names.iter().all(|n| forward.contains(n)));
    assert!(!forward.contains("name-40000"));
    let mut doubled = forward.clone();
    doubled.extend(names.iter().map(String::as_str));
    assert_eq!(doubled, forward);
    let mut emptied = forward;
    assert!(names.iter().all(|n| emptied.remove(n)));
    assert!(emptied.is_empty());
}

#[test]
#[should_panic(expected = "annotation name is empty")]
fn empty_names_are_rejected() {
    let _ = BypassMarkerLayer::new().opt_in("");
}

#[test]
#[should_panic(expected = "contains a control character")]
fn names_with_line_ends_are_rejected() {
    let _ = BypassMarkerLayer::new().never_forward("a\nb");
}

#[test]
#[should_panic(expected = "a layer takes at most 64 names")]
fn more_than_max_names_are_rejected() {
    let mut layer = BypassMarkerLayer::new();
    for i in 0..MAX_NAMES {
        layer = layer.opt_in(&format!("name-{i}"));
    }
}

#[test]
fn max_names_fit() {
    let mut layer = BypassMarkerLayer::new();
    for i in 1..MAX_NAMES {
        layer = layer.opt_in(&format!("name-{i}"));
    }
    // Setting a known name again does not add one.
    let _ = layer.opt_in(BYPASS_REMOTE_PREFILL).never_forward("name-1");
}

#[test]
fn debug_shows_the_configuration() {
    let layer = BypassMarkerLayer::new().opt_in("request_id").sdk_safe(true);
    let s = format!("{layer:?}");
    assert!(
        s.contains(r#"router_owned: ["x-bypass-remote-prefill"]"#),
        "{s}"
    );
    assert!(
        s.contains(r#"opt_in: ["x-bypass-remote-prefill", "request_id"]"#),
        "{s}"
    );
    assert!(s.contains("sdk_safe: true"), "{s}");
}
