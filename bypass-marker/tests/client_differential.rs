//! Property test: the sidecar's own HTTP/1.1 upstream client held to hyper's client
//! (`hyper::client::conn::http1`). The same upstream bytes (a response: status line, header
//! fields, body framing, and what follows), cut into the same writes, go to both, and both must
//! give the same status and header fields, the same body bytes, the same end (refused, cut,
//! complete) and the same decision to reuse the connection, but for the cases
//! `test_support::client` lists with their reasons (`STRICTER`: on purpose; `FOUND`: found and not
//! yet decided, empty today), each only for the client's own reason it names. Requests carry
//! bodies too (small, streamed by length or chunked, answered early or late), and a second
//! request finds the connection pooled, stale or new. The `client` fuzz target runs the same
//! check on any bytes (FUZZING.md).
//! `PROPTEST_CASES=20000 cargo test --release -p bypass-marker --test client_differential` runs a
//! long campaign.
use proptest::prelude::*;
use test_support::client::{
    check, compare, decode, interim_heads, verdicts, CutReason, End, HeadRefusal, FOUND, STRICTER,
};

/// An input of the fuzz target's format: mostly generated responses (realistic but hostile),
/// some at the client's limits, some arbitrary bytes; a third of the requests with a body, and
/// the second request on a stale connection or as a POST now and then.
fn input() -> impl Strategy<Value = Vec<u8>> {
    (
        (
            any::<bool>(),
            prop::bool::weighted(0.85),
            prop::bool::weighted(0.2),
        ),
        (
            prop::bool::weighted(0.3),
            any::<u8>(),
            any::<bool>(),
            any::<bool>(),
        ),
        prop::collection::vec(any::<u8>(), 0..8),
        prop::collection::vec(any::<u8>(), 0..160),
    )
        .prop_map(
            |((head, generated, limits), (upload, how, stale, post), cuts, rest)| {
                let flags = u8::from(head)
                    | if generated { 0x02 } else { 0 }
                    | if limits { 0x04 } else { 0 }
                    | if upload { 0x08 } else { 0 }
                    | if stale { 0x10 } else { 0 }
                    | if post { 0x20 } else { 0 };
                let mut data = vec![flags, cuts.len() as u8];
                if upload {
                    data.push(how);
                }
                data.extend_from_slice(&cuts);
                data.extend_from_slice(&rest);
                data
            },
        )
}

