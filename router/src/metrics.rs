//! `GET /metrics`: the pool's counters in the Prometheus text format (version 0.0.4).

use std::fmt::Write;

use crate::pool::PoolSnapshot;

/// The `Content-Type` of the Prometheus text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The exposition of `snapshot`.
pub fn render(snapshot: &PoolSnapshot) -> String {
    let mut text = String::new();
    let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(String, String)>| {
        // Writing to a String cannot fail.
        let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(text, "{name}{labels} {value}");
        }
    };
    let per_worker = |value: &dyn Fn(usize) -> String| -> Vec<(String, String)> {
        snapshot
            .workers
            .iter()
            .enumerate()
            .map(|(i, worker)| (format!("{{worker=\"{}\"}}", escape(&worker.url)), value(i)))
            .collect()
    };
    family(
        "pagedrs_router_requests_total",
        "counter",
        "Requests sent to each worker (a retried request counts once per worker tried).",
        per_worker(&|i| snapshot.workers[i].requests_routed.to_string()),
    );
    family(
        "pagedrs_router_routing_decisions_total",
        "counter",
        "Routing decisions by reason.",
        snapshot
            .num_decisions_per_reason
            .iter()
            .map(|(reason, count)| {
                (format!("{{reason=\"{}\"}}", reason.as_str()), count.to_string())
            })
            .collect(),
    );
    family(
        "pagedrs_router_retries_total",
        "counter",
        "Requests sent again to another worker after one failed before answering.",
        vec![(String::new(), snapshot.num_retries.to_string())],
    );
    family(
        "pagedrs_router_worker_healthy",
        "gauge",
        "1 if the worker takes requests, 0 if it is marked down.",
        per_worker(&|i| u8::from(snapshot.workers[i].healthy).to_string()),
    );
    family(
        "pagedrs_router_in_flight",
        "gauge",
        "Requests in flight to each worker.",
        per_worker(&|i| snapshot.workers[i].in_flight.to_string()),
    );
    text
}

/// `value` escaped for a label: backslash, double quote and newline.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::RoutingReason;
    use crate::pool::WorkerSnapshot;

    #[test]
    fn every_family_is_typed_and_labelled_per_worker_or_reason() {
        let snapshot = PoolSnapshot {
            workers: vec![WorkerSnapshot {
                url: "http://a:1".into(),
                healthy: true,
                in_flight: 3,
                tree_chars: 10,
                requests_routed: 7,
            }],
            num_decisions_per_reason: vec![
                (RoutingReason::CacheHit, 5),
                (RoutingReason::CacheMiss, 2),
            ],
            num_retries: 1,
        };
        let text = render(&snapshot);
        for line in [
            "# TYPE pagedrs_router_requests_total counter",
            "pagedrs_router_requests_total{worker=\"http://a:1\"} 7",
            "pagedrs_router_routing_decisions_total{reason=\"cache_hit\"} 5",
            "pagedrs_router_routing_decisions_total{reason=\"cache_miss\"} 2",
            "pagedrs_router_retries_total 1",
            "# TYPE pagedrs_router_worker_healthy gauge",
            "pagedrs_router_worker_healthy{worker=\"http://a:1\"} 1",
            "pagedrs_router_in_flight{worker=\"http://a:1\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
