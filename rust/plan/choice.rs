//! Which route a KV-cache cache's transfers take in one direction, chosen once when its handlers
//! are built: the rule, with the constants that steer it and the runs that set them.
//!
//! [`candidates`] ranks the routes a direction can take, best first, from what the caller asked
//! for ([`Ask`]: `path=`, the kernel's threshold and CTAs) and the cache's geometry (its GPU page
//! sizes, and the block and staged plans' own rules, asked lazily through closures so a rule is
//! read only where the choice needs it). The caller takes the first candidate it can build: a
//! candidate that names a kernel ([`KernelNeed`]) is built only where that kernel compiles and
//! loads into the core, which is the one step the rule cannot decide (Triton compiles it). The
//! last candidate of a default (`path="auto"`) choice needs nothing built.

use crate::direction::Direction;

/// Pages below this many bytes go to the copy kernel, the rest to DMA, with `path="auto"`, from
/// the host to the GPU. Chosen on an H200 (driver 580, 2026-11-21) from the suite's sweep
/// (`python benches/suite.py`, docs/benchmarks.md), one transfer of N scattered blocks at a time,
/// as fractions of the link's ceiling measured in the same run: with N = 2,560 the kernel reached
/// 74-91 % from 4 to 128 KiB against DMA's 8-87 % (the batch call's host cost, ~0.3-1.9 us per
/// descriptor, holds DMA back); at 256 KiB DMA 93 %, the kernel 92 %. With 8 transfers queued back
/// to back DMA catches up earlier (95 % at 64 KiB) because its submission then overlaps the
/// copies; the threshold follows the isolated case. With few blocks (N = 16) DMA is ahead of the
/// kernel from 4 KiB, but such transfers move little and are latency-bound either way.
pub const KERNEL_BELOW_H2D: u64 = 256 * 1024;

/// ...and from the GPU to the host: with N = 2,560 the kernel reached 74-94 % from 4 to 128 KiB
/// against DMA's 18-85 %; at 256 KiB DMA 91 %, the kernel 94 % (N = 256: both 93 %), and DMA,
/// which takes no SM, is kept.
pub const KERNEL_BELOW_D2H: u64 = 256 * 1024;

/// The threshold of `path="kernel"`: every page goes to the kernel.
pub const KERNEL_EVERY_PAGE: u64 = 1 << 62;

/// CTAs of the staged plan's kernel, which moves pages between the staging ring and the GPU pages
/// inside HBM: 32 reached 97-99 % of the link from 32 KiB pages where 132 gained nothing (H100,
/// 2026-11-23, `benches/probe_staged.py`). A transfer's kernel that overlaps no copy (CPU -> GPU
/// its last, GPU -> CPU its first) runs on [`crate::table::STAGED_RAMP`] times as many.
pub const STAGED_CTAS: u32 = 32;

/// Bytes of a staging slot by default (two per direction, in device memory): 16 MiB steps reached
/// 97-99 % of the link from 32 KiB pages (H100, `benches/probe_staged.py`).
pub const STAGE_BYTES: u64 = 16 << 20;

/// The largest slot [`stage_slot`] grows to, to hold one block's row: past it the staged plan is
/// not taken unless the caller sizes the slots itself.
pub const STAGE_MAX_AUTO: u64 = 64 << 20;

/// Why every transfer of the host backend moves as it does.
pub const HOST_ROUTE: &str = "host backend: memcpy (no GPU to run a kernel on)";

/// The staging slot a cache whose largest block row is `row` bytes gets by default: at least one
/// row (every page of a GPU block), [`STAGE_BYTES`] at least, and no more than
/// [`STAGE_MAX_AUTO`] (two slots per direction are device memory).
#[must_use]
pub fn stage_slot(row: u64) -> u64 {
    if row <= STAGE_MAX_AUTO {
        row.max(STAGE_BYTES)
    } else {
        STAGE_BYTES
    }
}

/// The route a caller asks for (`path=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The rule's choice from the geometry.
    Auto,
    /// Copy engines only: no SM is taken from the model.
    Dma,
    /// Every page by the copy kernel.
    Kernel,
    /// The block plan, or a refusal.
    Blocks,
    /// The staged plan, or a refusal.
    Staged,
}

