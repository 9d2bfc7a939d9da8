"""Build stock (unpatched) llama.cpp, the library a user of plain llama-cpp-python runs, for
benchmarks/time_to_answer.py; or, with --server, its `llama-server` for benchmarks/llama_server.py.

    python benchmarks/build_stock_llama.py [--dest DIR] [--jobs N]
    nice -n 19 python benchmarks/build_stock_llama.py --server --jobs 2

The same llama.cpp commit kvcli builds (the vendored tree of the pinned llama-cpp-python sdist,
fetched and extracted by kvcli.native.build into $KVCLI_CACHE), the same flags (GGML_NATIVE=ON,
Release, shared), none of native/patches and none of native/src. The libraries go to DEST
(default $KVCLI_CACHE/stock-lib); `LLAMA_CPP_LIB_PATH=DEST` makes llama-cpp-python load them.
--server builds the llama-server tool of the same unpatched tree (CPU, static, without the web UI, with kvcli's own
no-AMX flags) into $KVCLI_CACHE/build/server-<commit>/bin/llama-server, once: a second call reuses it. It is a
benchmark's tool, not part of the set-up or CI (it compiles llama.cpp's common library and server: several minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

from kvcli.native.build import cache_dir, extract_llama_cpp, fetch_sdist, log, no_amx_flags


def build_stock(dest: Path | None = None, jobs: int | None = None) -> Path:
    pristine, commit = extract_llama_cpp(fetch_sdist())
    dest = dest or cache_dir() / "stock-lib"
    build_dir = cache_dir() / "build" / f"stock-{commit[:12]}"
    flags = {"GGML_NATIVE": "ON", "CMAKE_BUILD_TYPE": "Release", "BUILD_SHARED_LIBS": "ON",
             "LLAMA_BUILD_COMMON": "OFF", "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_TOOLS": "OFF",
             "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_SERVER": "OFF", "LLAMA_CURL": "OFF",
             "CMAKE_BUILD_RPATH": "$ORIGIN", "CMAKE_INSTALL_RPATH": "$ORIGIN"}
    log(f"building stock llama.cpp {commit[:9]} (no kvcli patches) in {build_dir}")
    subprocess.run(["cmake", "-S", str(pristine), "-B", str(build_dir),
                    *[f"-D{k}={v}" for k, v in flags.items()]], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama", "-j", str(jobs or os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL)
    bin_dir = build_dir / "bin"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for p in bin_dir.iterdir():
        if p.name.startswith(("libllama.so", "libggml")) and ".so" in p.name:
            if p.is_symlink():
                os.symlink(os.readlink(p), dest / p.name)
            else:
                shutil.copy2(p, dest / p.name)
    if not (dest / "libllama.so").exists():
        raise SystemExit(f"the stock build produced no libllama.so in {bin_dir}")
    (dest / "build_info.json").write_text(json.dumps({"commit": commit, "flags": "GGML_NATIVE=ON (stock, unpatched)"}))
    log(f"stock llama.cpp libraries in {dest}")
    return dest


def build_server(jobs: int | None = None) -> Path:
    """llama-server from the unpatched tree (none of native/patches: the server a llama.cpp user runs)."""
    pristine, commit = extract_llama_cpp(fetch_sdist())
    build_dir = cache_dir() / "build" / f"server-{commit[:12]}"
    binary = build_dir / "bin" / "llama-server"
    done = build_dir / ".kvcli-built"
    if done.exists() and binary.exists():
        return binary
    # the flags kvcli's library is built with (native, Release, no AMX); the web UI would be downloaded
    # from Hugging Face at build time, so it is left out (the API does not need it)
    flags = {"GGML_NATIVE": "ON", "CMAKE_BUILD_TYPE": "Release", "BUILD_SHARED_LIBS": "OFF",
             "LLAMA_BUILD_COMMON": "ON", "LLAMA_BUILD_TOOLS": "ON", "LLAMA_BUILD_SERVER": "ON",
             "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_APP": "OFF",
             "LLAMA_BUILD_UI": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF", "LLAMA_OPENSSL": "OFF", **no_amx_flags()}
    log(f"building llama-server of stock llama.cpp {commit[:9]} (no kvcli patches) in {build_dir}")
    subprocess.run(["cmake", "-S", str(pristine), "-B", str(build_dir),
                    *[f"-D{k}={v}" for k, v in flags.items()]], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server",
                    "-j", str(jobs or os.cpu_count() or 2)], check=True, stdout=subprocess.DEVNULL)
    if not binary.exists():
        raise SystemExit(f"the build produced no llama-server in {build_dir / 'bin'}")
    done.write_text(commit)
    return binary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, help="where to put the libraries (default $KVCLI_CACHE/stock-lib)")
    ap.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    ap.add_argument("--server", action="store_true", help="build llama-server instead of the library")
    a = ap.parse_args()
    print(build_server(a.jobs) if a.server else build_stock(a.dest, a.jobs))


if __name__ == "__main__":
    main()
