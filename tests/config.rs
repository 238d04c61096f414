//! Engine settings: every limit refused by name, never adjusted; infinite timeouts wait forever.

use std::sync::Arc;
use std::time::Duration;

use blockswap::backend::host::HostBackend;
use blockswap::engine::{
    seconds, ConfigError, Engine, EngineConfig, EngineError, MAX_IN_FLIGHT, MIN_POOL_BYTES,
};
use blockswap::pool::Pool;
use blockswap::{Direction, MemoryKind};

fn refused(option: &str, config: EngineConfig) -> ConfigError {
    let e = config.validate().unwrap_err();
    assert_eq!(e.option, option, "{e}");
    match Engine::try_new(Arc::new(HostBackend::new()), config) {
        Err(EngineError::Config(c)) => assert_eq!(c, e),
        other => panic!("{option}: {:?}", other.map(drop)),
    }
    e
}

#[test]
fn defaults_and_bounds_are_accepted() {
    EngineConfig::default().validate().unwrap();
    let edge = EngineConfig {
        max_in_flight: MAX_IN_FLIGHT,
        pool_bytes: MIN_POOL_BYTES,
        max_descriptors: Pool::max_descriptors(),
        ..Default::default()
    };
    edge.validate().unwrap();
    let small = EngineConfig {
        max_in_flight: 1,
        max_descriptors: 1,
        ..Default::default()
    };
    let engine = Engine::try_new(Arc::new(HostBackend::new()), small).unwrap();
    assert_eq!(engine.config().max_in_flight, 1);
    assert_eq!(engine.config().max_descriptors, 1);
}

#[test]
fn settings_outside_their_limits_are_refused_not_adjusted() {
    let e = refused(
        "max_in_flight",
        EngineConfig {
            max_in_flight: 0,
            ..Default::default()
        },
    );
    assert_eq!(
        e.to_string(),
        format!("max_in_flight must be an int from 1 to {MAX_IN_FLIGHT}, not 0")
    );
    refused(
        "max_in_flight",
        EngineConfig {
            max_in_flight: MAX_IN_FLIGHT + 1,
            ..Default::default()
        },
    );
    let e = refused(
        "max_descriptors",
        EngineConfig {
            max_descriptors: 0,
            ..Default::default()
        },
    );
    assert!(e.to_string().ends_with(", not 0"), "{e}");
    refused(
        "max_descriptors",
        EngineConfig {
            max_descriptors: Pool::max_descriptors() + 1,
            ..Default::default()
        },
    );
    let e = refused(
        "pool_bytes",
        EngineConfig {
            pool_bytes: MIN_POOL_BYTES - 1,
            ..Default::default()
        },
    );
    assert_eq!(
        e.to_string(),
        format!(
            "pool_bytes must be an int from {MIN_POOL_BYTES} to {}, not {}",
            usize::MAX,
            MIN_POOL_BYTES - 1
        )
    );
}

#[test]
#[should_panic(expected = "max_in_flight must be")]
fn new_panics_on_a_refused_setting() {
    let config = EngineConfig {
        max_in_flight: 0,
        ..Default::default()
    };
    drop(Engine::new(Arc::new(HostBackend::new()), config));
}

#[test]
fn settings_from_outside_rust_name_the_value_given() {
    let c = EngineConfig::from_settings(8, 1 << 20, None, false, 2.5).unwrap();
    assert_eq!(
        (c.max_in_flight, c.pool_bytes, c.max_descriptors, c.coalesce),
        (8, 1 << 20, Pool::max_descriptors(), false)
    );
    assert_eq!(c.shutdown_timeout, Duration::from_millis(2500));
    let e = EngineConfig::from_settings(-1, 1 << 20, None, true, 1.0).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("max_in_flight must be an int from 1 to {MAX_IN_FLIGHT}, not -1")
    );
    let e = EngineConfig::from_settings(8, 1 << 20, Some(-3), true, 1.0).unwrap_err();
    assert_eq!(e.option, "max_descriptors");
    assert_eq!(e.given, "-3");
    let huge = i128::from(u64::MAX) + 1;
    let e = EngineConfig::from_settings(8, huge, None, true, 1.0).unwrap_err();
    assert_eq!(e.given, huge.to_string());
    let e = EngineConfig::from_settings(8, 1 << 20, None, true, f64::NAN).unwrap_err();
    assert_eq!(e.option, "shutdown_timeout");
    let c = EngineConfig::from_settings(8, 1 << 20, None, true, f64::INFINITY).unwrap();
    assert_eq!(c.shutdown_timeout, Duration::MAX);
}

#[test]
fn seconds_inf_is_forever_and_nan_or_negative_is_refused() {
    assert_eq!(seconds("timeout", f64::INFINITY), Ok(Duration::MAX));
    assert_eq!(seconds("timeout", 1e30), Ok(Duration::MAX));
    assert_eq!(seconds("timeout", 0.25), Ok(Duration::from_millis(250)));
    assert_eq!(seconds("timeout", 0.0), Ok(Duration::ZERO));
    for bad in [f64::NAN, -1.0, f64::NEG_INFINITY] {
        let e = seconds("timeout", bad).unwrap_err();
        assert_eq!(e.option, "timeout");
        assert!(e
            .to_string()
            .starts_with("timeout must be a non-negative number"));
    }
}

#[test]
fn timeouts_past_the_clock_wait_without_a_deadline() {
    let config = EngineConfig {
        shutdown_timeout: Duration::MAX,
        ..Default::default()
    };
    let engine = Engine::new(Arc::new(HostBackend::new()), config);
    let src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    // SAFETY: both vectors outlive the engine (dropped after it) and are not resized.
    unsafe {
        engine
            .register(src.as_ptr() as u64, 4096, MemoryKind::Host)
            .unwrap();
        engine
            .register(dst.as_mut_ptr() as u64, 4096, MemoryKind::Device)
            .unwrap();
    }
    let (s, d) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    engine
        .submit(1, &[s], &[d], &[4096], Direction::HostToDevice, None)
        .unwrap();
    engine.wait(&[1], Some(Duration::MAX)).unwrap();
    engine
        .submit(2, &[s], &[d], &[4096], Direction::HostToDevice, None)
        .unwrap();
    // Waits for job 2 without a deadline instead of overflowing the clock.
    engine.shutdown();
    let mut out = vec![];
    engine.get_finished(&mut out);
    assert!(out.iter().all(|r| r.success), "{out:?}");
    assert_eq!(out.len(), 2);
    drop(engine);
    assert_eq!(dst, src);
}
