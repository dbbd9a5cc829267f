//! The stream's rate limit: a token bucket per endpoint, so one noisy pod (a scan, a
//! retrying client) cannot drown the others' verdicts or the agent's log. What it holds
//! back is counted and reported with the pod's next record, or in a summary.

use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    refilled: Instant,
    suppressed: u64,
}

/// Per-key token buckets: `per_second` records a second, bursts of up to `burst`.
#[derive(Debug)]
pub struct RateLimiter {
    per_second: f64,
    burst: f64,
    buckets: HashMap<String, Bucket>,
}

/// Buckets idle this long (full again, nothing held back) are forgotten.
const IDLE: Duration = Duration::from_secs(60);

impl RateLimiter {
    pub fn new(per_second: u32, burst: u32) -> RateLimiter {
        RateLimiter {
            per_second: f64::from(per_second),
            burst: f64::from(burst.max(1)),
            buckets: HashMap::new(),
        }
    }

    /// Whether a record for `key` may pass at `now`; when it may, how many were held back
    /// before it (and the count starts again).
    pub fn admit(&mut self, key: &str, now: Instant) -> Option<u64> {
        let burst = self.burst;
        let bucket = self
            .buckets
            .entry(key.to_string())
            .or_insert_with(|| Bucket {
                tokens: burst,
                refilled: now,
                suppressed: 0,
            });
        let elapsed = now.saturating_duration_since(bucket.refilled).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * self.per_second).min(burst);
        bucket.refilled = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Some(std::mem::take(&mut bucket.suppressed))
        } else {
            bucket.suppressed += 1;
            None
        }
    }

    /// Takes the counts held back with no record after them, by key, and forgets idle
    /// buckets.
    pub fn drain_suppressed(&mut self, now: Instant) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        self.buckets.retain(|key, b| {
            if b.suppressed > 0 {
                out.push((key.clone(), std::mem::take(&mut b.suppressed)));
            }
            now.saturating_duration_since(b.refilled) < IDLE
        });
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_gets_its_burst_then_its_rate_and_the_rest_is_counted() {
        let mut limit = RateLimiter::new(2, 3);
        let t0 = Instant::now();
        let admitted = (0..10).filter(|_| limit.admit("a", t0).is_some()).count();
        assert_eq!(admitted, 3, "the burst");
        // Another pod is not held back by the noisy one.
        assert_eq!(limit.admit("b", t0), Some(0));
        // Half a second refills one token; the record carries the seven held back.
        assert_eq!(limit.admit("a", t0 + Duration::from_millis(500)), Some(7));
        assert_eq!(limit.admit("a", t0 + Duration::from_millis(500)), None);
        assert_eq!(
            limit.drain_suppressed(t0 + Duration::from_secs(1)),
            [("a".to_string(), 1)]
        );
        assert!(limit
            .drain_suppressed(t0 + Duration::from_secs(1))
            .is_empty());
        // Idle buckets go.
        limit.drain_suppressed(t0 + Duration::from_secs(120));
        assert!(limit.buckets.is_empty());
    }
}
