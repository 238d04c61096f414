//! The engine's counters and settings as Python dicts (`Engine.stats`, `Engine.info`).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::direction::Direction;
use crate::engine::Engine;

/// `Engine.stats`: see its documentation in `engine.rs`.
pub(super) fn stats<'py>(py: Python<'py>, engine: &Engine) -> PyResult<Bound<'py, PyDict>> {
    let s = engine.stats();
    let latency = engine.latency();
    let d = PyDict::new(py);
    for dir in Direction::ALL {
        let l = s.lanes[dir.lane()];
        let ld = PyDict::new(py);
        let t = latency[dir.lane()];
        let secs = |ns: Option<u64>| ns.map(|n| n as f64 * 1e-9);
        ld.set_item("wall_p50", secs(t.transfer_p50_ns))?;
        ld.set_item("wall_p99", secs(t.transfer_p99_ns))?;
        ld.set_item("submit_p50", secs(t.submit_p50_ns))?;
        ld.set_item("submit_p99", secs(t.submit_p99_ns))?;
        ld.set_item("refused", t.refused)?;
        ld.set_item("submit_failed", t.submit_failed)?;
        ld.set_item("transfers", l.transfers)?;
        ld.set_item("failed", l.failed)?;
        ld.set_item("bytes", l.bytes)?;
        ld.set_item("seconds", l.seconds)?;
        ld.set_item(
            "gb_per_s",
            if l.seconds > 0.0 {
                l.bytes as f64 / l.seconds / 1e9
            } else {
                0.0
            },
        )?;
        d.set_item(dir.as_str(), ld)?;
    }
    d.set_item("in_flight", s.in_flight)?;
    d.set_item("driver_ns", s.driver_ns)?;
    d.set_item("submit_ns", s.submit_ns)?;
    d.set_item("prepare_ns", s.prepare_ns)?;
    d.set_item("shutdown_timed_out", s.shutdown_timed_out)?;
    let p = PyDict::new(py);
    p.set_item("slabs", s.pool.slabs)?;
    p.set_item("free", s.pool.free)?;
    p.set_item("bytes", s.pool.bytes)?;
    p.set_item("cap", s.pool.cap)?;
    d.set_item("pool", p)?;
    Ok(d)
}

/// `Engine.info`: see its documentation in `engine.rs`.
pub(super) fn info<'py>(py: Python<'py>, engine: &Engine) -> PyResult<Bound<'py, PyDict>> {
    let i = engine.backend_info();
    let c = engine.config();
    let d = PyDict::new(py);
    d.set_item("backend", i.name)?;
    d.set_item("driver_version", i.driver_version)?;
    d.set_item("device", i.device)?;
    d.set_item("copy_path", i.copy_path)?;
    d.set_item("completion", i.completion)?;
    d.set_item("max_in_flight", c.max_in_flight)?;
    d.set_item("pool_bytes", c.pool_bytes)?;
    d.set_item("max_descriptors", c.max_descriptors)?;
    d.set_item("coalesce", c.coalesce)?;
    Ok(d)
}
