//! The production service on the in-order CPU device: async intake, admission answers, `/metrics`
//! on loopback, graceful shutdown.

use tierkv_engine::cpu_device::InOrderDevice;
use tierkv_engine::runtime::service::{serve_metrics, Service, ServiceError};
use tierkv_engine::runtime::MonotonicClock;
use tierkv_engine::synth::Synth;
use tierkv_engine::{Config, Engine, EngineOptions, Rejection, RequestSpec};

fn prompt(stream: u64, n: u64) -> Vec<u32> {
    let s = Synth::new(0);
    (0..n)
        .map(|i| s.token(if i < 128 { 1 } else { stream }, i))
        .collect()
}

#[test]
fn requests_complete_rejections_are_typed_and_metrics_answer() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.scheduler.queued_requests_max = 4;
    let service = Service::start(move || {
        Engine::new(
            cfg,
            InOrderDevice::new(),
            MonotonicClock::new(),
            EngineOptions::default(),
        )
    })
    .expect("the engine thread starts");
    let client = service.client();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let published = service.published.clone();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let server = tokio::spawn(serve_metrics(listener, published, stop_rx));

        // A burst far over the queue limit: some are rejected with the typed answer, the rest finish.
        let mut handles = Vec::new();
        for i in 0..40u64 {
            let c = client.clone();
            handles.push(tokio::spawn(async move {
                c.generate(RequestSpec {
                    prompt: prompt(10 + i, 150),
                    max_new_tokens: 3,
                })
                .await
            }));
        }
        let (mut ok, mut rejected) = (0, 0);
        for h in handles {
            match h.await.unwrap() {
                Ok(c) => {
                    assert_eq!(c.generated.len(), 3);
                    assert!(c.ttft_ns <= c.latency_ns);
                    ok += 1;
                }
                Err(ServiceError::Rejected(Rejection::QueueFull { limit: 4, .. })) => rejected += 1,
                Err(e) => panic!("unexpected: {e}"),
            }
        }
        assert!(ok >= 4, "{ok} finished");
        assert_eq!(ok + rejected, 40);

        // /metrics over loopback HTTP.
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        for m in [
            "tierkv_queue_depth",
            "tierkv_device_kv_pages_used",
            "tierkv_host_tokens_capacity",
            "tierkv_prefix_hit_rate{tier=\"device\"}",
            "tierkv_requests_rejected_total{reason=\"queue_full\"}",
            "tierkv_load_latency_seconds_count",
            "tierkv_backup_bytes_total",
        ] {
            assert!(body.contains(m), "metrics lack {m}:\n{body}");
        }
        let _ = stop_tx.send(true);
        server.await.unwrap().unwrap();
    });
    // The service's own text is what it published with the metrics, under one lock, and every
    // step the engine ran left a sample, not only the steps that published. The engine
    // publishes on its own time (every 50 ms while it steps, and on each idle turn): read until
    // the service's text agrees with a publication made after the steps ran.
    let shared = service.published.clone();
    let mut agreed = false;
    for _ in 0..10_000 {
        let text = service.metrics_text();
        let p = shared.lock().unwrap();
        assert_eq!(p.metrics_text, p.metrics.render_prometheus());
        if text == p.metrics_text && p.metrics.steps > 0 {
            assert!(
                p.steps.len() as u64 >= p.metrics.steps,
                "{} step samples for {} steps",
                p.steps.len(),
                p.metrics.steps
            );
            agreed = true;
            break;
        }
        drop(p);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(
        agreed,
        "no publication after the steps agreed with the service's text"
    );
    service.shutdown().unwrap();
}

#[test]
fn shutdown_drains_accepted_requests() {
    let cfg = Config::preset("sim-small").unwrap();
    let service = Service::start(move || {
        Engine::new(
            cfg,
            InOrderDevice::new(),
            MonotonicClock::new(),
            EngineOptions::default(),
        )
    })
    .expect("the engine thread starts");
    let client = service.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let h: Vec<_> = (0..3u64)
        .map(|i| {
            let c = client.clone();
            rt.spawn(async move {
                c.generate(RequestSpec {
                    prompt: prompt(i, 100),
                    max_new_tokens: 2,
                })
                .await
            })
        })
        .collect();
    // One turn of the current-thread runtime runs each task up to its await: all three are in
    // the intake queue. Shutdown must still complete every one of them.
    rt.block_on(async {
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
    });
    service.shutdown().unwrap();
    for j in h {
        let r = rt.block_on(j).unwrap();
        assert!(matches!(&r, Ok(c) if c.generated.len() == 2), "{r:?}");
    }
    let late = rt.block_on(client.generate(RequestSpec {
        prompt: prompt(9, 10),
        max_new_tokens: 1,
    }));
    assert_eq!(late, Err(ServiceError::ShuttingDown));
}

/// The production clock counts real nanoseconds since it was made: it moves forward between
/// two reads with work between them, and never back.
#[test]
fn the_monotonic_clock_moves_forward() {
    use tierkv_engine::device::Clock;
    let c = MonotonicClock::new();
    let first = c.now_ns();
    let mut last = first;
    for _ in 0..100_000_000u64 {
        let now = c.now_ns();
        assert!(now >= last, "{now} after {last}");
        last = now;
        if now > first {
            return;
        }
    }
    panic!("the clock stayed at {first} ns");
}
