//! Engine settings: [`EngineConfig`], the one place their limits live, and [`ConfigError`],
//! the refusal of a setting outside them.

use std::fmt;
use std::time::Duration;

use crate::pool::Pool;
use crate::table::STAGED_STEP_BYTES;

/// Engine settings. [`EngineConfig::validate`] holds every limit; an engine refuses a setting
/// outside them rather than adjusting it.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Transfers in flight per direction before submit refuses: 1 to [`MAX_IN_FLIGHT`].
    pub max_in_flight: usize,
    /// Byte cap of the descriptor slab pool: at least [`MIN_POOL_BYTES`].
    pub pool_bytes: usize,
    /// Descriptors one transfer may carry: 1 to [`Pool::max_descriptors`].
    pub max_descriptors: usize,
    /// Merge descriptors whose source and destination both continue the previous one.
    pub coalesce: bool,
    /// How long shutdown waits for transfers in flight before failing them. A duration past what
    /// the clock can count ([`Duration::MAX`], what [`seconds`] makes of infinity) waits forever.
    pub shutdown_timeout: Duration,
    /// Bytes of each of the two slots of a lane's staging ring (the staged plan): the most one
    /// step moves, and the largest block row the plan takes. See [`EngineConfig::stage_bytes`].
    pub stage_bytes: u64,
    /// The fewest bytes a full step of the staged plan carries behind a running transfer, where
    /// the transfer has them (a smaller one takes fewer steps). See
    /// [`EngineConfig::stage_step_bytes`].
    pub stage_step_bytes: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_in_flight: 1024,
            pool_bytes: 256 << 20,
            max_descriptors: Pool::max_descriptors(),
            coalesce: true,
            shutdown_timeout: Duration::from_secs(60),
            stage_bytes: DEFAULT_STAGE_BYTES,
            stage_step_bytes: STAGED_STEP_BYTES,
        }
    }
}

/// The most transfers one direction may have in flight: a quarter of the host backend's worker
/// queue, so that the four directions full never hold more jobs than it has room for.
pub use crate::backend::MAX_IN_FLIGHT;

/// Default bytes of a staging slot: two per lane, allocated on the lane's first staged transfer.
/// 16 MiB steps reached 97-99 % of the link from 32 KiB pages (H100, `benches/probe_staged.py`).
pub const DEFAULT_STAGE_BYTES: u64 = 16 << 20;

/// The smallest staging slot: one 4 KiB page.
pub const MIN_STAGE_BYTES: u64 = 4096;

/// The smallest descriptor pool: one slab of the smallest class (256 descriptors). A smaller
/// pool could never hand out a slab, so every transfer would be refused.
pub const MIN_POOL_BYTES: usize = crate::pool::DESCRIPTOR_BYTES << crate::pool::MIN_CLASS;

impl EngineConfig {
    /// Checks every setting against its limits.
    pub fn validate(&self) -> Result<(), ConfigError> {
        Self::sizes(
            self.max_in_flight as i128,
            self.pool_bytes as i128,
            self.max_descriptors as i128,
        )
        .map(drop)
    }

    /// A configuration from settings as a caller outside Rust gives them: integers of any sign
    /// and a timeout in seconds (infinity waits forever; NaN and negatives are refused).
    /// `max_descriptors: None` keeps the default. Checked as by [`EngineConfig::validate`].
    pub fn from_settings(
        max_in_flight: i128,
        pool_bytes: i128,
        max_descriptors: Option<i128>,
        coalesce: bool,
        shutdown_timeout: f64,
    ) -> Result<Self, ConfigError> {
        let max_descriptors = max_descriptors.unwrap_or(Pool::max_descriptors() as i128);
        let (max_in_flight, pool_bytes, max_descriptors) =
            Self::sizes(max_in_flight, pool_bytes, max_descriptors)?;
        Ok(EngineConfig {
            max_in_flight,
            pool_bytes,
            max_descriptors,
            coalesce,
            shutdown_timeout: seconds("shutdown_timeout", shutdown_timeout)?,
            // The staging sizes have setters of their own; until then, the defaults.
            ..Self::default()
        })
    }

    /// Sets the staging slot size, refusing one below [`MIN_STAGE_BYTES`] or past 2^40.
    pub fn stage_bytes(mut self, bytes: i128) -> Result<Self, ConfigError> {
        self.stage_bytes = within("stage_bytes", bytes, MIN_STAGE_BYTES as usize, 1 << 40)? as u64;
        Ok(self)
    }

    /// Sets the fewest bytes of a full staged step (see [`crate::table::STAGED_STEP_BYTES`]),
    /// refusing 0 or past 2^40. 1 cuts every transfer of enough rows into
    /// [`crate::table::STAGED_FULL_STEPS`] full steps, behind a running one too.
    pub fn stage_step_bytes(mut self, bytes: i128) -> Result<Self, ConfigError> {
        self.stage_step_bytes = within("stage_step_bytes", bytes, 1, 1 << 40)? as u64;
        Ok(self)
    }

    /// The limits of the integer settings: the one place they live.
    fn sizes(
        max_in_flight: i128,
        pool_bytes: i128,
        max_descriptors: i128,
    ) -> Result<(usize, usize, usize), ConfigError> {
        Ok((
            within("max_in_flight", max_in_flight, 1, MAX_IN_FLIGHT)?,
            within("pool_bytes", pool_bytes, MIN_POOL_BYTES, usize::MAX)?,
            within(
                "max_descriptors",
                max_descriptors,
                1,
                Pool::max_descriptors(),
            )?,
        ))
    }
}

/// `value` as a usize in `[lo, hi]`, or the error naming `option`.
fn within(option: &'static str, value: i128, lo: usize, hi: usize) -> Result<usize, ConfigError> {
    match usize::try_from(value) {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        _ => Err(ConfigError {
            option,
            expected: format!("an int from {lo} to {hi}"),
            given: value.to_string(),
        }),
    }
}

/// A timeout of `secs` seconds: infinity (or any time past [`Duration::MAX`]) becomes
/// [`Duration::MAX`], which the engine waits out without a deadline; NaN and negative times are
/// refused, naming `option`.
pub fn seconds(option: &'static str, secs: f64) -> Result<Duration, ConfigError> {
    if secs.is_nan() || secs < 0.0 {
        return Err(ConfigError {
            option,
            expected: "a non-negative number of seconds (inf waits forever)".into(),
            given: secs.to_string(),
        });
    }
    Ok(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

/// An engine setting outside its limits (see [`EngineConfig::validate`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The setting, spelled as its keyword.
    pub option: &'static str,
    /// What it must be.
    pub expected: String,
    /// What it was.
    pub given: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} must be {}, not {}",
            self.option, self.expected, self.given
        )
    }
}

impl std::error::Error for ConfigError {}