impl Path {
    /// Every path, as the caller names it.
    pub const ALL: [Path; 5] = [
        Path::Auto,
        Path::Dma,
        Path::Kernel,
        Path::Blocks,
        Path::Staged,
    ];

    /// The name the caller gives (`"auto"`, `"dma"`, `"kernel"`, `"blocks"`, `"staged"`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Path::Auto => "auto",
            Path::Dma => "dma",
            Path::Kernel => "kernel",
            Path::Blocks => "blocks",
            Path::Staged => "staged",
        }
    }

    /// The path named `s`, if any.
    #[must_use]
    pub fn parse(s: &str) -> Option<Path> {
        Path::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// What the caller asked for, and where the transfers run.
#[derive(Clone, Copy, Debug)]
pub struct Ask {
    pub path: Path,
    /// The CUDA backend: a kernel can run, and the core can launch one it loaded.
    pub on_cuda: bool,
    /// The CPU cache is block-major, each block's pages one chunk of host memory (allocated here,
    /// or given so, as vLLM's offload region lays out a chunk with one block:
    /// [`crate::engine::Engine::block_major`]): the block and staged plans are taken by default
    /// where the geometry gives them. A cache laid out as a mirror of the GPU keeps the page route
    /// by default: pitched copies into it measured 10-25 % slower below 32 KiB pages than into a
    /// block-major cache (H100, 2026-11-23).
    pub block_major: bool,
    /// The page size below which pages take the kernel (`None`: the direction's default,
    /// [`KERNEL_BELOW_H2D`] / [`KERNEL_BELOW_D2H`]).
    pub kernel_below: Option<u64>,
    /// CTAs of the page kernel.
    pub kernel_ctas: u32,
}

/// A copy kernel a candidate needs compiled and loaded into the core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelNeed {
    /// The largest page it moves.
    pub max_size: u64,
    pub ctas: u32,
    /// The staged plan's kernel (ring slot <-> GPU pages) rather than the page kernel.
    pub staged: bool,
}

/// One route a direction can take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Candidate {
    /// A descriptor per page, copy engines only.
    Dma,
    /// A descriptor per page, those below `below` bytes by the copy kernel: the core's where
    /// `load` names it, else one the caller launches itself.
    Kernel {
        below: u64,
        load: Option<KernelNeed>,
    },
    /// The block plan's 2-D copies.
    Blocks,
    /// The staged plan, its GPU side moved by the kernel `load` names (none on the host backend).
    Staged { load: Option<KernelNeed> },
    /// The staged plan's kernel moving the host pages in place ([`crate::table::StagedRequest::direct`]):
    /// the kernel route's SMs on `PCIe`, each page's addresses computed on the GPU from a block
    /// entry and its table's geometry instead of a descriptor per page.
    Direct { load: KernelNeed },
}

/// A candidate, and why it was ranked where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub candidate: Candidate,
    pub reason: String,
}

/// Why no route can be offered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `path="kernel"` where the copy kernel cannot run in this process (the reason).
    Unavailable(String),
    /// A path the geometry gives no plan for, or an argument out of its domain (the message).
    Refused(String),
}

/// The ranked routes of one direction, best first, and the routes passed over with why (for the
/// caller's log); or a [`Refusal`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ranking {
    pub choices: Vec<Choice>,
    pub declined: Vec<String>,
}

/// The rules a choice reads, each asked at most once and only where the choice needs it, their
/// errors (`E`) returned as they are: `block(insist)` the block plan's (`Ok(why)` or `Err(why
/// not)`; `insist` for `path="blocks"`), `staged()` the staged plan's (`Ok((largest row, slot
/// bytes))` or `Err(why not)`), `direct()` the direct plan's (`Ok(largest block span)` or
/// `Err(why not)`), `unavailable()` why the copy kernel cannot run in this process
/// (`None` where it can).
#[derive(Debug)]
pub struct Rules<B, S, D, U> {
    pub block: B,
    pub staged: S,
    pub direct: D,
    pub unavailable: U,
}

