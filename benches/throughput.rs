//! Throughput of `BypassMarkerBody`, against the unfiltered body, a bare `memchr2` line scan and
//! an `eventsource-stream` decode + re-encode, on the same chunks in the same run. Each workload
//! runs twice: with static chunks (`layer`, ...) and with reference-counted chunks as hyper hands
//! them over (`layer_refcounted`, ...).
//!
//! `cargo bench --bench throughput` (add a filter such as `-- events_64k` to run one workload).
//! For the table of ratios, see `cargo run --release --example bench_summary` and BENCHMARKS.md.

use std::time::Duration;

use criterion::{black_box, criterion_main, Criterion, SamplingMode, Throughput};

use test_support::bench::{adversarial_workloads, workloads, Handover};

fn throughput(c: &mut Criterion) {
    let adversarial = adversarial_workloads()
        .into_iter()
        .flat_map(|(small, large)| [small, large]);
    for workload in workloads().into_iter().chain(adversarial) {
        workload.check();
        let target = workload
            .floor_target
            .map_or(String::new(), |t| format!(", target layer/floor >= {t}"));
        eprintln!(
            "{}: {}, {} chunks, {} bytes{target}",
            workload.name,
            workload.shape,
            workload.chunk_count(),
            workload.input_len()
        );
        let mut group = c.benchmark_group(workload.name);
        group.throughput(Throughput::Bytes(workload.input_len()));
        // A run is 1 to 2 MiB, so each sample is long enough; keep `cargo bench` to minutes. A run
        // of the decode path over a million 1-byte chunks takes about 0.2 s: fewer, longer samples.
        let slow = workload.chunk_count() > 100_000;
        if slow {
            group.sampling_mode(SamplingMode::Flat);
        }
        group.sample_size(if slow { 10 } else { 20 });
        group.warm_up_time(Duration::from_millis(500));
        group.measurement_time(Duration::from_secs(if slow { 4 } else { 2 }));
        // The adversarial shapes are about how time grows with the input: static chunks only.
        let handovers = if workload.adversarial {
            &Handover::ALL[..1]
        } else {
            &Handover::ALL[..]
        };
        for &handover in handovers {
            for &variant in workload.variants() {
                // `layer` (static chunks, the ids of earlier runs) and `layer_refcounted`.
                let id = match handover {
                    Handover::Static => variant.name().to_owned(),
                    _ => format!("{}_{}", variant.name(), handover.name()),
                };
                group.bench_function(id, |b| {
                    b.iter(|| black_box(workload.run(handover, black_box(variant))))
                });
            }
        }
        group.finish();
    }
}

// criterion_group! writes an undocumented `pub fn benches`.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::throughput);
}
use group::benches;
criterion_main!(benches);
