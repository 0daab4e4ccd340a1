//! The sidecar (`bypass_marker`) when the process runs out of file descriptors: its accept
//! loop must neither stop (serving resumes once descriptors are free) nor spin.
//!
//! Its own test binary, because it lowers the process's limit on open files.
#![cfg(target_os = "linux")]

use bypass_marker as proxy;
use bypass_marker::proxy::ACCEPT_FAILURES;

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use support::{proxy_args, send, serve_upstream, starve, BoxError, PATIENCE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The body of `GET /ok` through the proxy at `addr`, which must answer 200.
async fn get_ok(addr: std::net::SocketAddr) -> Result<Bytes, BoxError> {
    let req = http::Request::get(format!("http://{addr}/ok"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let reply = send(req).await?;
    assert_eq!(reply.status, http::StatusCode::OK);
    Ok(reply.body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_neither_stops_nor_spins_the_accept_loop() {
    let app = axum::Router::new().route("/ok", axum::routing::get(|| async { "ok" }));
    let upstream = serve_upstream(app).await;

    let config = proxy_args(&format!("http://{upstream}"), &[]);
    let listener = proxy::bind(config.listen, config.backlog).unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(proxy::serve(listener, config, std::future::pending()));
    assert_eq!(get_ok(addr).await.unwrap(), "ok");

    // Out of descriptors, with connections waiting in the proxy's accept queue: every `accept`
    // fails with EMFILE.
    let (starved, waiting) = starve(addr, 8).await;
    // Give the accept loop time to hit EMFILE, then count its attempts for a second.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = ACCEPT_FAILURES.load(Ordering::Relaxed);
    assert!(before > 0, "accept has not failed yet");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let failures = ACCEPT_FAILURES.load(Ordering::Relaxed) - before;
    // Backing off from 10 ms to 1 s, doubling, makes at most 8 attempts in a second (fewer once
    // the back-off has grown); a loop that retried at once would make tens of thousands.
    assert!(
        (1..=10).contains(&failures),
        "{failures} failed accepts in 1 s while out of file descriptors"
    );

    // Free the descriptors: the proxy accepts the connections that waited, and serves again.
    starved.free();
    for mut conn in waiting {
        conn.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut response = Vec::new();
        tokio::time::timeout(PATIENCE, conn.read_to_end(&mut response))
            .await
            .expect("a connection that waited is served")
            .unwrap();
        assert!(response.starts_with(b"HTTP/1.1 200"), "{response:?}");
        assert!(response.ends_with(b"ok"), "{response:?}");
    }
    let served = tokio::time::timeout(PATIENCE, async {
        loop {
            match get_ok(addr).await {
                Ok(body) => break body,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await
    .expect("the proxy serves again once descriptors are free");
    assert_eq!(served, "ok");
}
