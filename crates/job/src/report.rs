//! What a job reports: a line per pass while it trains, and one report when
//! it ends, which the master also stores under `/oar/<job>/result`.

use crate::{keys::JobKeys, Error, Result};
use oar_discovery::Discovery;
use serde::{Deserialize, Serialize};

/// Floats that may be NaN or infinite (a diverged job's loss) are written
/// as `null` and read back as NaN, so a report always round-trips.
mod float_or_null {
    use serde::{Deserialize, Deserializer, Serializer};

    /// f32 and f64, each written as itself (an f32 as an f32: `0.85`, not
    /// `0.8500000238418579`).
    pub trait Float: Copy {
        fn write<S: Serializer>(self, s: S) -> Result<S::Ok, S::Error>;
        fn read(v: Option<f64>) -> Self;
    }
    impl Float for f64 {
        fn write<S: Serializer>(self, s: S) -> Result<S::Ok, S::Error> {
            if self.is_finite() {
                s.serialize_f64(self)
            } else {
                s.serialize_none()
            }
        }
        fn read(v: Option<f64>) -> Self {
            v.unwrap_or(f64::NAN)
        }
    }
    impl Float for f32 {
        fn write<S: Serializer>(self, s: S) -> Result<S::Ok, S::Error> {
            if self.is_finite() {
                s.serialize_f32(self)
            } else {
                s.serialize_none()
            }
        }
        fn read(v: Option<f64>) -> Self {
            v.map_or(f32::NAN, |v| v as f32)
        }
    }

    pub fn serialize<S: Serializer, F: Float>(value: &F, s: S) -> Result<S::Ok, S::Error> {
        value.write(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>, F: Float>(d: D) -> Result<F, D::Error> {
        Ok(F::read(Option::<f64>::deserialize(d)?))
    }
}

/// Progress at the end of one pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PassReport {
    /// The pass that ended (0-based).
    pub pass: u32,
    /// Mean training loss the trainers measured during the pass.
    #[serde(with = "float_or_null")]
    pub train_loss: f64,
    /// Loss on the held-out data after the pass.
    #[serde(with = "float_or_null")]
    pub test_loss: f32,
    /// Accuracy on the held-out data after the pass.
    #[serde(with = "float_or_null")]
    pub test_accuracy: f32,
    /// Tasks finished in the pass.
    pub tasks_done: u64,
    /// Tasks discarded so far.
    pub tasks_discarded: usize,
}

/// Progress of a streaming job over one window (see
/// [`StreamConfig::window`](crate::config::StreamConfig::window)).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WindowReport {
    /// The window (0-based).
    pub window: u32,
    /// Records (examples) trained in the window.
    pub records: u64,
    /// Mean training loss over those records.
    #[serde(with = "float_or_null")]
    pub train_loss: f64,
    /// Mean lag, seconds, from a task's arrival (the master took it from
    /// the source) to its finished report, over the tasks finished in the
    /// window; NaN if none finished.
    #[serde(with = "float_or_null")]
    pub lag_seconds: f64,
    /// Tasks waiting: appended and not handed out yet.
    pub backlog: usize,
    /// The source's position.
    pub position: String,
    /// Loss on the held-out data at the window's end (NaN without any).
    #[serde(with = "float_or_null")]
    pub test_loss: f32,
    /// Accuracy on the held-out data at the window's end (NaN without any).
    #[serde(with = "float_or_null")]
    pub test_accuracy: f32,
    /// Tasks finished so far.
    pub tasks_done: u64,
    /// Tasks discarded so far.
    pub tasks_discarded: usize,
}

/// What a master tells its caller as the job goes (see
/// [`role::master`](crate::role::master)): every change of the task queue,
/// and each pass as it ends, scored.
#[derive(Clone, Copy, Debug)]
pub enum Progress<'a> {
    /// The task queue changed (a task handed out, finished or failed).
    Status(&'a oar_task_queue::MasterStatus),
    /// A pass ended and the model was scored.
    PassEnded(&'a PassReport),
    /// A streaming job's window ended and the model was scored.
    WindowEnded(&'a WindowReport),
}

/// How a job ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobEnd {
    /// Every pass ended with at least one task finished.
    Done,
    /// The job failed: a pass ended with every task discarded, or training
    /// diverged ([`JobReport::reason`] says which).
    Failed,
}

impl std::fmt::Display for JobEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            JobEnd::Done => "done",
            JobEnd::Failed => "failed",
        })
    }
}

