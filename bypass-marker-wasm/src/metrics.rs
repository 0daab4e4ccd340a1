//! The counters, as proxy-wasm metrics: the module's names, with their one label carried in the
//! name the way Istio's stats are (`annotation=.=x-bypass-remote-prefill;.;bypass_marker_frames_removed`),
//! since proxy-wasm metrics have no labels. Envoy's tag extraction turns each back into a label
//! (`stats_config.stats_tags` with the regexes of [`STATS_TAGS`]; in Istio,
//! `meshConfig.defaultConfig.extraStatTags`), and `/stats/prometheus` shows
//! `bypass_marker_frames_removed{annotation="x-bypass-remote-prefill"}`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use bypass_marker_envoy_adapter::metrics::Counter;

use crate::proxy::Proxy;

/// The `stats_tags` an Envoy bootstrap needs for the labels: (tag name, regex).
pub const STATS_TAGS: [(&str, &str); 3] = [
    ("annotation", r"(annotation=\.=(.*?);\.;)"),
    ("status", r"(status=\.=(.*?);\.;)"),
    ("coding", r"(coding=\.=(.*?);\.;)"),
];

/// The proxy-wasm metric name of a counter's series with this label.
pub fn metric_name(counter: Counter, label: &str) -> String {
    format!("{}=.={label};.;{}", counter.label(), counter.name())
}

thread_local! {
    /// The ids of the series defined so far, by counter and label (a plugin's VM runs on one
    /// thread; a VM reloaded after a failure starts with none).
    static SERIES: RefCell<HashMap<(usize, String), u32>> = RefCell::new(HashMap::new());
}

/// Adds `value` to a counter's series, defining the series the first time.
pub fn increment(proxy: &mut impl Proxy, counter: Counter, label: &str, value: u64) {
    let known = SERIES.with(|series| {
        series
            .borrow()
            .get(&(counter as usize, label.to_owned()))
            .copied()
    });
    let id = match known {
        Some(id) => id,
        None => {
            let id = proxy.define_counter(&metric_name(counter, label));
            SERIES.with(|series| {
                series
                    .borrow_mut()
                    .insert((counter as usize, label.to_owned()), id)
            });
            id
        }
    };
    proxy.increment(id, value);
}

/// The gauge of the plugin's VM memory: the bytes of the largest plugin VM's linear memory, which
/// never shrinks (each worker's VM keeps its high-water mark; docs/envoy.md, "The plugin's
/// memory").
pub const VM_MEMORY: &str = "bypass_marker_vm_memory_bytes";

thread_local! {
    /// The gauge's id once defined, and the most this VM has reported.
    static MEMORY: Cell<(Option<u32>, u64)> = const { Cell::new((None, 0)) };
}

/// The bytes of this VM's linear memory (0 off wasm32: the host tests).
pub fn vm_memory() -> u64 {
    #[cfg(target_arch = "wasm32")]
    {
        (core::arch::wasm32::memory_size(0) as u64) * 65536
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        0
    }
}

/// Reports this VM's memory if it grew since the last report: one host call per growth.
pub fn report_memory(proxy: &mut impl Proxy, bytes: u64) {
    let (id, reported) = MEMORY.with(Cell::get);
    if bytes <= reported {
        return;
    }
    let id = id.unwrap_or_else(|| proxy.define_gauge(VM_MEMORY));
    proxy.raise_gauge(id, bytes);
    MEMORY.with(|memory| memory.set((Some(id), bytes)));
}
