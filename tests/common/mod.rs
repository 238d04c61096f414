//! Helpers shared by the engine integration tests (`tests/engine.rs`, `tests/engine_blocks.rs`;
//! `tests/engine_faults.rs` takes `config`): an engine over the host backend with a "host" and a
//! "device" buffer registered, and waiting for results.

use std::sync::Arc;
use std::time::Duration;

use blockswap::backend::host::HostBackend;
use blockswap::engine::{Engine, EngineConfig};
use blockswap::{MemoryKind, TransferResult};

/// The engine's default settings; under Miri with a 16 MiB descriptor pool and 64 transfers in
/// flight a direction. Miri builds every slot of the pool's free lists and the completion rings
/// one at a time: at the defaults (256 MiB, 1,024) that took most of each engine test's time
/// there, and no test here holds more than a few slabs or transfers at once.
pub fn config() -> EngineConfig {
    if cfg!(miri) {
        EngineConfig {
            max_in_flight: 64,
            pool_bytes: 16 << 20,
            ..EngineConfig::default()
        }
    } else {
        EngineConfig::default()
    }
}

pub struct Buffers {
    pub src: Vec<u8>,
    pub dst: Vec<u8>,
}

pub fn engine_with(buffers: &mut Buffers, config: EngineConfig) -> (Engine, Arc<HostBackend>) {
    let host = Arc::new(HostBackend::new());
    let engine = Engine::new(host.clone(), config);
    // SAFETY: both vectors outlive the engine in every test (dropped after it) and are not resized.
    unsafe {
        engine
            .register(
                buffers.src.as_ptr() as u64,
                buffers.src.len() as u64,
                MemoryKind::Host,
            )
            .unwrap();
        engine
            .register(
                buffers.dst.as_mut_ptr() as u64,
                buffers.dst.len() as u64,
                MemoryKind::Device,
            )
            .unwrap();
    }
    (engine, host)
}

/// `n` seconds of patience: how long a test waits for what should come at once before it fails
/// rather than hangs. Twenty times as long under Miri, which interprets every step (a test
/// that took 26 s there passed its 30 s deadline on a machine busy with other builds).
pub fn secs(n: u64) -> Duration {
    Duration::from_secs(if cfg!(miri) { 20 * n } else { n })
}

pub fn finish(engine: &Engine, ids: &[u64]) -> Vec<TransferResult> {
    engine.wait(ids, Some(secs(30))).unwrap();
    let mut out = vec![];
    engine.get_finished(&mut out);
    out
}
