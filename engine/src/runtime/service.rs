//! The service around one engine: an async API to submit a request and await its result (tokio),
//! the engine loop on its own thread owning the device and its streams, `/metrics` in Prometheus
//! text over loopback HTTP, and graceful shutdown that drains in-flight work and transfers.
//!
//! Cross-thread hand-offs go through the `sync` seam: the intake queue ([`Intake`]) that request
//! handlers push into and the engine thread drains, and the metrics snapshot. Replies travel on
//! tokio oneshot channels (sent from the engine thread, awaited by the handler).

use crate::device::{Clock, Device, DeviceTiming};
use crate::engine::{Engine, EngineError};
use crate::metrics::StepTimes;
use crate::scheduler::{Output, Rejection, RequestSpec};
use crate::sync::{Arc, AtomicBool, Condvar, Mutex, Ordering};
use crate::transfer::Transfer;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// A finished request as the client sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub request: u64,
    pub generated: Vec<u32>,
    /// Submission to first token, and to completion.
    pub ttft_ns: u64,
    pub latency_ns: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Rejected(#[from] Rejection),
    #[error("request {0} was aborted")]
    Aborted(u64),
    #[error(
        "request {request}: its KV could not be moved to the decode engine ({tries} sends failed)"
    )]
    TransferFailed { request: u64, tries: u32 },
    #[error(
        "request {request}: the decode engine was never told its KV had arrived ({tries} sends, the last timed out)"
    )]
    TransferTimedOut { request: u64, tries: u32 },
    #[error("the service is shutting down")]
    ShuttingDown,
    #[error("the engine stopped: {0}")]
    EngineFailed(String),
    /// The operating system refused the engine's thread (out of memory or threads).
    #[error("the engine thread could not be started: {0}")]
    Spawn(String),
}

struct Submission {
    spec: RequestSpec,
    submitted: Instant,
    reply: tokio::sync::oneshot::Sender<Result<Completion, ServiceError>>,
}

/// The intake queue: handlers push, the engine thread drains. Closed at shutdown.
pub struct Intake {
    queue: Mutex<VecDeque<Submission>>,
    ready: Condvar,
    closed: AtomicBool,
}

impl Intake {
    fn new() -> Self {
        Intake {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            closed: AtomicBool::new(false),
        }
    }
    fn push(&self, s: Submission) -> Result<(), Submission> {
        if self.closed.load(Ordering::Acquire) {
            return Err(s);
        }
        self.queue.lock().expect("intake lock").push_back(s);
        self.ready.notify_one();
        Ok(())
    }
    fn drain(&self) -> Vec<Submission> {
        self.queue.lock().expect("intake lock").drain(..).collect()
    }
    /// Sleeps up to `timeout` for a submission or the close, unless either is there already;
    /// answers whether it slept.
    fn wait(&self, timeout: Duration) -> bool {
        let q = self.queue.lock().expect("intake lock");
        let idle = q.is_empty() && !self.closed.load(Ordering::Acquire);
        if idle {
            let _ = self.ready.wait_timeout(q, timeout);
        }
        idle
    }
    fn close(&self) {
        // Under the lock: a waiter checks `closed` under it, so the notify cannot fall between
        // its check and its wait (loom found that lost wakeup when this store was outside).
        let _q = self.queue.lock().expect("intake lock");
        self.closed.store(true, Ordering::Release);
        self.ready.notify_all();
    }
}

/// Steps kept for percentiles (the first `STEP_SAMPLES`).
const STEP_SAMPLES: usize = 65_536;

/// One step as the service saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepSample {
    /// Wall time of `Engine::step`.
    pub wall_ns: u64,
    /// Query rows it computed (0: it only waited for copies).
    pub rows: usize,
    /// Where its host time went.
    pub host: StepTimes,
    /// The device's timing of its compute-stream work, if the device times its work.
    pub device: Option<DeviceTiming>,
}

/// What the engine thread publishes for readers on other threads.
#[derive(Default)]
pub struct Published {
    /// How long building the engine took on the engine thread (its device: a CUDA context, the
    /// kernels, the pinned host mirror), once it is built.
    pub built_in: Option<Duration>,
    pub metrics_text: String,
    /// The first `STEP_SAMPLES` steps.
    pub steps: Vec<StepSample>,
    pub metrics: crate::metrics::Metrics,
}

/// A handle for submitting requests (cheap to clone).
#[derive(Clone)]
pub struct Client {
    intake: Arc<Intake>,
}

