# Page-locking a shared region: the whole of it (what every rank does now) against one rank's
# cells only (vLLM's way where a row saves >= 3 MiB), one cudaHostRegister per row.
import mmap, os, sys, time, ctypes
import torch

torch.cuda.init()
rt = torch.cuda.cudart()
GiB = 1 << 30
total = int(sys.argv[1]) * GiB
world = 8
for cell in (2 << 20, 8 << 20):
    row = cell * world
    rows = total // row
    path = "/dev/shm/pin_probe"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, rows * row)
    m = mmap.mmap(fd, rows * row, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    os.close(fd); os.unlink(path)
    keep = ctypes.c_char.from_buffer(m)
    base = ctypes.addressof(keep)
    # whole region, in 16 GiB pieces
    t0 = time.perf_counter()
    piece = 16 * GiB // row * row
    starts = list(range(0, rows * row, piece))
    for s in starts:
        n = min(piece, rows * row - s)
        assert int(rt.cudaHostRegister(base + s, n, 0)) == 0
    whole = time.perf_counter() - t0
    for s in starts:
        assert int(rt.cudaHostUnregister(base + s)) == 0
    # rank 3's cells only
    t0 = time.perf_counter()
    for r in range(rows):
        assert int(rt.cudaHostRegister(base + r * row + 3 * cell, cell, 0)) == 0
    cells = time.perf_counter() - t0
    for r in range(rows):
        assert int(rt.cudaHostUnregister(base + r * row + 3 * cell)) == 0
    print(f"region {rows*row/GiB:.1f} GiB, cell {cell>>20} MiB x {world}, {rows} rows: "
          f"whole {whole:.2f} s ({rows*row/GiB/whole:.1f} GiB/s of region), "
          f"own cells {cells:.2f} s ({rows} registrations, {rows*cell/GiB/cells:.1f} GiB/s of cells)", flush=True)
    del keep
    m.close()
