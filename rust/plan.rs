//! How a transfer moves: one of three routes, the same enum at every layer.
//!
//! - [`Plan::Pages`]: a `(src, dst, size)` descriptor per page (merged where pages continue each
//!   other), by the copy engines, or the small ones by a copy kernel;
//! - [`Plan::Runs`]: each block as the 2-D copies of its table pair's block plan
//!   ([`crate::table::block_runs`]), copy engines only;
//! - [`Plan::Staged`]: each block's host row across `PCIe` as one copy through a device staging
//!   ring, its pages moved inside the GPU by a kernel (`table/staged.rs`); or, direct, the same
//!   kernel on the host pages in place, no row and no ring
//!   ([`crate::table::StagedRequest::direct`]).
//!
//! Each layer carries what it knows of the route in the variants' fields, and names its own form
//! with an alias: the caller's choice ([`crate::engine::Route`]: which kernel, below which page
//! size), the slab's expansion ([`crate::table::Expansion`]: coalescing, the block plans, the
//! staged rows), the backend's request ([`crate::backend::Issue`]: the kernel's batch, the
//! staged steps' numbers) and each backend's queued job. A route is matched in one place per
//! layer, and a new route is a new variant the compiler walks every layer through.

pub mod choice;

/// One route of a transfer, with the pages' (`P`), the block plan's (`R`) and the staged plan's
/// (`S`) data at one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan<P, R, S> {
    /// A descriptor per page.
    Pages(P),
    /// The 2-D copies of each table pair's block plan.
    Runs(R),
    /// A copy per host row through a device staging ring.
    Staged(S),
}

impl<P, R, S> Plan<P, R, S> {
    /// The route's name, as the Python layer and the logs give it: `pages`, `blocks`, `staged`.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Plan::Pages(_) => "pages",
            Plan::Runs(_) => "blocks",
            Plan::Staged(_) => "staged",
        }
    }

    /// The same route with each variant's data mapped: how one layer's plan becomes the next's.
    pub fn map<P2, R2, S2>(
        self,
        pages: impl FnOnce(P) -> P2,
        runs: impl FnOnce(R) -> R2,
        staged: impl FnOnce(S) -> S2,
    ) -> Plan<P2, R2, S2> {
        match self {
            Plan::Pages(p) => Plan::Pages(pages(p)),
            Plan::Runs(r) => Plan::Runs(runs(r)),
            Plan::Staged(s) => Plan::Staged(staged(s)),
        }
    }

    /// The page route's data, if it is the page route.
    pub fn pages(&self) -> Option<&P> {
        match self {
            Plan::Pages(p) => Some(p),
            _ => None,
        }
    }

    /// The staged plan's data, if it is the staged plan.
    pub fn staged(&self) -> Option<&S> {
        match self {
            Plan::Staged(s) => Some(s),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Plan;

    #[test]
    fn a_route_keeps_its_variant_through_a_map() {
        let routes: [Plan<u8, (), bool>; 3] = [Plan::Pages(3), Plan::Runs(()), Plan::Staged(true)];
        let mapped: Vec<Plan<u16, u8, String>> = routes
            .iter()
            .map(|r| r.map(|p| u16::from(p) * 2, |()| 7, |s| s.to_string()))
            .collect();
        assert_eq!(
            mapped,
            [
                Plan::Pages(6),
                Plan::Runs(7),
                Plan::Staged("true".to_string())
            ]
        );
        let names: Vec<_> = routes.iter().map(Plan::name).collect();
        assert_eq!(names, ["pages", "blocks", "staged"]);
        assert_eq!(routes[0].pages(), Some(&3));
        assert_eq!(routes[1].pages(), None);
        assert_eq!(routes[2].staged(), Some(&true));
        assert_eq!(routes[0].staged(), None);
    }
}
