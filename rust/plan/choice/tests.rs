use std::cell::Cell;
use std::convert::Infallible;

use super::{
    candidates, stage_slot, Ask, Candidate, KernelNeed, Path, Ranking, Refusal, Rules, HOST_ROUTE,
    KERNEL_BELOW_D2H, KERNEL_BELOW_H2D, KERNEL_EVERY_PAGE, STAGED_CTAS, STAGE_BYTES,
    STAGE_MAX_AUTO,
};
use crate::direction::Direction;

const KIB: u64 = 1024;
const H2D: Direction = Direction::HostToDevice;
const D2H: Direction = Direction::DeviceToHost;

fn ask(path: Path, on_cuda: bool) -> Ask {
    Ask {
        path,
        on_cuda,
        block_major: false,
        kernel_below: None,
        kernel_ctas: 16,
    }
}

/// The rule's answer, with how often each closure was asked.
struct Probe {
    block: Result<String, String>,
    staged: Result<(u64, u64), String>,
    direct: Result<u64, String>,
    unavailable: Option<String>,
    asked: Cell<[u32; 4]>,
}

impl Probe {
    fn new() -> Self {
        Probe {
            block: Err("pages not at one pitch".into()),
            staged: Err("not block-major".into()),
            direct: Err("not in cells".into()),
            unavailable: None,
            asked: Cell::new([0; 4]),
        }
    }

    fn count(&self, i: usize) {
        let mut a = self.asked.get();
        a[i] += 1;
        self.asked.set(a);
    }

    fn run(&self, ask: &Ask, d: Direction, sizes: &[u64]) -> Result<Ranking, Refusal> {
        let rules = Rules {
            block: |_insist| {
                self.count(0);
                Ok(self.block.clone())
            },
            staged: || {
                self.count(1);
                Ok(self.staged.clone())
            },
            unavailable: || {
                self.count(2);
                Ok(self.unavailable.clone())
            },
            direct: || {
                self.count(3);
                Ok(self.direct.clone())
            },
        };
        let r: Result<_, Infallible> = candidates(ask, d, sizes, rules);
        let out = r.unwrap();
        assert!(
            self.asked.get().iter().all(|&n| n <= 1),
            "a rule asked twice"
        );
        out
    }
}

fn kinds(r: &Ranking) -> Vec<Candidate> {
    r.choices.iter().map(|c| c.candidate).collect()
}

#[test]
fn dma_and_the_host_backend_take_the_copy_engines_without_asking_the_kernel() {
    let p = Probe::new();
    let r = p.run(&ask(Path::Dma, true), H2D, &[4 * KIB]).unwrap();
    assert_eq!(kinds(&r), [Candidate::Dma]);
    assert_eq!(r.choices[0].reason, "dma");
    let r = p.run(&ask(Path::Auto, false), D2H, &[4 * KIB]).unwrap();
    assert_eq!(kinds(&r), [Candidate::Dma]);
    assert_eq!(r.choices[0].reason, HOST_ROUTE);
    assert_eq!(p.asked.get(), [0, 0, 0, 0]);
}

#[test]
fn small_pages_take_the_core_kernel_first_then_a_launcher() {
    for (d, below) in [(H2D, KERNEL_BELOW_H2D), (D2H, KERNEL_BELOW_D2H)] {
        let p = Probe::new();
        let r = p
            .run(&ask(Path::Auto, true), d, &[8 * KIB, 8 * KIB])
            .unwrap();
        let need = KernelNeed {
            max_size: 8 * KIB,
            ctas: 16,
            staged: false,
        };
        assert_eq!(
            kinds(&r),
            [
                Candidate::Kernel {
                    below,
                    load: Some(need)
                },
                Candidate::Kernel { below, load: None }
            ]
        );
        assert_eq!(r.choices[1].reason, "kernel (16 CTAs): pages [8192] bytes");
        assert!(r.choices[0].reason.ends_with(", launched by the core"));
        // The threshold is exclusive: a page of exactly `below` bytes is DMA's.
        let r = p.run(&ask(Path::Auto, true), d, &[below]).unwrap();
        assert_eq!(kinds(&r), [Candidate::Dma]);
        assert_eq!(
            r.choices[0].reason,
            format!("dma: every page is >= {below} bytes")
        );
    }
}

