//! The sidecar (`bypass_marker_cli`) when the process runs out of file descriptors: its accept
//! loop must neither stop (serving resumes once descriptors are free) nor spin.
//!
//! Its own test binary, because it lowers the process's limit on open files.
#![cfg(target_os = "linux")]

use bypass_marker_cli as proxy;
use bypass_marker_cli::proxy::ACCEPT_FAILURES;

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const PATIENCE: Duration = Duration::from_secs(30);

fn open_files() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn set_open_files_limit(soft: Option<u64>) -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the struct we pass, nothing else.
    #[allow(unsafe_code)]
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        let old = limit.rlim_cur;
        if let Some(soft) = soft {
            limit.rlim_cur = soft;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
        old
    }
}

async fn get_ok(
    addr: std::net::SocketAddr,
) -> Result<Bytes, Box<dyn std::error::Error + Send + Sync>> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = http::Request::get(format!("http://{addr}/ok"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let res = tokio::time::timeout(PATIENCE, client.request(req)).await??;
    assert_eq!(res.status(), http::StatusCode::OK);
    Ok(res.into_body().collect().await?.to_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_neither_stops_nor_spins_the_accept_loop() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let app = axum::Router::new().route("/ok", axum::routing::get(|| async { "ok" }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let config = proxy::ProxyArgs::from_args([
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &format!("http://{upstream}"),
    ])
    .unwrap();
    let listener = proxy::bind(config.listen, config.backlog).unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(proxy::serve(listener, config, std::future::pending()));
    assert_eq!(get_ok(addr).await.unwrap(), "ok");

    // Sockets made while descriptors are free, connected once they are gone: their connections
    // wait in the proxy's accept queue while every `accept` fails with EMFILE.
    let sockets: Vec<tokio::net::TcpSocket> = (0..8)
        .map(|_| tokio::net::TcpSocket::new_v4().unwrap())
        .collect();
    let original = set_open_files_limit(Some(open_files() as u64 + 64));
    let mut filler = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(file) => filler.push(file),
            Err(err) if err.raw_os_error() == Some(libc::EMFILE) => break,
            Err(err) => panic!("open failed: {err}"),
        }
        assert!(filler.len() < 1000, "the limit on open files had no effect");
    }
    let mut waiting = Vec::new();
    for socket in sockets {
        waiting.push(socket.connect(addr).await.unwrap());
    }
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
    drop(filler);
    set_open_files_limit(Some(original));
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
