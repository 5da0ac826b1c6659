//! Retention policies: which steps to keep as a run goes on.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::SaveRecord;

/// Which way a metric improves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Goal {
    /// Lower is better (loss).
    Minimize,
    /// Higher is better (accuracy).
    Maximize,
}

/// A composable retention policy: a step is kept if **any** rule keeps it,
/// and pinned steps are always kept. A policy with no rules keeps
/// everything.
///
/// ```
/// use std::time::Duration;
/// use ckptstore::{Goal, Retention};
///
/// let policy = Retention::new()
///     .keep_last(3)                            // the three newest steps
///     .keep_every(1000)                        // every 1000th step
///     .keep_one_per(Duration::from_secs(3600)) // the last step of each hour
///     .keep_best("loss", 2, Goal::Minimize);   // the two lowest losses
/// assert!(!policy.is_empty());
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Retention {
    keep_last: Option<usize>,
    keep_every: Option<u64>,
    keep_one_per: Option<Duration>,
    keep_best: Vec<(String, usize, Goal)>,
    allow_deleting_all: bool,
}

impl Retention {
    /// A policy with no rules (keeps everything).
    pub fn new() -> Self {
        Self::default()
    }

    /// Keep the `n` highest steps.
    pub fn keep_last(mut self, n: usize) -> Self {
        self.keep_last = Some(n);
        self
    }

    /// Keep every step that is a multiple of `n` (`n` = 0 keeps none by this
    /// rule).
    pub fn keep_every(mut self, n: u64) -> Self {
        self.keep_every = Some(n);
        self
    }

    /// Keep one step per `interval` of checkpoint time: the highest step
    /// whose timestamp falls in each interval (aligned to the Unix epoch).
    pub fn keep_one_per(mut self, interval: Duration) -> Self {
        self.keep_one_per = Some(interval);
        self
    }

    /// Keep the `k` steps with the best value of `metric`. Steps without
    /// that metric are not ranked. May be given for several metrics.
    pub fn keep_best(mut self, metric: impl Into<String>, k: usize, goal: Goal) -> Self {
        self.keep_best.push((metric.into(), k, goal));
        self
    }

    /// Allow a policy whose rules keep no step (`keep_last(0)`,
    /// `keep_every(0)`, `keep_best(_, 0, _)` and nothing else): without
    /// this, [`CheckpointStore::apply_retention`](crate::CheckpointStore::apply_retention)
    /// and opening a store with it refuse such a policy as a likely mistake.
    ///
    /// ```
    /// use ckptstore::Retention;
    /// assert!(Retention::new().keep_last(0).keeps_nothing());
    /// assert!(!Retention::new().keep_last(0).keep_every(10).keeps_nothing());
    /// ```
    pub fn allow_deleting_all(mut self) -> Self {
        self.allow_deleting_all = true;
        self
    }

    /// True when the policy has rules and none of them can keep a step:
    /// it deletes every unpinned step.
    pub fn keeps_nothing(&self) -> bool {
        !self.is_empty()
            && self.keep_last.is_none_or(|n| n == 0)
            && self.keep_every.is_none_or(|n| n == 0)
            && self.keep_one_per.is_none()
            && self.keep_best.iter().all(|(_, k, _)| *k == 0)
    }

    /// Refuse a policy that deletes every unpinned step unless
    /// [`allow_deleting_all`](Self::allow_deleting_all) was said.
    pub(crate) fn check_keeps_something(&self) -> crate::Result<()> {
        if self.keeps_nothing() && !self.allow_deleting_all {
            return Err(crate::Error::InvalidOptions(
                "the retention policy keeps no step (every rule is zero: keep_last(0), \
                 keep_every(0), keep_best(_, 0, _)) and would delete every unpinned step; \
                 call Retention::allow_deleting_all() if that is what you want"
                    .to_owned(),
            ));
        }
        Ok(())
    }

    /// True when the policy has no rules, and so deletes nothing.
    pub fn is_empty(&self) -> bool {
        self.keep_last.is_none()
            && self.keep_every.is_none()
            && self.keep_one_per.is_none()
            && self.keep_best.is_empty()
    }

    /// The steps of `summaries` this policy deletes, ascending.
    pub(crate) fn doomed(&self, summaries: &[StepSummary], pinned: &BTreeSet<u64>) -> Vec<u64> {
        if self.is_empty() {
            return Vec::new();
        }
        let mut keep: BTreeSet<u64> = pinned.clone();
        let mut steps: Vec<u64> = summaries.iter().map(|s| s.step).collect();
        steps.sort_unstable();
        if let Some(n) = self.keep_last {
            keep.extend(steps.iter().rev().take(n));
        }
        if let Some(n) = self.keep_every {
            if n > 0 {
                keep.extend(steps.iter().filter(|s| *s % n == 0));
            }
        }
        if let Some(interval) = self.keep_one_per {
            let secs = interval.as_secs().max(1);
            let mut last_in_bucket: HashMap<u64, u64> = HashMap::new();
            for s in summaries {
                let bucket = last_in_bucket.entry(s.timestamp / secs).or_insert(s.step);
                *bucket = (*bucket).max(s.step);
            }
            keep.extend(last_in_bucket.values());
        }
        for (metric, k, goal) in &self.keep_best {
            let mut ranked: Vec<(f64, u64)> = summaries
                .iter()
                .filter_map(|s| s.metrics.get(metric).map(|&v| (v, s.step)))
                .collect();
            ranked.sort_by(|a, b| {
                let by_value = match goal {
                    Goal::Minimize => a.0.total_cmp(&b.0),
                    Goal::Maximize => b.0.total_cmp(&a.0),
                };
                // Ties go to the newer step.
                by_value.then(b.1.cmp(&a.1))
            });
            keep.extend(ranked.iter().take(*k).map(|&(_, step)| step));
        }
        steps.into_iter().filter(|s| !keep.contains(s)).collect()
    }
}

