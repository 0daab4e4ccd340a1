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
//! The main table is printed twice: with the chunks handed over as `Bytes::from_static` and with
//! reference-counted chunks split off one shared buffer, as hyper hands them over (see `Handover`
//! in `test-support/src/bench.rs`). `--handover static` or `--handover refcounted` prints only one.
//!
//! A second table covers the scanner's worst cases (`adversarial_workloads`): each shape in one
//! chunk and in 64 KiB chunks, at 1 MiB and 2 MiB, with layer / floor at both sizes and the time
//! the layer takes on 2 MiB over its time on 1 MiB (2x when linear). Only the layer, the
//! unfiltered body and the floor run on those. `WORKLOAD` filters both tables by name (for example
//! `open_after` or `chat`).
//!
//! `--profile VARIANT` (`layer`, `unfiltered`, `memchr2_floor` or `decode_reencode`) runs only that
//! variant for 25 times `--min-ms` per workload (and per handover, unless `--handover` picks one),
//! for a profiler to sample.

use std::time::{Duration, Instant};

use test_support::bench::{adversarial_workloads, workloads, Handover, Variant, Workload};

struct Options {
    rounds: usize,
    min_time: Duration,
    filter: Option<String>,
    /// `--profile VARIANT`: only run that variant, for a profiler to watch.
    profile: Option<Variant>,
    /// `--handover NAME`: only hand the chunks over this way (both by default).
    handovers: Vec<Handover>,
}

fn options() -> Options {
    let mut options = Options {
        rounds: 9,
        min_time: Duration::from_millis(40),
        filter: None,
        profile: None,
        handovers: Handover::ALL.to_vec(),
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
            "--handover" => {
                let name = args.next().unwrap_or_default();
                let handover = Handover::ALL.into_iter().find(|h| h.name() == name);
                options.handovers =
                    vec![handover
                        .unwrap_or_else(|| panic!("--handover takes `static` or `refcounted`"))];
            }
            _ => options.filter = Some(arg),
        }
    }
    options
}