#[test]
fn mixed_pages_go_hybrid_and_the_kernel_is_sized_for_the_small_ones() {
    let p = Probe::new();
    let r = p
        .run(&ask(Path::Auto, true), H2D, &[1 << 20, 8 * KIB, 64 * KIB])
        .unwrap();
    assert_eq!(
        r.choices[0].candidate,
        Candidate::Kernel {
            below: KERNEL_BELOW_H2D,
            load: Some(KernelNeed {
                max_size: 64 * KIB,
                ctas: 16,
                staged: false
            })
        }
    );
    assert!(r.choices[1]
        .reason
        .starts_with(&format!("hybrid: pages < {KERNEL_BELOW_H2D} bytes")));
    // The caller's threshold replaces the default.
    let mut a = ask(Path::Auto, true);
    a.kernel_below = Some(4 * KIB);
    let r = p.run(&a, H2D, &[8 * KIB]).unwrap();
    assert_eq!(kinds(&r), [Candidate::Dma]);
}

#[test]
fn the_kernel_path_takes_every_page_or_is_refused_where_it_cannot_run() {
    let mut p = Probe::new();
    let r = p.run(&ask(Path::Kernel, false), H2D, &[1 << 20]).unwrap();
    assert_eq!(
        kinds(&r),
        [Candidate::Kernel {
            below: KERNEL_EVERY_PAGE,
            load: None
        }]
    );
    p.unavailable = Some("no driver".into());
    p.asked.set([0; 4]);
    assert_eq!(
        p.run(&ask(Path::Kernel, true), H2D, &[4 * KIB]),
        Err(Refusal::Unavailable("no driver".into()))
    );
    p.asked.set([0; 4]);
    let r = p.run(&ask(Path::Auto, true), H2D, &[4 * KIB]).unwrap();
    assert_eq!(kinds(&r), [Candidate::Dma]);
    assert_eq!(r.choices[0].reason, "dma: no driver");
}

#[test]
fn an_insisted_plan_is_the_only_candidate_or_a_refusal_that_says_why() {
    let mut p = Probe::new();
    let Err(Refusal::Refused(why)) = p.run(&ask(Path::Blocks, true), D2H, &[4 * KIB]) else {
        panic!("blocks without a block plan")
    };
    assert!(why.starts_with("path='blocks' needs") && why.ends_with("pages not at one pitch"));
    let Err(Refusal::Refused(why)) = p.run(&ask(Path::Staged, true), D2H, &[4 * KIB]) else {
        panic!("staged without a block-major cache")
    };
    assert_eq!(why, "path='staged' is not possible here: not block-major");
    p.block = Ok("one copy per block".into());
    p.staged = Ok((64 * KIB, STAGE_BYTES));
    p.asked.set([0; 4]);
    let r = p.run(&ask(Path::Blocks, true), D2H, &[4 * KIB]).unwrap();
    assert_eq!(kinds(&r), [Candidate::Blocks]);
    assert_eq!(r.choices[0].reason, "one copy per block");
    let r = p
        .run(&ask(Path::Staged, true), D2H, &[4 * KIB, 8 * KIB])
        .unwrap();
    assert_eq!(
        kinds(&r),
        [Candidate::Staged {
            load: Some(KernelNeed {
                max_size: 8 * KIB,
                ctas: STAGED_CTAS,
                staged: true
            })
        }]
    );
    assert!(r.choices[0].reason.starts_with(&format!(
        "staged: a copy per block row (up to {} B) through a ring of 2 x {STAGE_BYTES} B",
        64 * KIB
    )));
    p.asked.set([0; 4]);
    let r = p.run(&ask(Path::Staged, false), D2H, &[4 * KIB]).unwrap();
    assert_eq!(kinds(&r), [Candidate::Staged { load: None }]);
    assert!(r.choices[0].reason.ends_with(HOST_ROUTE));
}

