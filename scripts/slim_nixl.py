"""Cut the NIXL CUDA wheel down to what `--kv-transport nixl` loads: the UCX backend, for a GPU
machine that has no package index and little room to carry files (the wheel is ~59 MB).

Kept: the Python package (`nixl_cu13`, and the `nixl` meta package that picks it), the UCX
backend plugin, the UCX transport modules named by --ucx-modules, and every shared library
those reach through ELF NEEDED entries (found with `readelf -d`, searched along each file's
RPATH/RUNPATH as the loader does; what is not in the wheel is the system's or CUDA's).
libnixl itself links gRPC and etcd (its etcd metadata exchange, unused here), so they stay.
Dropped: the other backend plugins (GDS, POSIX, OBJ/S3, Azure, GPUNETIO, LIBFABRIC, GUSLI,
INFINIA) with the libraries only they need (AWS, Azure, curl, xml2, aio, uring...), the
telemetry exporters and tracing plugin, `nixl_ep` (expert-parallel kernels for three torch
versions, ~95 MB unpacked), the UCX perftests, the second auditwheel copy of the plugins, and
the tools under nixl_cu13.scripts. ELF files are then `strip --strip-unneeded` (local symbols
and debug sections only; the dynamic symbol table the loader uses is kept) and the tree is
written as one .tar.xz laid out like site-packages.

  python scripts/slim_nixl.py --wheel nixl_cu13-1.5.1-...whl --meta-wheel nixl-1.5.1-...whl \
      --out .nixlslim/nixl_slim.tar.xz
  python -c "import tarfile; tarfile.open('.nixlslim/nixl_slim.tar.xz').extractall('/tmp/site')"
  PYTHONPATH=/tmp/site python -c "import nixl"

UCX modules (nixl_cu13.libs/ucx/libuct_<name>.so, libucm_<name>.so): `cuda` (cuda_copy,
cuda_ipc: GPU memory, and GPU to GPU within a node), `cma` (shared memory between processes
of one node); `ib`, `ib_mlx5` (RDMA across nodes) bring libibverbs/libmlx5/libnl (~10 MB).
tcp, sysv/posix shared memory and self are inside libuct itself.
"""
from __future__ import annotations

import argparse
import io
import lzma
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

KEEP_PLUGINS = ("UCX",)
PY_PACKAGES = ("nixl_cu13/", "nixl/", "nixl_meta_utils.py")


def elf_deps(path: Path) -> tuple[list[str], list[Path]]:
    """(NEEDED sonames, RPATH/RUNPATH directories with $ORIGIN resolved) of one ELF file."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    needed, dirs = [], []
    for line in out.splitlines():
        value = line.split("[", 1)[-1].rstrip("]")
        if "(NEEDED)" in line:
            needed.append(value)
        elif "(RPATH)" in line or "(RUNPATH)" in line:
            dirs += [Path(d.replace("$ORIGIN", str(path.parent))) for d in value.split(":") if d]
    return needed, dirs


def closure(root: Path, seeds: list[Path]) -> set[Path]:
    """Every file under root that the seeds reach through NEEDED (files outside root are the system's)."""
    seen: set[Path] = set()
    stack = [p.resolve() for p in seeds]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen.add(path)
        needed, dirs = elf_deps(path)
        for soname in needed:
            for d in dirs + [path.parent]:
                hit = (d / soname).resolve()
                if hit.is_file() and hit.is_relative_to(root):
                    stack.append(hit)
                    break
    return seen


def slim(wheel: Path, meta_wheel: Path | None, out: Path, ucx_modules: list[str]) -> list[str]:
    """Write out (.tar.xz, site-packages layout); return the kept file names, largest first."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp).resolve()
        zipfile.ZipFile(wheel).extractall(root)
        if meta_wheel is not None:
            zipfile.ZipFile(meta_wheel).extractall(root)
        pkg = next(root.glob("nixl_cu*/_bindings*.so")).parent
        meson = root / f".{pkg.name}.mesonpy.libs"  # libnixl and the plugin dir it scans (next to itself)
        ucx_dir = root / f"{pkg.name}.libs" / "ucx"  # libucs loads UCX modules from <its dir>/ucx
        seeds = sorted(pkg.glob("*.so")) + [meson / "plugins" / f"libplugin_{p}.so" for p in KEEP_PLUGINS]
        for name in ucx_modules:
            found = sorted(ucx_dir.glob(f"libuc[tm]_{name}.so*"))
            if not found:
                raise SystemExit(f"no UCX module {name!r} in {ucx_dir}")
            seeds += found
        keep = closure(root, seeds)
        keep |= {p.resolve() for p in root.rglob("*") if p.is_file() and p.suffix != ".so"
                 and str(p.relative_to(root)).startswith(PY_PACKAGES)}
        keep |= {p.resolve() for p in root.glob("*.dist-info/*") if p.name in ("METADATA", "WHEEL", "top_level.txt")}
        keep |= {p.resolve() for p in root.glob("*.dist-info/licenses/**/*") if p.is_file()}
        keep = {p for p in keep if "__pycache__" not in p.parts}
        for path in keep:
            if path.read_bytes()[:4] == b"\x7fELF":
                subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path in sorted(keep):
                tar.add(path, arcname=str(path.relative_to(root)))
        out.write_bytes(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))
        return [f"{p.stat().st_size:>10} {p.relative_to(root)}" for p in sorted(keep, key=lambda p: -p.stat().st_size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, required=True, help="the nixl_cu12/nixl_cu13 wheel")
    ap.add_argument("--meta-wheel", type=Path, help="the `nixl` meta wheel (the `import nixl` package); optional")
    ap.add_argument("--out", type=Path, required=True, help="the .tar.xz to write (site-packages layout)")
    ap.add_argument("--ucx-modules", nargs="+", default=["cuda", "cma"],
                    help="UCX transport modules to keep (cuda = cuda_copy + cuda_ipc; ib ib_mlx5 for RDMA)")
    ap.add_argument("--list", action="store_true", help="print the kept files")
    args = ap.parse_args()
    if shutil.which("readelf") is None or shutil.which("strip") is None:
        raise SystemExit("needs binutils (readelf, strip)")
    kept = slim(args.wheel, args.meta_wheel, args.out, args.ucx_modules)
    if args.list:
        print("\n".join(kept))
    total = sum(int(k.split()[0]) for k in kept)
    print(f"{args.out}: {os.path.getsize(args.out) / 1e6:.1f} MB (.tar.xz; {len(kept)} files, "
          f"{total / 1e6:.1f} MB unpacked) from {args.wheel.name} ({args.wheel.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
