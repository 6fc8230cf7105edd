"""onnxruntime-gpu for a lent GPU machine that can be sent 64 MiB a call: its 255 MB wheel as two
parts of under 64 MiB, one a call, joined there into an importable package.

    python bench/ort_parts.py split WHEEL OUT [--keep-sm 90]   (here: OUT/a and OUT/b)
    python bench/ort_parts.py join A B SITE                    (there: A kept from the first call)

The CUDA provider library is most of the wheel: a cubin for each GPU architecture
(sm_75/80/86/89/90/120) in its `.nv_fatbin` section, no PTX. `split` zeroes every cubin but the
kept architecture's (H100 and H200 are sm_90), which xz then squeezes to almost nothing: 284 MB to
52 MB. Part a is that library; part b is the core library, the Python binding and the rest of
the package. `join` unpacks both into SITE/onnxruntime; put SITE on PYTHONPATH, and the CUDA
libraries torch's wheel brings (nvidia/*/lib) on LD_LIBRARY_PATH (dev notes: .whl/dev2.sh).
"""

from __future__ import annotations

import argparse
import io
import lzma
import shutil
import struct
import tarfile
import zipfile
from pathlib import Path

CAPI = "onnxruntime/capi/"
PROVIDER = "libonnxruntime_providers_cuda.so"
FATBIN_MAGIC = 0xBA55ED50


def section(elf: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of the ELF64 section `name`."""
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * entsize) for i in range(count)]
    strings = headers[names][4]
    for name_at, _, _, _, offset, size in headers:
        if elf[strings + name_at : elf.index(b"\0", strings + name_at)].decode() == name:
            return offset, size
    raise SystemExit(f"no {name} section: not a CUDA library")


def keep_one_architecture(elf: bytearray, sm: int) -> dict[tuple[str, int], int]:
    """Zero, in place, every entry of every fatbin but `sm`'s cubins; returns bytes by (kind, sm).
    A fatbin: a 16-byte header (magic, version, header size, size), then entries, each a header
    (kind 1 PTX / 2 cubin at +0, its header size at +4, padded size at +8, sm at +28) and payload."""
    start, size = section(elf, ".nv_fatbin")
    seen: dict[tuple[str, int], int] = {}
    pos = start
    while pos < start + size:
        magic, _, header, length = struct.unpack_from("<IHHQ", elf, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fatbins are 8-byte aligned
            continue
        entry, end = pos + header, pos + header + length
        while entry < end:
            kind, _, entry_header, padded = struct.unpack_from("<HHII", elf, entry)
            (arch,) = struct.unpack_from("<I", elf, entry + 28)
            label = ("ptx" if kind == 1 else "cubin", arch)
            seen[label] = seen.get(label, 0) + padded
            if label != ("cubin", sm):
                elf[entry + entry_header : entry + entry_header + padded] = bytes(padded)
            entry += entry_header + padded
        pos = end
    return seen


def xz(data: bytes, path: Path) -> None:
    """`data` xz-compressed as `path`.xz."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_name(path.name + ".xz").write_bytes(lzma.compress(data, preset=6))


def split(wheel: Path, out: Path, sm: int) -> None:
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if n.startswith("onnxruntime/") and not n.endswith("/")]
        provider = bytearray(whl.read(CAPI + PROVIDER))
        for (kind, arch), size in sorted(keep_one_architecture(provider, sm).items()):
            print(f"{kind} sm_{arch}: {size / 1e6:.1f} MB{' (kept)' if (kind, arch) == ('cubin', sm) else ''}")
        xz(bytes(provider), out / "a" / PROVIDER)
        # TensorRT's provider needs TensorRT, which a torch image does not have
        rest = [n for n in names if not n.endswith((PROVIDER, "libonnxruntime_providers_tensorrt.so"))]
        packed = io.BytesIO()
        with tarfile.open(fileobj=packed, mode="w") as tar:
            for name in rest:
                data = whl.read(name)
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        xz(packed.getvalue(), out / "b" / "onnxruntime.tar")
    for part in ("a", "b"):
        size = sum(f.stat().st_size for f in (out / part).iterdir())
        print(f"{out / part}: {size / 2**20:.1f} MiB")


def join(a: Path, b: Path, site: Path) -> None:
    with lzma.open(b / "onnxruntime.tar.xz") as packed, tarfile.open(fileobj=packed) as tar:
        tar.extractall(site, filter="data")
    with lzma.open(a / f"{PROVIDER}.xz") as src, open(site / CAPI / PROVIDER, "wb") as dst:
        shutil.copyfileobj(src, dst)
    print(f"onnxruntime in {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("split", help="the wheel as two parts, OUT/a and OUT/b")
    cut.add_argument("wheel", type=Path)
    cut.add_argument("out", type=Path)
    cut.add_argument("--keep-sm", type=int, default=90, help="the GPU architecture kept (90: H100, H200)")
    glue = sub.add_parser("join", help="the two parts as SITE/onnxruntime")
    glue.add_argument("a", type=Path)
    glue.add_argument("b", type=Path)
    glue.add_argument("site", type=Path)
    args = parser.parse_args()
    if args.command == "split":
        split(args.wheel, args.out, args.keep_sm)
    else:
        join(args.a, args.b, args.site)


if __name__ == "__main__":
    main()
