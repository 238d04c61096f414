//! Which pages a shared-memory file gets: the `huge=` policy of the tmpfs that holds it.
//!
//! vLLM's CPU tier lives in files in /dev/shm. A tmpfs mounted `huge=never` (the default)
//! gives them 4 KiB pages; `huge=within_size` or `huge=always` gives them 2 MiB pages however
//! they are allocated; `huge=advise` gives 2 MiB pages only to faults through a mapping advised
//! `MADV_HUGEPAGE`, and 4 KiB pages to `fallocate`, which has no mapping. On the H200 machine 8
//! GiB of /dev/shm filled from 16 threads and page-locked at 3.4-3.8 GiB/s in 4 KiB pages and
//! at 9.6-11.7 GiB/s in 2 MiB pages; eight ranks filled their cells of 48 GiB in 0.86-1.21 s
//! against 2.15 s (docs/benchmarks.md, "vLLM's region in huge pages"). The fill
//! ([`super::fill_and_pin`]) reads the policy to leave a `huge=advise` file's pages to the
//! faults.

/// A tmpfs mount's `huge=` policy, as `/sys/kernel/mm/transparent_hugepage/shmem_enabled` may
/// override it (`deny`, `force`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShmemHuge {
    /// 4 KiB pages (`huge=never`, no `huge=` option, or `shmem_enabled` `deny`).
    Never,
    /// 2 MiB pages wherever they fit (`huge=always`, or `shmem_enabled` `force`).
    Always,
    /// 2 MiB pages wherever the file's size covers them (`huge=within_size`).
    WithinSize,
    /// 2 MiB pages for faults through mappings advised `MADV_HUGEPAGE` only (`huge=advise`).
    Advise,
}

impl ShmemHuge {
    /// The mount option's word.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ShmemHuge::Never => "never",
            ShmemHuge::Always => "always",
            ShmemHuge::WithinSize => "within_size",
            ShmemHuge::Advise => "advise",
        }
    }
}

/// The `huge=` policy that applies to the open file `fd`; `None` where the file is not on a
/// tmpfs or the mount table cannot be read.
#[must_use]
pub fn shmem_huge(fd: i32) -> Option<ShmemHuge> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a `stat` into the buffer given, and nothing else of this process.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: fstat returned 0: it wrote the whole `stat`.
    let dev = unsafe { st.assume_init() }.st_dev;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = mount_huge(&mounts, libc::major(dev), libc::minor(dev))?;
    let global = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok();
    Some(global.as_deref().and_then(overridden).unwrap_or(mount))
}

/// The `huge=` option of the tmpfs with device `major:minor` in `mountinfo` (the format of
/// `/proc/self/mountinfo`: the device is the third field; the file system type, source and
/// its own options follow the `-` separator); `None` where no tmpfs has that device.
fn mount_huge(mountinfo: &str, major: u32, minor: u32) -> Option<ShmemHuge> {
    let device = format!("{major}:{minor}");
    mountinfo.lines().find_map(|line| {
        let mut fields = line.split(' ');
        if fields.nth(2) != Some(device.as_str()) {
            return None;
        }
        let mut after = fields.skip_while(|&f| f != "-").skip(1);
        if after.next() != Some("tmpfs") {
            return None;
        }
        let options = after.nth(1).unwrap_or("");
        Some(
            match options.split(',').find_map(|o| o.strip_prefix("huge=")) {
                Some("always") => ShmemHuge::Always,
                Some("within_size") => ShmemHuge::WithinSize,
                Some("advise") => ShmemHuge::Advise,
                _ => ShmemHuge::Never,
            },
        )
    })
}

/// What `shmem_enabled` (the word in brackets) imposes on every tmpfs mount, if anything.
fn overridden(shmem_enabled: &str) -> Option<ShmemHuge> {
    if shmem_enabled.contains("[deny]") {
        Some(ShmemHuge::Never)
    } else if shmem_enabled.contains("[force]") {
        Some(ShmemHuge::Always)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
25 22 0:23 / /dev rw,nosuid - devtmpfs devtmpfs rw,size=65973932k,mode=755
26 25 0:24 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,size=131961788k
27 22 0:25 / /mnt/a rw,relatime - tmpfs none rw,size=9437184k,huge=advise
28 22 0:26 / /mnt/b rw,relatime - tmpfs none rw,huge=within_size,size=9437184k
29 22 0:27 / /mnt/c rw,relatime master:7 - tmpfs none rw,size=4k,huge=always
30 22 0:25 /sub /mnt/bind rw,relatime - tmpfs none rw,size=9437184k,huge=advise
";

    #[test]
    fn a_mounts_huge_option_is_read_by_its_device() {
        assert_eq!(mount_huge(MOUNTINFO, 0, 24), Some(ShmemHuge::Never));
        assert_eq!(mount_huge(MOUNTINFO, 0, 25), Some(ShmemHuge::Advise));
        assert_eq!(mount_huge(MOUNTINFO, 0, 26), Some(ShmemHuge::WithinSize));
        assert_eq!(mount_huge(MOUNTINFO, 0, 27), Some(ShmemHuge::Always));
        // Not a tmpfs; no such device.
        assert_eq!(mount_huge(MOUNTINFO, 0, 21), None);
        assert_eq!(mount_huge(MOUNTINFO, 0, 23), None);
        assert_eq!(mount_huge(MOUNTINFO, 8, 1), None);
        assert_eq!(mount_huge("", 0, 24), None);
        assert_eq!(mount_huge("garbage", 0, 24), None);
    }

    #[test]
    fn deny_and_force_override_every_mount() {
        let word = |w: &str| {
            let all = ["always", "within_size", "advise", "never", "deny", "force"];
            all.map(|a| {
                if a == w {
                    format!("[{a}]")
                } else {
                    a.to_string()
                }
            })
            .join(" ")
        };
        assert_eq!(overridden(&word("deny")), Some(ShmemHuge::Never));
        assert_eq!(overridden(&word("force")), Some(ShmemHuge::Always));
        for w in ["always", "within_size", "advise", "never"] {
            assert_eq!(overridden(&word(w)), None, "{w}");
        }
    }

    #[test]
    fn a_memfd_or_a_pipe_is_on_no_mount_of_a_tmpfs() {
        // SAFETY: plain system calls on descriptors this test owns.
        unsafe {
            let fd = libc::memfd_create(c"blockswap-huge".as_ptr(), 0);
            assert!(fd >= 0);
            // memfds live on the kernel's internal tmpfs, which is in no mount table.
            assert_eq!(shmem_huge(fd), None);
            libc::close(fd);
            let mut p = [0; 2];
            assert_eq!(libc::pipe(p.as_mut_ptr()), 0);
            assert_eq!(shmem_huge(p[0]), None);
            libc::close(p[0]);
            libc::close(p[1]);
            assert_eq!(shmem_huge(-1), None);
        }
    }

    #[test]
    fn a_file_in_dev_shm_reads_the_policy_of_its_mount() {
        let Ok(f) = std::fs::File::create("/dev/shm/blockswap-huge-test") else {
            return; // no /dev/shm on this host: nothing to read
        };
        let _ = std::fs::remove_file("/dev/shm/blockswap-huge-test");
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let on_tmpfs = mounts
            .lines()
            .any(|l| l.split(' ').nth(4) == Some("/dev/shm") && l.contains(" - tmpfs "));
        let got = shmem_huge(std::os::fd::AsRawFd::as_raw_fd(&f));
        assert_eq!(got.is_some(), on_tmpfs, "{got:?}");
    }
}
