//! Prints the table of throughput ratios in BENCHMARKS.md, measured in one run.
//!
//! ```text
//! cargo run --release --example bench_summary [-- [--rounds N] [--min-ms MS] [WORKLOAD]]
//! ```
//!
//! Runs the workloads of `benches/throughput.rs` (same chunks, same harness) with a small
//! self-timing loop instead of criterion: in each round every variant runs for at least `--min-ms`
//! (default 40) milliseconds, the variants in a different order each round, and the ratios are taken
//! within the round. The table shows the median over `--rounds` (default 9) rounds and, for the
//! layer / floor ratio, the lowest and highest round, so that a noisy machine shows as a wide range
//! rather than as a wrong figure.
//!
//! `--profile VARIANT` (`layer`, `unfiltered`, `memchr2_floor` or `decode_reencode`) runs only that
//! variant for 25 times `--min-ms` per workload, for a profiler to sample.

use std::time::{Duration, Instant};

#[path = "../benches/support/mod.rs"]
mod support;

use support::{workloads, Variant, Workload};

struct Options {
    rounds: usize,
    min_time: Duration,
    filter: Option<String>,
    /// `--profile VARIANT`: only run that variant, for a profiler to watch.
    profile: Option<Variant>,
}

fn options() -> Options {
    let mut options = Options {
        rounds: 9,
        min_time: Duration::from_millis(40),
        filter: None,
        profile: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |what: &str| -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{what} takes a positive number"))
        };
        match arg.as_str() {
            "--rounds" => options.rounds = number("--rounds").max(1) as usize,
            "--min-ms" => options.min_time = Duration::from_millis(number("--min-ms")),
            "--profile" => {
                let name = args.next().unwrap_or_default();
                let variant = Variant::ALL.into_iter().find(|v| v.name() == name);
                options.profile =
                    Some(variant.unwrap_or_else(|| panic!("--profile takes a variant name")));
            }
            _ => options.filter = Some(arg),
        }
    }
    options
}

/// Bytes per second of `variant` over `workload`: runs it until `min_time` has passed.
fn measure(workload: &Workload, variant: Variant, min_time: Duration) -> f64 {
    let start = Instant::now();
    let mut runs = 0u64;
    loop {
        std::hint::black_box(workload.run(std::hint::black_box(variant)));
        runs += 1;
        let elapsed = start.elapsed();
        if elapsed >= min_time {
            return (runs * workload.input_len()) as f64 / elapsed.as_secs_f64();
        }
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

struct Row {
    /// Median bytes per second, in `Variant::ALL` order.
    speed: [f64; 4],
    /// Per-round ratios: layer / floor, layer / unfiltered, layer / decode.
    floor: Vec<f64>,
    unfiltered: Vec<f64>,
    decode: Vec<f64>,
}

fn measure_workload(workload: &Workload, options: &Options) -> Row {
    let mut speeds: [Vec<f64>; 4] = Default::default();
    let mut row = Row {
        speed: [0.0; 4],
        floor: Vec::new(),
        unfiltered: Vec::new(),
        decode: Vec::new(),
    };
    // Warm up caches, the allocator and the CPU clock once per variant.
    for variant in Variant::ALL {
        measure(workload, variant, options.min_time / 4);
    }
    for round in 0..options.rounds {
        let mut speed = [0.0; 4];
        for k in 0..Variant::ALL.len() {
            // Rotate the order, so no variant always runs first (or right after the slow one).
            let i = (k + round) % Variant::ALL.len();
            speed[i] = measure(workload, Variant::ALL[i], options.min_time);
        }
        for (all, s) in speeds.iter_mut().zip(speed) {
            all.push(s);
        }
        let [layer, unfiltered, floor, decode] = speed;
        row.floor.push(layer / floor);
        row.unfiltered.push(layer / unfiltered);
        row.decode.push(layer / decode);
    }
    for (m, all) in row.speed.iter_mut().zip(speeds.iter_mut()) {
        *m = median(all);
    }
    row
}

fn mib(bytes_per_sec: f64) -> f64 {
    bytes_per_sec / (1024.0 * 1024.0)
}

fn main() {
    let options = options();
    let workloads: Vec<Workload> = workloads()
        .into_iter()
        .filter(|w| match &options.filter {
            Some(filter) => w.name.contains(filter.as_str()),
            None => true,
        })
        .collect();
    assert!(!workloads.is_empty(), "no workload matches the filter");
    if let Some(variant) = options.profile {
        // `perf record -g target/release/examples/bench_summary --profile layer events_64k`
        for workload in &workloads {
            let speed = measure(workload, variant, options.min_time * 25);
            println!(
                "{} {}: {:.0} MiB/s",
                workload.name,
                variant.name(),
                mib(speed)
            );
        }
        return;
    }

    println!(
        "{} rounds, each variant >= {} ms per round; MiB/s and ratios are medians over rounds\n",
        options.rounds,
        options.min_time.as_millis()
    );
    let speeds: Vec<String> = Variant::ALL
        .iter()
        .map(|v| format!("{} MiB/s", v.name()))
        .collect();
    println!(
        "| workload | {} | layer / floor (min-max) | target | layer / unfiltered | layer vs decode | target |",
        speeds.join(" | ")
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut missed = Vec::new();
    for workload in &workloads {
        workload.check();
        let mut row = measure_workload(workload, &options);
        let lo = row.floor.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = row.floor.iter().copied().fold(0.0, f64::max);
        let floor = median(&mut row.floor);
        let unfiltered = median(&mut row.unfiltered);
        let decode = median(&mut row.decode);
        let floor_target = match workload.floor_target {
            Some(t) if floor >= t => format!(">= {t} met"),
            Some(t) => {
                missed.push(format!("{}: layer / floor {floor:.2} < {t}", workload.name));
                format!(">= {t} **missed**")
            }
            None => "-".to_owned(),
        };
        let decode_target = if decode >= 10.0 {
            ">= 10x met".to_owned()
        } else {
            missed.push(format!(
                "{}: {decode:.1}x the decode path < 10x",
                workload.name
            ));
            ">= 10x **missed**".to_owned()
        };
        let [s_layer, s_unfiltered, s_floor, s_decode] = row.speed;
        println!(
            "| {} ({}) | {:.0} | {:.0} | {:.0} | {:.1} | {floor:.2} ({lo:.2}-{hi:.2}) | {floor_target} \
             | {unfiltered:.2} | {decode:.1}x | {decode_target} |",
            workload.name,
            workload.shape,
            mib(s_layer),
            mib(s_unfiltered),
            mib(s_floor),
            mib(s_decode),
        );
    }
    println!();
    let chunks: Vec<String> = workloads
        .iter()
        .map(|w| {
            format!(
                "{} {} chunks / {} B",
                w.name,
                w.chunk_count(),
                w.input_len()
            )
        })
        .collect();
    println!("inputs per run: {}", chunks.join("; "));
    if missed.is_empty() {
        println!("all targets met");
    } else {
        println!("targets missed: {}", missed.join("; "));
    }
}
