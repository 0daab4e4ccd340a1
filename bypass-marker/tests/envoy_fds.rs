//! The Envoy processor (`bypass_marker::envoy::serve`) when the process runs out of file
//! descriptors: accepting must neither stop (health answers again once descriptors are free) nor
//! spin (tonic's own accept loop retries a failed accept at once).
//!
//! Its own test binary, because it lowers the process's limit on open files.
#![cfg(target_os = "linux")]

mod support;

use std::time::Duration;

use bypass_marker::envoy::{self, ExtProc};
use support::{starve, PATIENCE};
use tokio::net::TcpListener;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tower_bypass_marker::BypassMarkerLayer;

/// CPU time this process has used (user and system); `getrusage` needs no file descriptor.
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes the struct we pass, nothing else.
    #[allow(unsafe_code)]
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        assert_eq!(libc::getrusage(libc::RUSAGE_SELF, &mut usage), 0);
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

async fn serving(addr: std::net::SocketAddr) -> bool {
    let Ok(channel) = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
    else {
        return false;
    };
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await;
    matches!(answer, Ok(res) if res.get_ref().status() == ServingStatus::Serving)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_neither_stops_nor_spins_accepting() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(envoy::serve(
        listener,
        ExtProc::new(BypassMarkerLayer::dynamo()),
        std::future::pending(),
    ));
    assert!(serving(addr).await);

    // Out of descriptors, with connections waiting in the accept queue: every `accept` fails
    // with EMFILE.
    let (starved, waiting) = starve(addr, 4).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A loop that retried at once would keep a core busy for the whole second.
    let before = cpu_time();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = cpu_time() - before;
    assert!(
        used < Duration::from_millis(300),
        "{used:?} of CPU in 1 s while out of file descriptors"
    );

    // Free the descriptors: the processor accepts again.
    starved.free();
    drop(waiting);
    let back = tokio::time::timeout(PATIENCE, async {
        while !serving(addr).await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        back.is_ok(),
        "the processor serves again once descriptors are free"
    );
}