/// The result of a whole job: the final JSON line of the examples, and the
/// value of `/oar/<job>/result`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobReport {
    /// Done or failed.
    pub state: JobEnd,
    /// Why a failed job failed, in a sentence that names the cause.
    pub reason: Option<String>,
    /// Passes completed.
    pub passes: u32,
    /// Mean training loss of the last pass; NaN (written `null`) when no
    /// example was trained on.
    #[serde(with = "float_or_null")]
    pub final_loss: f64,
    /// Accuracy of the final model on the training data (on an evenly
    /// spread sample of [`TRAIN_SAMPLE_BYTES`](crate::role::TRAIN_SAMPLE_BYTES)
    /// if the data is larger).
    #[serde(with = "float_or_null")]
    pub train_accuracy: f32,
    /// Accuracy of the final model on the held-out data.
    #[serde(with = "float_or_null")]
    pub test_accuracy: f32,
    /// Examples trained on per second, over all trainers, while this master
    /// served (a master that took over counts from its start).
    #[serde(with = "float_or_null")]
    pub examples_per_second: f64,
    /// Tasks finished, summed over passes.
    pub tasks_done: u64,
    /// Task failures (timeouts, failed reports, trainers gone).
    pub tasks_failed: u64,
    /// Tasks discarded.
    pub tasks_discarded: usize,
    /// Why each discarded task was discarded: (task id, reason).
    pub discarded: Vec<(u64, String)>,
    /// Bad lines skipped (with `skip_bad_lines`).
    pub skipped_lines: u64,
    /// Seconds from this master's start to the end.
    #[serde(with = "float_or_null")]
    pub wall_seconds: f64,
}

impl JobReport {
    /// Whether the job finished well.
    pub fn is_done(&self) -> bool {
        self.state == JobEnd::Done
    }

    /// The report as stored and printed: one line of JSON.
    pub fn to_json(&self) -> String {
        // Every field serialises (non-finite floats become null).
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A report read back from [`to_json`](Self::to_json)'s form.
    pub fn from_json(key: &str, bytes: &[u8]) -> Result<JobReport> {
        serde_json::from_slice(bytes).map_err(|e| Error::BadValue {
            key: key.to_string(),
            what: "job report",
            reason: e.to_string(),
        })
    }
}

/// The job's final report, if the master wrote it.
pub async fn read_result(discovery: &dyn Discovery, job: &str) -> Result<Option<JobReport>> {
    let key = JobKeys::new(job)?.result();
    match discovery.get(&key).await? {
        None => Ok(None),
        Some(kv) => JobReport::from_json(&key, &kv.value).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> JobReport {
        JobReport {
            state: JobEnd::Failed,
            reason: Some("every task of pass 1 was discarded".into()),
            passes: 0,
            final_loss: f64::NAN,
            train_accuracy: f32::NAN,
            test_accuracy: 0.25,
            examples_per_second: 0.0,
            tasks_done: 0,
            tasks_failed: 9,
            tasks_discarded: 3,
            discarded: vec![(1, "bad line".into())],
            skipped_lines: 0,
            wall_seconds: 1.5,
        }
    }

    #[test]
    fn a_report_round_trips_through_its_json_whatever_its_values() {
        let r = report();
        let json = r.to_json();
        assert!(json.contains(r#""state":"failed""#) && json.contains(r#""final_loss":null"#), "{json}");
        let back = JobReport::from_json("k", json.as_bytes()).unwrap();
        assert!(back.final_loss.is_nan() && back.train_accuracy.is_nan(), "{back:?}");
        // NaN is not equal to itself: compare the JSON again.
        assert_eq!(back.to_json(), json);
        let inf = JobReport { final_loss: f64::INFINITY, wall_seconds: -0.0, ..report() };
        assert!(JobReport::from_json("k", inf.to_json().as_bytes()).unwrap().final_loss.is_nan());
        let done = JobReport {
            state: JobEnd::Done,
            reason: None,
            final_loss: 0.25,
            train_accuracy: 0.5,
            ..report()
        };
        assert_eq!(JobReport::from_json("k", done.to_json().as_bytes()).unwrap(), done);
    }

    #[test]
    fn a_value_that_is_no_report_is_an_error_naming_the_key() {
        let err = JobReport::from_json("/oar/j/result", b"{").unwrap_err().to_string();
        assert!(err.contains("/oar/j/result") && err.contains("job report"), "{err}");
    }
}