#[test]
fn a_block_major_cache_ranks_blocks_then_staged_then_pages() {
    let mut p = Probe::new();
    let mut a = ask(Path::Auto, true);
    a.block_major = true;
    p.block = Ok("one copy per block".into());
    p.staged = Ok((4 * KIB, STAGE_BYTES));
    let r = p.run(&a, H2D, &[4 * KIB]).unwrap();
    assert_eq!(r.choices[0].candidate, Candidate::Blocks);
    assert_eq!(
        p.asked.get()[1],
        0,
        "the staged rule is not read behind a block route"
    );
    assert_eq!(r.choices.len(), 3, "then the core's kernel and a launcher");
    p.block = Err("pages not at one pitch".into());
    p.asked.set([0; 4]);
    let r = p.run(&a, H2D, &[4 * KIB]).unwrap();
    assert!(matches!(r.choices[0].candidate, Candidate::Staged { .. }));
    assert_eq!(r.declined, ["no block route: pages not at one pitch"]);
    p.staged = Err("rows larger than a slot".into());
    p.asked.set([0; 4]);
    let r = p.run(&a, H2D, &[4 * KIB]).unwrap();
    assert!(matches!(r.choices[0].candidate, Candidate::Kernel { .. }));
    assert_eq!(r.declined.len(), 3, "{:?}", r.declined);
    assert_eq!(r.declined[2], "no direct route: not in cells");
    // Not block-major: neither plan's rule is read.
    a.block_major = false;
    p.asked.set([0; 4]);
    p.run(&a, H2D, &[4 * KIB]).unwrap();
    assert_eq!(&p.asked.get()[..2], [0, 0]);
}

#[test]
fn pages_in_cells_all_for_the_kernel_take_the_direct_plan_first() {
    let mut p = Probe::new();
    p.direct = Ok(80 * KIB);
    let a = ask(Path::Auto, true);
    for d in [H2D, D2H] {
        p.asked.set([0; 4]);
        let r = p.run(&a, d, &[512, 1024]).unwrap();
        let need = KernelNeed {
            max_size: 1024,
            ctas: 16,
            staged: true,
        };
        assert_eq!(r.choices[0].candidate, Candidate::Direct { load: need });
        assert!(
            r.choices[0]
                .reason
                .starts_with("direct: pages moved in place"),
            "{}",
            r.choices[0].reason
        );
        // Then the page route's kernel, loaded by the core, and a launcher: what runs where the
        // staged kernel does not load.
        assert!(matches!(
            kinds(&r)[1..],
            [
                Candidate::Kernel { load: Some(_), .. },
                Candidate::Kernel { load: None, .. }
            ]
        ));
        // `path="kernel"` keeps the page route it names.
        p.asked.set([0; 4]);
        let r = p.run(&ask(Path::Kernel, true), d, &[512]).unwrap();
        assert!(matches!(r.choices[0].candidate, Candidate::Kernel { .. }));
        assert_eq!(p.asked.get()[3], 0);
    }
    // Not where some pages go to DMA (hybrid), nor on the host backend, nor where the rule
    // refuses (its reason among the declined).
    p.asked.set([0; 4]);
    let r = p.run(&a, H2D, &[4 * KIB, 1 << 20]).unwrap();
    assert!(!kinds(&r)
        .iter()
        .any(|c| matches!(c, Candidate::Direct { .. })));
    assert_eq!(
        p.asked.get()[3],
        0,
        "the direct rule is not read for hybrid pages"
    );
    let r = p.run(&ask(Path::Auto, false), H2D, &[4 * KIB]).unwrap();
    assert_eq!(kinds(&r), [Candidate::Dma]);
    p.direct = Err("not in cells".into());
    p.asked.set([0; 4]);
    let r = p.run(&a, H2D, &[4 * KIB]).unwrap();
    assert!(matches!(r.choices[0].candidate, Candidate::Kernel { .. }));
    assert_eq!(r.declined, ["no direct route: not in cells"]);
}

#[test]
fn only_the_two_host_gpu_directions_have_routes() {
    let p = Probe::new();
    let Err(Refusal::Refused(why)) = p.run(&ask(Path::Auto, true), Direction::HostToHost, &[1])
    else {
        panic!("h2h has no route")
    };
    assert_eq!(why, "direction must be 'h2d' or 'd2h', not \"h2h\"");
}

#[test]
fn a_slot_holds_a_row_up_to_the_automatic_limit() {
    assert_eq!(stage_slot(4 * KIB), STAGE_BYTES);
    assert_eq!(stage_slot(STAGE_BYTES + 1), STAGE_BYTES + 1);
    assert_eq!(stage_slot(STAGE_MAX_AUTO), STAGE_MAX_AUTO);
    assert_eq!(stage_slot(STAGE_MAX_AUTO + 1), STAGE_BYTES);
    for p in Path::ALL {
        assert_eq!(Path::parse(p.as_str()), Some(p));
    }
    assert_eq!(Path::parse("pitched"), None);
}