/// The small per-step record that listings, retention and metric queries
/// read instead of the whole manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct StepSummary {
    /// The step number.
    pub step: u64,
    /// Unix time in seconds of the checkpoint.
    pub timestamp: u64,
    /// CID of the loss tensor.
    pub loss_cid: Option<String>,
    /// Named metrics.
    #[serde(default)]
    pub metrics: BTreeMap<String, f64>,
    /// Bytes of optimizer state.
    pub logical_bytes: u64,
    /// Bytes of blob data this step added to the store when committed (the
    /// rest was shared with steps before it).
    pub bytes_written: u64,
    /// What those bytes take where they are kept: in a store, as many; in
    /// a bucket, the new chunks as its packs hold them (fewer where they
    /// are stored compressed, bucket format 4).
    #[serde(default)]
    pub stored_bytes: u64,
    /// Number of optimizer blobs.
    pub blobs: usize,
    /// How the step was saved. A step 0.4.0 wrote has its staging cost
    /// here (lifted from its metrics) and Lightning's names still among its
    /// metrics: a summary does not know the step's blob names, which tell
    /// those apart from a run's own metrics.
    #[serde(default, skip_serializing_if = "SaveRecord::is_empty")]
    pub save_record: SaveRecord,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(step: u64, timestamp: u64, loss: Option<f64>) -> StepSummary {
        StepSummary {
            step,
            timestamp,
            loss_cid: None,
            metrics: loss
                .map(|l| [("loss".to_owned(), l)].into())
                .unwrap_or_default(),
            logical_bytes: 0,
            save_record: SaveRecord::default(),
            bytes_written: 0,
            stored_bytes: 0,
            blobs: 0,
        }
    }

    fn kept(policy: &Retention, all: &[StepSummary], pinned: &[u64]) -> Vec<u64> {
        let doomed = policy.doomed(all, &pinned.iter().copied().collect());
        all.iter()
            .map(|s| s.step)
            .filter(|s| !doomed.contains(s))
            .collect()
    }

    #[test]
    fn each_rule_and_their_union() {
        // Steps 0..=10, one every 10 minutes, loss lowest at step 4.
        let all: Vec<StepSummary> = (0..=10u64)
            .map(|s| summary(s, 600 * s, Some(((s as f64) - 4.0).abs())))
            .collect();
        assert_eq!(kept(&Retention::new(), &all, &[]).len(), 11);
        assert_eq!(
            kept(&Retention::new().keep_last(3), &all, &[]),
            vec![8, 9, 10]
        );
        assert_eq!(
            kept(&Retention::new().keep_last(0), &all, &[]),
            Vec::<u64>::new()
        );
        assert_eq!(
            kept(&Retention::new().keep_every(5), &all, &[]),
            vec![0, 5, 10]
        );
        assert_eq!(
            kept(&Retention::new().keep_every(0), &all, &[]),
            Vec::<u64>::new()
        );
        // Hourly buckets: 0-5 (0..3000s), 6-11 -> the last of each.
        assert_eq!(
            kept(
                &Retention::new().keep_one_per(Duration::from_secs(3600)),
                &all,
                &[]
            ),
            vec![5, 10]
        );
        assert_eq!(
            kept(
                &Retention::new().keep_best("loss", 3, Goal::Minimize),
                &all,
                &[]
            ),
            vec![3, 4, 5]
        );
        assert_eq!(
            kept(
                &Retention::new().keep_best("loss", 1, Goal::Maximize),
                &all,
                &[]
            ),
            vec![10]
        );
        assert_eq!(
            kept(
                &Retention::new().keep_best("nope", 3, Goal::Minimize),
                &all,
                &[]
            ),
            Vec::<u64>::new()
        );
        let union =
            Retention::new()
                .keep_last(2)
                .keep_every(5)
                .keep_best("loss", 1, Goal::Minimize);
        assert_eq!(kept(&union, &all, &[7]), vec![0, 4, 5, 7, 9, 10]);
    }

    #[test]
    fn best_ties_prefer_newer_steps() {
        let all = vec![summary(1, 0, Some(1.0)), summary(2, 0, Some(1.0))];
        let p = Retention::new().keep_best("loss", 1, Goal::Minimize);
        assert_eq!(kept(&p, &all, &[]), vec![2]);
    }
}
