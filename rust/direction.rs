//! The four directions a transfer moves bytes in, each an ordered lane of its own, and the kind of
//! memory each reads and writes.

use std::fmt;

use crate::region::MemoryKind;

/// Which way a transfer moves bytes; each direction is its own ordered lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Pinned host memory to device memory (onload).
    HostToDevice = 0,
    /// Device memory to pinned host memory (offload).
    DeviceToHost = 1,
    /// Host to host.
    HostToHost = 2,
    /// Device to device.
    DeviceToDevice = 3,
}

impl Direction {
    /// All directions, in lane order.
    pub const ALL: [Direction; 4] = [
        Direction::HostToDevice,
        Direction::DeviceToHost,
        Direction::HostToHost,
        Direction::DeviceToDevice,
    ];

    /// The lane index of this direction.
    #[must_use]
    pub fn lane(self) -> usize {
        self as usize
    }

    /// Whether this direction crosses between host and device memory (`h2d`, `d2h`): the only
    /// directions the staged plan moves.
    #[must_use]
    pub fn crosses(self) -> bool {
        self.src_kind() != self.dst_kind()
    }

    /// The kind of memory the sources must lie in.
    #[must_use]
    pub fn src_kind(self) -> MemoryKind {
        match self {
            Direction::HostToDevice | Direction::HostToHost => MemoryKind::Host,
            Direction::DeviceToHost | Direction::DeviceToDevice => MemoryKind::Device,
        }
    }

    /// The kind of memory the destinations must lie in.
    #[must_use]
    pub fn dst_kind(self) -> MemoryKind {
        match self {
            Direction::DeviceToHost | Direction::HostToHost => MemoryKind::Host,
            Direction::HostToDevice | Direction::DeviceToDevice => MemoryKind::Device,
        }
    }

    /// Short name: `h2d`, `d2h`, `h2h`, `d2d`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::HostToDevice => "h2d",
            Direction::DeviceToHost => "d2h",
            Direction::HostToHost => "h2h",
            Direction::DeviceToDevice => "d2d",
        }
    }

    /// Parses the short name (`h2d`, `d2h`, `h2h`, `d2d`).
    #[must_use]
    pub fn parse(s: &str) -> Option<Direction> {
        Direction::ALL.into_iter().find(|d| d.as_str() == s)
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::Direction;

    #[test]
    fn only_h2d_and_d2h_cross_between_host_and_device() {
        let crossing: Vec<_> = Direction::ALL.into_iter().filter(|d| d.crosses()).collect();
        assert_eq!(crossing, [Direction::HostToDevice, Direction::DeviceToHost]);
    }
}