/// Bytes per second of `variant` over `workload`: runs it until `min_time` has passed.
fn measure(workload: &Workload, handover: Handover, variant: Variant, min_time: Duration) -> f64 {
    let start = Instant::now();
    let mut runs = 0u64;
    loop {
        std::hint::black_box(workload.run(handover, std::hint::black_box(variant)));
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

fn measure_workload(workload: &Workload, handover: Handover, options: &Options) -> Row {
    let mut speeds: [Vec<f64>; 4] = Default::default();
    let mut row = Row {
        speed: [0.0; 4],
        floor: Vec::new(),
        unfiltered: Vec::new(),
        decode: Vec::new(),
    };
    let variants = workload.variants();
    // Warm up caches, the allocator and the CPU clock once per variant.
    for &variant in variants {
        measure(workload, handover, variant, options.min_time / 4);
    }
    for round in 0..options.rounds {
        // A variant that does not run on the workload (decode, on adversarial shapes) reads NaN.
        let mut speed = [f64::NAN; 4];
        for k in 0..variants.len() {
            // Rotate the order, so no variant always runs first (or right after the slow one).
            let i = (k + round) % variants.len();
            speed[i] = measure(workload, handover, variants[i], options.min_time);
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
    let selected = |w: &Workload| match &options.filter {
        Some(filter) => w.name.contains(filter.as_str()),
        None => true,
    };
    let workloads: Vec<Workload> = workloads().into_iter().filter(selected).collect();
    let adversarial: Vec<(Workload, Workload)> = adversarial_workloads()
        .into_iter()
        .filter(|(small, large)| selected(small) || selected(large))
        .collect();
    assert!(
        !workloads.is_empty() || !adversarial.is_empty(),
        "no workload matches the filter"
    );
    if let Some(variant) = options.profile {
        // `perf record -g target/release/examples/bench_summary --profile layer events_64k`
        let pairs = adversarial.iter().flat_map(|(s, l)| [s, l]);
        for workload in workloads.iter().chain(pairs) {
            for &handover in &options.handovers {
                let speed = measure(workload, handover, variant, options.min_time * 25);
                println!(
                    "{} {} ({} chunks): {:.0} MiB/s",
                    workload.name,
                    variant.name(),
                    handover.name(),
                    mib(speed)
                );
            }
        }
        return;
    }

    println!(
        "{} rounds, each variant >= {} ms per round; MiB/s and ratios are medians over rounds\n",
        options.rounds,
        options.min_time.as_millis()
    );
    let mut missed = Vec::new();
    if !workloads.is_empty() {
        for &handover in &options.handovers {
            main_table(&workloads, handover, &options, &mut missed);
        }
    }
    if !adversarial.is_empty() {
        adversarial_table(&adversarial, &options, &mut missed);
    }
    if missed.is_empty() {
        println!("all targets met");
    } else {
        println!("targets missed: {}", missed.join("; "));
    }
}

/// The worst cases of the scanner: layer / floor at 1 MiB and 2 MiB, and how much longer the layer
/// takes on 2 MiB than on 1 MiB (linear: 2x; the target is at most 2.2x), each the median over
/// rounds of a ratio taken within the round. Static chunks.
fn adversarial_table(pairs: &[(Workload, Workload)], options: &Options, missed: &mut Vec<String>) {
    println!(
        "| adversarial workload | layer MiB/s 1 MiB | floor MiB/s 1 MiB | layer / floor 1 MiB (min-max) \
         | layer MiB/s 2 MiB | floor MiB/s 2 MiB | layer / floor 2 MiB (min-max) | time 2 MiB / 1 MiB (min-max) | targets |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for (small, large) in pairs {
        small.check();
        large.check();
        let runs = [
            (small, Variant::Layer),
            (small, Variant::Floor),
            (large, Variant::Layer),
            (large, Variant::Floor),
        ];
        for (w, v) in runs {
            measure(w, Handover::Static, v, options.min_time / 4);
        }
        // Per round, all four in a rotated order, so that the 1 MiB and 2 MiB runs see the same
        // machine and the time ratio is taken within the round.
        let mut speeds: [Vec<f64>; 4] = Default::default();
        let mut floor_small = Vec::new();
        let mut floor_large = Vec::new();
        let mut growth = Vec::new();
        for round in 0..options.rounds {
            let mut speed = [0.0; 4];
            for k in 0..runs.len() {
                let i = (k + round) % runs.len();
                speed[i] = measure(runs[i].0, Handover::Static, runs[i].1, options.min_time);
            }
            for (all, s) in speeds.iter_mut().zip(speed) {
                all.push(s);
            }
            floor_small.push(speed[0] / speed[1]);
            floor_large.push(speed[2] / speed[3]);
            let time = |w: &Workload, speed: f64| w.input_len() as f64 / speed;
            growth.push(time(large, speed[2]) / time(small, speed[0]));
        }
        let mut met = true;
        let mut cells = Vec::new();
        for (w, ratios, layer, floor) in [
            (small, &mut floor_small, 0, 1),
            (large, &mut floor_large, 2, 3),
        ] {
            let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = ratios.iter().copied().fold(0.0, f64::max);
            let ratio = median(ratios);
            if ratio < 0.1 {
                met = false;
                missed.push(format!("{}: layer / floor {ratio:.3} < 0.1", w.name));
            }
            cells.push(format!(
                "{:.0} | {:.0} | {ratio:.2} ({lo:.2}-{hi:.2})",
                mib(median(&mut speeds[layer])),
                mib(median(&mut speeds[floor]))
            ));
        }
        let lo = growth.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = growth.iter().copied().fold(0.0, f64::max);
        let growth = median(&mut growth);
        if growth > 2.2 {
            met = false;
            missed.push(format!(
                "{}: 2 MiB takes {growth:.2}x 1 MiB > 2.2x",
                small.name
            ));
        }
        println!(
            "| {} ({}) | {} | {} | {growth:.2}x ({lo:.2}-{hi:.2}) | {} |",
            small.name.trim_end_matches("_1MiB"),
            small.shape.trim_end_matches(", 1MiB"),
            cells[0],
            cells[1],
            if met { "met" } else { "**missed**" }
        );
    }
    println!();
}

fn main_table(
    workloads: &[Workload],
    handover: Handover,
    options: &Options,
    missed: &mut Vec<String>,
) {
    println!("chunks handed over {}:\n", handover.name());
    let speeds: Vec<String> = Variant::ALL
        .iter()
        .map(|v| format!("{} MiB/s", v.name()))
        .collect();
    println!(
        "| workload | {} | layer / floor (min-max) | target | layer / unfiltered | layer vs decode | target |",
        speeds.join(" | ")
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for workload in workloads {
        workload.check();
        let mut row = measure_workload(workload, handover, options);
        let lo = row.floor.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = row.floor.iter().copied().fold(0.0, f64::max);
        let floor = median(&mut row.floor);
        let unfiltered = median(&mut row.unfiltered);
        let decode = median(&mut row.decode);
        let floor_target = match workload.floor_target {
            Some(t) if floor >= t => format!(">= {t} met"),
            Some(t) => {
                missed.push(format!(
                    "{} ({}): layer / floor {floor:.2} < {t}",
                    workload.name,
                    handover.name()
                ));
                format!(">= {t} **missed**")
            }
            None => "-".to_owned(),
        };
        let decode_target = if decode >= 10.0 {
            ">= 10x met".to_owned()
        } else {
            missed.push(format!(
                "{} ({}): {decode:.1}x the decode path < 10x",
                workload.name,
                handover.name()
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
    println!("inputs per run: {}\n", chunks.join("; "));
}