impl Client {
    /// Submits a request and waits for its result. Admission control answers with
    /// `ServiceError::Rejected` at once when the engine is over its limits.
    pub async fn generate(&self, spec: RequestSpec) -> Result<Completion, ServiceError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sub = Submission {
            spec,
            submitted: Instant::now(),
            reply: tx,
        };
        if self.intake.push(sub).is_err() {
            return Err(ServiceError::ShuttingDown);
        }
        rx.await.unwrap_or(Err(ServiceError::ShuttingDown))
    }
}

/// The running service.
pub struct Service {
    intake: Arc<Intake>,
    pub published: Arc<Mutex<Published>>,
    engine_thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Service {
    /// Starts the engine thread; `make` builds the engine on that thread (so the device never
    /// has to cross threads). Fails, typed, when the operating system cannot start the thread.
    pub fn start<D, C, T, F>(make: F) -> Result<Service, ServiceError>
    where
        D: Device + 'static,
        C: Clock + 'static,
        T: Transfer + 'static,
        F: FnOnce() -> Result<Engine<D, C, T>, EngineError> + Send + 'static,
    {
        let intake = Arc::new(Intake::new());
        let published = Arc::new(Mutex::new(Published::default()));
        let (i2, p2) = (intake.clone(), published.clone());
        let engine_thread = std::thread::Builder::new()
            .name("tierkv-engine".into())
            .spawn(move || engine_loop(make, &i2, &p2))
            .map_err(|e| ServiceError::Spawn(e.to_string()))?;
        Ok(Service {
            intake,
            published,
            engine_thread: Some(engine_thread),
        })
    }

    pub fn client(&self) -> Client {
        Client {
            intake: self.intake.clone(),
        }
    }

    /// The current metrics in Prometheus text.
    pub fn metrics_text(&self) -> String {
        self.published
            .lock()
            .expect("published lock")
            .metrics_text
            .clone()
    }

    /// Stops intake, lets the engine finish every accepted request and every transfer, and joins
    /// the engine thread.
    pub fn shutdown(mut self) -> Result<(), String> {
        self.intake.close();
        match self.engine_thread.take() {
            Some(h) => h
                .join()
                .map_err(|_| "the engine thread panicked".to_string())?,
            None => Ok(()),
        }
    }
}

/// A request the engine accepted, waiting for its answer.
struct Pending {
    reply: tokio::sync::oneshot::Sender<Result<Completion, ServiceError>>,
    submitted: Instant,
    first_token: Option<Instant>,
}

fn engine_loop<D: Device, C: Clock, T: Transfer>(
    make: impl FnOnce() -> Result<Engine<D, C, T>, EngineError>,
    intake: &Intake,
    published: &Mutex<Published>,
) -> Result<(), String> {
    let t_make = Instant::now();
    let mut engine = match make() {
        Ok(e) => {
            published.lock().expect("published lock").built_in = Some(t_make.elapsed());
            e
        }
        Err(e) => {
            intake.close();
            for s in intake.drain() {
                let _ = s.reply.send(Err(ServiceError::EngineFailed(e.to_string())));
            }
            return Err(e.to_string());
        }
    };
    let mut pending: BTreeMap<u64, Pending> = BTreeMap::new();
    publish(&engine, published, None);
    let mut last_publish = Instant::now();
    loop {
        admit_submissions(&mut engine, intake, &mut pending);
        let closed = intake.closed.load(Ordering::Acquire);
        if engine.is_idle() {
            publish(&engine, published, None);
            if closed && intake.queue.lock().expect("intake lock").is_empty() {
                return Ok(());
            }
            intake.wait(Duration::from_millis(20));
            continue;
        }
        let t0 = Instant::now();
        let report = match engine.step() {
            Ok(r) => r,
            Err(e) => {
                let msg = e.to_string();
                for (_, p) in std::mem::take(&mut pending) {
                    let _ = p.reply.send(Err(ServiceError::EngineFailed(msg.clone())));
                }
                intake.close();
                return Err(msg);
            }
        };
        let sample = StepSample {
            wall_ns: t0.elapsed().as_nanos() as u64,
            rows: report.rows,
            host: report.host,
            device: report.device,
        };
        answer(engine.drain_outputs(), &mut pending);
        if last_publish.elapsed() > Duration::from_millis(50) {
            last_publish = Instant::now();
            publish(&engine, published, Some(sample));
        } else {
            let mut p = published.lock().expect("published lock");
            keep_sample(&mut p.steps, sample, STEP_SAMPLES);
        }
    }
}

/// Hands every queued submission to the engine; a rejection is answered at once.
fn admit_submissions<D: Device, C: Clock, T: Transfer>(
    engine: &mut Engine<D, C, T>,
    intake: &Intake,
    pending: &mut BTreeMap<u64, Pending>,
) {
    for s in intake.drain() {
        match engine.submit(s.spec) {
            Ok(id) => {
                pending.insert(
                    id,
                    Pending {
                        reply: s.reply,
                        submitted: s.submitted,
                        first_token: None,
                    },
                );
            }
            Err(r) => {
                let _ = s.reply.send(Err(ServiceError::Rejected(r)));
            }
        }
    }
}

/// Answers the requests a step finished or aborted, and notes first tokens.
fn answer(outputs: Vec<Output>, pending: &mut BTreeMap<u64, Pending>) {
    for o in outputs {
        match o {
            Output::Token { request, .. } => {
                if let Some(p) = pending.get_mut(&request) {
                    p.first_token.get_or_insert_with(Instant::now);
                }
            }
            Output::Finished { request, generated } => {
                if let Some(p) = pending.remove(&request) {
                    let now = Instant::now();
                    let _ = p.reply.send(Ok(Completion {
                        request,
                        generated,
                        ttft_ns: p
                            .first_token
                            .unwrap_or(now)
                            .duration_since(p.submitted)
                            .as_nanos() as u64,
                        latency_ns: now.duration_since(p.submitted).as_nanos() as u64,
                    }));
                }
            }
            Output::Aborted { request } => {
                if let Some(p) = pending.remove(&request) {
                    let _ = p.reply.send(Err(ServiceError::Aborted(request)));
                }
            }
            Output::TransferFailed { request, tries } => {
                if let Some(p) = pending.remove(&request) {
                    let _ = p
                        .reply
                        .send(Err(ServiceError::TransferFailed { request, tries }));
                }
            }
            Output::TransferTimedOut { request, tries } => {
                if let Some(p) = pending.remove(&request) {
                    let _ = p
                        .reply
                        .send(Err(ServiceError::TransferTimedOut { request, tries }));
                }
            }
            // A requeued request is still pending: its completion comes later.
            Output::Digests { .. } | Output::Recompute { .. } | Output::Requeued { .. } => {}
        }
    }
}

fn publish<D: Device, C: Clock, T: Transfer>(
    engine: &Engine<D, C, T>,
    published: &Mutex<Published>,
    step: Option<StepSample>,
) {
    let text = engine.metrics.render_prometheus();
    let mut p = published.lock().expect("published lock");
    p.metrics_text = text;
    p.metrics = engine.metrics.clone();
    if let Some(s) = step {
        keep_sample(&mut p.steps, s, STEP_SAMPLES);
    }
}

/// Keeps `sample` when fewer than `limit` are kept: the first `limit` steps of a run.
fn keep_sample(steps: &mut Vec<StepSample>, sample: StepSample, limit: usize) {
    if steps.len() < limit {
        steps.push(sample);
    }
}

/// Serves `GET /metrics` (Prometheus text) on `addr` (loopback) until `stop` resolves.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    published: Arc<Mutex<Published>>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stop = stop;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => return Ok(()),
        };
        let (mut sock, _) = accepted?;
        let published = published.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = match sock.read(&mut buf).await {
                Ok(n) => n,
                Err(_) => return,
            };
            let req = String::from_utf8_lossy(&buf[..n]);
            let (status, body) = if req.starts_with("GET /metrics") {
                (
                    "200 OK",
                    published
                        .lock()
                        .expect("published lock")
                        .metrics_text
                        .clone(),
                )
            } else {
                ("404 Not Found", "only GET /metrics is served\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests;

#[cfg(all(test, tierkv_loom))]
mod loom_tests {
    use super::*;
    use loom::thread;

    fn submission(n: u32) -> Submission {
        let (reply, _rx) = tokio::sync::oneshot::channel();
        Submission {
            spec: RequestSpec {
                prompt: vec![n],
                max_new_tokens: 1,
            },
            submitted: Instant::now(),
            reply,
        }
    }

    /// Handlers push and close from another thread; the engine thread's drain/wait loop sees
    /// every accepted submission and stops only once intake is closed and empty.
    #[test]
    fn loom_intake_loses_no_submission_and_no_wakeup() {
        loom::model(|| {
            let intake = Arc::new(Intake::new());
            let i2 = intake.clone();
            let h = thread::spawn(move || {
                let accepted =
                    i2.push(submission(1)).is_ok() as u32 + i2.push(submission(2)).is_ok() as u32;
                i2.close();
                accepted
            });
            let mut seen = 0u32;
            loop {
                seen += intake.drain().len() as u32;
                if intake.closed.load(Ordering::Acquire) && intake.queue.lock().unwrap().is_empty()
                {
                    break;
                }
                intake.wait(Duration::from_millis(1));
            }
            let accepted = h.join().unwrap();
            seen += intake.drain().len() as u32;
            assert_eq!(seen, accepted);
            assert!(
                intake.push(submission(3)).is_err(),
                "a closed intake refuses"
            );
        });
    }
}
