//! Runs one variant over one workload of `benches/throughput.rs` a fixed number of times: for
//! callgrind (instruction counts that repeat to the instruction), and for A/B runs of two builds
//! (the file builds unchanged in a checkout of an older commit that has the same
//! `test_support::bench`).
//!
//! ```text
//! cargo build --release --example chunk_cost
//! target/release/examples/chunk_cost [WORKLOAD [HANDOVER [RUNS [VARIANT]]]]
//! valgrind --tool=callgrind target/release/examples/chunk_cost chat_61_byte_splits static 4
//! ```
//!
//! Defaults: `chat_61_byte_splits`, `static`, 20 runs, `layer`. Prints the throughput by the wall
//! clock and by the thread's CPU time. Building the workloads costs the same whatever the runs:
//! the instructions per chunk are (count for RUNS - count for 0 runs) / RUNS / chunks.

use std::time::Instant;

use test_support::bench::{workloads, Handover, Variant};

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "chat_61_byte_splits".into());
    let handover = args.next().map_or(Handover::Static, |h| {
        Handover::ALL
            .into_iter()
            .find(|x| x.name() == h)
            .unwrap_or_else(|| panic!("HANDOVER is `static` or `refcounted`"))
    });
    let runs: u64 = args
        .next()
        .map_or(20, |n| n.parse().expect("RUNS is a number"));
    let variant = args.next().map_or(Variant::Layer, |v| {
        Variant::ALL
            .into_iter()
            .find(|x| x.name() == v)
            .unwrap_or_else(|| panic!("VARIANT is a variant name, such as `layer`"))
    });
    let workload = workloads()
        .into_iter()
        .find(|w| w.name == name)
        .unwrap_or_else(|| panic!("no workload named {name}"));
    let start = Instant::now();
    let cpu_start = thread_cpu();
    let mut total = 0;
    for _ in 0..runs {
        total += std::hint::black_box(workload.run(handover, std::hint::black_box(variant)));
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = thread_cpu() - cpu_start;
    let mib = (runs * workload.input_len()) as f64 / 1048576.0;
    println!(
        "{name} {} {}: {runs} runs, {} chunks each, {:.1} MiB/s, cpu {:.1} MiB/s ({total} bytes)",
        variant.name(),
        handover.name(),
        workload.chunk_count(),
        mib / secs,
        mib / cpu,
    );
}

/// This thread's CPU time, in seconds.
fn thread_cpu() -> f64 {
    test_support::clock::thread_cpu().as_secs_f64()
}