proptest! {
    // 512 cases, or `PROPTEST_CASES`.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(512),
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_sidecar_client_reaches_hypers_verdict_on_any_split_response(data in input()) {
        check(&data);
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A raw response as the fuzz input of it, with cuts at the given fractions of its length.
fn raw(head: bool, cuts: &[u8], response: &[u8]) -> Vec<u8> {
    let mut data = vec![u8::from(head), cuts.len() as u8];
    data.extend_from_slice(cuts);
    data.extend_from_slice(response);
    data
}

/// Both verdicts, and whether they agree.
fn run(
    data: &[u8],
) -> (
    test_support::client::Verdict,
    test_support::client::Verdict,
    Result<(), String>,
) {
    let case = decode(data);
    let (hyper, ours) = runtime().block_on(verdicts(&case));
    let agree = compare(&case, &hyper, &ours);
    (hyper, ours, agree)
}

#[test]
fn well_formed_responses_agree_whole_cut_and_reused() {
    let cases: &[&[u8]] = &[
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\nx: 1\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\n\r\nuntil the close",
        b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\ncut",
    ];
    for response in cases {
        for cuts in [&[][..], &[100], &[30, 60, 90, 200]] {
            let (hyper, ours, agree) = run(&raw(false, cuts, response));
            assert_eq!(agree, Ok(()), "{hyper:?}\n{ours:?}");
        }
    }
    // The reuse decision is exercised both ways.
    let (hyper, ours, _) = run(&raw(false, &[], cases[0]));
    assert!(hyper.reused && ours.reused);
    let (hyper, ours, _) = run(&raw(false, &[], cases[3]));
    assert!(!hyper.reused && !ours.reused);
    let (_, ours, _) = run(&raw(false, &[], cases[5]));
    assert_eq!(ours.end, End::Cut);
}

#[test]
fn every_listed_case_is_one_where_the_verdicts_differ() {
    // One response for each entry of `STRICTER`, in order (HEAD, the response): each must differ
    // from hyper's verdict without the list (else the entry is dead), this client refusing it,
    // and be matched by its entry. `FOUND` is empty: a disagreement found is fixed or listed as
    // stricter with its reason.
    let zeros = [
        &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"[..],
        &[b'0'; 5000],
        b"2\r\nok\r\n0\r\n\r\n",
    ]
    .concat();
    let stricter: &[(bool, &[u8])] = &[
        (false, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n2\r\nok\r\n0\r\n\r\n"),
        (false, b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"),
        (false, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding:\r\n\r\n2\r\nok\r\n0\r\n\r\n"),
        (false, b"HTTP/1.1 101 Switching Protocols\r\n\r\n"),
        (false, &[&b"HTTP/1.1 100 Continue\r\n\r\n".repeat(17)[..], b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"].concat()),
        (true, b"HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\n"),
        (false, &zeros),
    ];
    assert_eq!(stricter.len(), STRICTER.len());
    assert!(FOUND.is_empty(), "a disagreement left undecided");
    for ((why, applies, reasons), (head, response)) in STRICTER.iter().zip(stricter) {
        let (hyper, ours, agree) = run(&raw(*head, &[], response));
        let case = decode(&raw(*head, &[], response));
        assert!(applies(&case, &hyper), "{why}: the entry matches its case");
        // Which entry the case meets first is its own.
        let first = STRICTER.iter().position(|(_, a, _)| a(&case, &hyper));
        assert_eq!(first.map(|i| STRICTER[i].0), Some(*why));
        assert_eq!(
            hyper.end,
            End::Complete,
            "{why}: hyper accepts it\n{hyper:?}"
        );
        assert_ne!(
            ours.end,
            End::Complete,
            "{why}: this client refuses or cuts it\n{ours:?}"
        );
        assert!(
            ours.reason.is_some_and(|r| reasons.contains(&r)),
            "{why}: for the reason listed\n{ours:?}"
        );
        assert_eq!(agree, Ok(()), "{why}: the entry excuses it");
        // The same refusal for another reason is not excused.
        let mut other = ours.clone();
        other.reason = Some(CutReason::Io(std::io::ErrorKind::UnexpectedEof));
        assert!(compare(&case, &hyper, &other).is_err(), "{why}: any reason");
    }
}

/// The disagreements issue 28 named (items 7 and 8) and the one the `client` target found in the
/// trailers are gone: these cases reach hyper's verdict with no list applying, however cut.
#[test]
fn the_disagreements_issue_28_fixed_reach_hypers_verdict_unlisted() {
    let cases: &[(&[u8], End)] = &[
        // Item 7: whitespace after a chunk size followed by no `;`; 17 digits, leading zeros.
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2 x\r\nok\r\n0\r\n\r\n", End::Cut),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n00000000000000002\r\nok\r\n0\r\n\r\n", End::Complete),
        // Item 8: empty lines before the status line, arriving alone (cut after them).
        (b"\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", End::Complete),
        // A malformed trailer section: hyper fails the body, and so does this client.
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nbad trailer\r\n\r\n", End::Cut),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-a: 1\r\n x-fold\r\n\r\n", End::Cut),
    ];
    for (response, end) in cases {
        assert_agree_unlisted(response, *end, &String::from_utf8_lossy(response));
    }
}

/// Runs `response` whole, then cut at one place, then at three, and checks each time that no
/// entry of `STRICTER` applies, that the two verdicts agree and that both end as `end`; `what`
/// names the case in a failure. Returns this client's verdict of each run.
fn assert_agree_unlisted(
    response: &[u8],
    end: End,
    what: &str,
) -> Vec<test_support::client::Verdict> {
    let mut verdicts = Vec::new();
    for cuts in [&[][..], &[24], &[60, 90, 120]] {
        let data = raw(false, cuts, response);
        let case = decode(&data);
        let (hyper, ours, agree) = run(&data);
        assert!(
            STRICTER
                .iter()
                .all(|(_, applies, _)| !applies(&case, &hyper)),
            "{what}: no entry applies"
        );
        assert_eq!(agree, Ok(()), "{what}\n{hyper:?}\n{ours:?}");
        assert_eq!((hyper.end, ours.end), (end, end), "{what}");
        verdicts.push(ours);
    }
    verdicts
}

/// Item 6: a repeated length (`2, 2`) reaches the client as the one number, where hyper hands
/// the list on; the comparison takes the two as the same verdict, and only that.
#[test]
fn a_repeated_content_length_goes_on_as_one_number_and_is_held_the_same() {
    let (hyper, ours, agree) = run(&raw(
        false,
        &[],
        b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\nok",
    ));
    assert_eq!(agree, Ok(()), "{hyper:?}\n{ours:?}");
    assert_eq!(hyper.header_values("content-length"), [&b"2, 2"[..]]);
    assert_eq!(ours.header_values("content-length"), [&b"2"[..]]);
    assert_eq!((hyper.end, ours.end), (End::Complete, End::Complete));
    // Any other change to the field is a difference.
    let mut changed = ours.clone();
    changed.headers = vec![("content-length".to_owned(), b"02".to_vec())];
    let case = decode(&raw(
        false,
        &[],
        b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\nok",
    ));
    assert!(compare(&case, &hyper, &changed).is_err());
}

#[test]
fn every_stored_input_reaches_hypers_verdict() {
    // The fuzz target's seeds and the inputs of its findings (FUZZING.md).
    let mut n = 0;
    for dir in ["../fuzz/seeds-client", "../fuzz/regressions/client"] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            check(&std::fs::read(&path).unwrap());
            n += 1;
        }
    }
    assert!(n >= 10, "the stored inputs are there");
}

/// The four inputs issue 34 found unlisted: each now reaches hyper's verdict, however cut, with
/// no entry applying. hyper's limits: a `Content-Length` framing a body is at most
/// `u64::MAX - 2`, the chunk extensions of a body fewer than 16 KiB, a trailer section shorter
/// than the head's limit.
#[test]
fn the_four_disagreements_of_issue_34_reach_hypers_verdict_unlisted() {
    const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
    let long_extension = [CHUNKED, b"2;", &[b'e'; 5000], b"\r\nok\r\n0\r\n\r\n"].concat();
    let mut many_extensions = CHUNKED.to_vec();
    for _ in 0..20 {
        many_extensions.extend_from_slice(b"1;");
        many_extensions.extend_from_slice(&[b'e'; 999]);
        many_extensions.extend_from_slice(b"\r\nA\r\n");
    }
    many_extensions.extend_from_slice(b"0\r\n\r\n");
    let mut trailers = [CHUNKED, b"2\r\nok\r\n0\r\nx-a: "].concat();
    trailers.resize(trailers.len() + 20 * 1024, b't');
    trailers.extend_from_slice(b"\r\n\r\n");
    let cases: &[(&[u8], End, Option<CutReason>)] = &[
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 18446744073709551615\r\n\r\nok",
            End::Refused,
            Some(CutReason::Head(HeadRefusal::ContentLengthTooLarge)),
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 18446744073709551614\r\n\r\nok",
            End::Refused,
            Some(CutReason::Head(HeadRefusal::ContentLengthTooLarge)),
        ),
        (&long_extension, End::Complete, None),
        (
            &many_extensions,
            End::Cut,
            Some(CutReason::Chunked("chunk extensions of 16 KiB or more")),
        ),
        (&trailers, End::Complete, None),
    ];
    for (response, end, reason) in cases {
        let what = String::from_utf8_lossy(&response[..response.len().min(80)]);
        for ours in assert_agree_unlisted(response, *end, &what) {
            assert_eq!(ours.reason, *reason, "{what}");
        }
    }
}

/// The rule for "more than 16 interim responses" counts the interim heads a client reads before
/// the final one, not status lines anywhere in the bytes (a body of them, here), and excuses
/// only a refusal for that reason.
#[test]
fn interim_responses_are_counted_in_the_head_sequence_only() {
    let interim = b"HTTP/1.1 100 Continue\r\n\r\n".repeat(17);
    let in_body = [
        format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
            interim.len()
        )
        .as_bytes(),
        &interim,
    ]
    .concat();
    assert_eq!(interim_heads(&in_body), 0);
    let heads = [&interim[..], b"\r\n", &in_body].concat();
    assert_eq!(interim_heads(&heads), 17);
    // A refusal of the response with the body of status lines is not excused by the rule.
    let (hyper, ours, agree) = run(&raw(false, &[], &in_body));
    assert_eq!(agree, Ok(()));
    assert_eq!((hyper.end, ours.end), (End::Complete, End::Complete));
    let mut refused = ours.clone();
    refused.end = End::Refused;
    refused.status = None;
    refused.headers.clear();
    refused.body.clear();
    refused.reason = Some(CutReason::Head(HeadRefusal::TooManyInterim));
    assert!(compare(&decode(&raw(false, &[], &in_body)), &hyper, &refused).is_err());
}

/// A request input: `how` is the upload byte (framing `% 3`, size `/ 3 % 4`, `0x80` early).
fn upload(how: u8, stale: bool, post: bool, response: &[u8]) -> Vec<u8> {
    let flags = 0x08 | if stale { 0x10 } else { 0 } | if post { 0x20 } else { 0 };
    let mut data = vec![flags, 0, how];
    data.extend_from_slice(response);
    data
}

/// Request bodies of each framing, answered after their end or at once after the head, then a
/// second request on the connection: both clients deliver the body whole, reuse the connection
/// after it alike (this client too when the answer came before the upload's end), and this
/// client retries a GET that finds the pooled connection stale, never a POST.
#[test]
fn uploads_early_answers_reuse_and_the_stale_connection_retry() {
    let response = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    for framing in 0..3u8 {
        for size in 0..4u8 {
            for early in [0, 0x80] {
                let how = (framing + 3 * size) | early;
                for (stale, post) in [(false, false), (true, false), (true, true)] {
                    let data = upload(how, stale, post, response);
                    let case = decode(&data);
                    let (hyper, ours, agree) = run(&data);
                    let what = format!("{:?}, stale {stale}, POST {post}", case.upload);
                    assert_eq!(agree, Ok(()), "{what}\n{hyper:?}\n{ours:?}");
                    assert_eq!(
                        (hyper.end, ours.end),
                        (End::Complete, End::Complete),
                        "{what}"
                    );
                    let sent = case.upload.unwrap().bytes();
                    assert_eq!(hyper.uploaded.as_ref(), Some(&sent), "{what}");
                    assert_eq!(ours.uploaded.as_ref(), Some(&sent), "{what}");
                    assert!(hyper.reused && ours.reused, "{what}");
                    let next = ours.next.clone().unwrap();
                    if stale && post {
                        assert!(matches!(next, Err(CutReason::Io(_))), "{what}: {next:?}");
                    } else {
                        assert_eq!(next, Ok(b"ok".to_vec()), "{what}");
                    }
                }
            }
        }
    }
}