/// The routes `direction` can take for a cache whose GPU pages have the sizes `page_sizes`, best
/// first (see the module docs), by the cache's `rules`.
///
/// # Errors
/// `E` from a rule.
pub fn candidates<E, B, S, D, U>(
    ask: &Ask,
    direction: Direction,
    page_sizes: &[u64],
    rules: Rules<B, S, D, U>,
) -> Result<Result<Ranking, Refusal>, E>
where
    B: FnOnce(bool) -> Result<Result<String, String>, E>,
    S: FnOnce() -> Result<Result<(u64, u64), String>, E>,
    D: FnOnce() -> Result<Result<u64, String>, E>,
    U: FnOnce() -> Result<Option<String>, E>,
{
    let Rules {
        block,
        staged,
        direct,
        unavailable,
    } = rules;
    let default_below = match direction {
        Direction::HostToDevice => KERNEL_BELOW_H2D,
        Direction::DeviceToHost => KERNEL_BELOW_D2H,
        other => {
            return Ok(Err(Refusal::Refused(format!(
                "direction must be 'h2d' or 'd2h', not {:?}",
                other.as_str()
            ))))
        }
    };
    let mut sizes = page_sizes.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    let mut ranking = Ranking {
        choices: Vec::new(),
        declined: Vec::new(),
    };
    match ask.path {
        Path::Dma => {
            ranking.choices.push(dma("dma".into()));
            return Ok(Ok(ranking));
        }
        Path::Blocks => {
            return Ok(match block(true)? {
                Ok(why) => {
                    ranking.choices.push(Choice {
                        candidate: Candidate::Blocks,
                        reason: why,
                    });
                    Ok(ranking)
                }
                Err(why) => Err(Refusal::Refused(format!(
                    "path='blocks' needs KV-cache groups whose pages lie at one pitch on both \
                     sides, in memory no other group shares; here: {why}"
                ))),
            });
        }
        Path::Staged => {
            return Ok(match staged_choice(ask, &sizes, staged)? {
                Ok(choice) => {
                    ranking.choices.push(choice);
                    Ok(ranking)
                }
                Err(why) => Err(Refusal::Refused(format!(
                    "path='staged' is not possible here: {why}"
                ))),
            });
        }
        Path::Auto | Path::Kernel => {}
    }
    if ask.path == Path::Auto && ask.block_major {
        match block(false)? {
            Ok(why) => ranking.choices.push(Choice {
                candidate: Candidate::Blocks,
                reason: why,
            }),
            Err(why) => ranking.declined.push(format!("no block route: {why}")),
        }
        if ranking.choices.is_empty() {
            match staged_choice(ask, &sizes, staged)? {
                Ok(choice) => ranking.choices.push(choice),
                Err(why) => ranking.declined.push(format!("no staged route: {why}")),
            }
        }
    }
    match page_choices(ask, default_below, &sizes, unavailable)? {
        Ok(pages) => {
            // Behind a block or staged route (copy engines on PCIe) the direct plan is not asked.
            if ranking.choices.is_empty() {
                match direct_choice(ask, &sizes, &pages, direct)? {
                    Some(Ok(choice)) => ranking.choices.push(choice),
                    Some(Err(why)) => ranking.declined.push(format!("no direct route: {why}")),
                    None => {}
                }
            }
            ranking.choices.extend(pages);
        }
        Err(refusal) => return Ok(Err(refusal)),
    }
    Ok(Ok(ranking))
}

/// The direct plan, ranked ahead of the page route's kernel where `path="auto"` on CUDA sends
/// every page to that kernel (`None` otherwise), if the direct plan's rule takes the cache (its
/// host blocks laid out in chunks or cells; `Some(Err(why not))` where it does not): the same
/// SMs on `PCIe`, no descriptor per page. Canonical fragments of 512 B-2 KiB, one launch each
/// way, reached 92.8-95.2 % of the link this way against 87.3-93.5 % by descriptors in pinned
/// memory (H100, 2026-11-27, `python benches/probe_direct.py`).
fn direct_choice<E>(
    ask: &Ask,
    sizes: &[u64],
    pages: &[Choice],
    direct: impl FnOnce() -> Result<Result<u64, String>, E>,
) -> Result<Option<Result<Choice, String>>, E> {
    let Some(Choice {
        candidate: Candidate::Kernel {
            below,
            load: Some(need),
        },
        ..
    }) = pages.first()
    else {
        return Ok(None);
    };
    // `path="kernel"` keeps the page route it names.
    if ask.path != Path::Auto || !ask.on_cuda || sizes.iter().any(|&n| n >= *below) {
        return Ok(None);
    }
    let span = match direct()? {
        Ok(fit) => fit,
        Err(why) => return Ok(Some(Err(why))),
    };
    Ok(Some(Ok(Choice {
        candidate: Candidate::Direct {
            load: KernelNeed {
                staged: true,
                ..*need
            },
        },
        reason: format!(
            "direct: pages moved in place by the core's kernel on {} CTAs, addressed from \
             block entries and geometries in device memory (blocks of up to {span} B, launches \
             of up to kernel_launch_bytes of pages)",
            need.ctas
        ),
    })))
}

fn dma(reason: String) -> Choice {
    Choice {
        candidate: Candidate::Dma,
        reason,
    }
}

/// The staged plan where its rule takes the cache: `Err(why not)` otherwise.
fn staged_choice<E>(
    ask: &Ask,
    sizes: &[u64],
    staged: impl FnOnce() -> Result<Result<(u64, u64), String>, E>,
) -> Result<Result<Choice, String>, E> {
    let (row, slot) = match staged()? {
        Ok(fit) => fit,
        Err(why) => return Ok(Err(why)),
    };
    let (load, how) = match sizes.last() {
        Some(&max_size) if ask.on_cuda => (
            Some(KernelNeed {
                max_size,
                ctas: STAGED_CTAS,
                staged: true,
            }),
            format!("pages moved inside the GPU by the core's kernel on {STAGED_CTAS} CTAs"),
        ),
        _ => (None, HOST_ROUTE.to_string()),
    };
    Ok(Ok(Choice {
        candidate: Candidate::Staged { load },
        reason: format!(
            "staged: a copy per block row (up to {row} B) through a ring of 2 x {slot} B, {how}"
        ),
    }))
}

/// The page route: pages below the threshold by the kernel (the core's first, on CUDA, then one
/// the caller launches), the rest by DMA; DMA alone where no page is below it, on the host
/// backend unless the kernel is insisted on, or where the kernel cannot run here.
fn page_choices<E>(
    ask: &Ask,
    default_below: u64,
    sizes: &[u64],
    unavailable: impl FnOnce() -> Result<Option<String>, E>,
) -> Result<Result<Vec<Choice>, Refusal>, E> {
    let every = ask.path == Path::Kernel;
    if !every && !ask.on_cuda {
        return Ok(Ok(vec![dma(HOST_ROUTE.into())]));
    }
    let below = if every {
        KERNEL_EVERY_PAGE
    } else {
        ask.kernel_below.unwrap_or(default_below)
    };
    let Some(&largest_small) = sizes.iter().rev().find(|&&n| n < below) else {
        return Ok(Ok(vec![dma(format!(
            "dma: every page is >= {below} bytes"
        ))]));
    };
    if let Some(why) = unavailable()? {
        return Ok(if every {
            Err(Refusal::Unavailable(why))
        } else {
            Ok(vec![dma(format!("dma: {why}"))])
        });
    }
    let reason = if sizes.iter().all(|&n| n < below) {
        format!("kernel ({} CTAs): pages {sizes:?} bytes", ask.kernel_ctas)
    } else {
        format!("hybrid: pages < {below} bytes by kernel, the rest by DMA")
    };
    let mut out = Vec::with_capacity(2);
    if ask.on_cuda {
        out.push(Choice {
            candidate: Candidate::Kernel {
                below,
                load: Some(KernelNeed {
                    max_size: largest_small,
                    ctas: ask.kernel_ctas,
                    staged: false,
                }),
            },
            reason: format!("{reason}, launched by the core"),
        });
    }
    out.push(Choice {
        candidate: Candidate::Kernel { below, load: None },
        reason,
    });
    Ok(Ok(out))
}

#[cfg(test)]
mod tests;
