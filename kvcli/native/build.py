"""Build the patched llama.cpp library that the native engine loads.

    python -m kvcli.native.build [--cuda] [--sanitize] [--force] [--jobs N]

Steps (each cached under $KVCLI_CACHE, default ~/.cache/kvcli):
1. the llama-cpp-python 0.3.36 source distribution (pinned), fetched once with pip;
2. its vendored llama.cpp tree, extracted once per llama.cpp commit;
3. a copy with every patch in native/patches/ applied in order (a patch that does not apply
   stops the build with its name);
4. a CMake build of native/CMakeLists.txt (the `llama` target + ggml, shared, with our
   native/src/*.cpp compiled in; Ninja where it is on PATH), keyed by the commit, the patches, our sources, the
   flags and the generator,
   so a second install does not rebuild. CMake builds from a mirror of native/ kept in the cache,
   so that a checkout elsewhere on disk (a CI clone) reuses the same build folder.
The libraries are then copied into kvcli/native/lib/<variant>/ with a build_info.json.
`pip install .` runs the same build (setup.py's build_py step) into the wheel's kvcli/native/; every build copies
there (or into this checkout's kvcli/native/: `python -m kvcli.native.build`, and `pip install -e .`, which
./setup.sh runs) the sdist's Python bindings (its `llama_cpp` package: ctypes only, no compiled code) as
kvcli/native/_vendor/, which kvcli.native.load_llama_cpp imports: llama-cpp-python itself is not installed, so
llama.cpp is compiled once (ours), not twice.
CUDA (--cuda): nvcc from $CUDACXX, PATH or /usr/local/cuda; cuBLAS from the toolkit or from the
`nvidia-cublas` wheel (requirements-cuda.txt, which `KVCLI_CUDA=1 ./setup.sh` installs); without
a libcuda.so to link (no driver, no stub) ggml's VMM pool is switched off (GGML_CUDA_NO_VMM).
--cuda-arch (KVCLI_CUDA_ARCH) sets CMAKE_CUDA_ARCHITECTURES: "native" where a GPU is visible,
otherwise ggml's own portable list unless one is named (each architecture is a full kernel build).
Environment: KVCLI_CUDA=1 is the same as --cuda; KVCLI_CMAKE_ARGS adds CMake arguments;
KVCLI_CACHE moves the cache; KVCLI_LIB_DIR installs (and kvcli loads) the default variant elsewhere.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kvcli import __version__

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
REPO_NATIVE = Path(__file__).resolve().parents[2] / "native"
PACKAGE_DIR = Path(__file__).resolve().parent   # kvcli/native: lib/<variant>/ and _vendor/ go here
LIB_ROOT = PACKAGE_DIR / "lib"


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = Path(os.environ.get("KVCLI_CACHE", Path.home() / ".cache" / "kvcli"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def log(msg: str) -> None:
    print(f"[kvcli build] {msg}", file=sys.stderr, flush=True)


def fetch_sdist() -> Path:
    dest = cache_dir() / "sdist"
    path = dest / SDIST_NAME
    if path.exists():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} source distribution")
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
               "--no-build-isolation", "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]
        # --no-build-isolation: pip would otherwise build an isolated environment just to read metadata.
        # --no-binary names the one package: `:all:` reached that environment too, where pip then built
        # scikit-build-core, hatchling and the rest from their sdists (minutes on a fresh machine)
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / SDIST_NAME
        if not got.exists():
            # metadata preparation may need scikit-build-core; retry the plain way
            cmd.remove("--no-build-isolation")
            r = subprocess.run(cmd, capture_output=True, text=True)
        if not got.exists():
            raise BuildError(f"could not download {SDIST_NAME}: {r.stderr.strip()[-500:]}")
        os.replace(got, path)
    return path


def extract_llama_cpp(sdist: Path) -> tuple[Path, str]:
    """Extract vendor/llama.cpp once; return (tree, commit)."""
    root = cache_dir() / "src"
    pristine = root / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    stamp = pristine / ".kvcli-commit"
    if not stamp.exists():
        log("extracting vendor/llama.cpp from the source distribution")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
        tmp = Path(tempfile.mkdtemp(dir=root.parent if root.exists() else cache_dir()))
        head = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/.git/modules/vendor/llama.cpp/HEAD"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(tmp, members=members, filter="data")
            commit = tar.extractfile(head).read().decode().strip()
        if len(commit) != 40:
            raise BuildError("the source distribution does not name its llama.cpp commit")
        tree = tmp / prefix
        (tree / ".git").unlink(missing_ok=True)  # a submodule pointer into the sdist's .git: useless here
        root.mkdir(parents=True, exist_ok=True)
        if pristine.exists():
            shutil.rmtree(pristine)
        shutil.move(str(tree), pristine)
        shutil.rmtree(tmp, ignore_errors=True)
        stamp.write_text(commit)
    return pristine, stamp.read_text().strip()


def extract_bindings(sdist: Path) -> Path:
    """Extract the sdist's `llama_cpp` Python package (and its licence) once; return the folder holding both."""
    dest = cache_dir() / "src" / f"llama_cpp-bindings-{LLAMA_CPP_PYTHON_VERSION}"
    if (dest / ".kvcli-extracted").exists():
        return dest
    log("extracting the llama_cpp Python bindings from the source distribution")
    top = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
    tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(top + "llama_cpp/") or m.name == top + "LICENSE.md"]
            tar.extractall(tmp, members=members, filter="data")
        out = tmp / "out"
        out.mkdir()
        shutil.move(str(tmp / top / "llama_cpp"), out / "llama_cpp")
        shutil.move(str(tmp / top / "LICENSE.md"), out / "LICENSE-llama-cpp-python.md")
        (out / ".kvcli-extracted").write_text(LLAMA_CPP_PYTHON_VERSION)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(out, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def install_bindings(src: Path, package_dir: Path) -> Path:
    """Copy the bindings into package_dir/_vendor (replacing what was there); return that folder."""
    dest = package_dir / "_vendor"
    tmp = package_dir / "._vendor.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(".kvcli-extracted", "__pycache__"))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def patches() -> list[Path]:
    return sorted((REPO_NATIVE / "patches").glob("*.patch"))


def source_hash(extra: list[str]) -> str:
    h = hashlib.sha256()
    files = patches() + sorted((REPO_NATIVE / "src").rglob("*")) + sorted((REPO_NATIVE / "include").rglob("*"))
    files.append(REPO_NATIVE / "CMakeLists.txt")
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(REPO_NATIVE)).encode())
            h.update(f.read_bytes())
    for e in extra:
        h.update(e.encode())
    h.update(__version__.encode())
    return h.hexdigest()[:16]


def patched_tree(pristine: Path, commit: str) -> Path:
    h = hashlib.sha256(commit.encode())
    for p in patches():
        h.update(p.read_bytes())
    tree = cache_dir() / "src" / f"llama.cpp-{commit[:9]}-patched-{h.hexdigest()[:12]}"
    if (tree / ".kvcli-patched").exists():
        return tree
    log(f"applying {len(patches())} patch(es) from native/patches/")
    tmp = tree.with_name(tree.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(pristine, tmp, symlinks=True)
    for p in patches():
        r = subprocess.run(["git", "apply", "--whitespace=nowarn", str(p)], cwd=tmp, capture_output=True, text=True)
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BuildError(f"patch {p.name} does not apply to llama.cpp {commit[:9]}:\n{r.stderr.strip()}")
    (tmp / ".kvcli-patched").write_text("\n".join(p.name for p in patches()))
    if tree.exists():
        shutil.rmtree(tree)
    os.replace(tmp, tree)
    return tree


def mirror_sources(variant: str) -> Path:
    """Copy native/ (CMakeLists, include, src) into a fixed folder of the cache and return it.

    CMake records its source folder in the build folder and refuses another one, so a cached build
    could serve only the checkout that made it; building from this mirror lets every checkout of the
    project (a CI clone elsewhere on disk) reuse the cached build. Only changed files are rewritten,
    so make recompiles only what changed."""
    dest = cache_dir() / "native-src" / variant
    wanted = {REPO_NATIVE / "CMakeLists.txt"}
    for sub in ("include", "src"):
        wanted.update(f for f in (REPO_NATIVE / sub).rglob("*") if f.is_file())
    rel = {f.relative_to(REPO_NATIVE) for f in wanted}
    if dest.exists():
        for f in sorted(dest.rglob("*"), reverse=True):
            r = f.relative_to(dest)
            if f.is_file() and r not in rel:
                f.unlink()
            elif f.is_dir() and not any(f.iterdir()):
                f.rmdir()
    for r in sorted(rel):
        src, out = REPO_NATIVE / r, dest / r
        data = src.read_bytes()
        if out.is_file() and out.read_bytes() == data:
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, out)
    return dest


def find_nvcc() -> tuple[Path, Path]:
    """nvcc and the toolkit folder it belongs to (asked of nvcc: it may be a wrapper script)."""
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            nvcc = Path(cand).resolve()
            dry = subprocess.run([str(nvcc), "-dryrun", "-c", "x.cu"], capture_output=True, text=True)
            top = [ln.split("=", 1)[1] for ln in dry.stderr.splitlines() if ln.startswith("#$ TOP=")]
            return nvcc, (Path(top[0]).resolve() if top else nvcc.parent.parent)
    raise BuildError("--cuda needs nvcc (the CUDA toolkit): none on PATH, in $CUDACXX or /usr/local/cuda/bin")


def _wheel_cuda_dirs() -> list[Path]:
    """The nvidia/cu*/ folders that NVIDIA's pip wheels (nvidia-cublas, ...) install."""
    roots = [Path(p) for p in site.getsitepackages()] + [Path(site.getusersitepackages())]
    return sorted({d for r in roots for d in (r / "nvidia").glob("cu*") if d.is_dir()})


def cuda_cmake_args(arch: str | None) -> tuple[dict[str, str], list[str]]:
    """CMake flags for -DGGML_CUDA=ON on this machine: the compiler, where cuBLAS is, whether the
    driver library can be linked, the architectures. Returns (flags that key the build, rpaths)."""
    nvcc, toolkit = find_nvcc()
    real = toolkit / "bin" / "nvcc"
    flags = {"CMAKE_CUDA_COMPILER": str(real if real.is_file() else nvcc)}
    lib_dirs = [d for d in (toolkit / "lib64", toolkit / "lib") if d.is_dir()]
    rpaths = [str(lib_dirs[0])] if lib_dirs else []
    if not any(any(d.glob("libcublas.so*")) for d in lib_dirs):
        for wheel_dir in _wheel_cuda_dirs():
            libs = {n: sorted((wheel_dir / "lib").glob(f"lib{n}.so*")) for n in ("cublas", "cublasLt")}
            if all(libs.values()) and (wheel_dir / "include" / "cublas_v2.h").is_file():
                # FindCUDAToolkit looks only in the toolkit; the wheel ships libcublas.so.N alone
                flags["CUDA_cublas_LIBRARY"] = str(libs["cublas"][0])
                flags["CUDA_cublasLt_LIBRARY"] = str(libs["cublasLt"][0])
                flags["CMAKE_CUDA_FLAGS"] = f"-I{wheel_dir / 'include'}"
                flags["CMAKE_CXX_FLAGS"] = f"-I{wheel_dir / 'include'}"
                rpaths.append(str(wheel_dir / "lib"))
                log(f"cuBLAS from the nvidia-cublas wheel in {wheel_dir}")
                break
        else:
            raise BuildError(f"--cuda needs cuBLAS: none in {toolkit} and no nvidia-cublas wheel installed "
                             "(pip install -r requirements-cuda.txt)")
    stubs = [p for d in lib_dirs for p in (d / "stubs").glob("libcuda.so")]
    if not stubs and not any(any(Path(d).glob("libcuda.so*")) for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64",
                                                                       "/usr/local/nvidia/lib64")):
        log("no libcuda.so (driver or stub) to link: building with GGML_CUDA_NO_VMM=ON")
        flags["GGML_CUDA_NO_VMM"] = "ON"
    if not arch and shutil.which("nvidia-smi") and subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        arch = "native"
    if arch:
        flags["CMAKE_CUDA_ARCHITECTURES"] = arch
    return flags, rpaths


def no_amx_flags() -> dict[str, str]:
    """Compiler flags that keep ggml's AMX kernels out of a native x86 build. -march=native turns them on where the
    CPU lists AMX (Sapphire Rapids and later), and on such a VM here (kernel 6.18, Firecracker) the first prompt
    crashed in ggml_backend_amx_mul_mat (SIGSEGV, llama.cpp 0c1e57098): the guest lists AMX but its tile state
    is not usable. The AVX-512 kernels are used instead. GCC applies an explicit -mno-* whatever -march says."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {}
    off = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    probe = subprocess.run(["cc", *off.split(), "-x", "c", "-E", "-", "-o", os.devnull], input=b"",
                           capture_output=True)
    if probe.returncode != 0:   # a compiler too old to know AMX cannot emit it either
        return {}
    return {"CMAKE_C_FLAGS": off, "CMAKE_CXX_FLAGS": off}


def build(cuda: bool = False, sanitize: bool = False, force: bool = False, jobs: int | None = None,
          cuda_arch: str | None = None, extra_args: list[str] | None = None, package_dir: Path | None = None) -> Path:
    """Build (or reuse) the library; return the directory holding libllama.so.

    package_dir: the kvcli/native folder to install into (setup.py gives its build folder, for the wheel); by
    default this one (and $KVCLI_LIB_DIR for the default variant)."""
    variant = "sanitize" if sanitize else "default"
    flags = {
        "GGML_NATIVE": "ON",
        "GGML_CUDA": "ON" if cuda else "OFF",
        "KVCLI_SANITIZE": "ON" if sanitize else "OFF",
        "CMAKE_BUILD_TYPE": "RelWithDebInfo" if sanitize else "Release",
    }
    flags.update(no_amx_flags())
    rpath = "$ORIGIN"
    if cuda:
        cuda_flags, cuda_rpaths = cuda_cmake_args(cuda_arch)
        flags.update(cuda_flags)
        rpath = ";".join(["$ORIGIN", *cuda_rpaths])  # cudart / cuBLAS outside the system's loader path
    extra_args = [*(extra_args or []), *os.environ.get("KVCLI_CMAKE_ARGS", "").split()]
    sdist = fetch_sdist()
    pristine, commit = extract_llama_cpp(sdist)
    tree = patched_tree(pristine, commit)
    # The build folder is keyed by what forces a full rebuild (llama.cpp tree + flags); our own
    # sources are built incrementally in it, and the stamp holds the hash of everything.
    # (and by the source folder CMake is given: it refuses a build folder made from another one)
    source = mirror_sources(variant)
    # Ninja where it is on PATH (it schedules the two unity-heavy targets better than make); CMake refuses another
    # generator in a build folder, so it keys the folder
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    tree_key = hashlib.sha256(
        f"{tree.name}{json.dumps(flags, sort_keys=True)}{extra_args}{source}{generator}".encode())
    tree_key = tree_key.hexdigest()[:12]
    key = source_hash([commit, json.dumps(flags, sort_keys=True), *extra_args])
    build_dir = cache_dir() / "build" / f"{variant}-{tree_key}"
    bin_dir = build_dir / "bin"
    done = build_dir / ".kvcli-built"
    flag_text = " ".join(f"{k}={v}" for k, v in flags.items()
                         if k in ("GGML_NATIVE", "GGML_CUDA", "KVCLI_SANITIZE", "GGML_CUDA_NO_VMM",
                                  "CMAKE_CUDA_ARCHITECTURES"))
    if force or not done.exists() or done.read_text() != key:
        log(f"building llama.cpp {commit[:9]} + kvcli ({flag_text}); this takes a few minutes")
        args = ["cmake", *generator, "-S", str(source), "-B", str(build_dir),
                f"-DKVCLI_LLAMA_SRC={tree}", f"-DKVCLI_LLAMA_COMMIT={commit}",
                f"-DKVCLI_VERSION={__version__}", f"-DKVCLI_BUILD_FLAGS={flag_text}",
                f"-DCMAKE_BUILD_RPATH={rpath}", f"-DCMAKE_INSTALL_RPATH={rpath}",
                *[f"-D{k}={v}" for k, v in flags.items()], *extra_args]
        run(args)
        run(["cmake", "--build", str(build_dir), "--target", "llama", "-j", str(jobs or os.cpu_count() or 2)])
        done.write_text(key)
    else:
        log(f"reusing the cached build {build_dir.name}")
    # the bindings beside the library: into a wheel's contents (setup.py), or into this checkout's kvcli/native (an
    # editable install, ./setup.sh), which then needs no llama-cpp-python
    install_bindings(extract_bindings(sdist), package_dir or PACKAGE_DIR)
    return install(bin_dir, variant, {"commit": commit, "flags": flag_text, "key": key,
                                       "kvcli_version": __version__, "build_dir": str(build_dir)},
                   package_dir=package_dir)


def install(bin_dir: Path, variant: str, info: dict, package_dir: Path | None = None) -> Path:
    """Copy the libraries to where kvcli loads them (KVCLI_LIB_DIR overrides, for side-by-side builds).
    Into a package_dir (a wheel's contents) the soname links are copied as what the loader asks for only: a
    wheel cannot hold a link, and each link would become another copy of the library."""
    if package_dir is not None:
        dest = package_dir / "lib" / variant
    elif os.environ.get("KVCLI_LIB_DIR") and variant == "default":
        dest = Path(os.environ["KVCLI_LIB_DIR"])
    else:
        dest = LIB_ROOT / variant
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    libs = [p for p in bin_dir.iterdir() if p.name.startswith(("libllama.so", "libggml")) and ".so" in p.name]
    if not any(p.name == "libllama.so" for p in libs):
        raise BuildError(f"the build produced no libllama.so in {bin_dir}")
    linked = {p.resolve() for p in libs if p.is_symlink()}
    for p in libs:  # keep the soname symlinks as links
        if package_dir is not None:
            soname = p.is_symlink() and not (p.parent / os.readlink(p)).is_symlink()   # libggml.so.0 -> ....0.25.3
            if p.name == "libllama.so" or (soname and not p.name.startswith("libllama.so.")) or \
                    (not p.is_symlink() and p.resolve() not in linked):
                # libllama.so (llama_cpp loads it by that name) and the sonames its libraries need, as files
                shutil.copy2(p.resolve(), tmp / p.name)
        elif p.is_symlink():
            os.symlink(os.readlink(p), tmp / p.name)
        else:
            shutil.copy2(p, tmp / p.name)
    (tmp / "build_info.json").write_text(json.dumps(info, indent=2))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    log(f"installed into {dest}")
    return dest


def cmake_args_from_env(environ) -> tuple[bool, list[str]]:
    """(CUDA on?, the other CMake arguments) for `pip install`: CMAKE_ARGS read as llama-cpp-python reads it
    (CMAKE_ARGS="-DGGML_CUDA=on"), and KVCLI_CUDA=1. llama-cpp-python's own switches (LLAMA_BUILD, LLAVA_BUILD,
    MTMD_BUILD) mean nothing here and are dropped."""
    cuda = environ.get("KVCLI_CUDA") == "1"
    extra = []
    for arg in shlex.split(environ.get("CMAKE_ARGS", "")):
        m = re.fullmatch(r"-DGGML_CUDA(?::BOOL)?=(\S*)", arg, re.IGNORECASE)
        if m:
            cuda = m[1].upper() in ("ON", "1", "TRUE", "YES", "Y")
        elif not re.match(r"-D(LLAMA_BUILD|LLAVA_BUILD|MTMD_BUILD)\b", arg):
            extra.append(arg)
    return cuda, extra


def run(args: list[str]) -> None:
    r = subprocess.run(args)
    if r.returncode != 0:
        raise BuildError(f"command failed ({r.returncode}): {' '.join(args[:4])} ...")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.native.build", description=__doc__.split("\n")[0])
    ap.add_argument("--cuda", action="store_true", default=os.environ.get("KVCLI_CUDA") == "1",
                    help="build with -DGGML_CUDA=ON (also KVCLI_CUDA=1)")
    ap.add_argument("--cuda-arch", default=os.environ.get("KVCLI_CUDA_ARCH"),
                    help="CMAKE_CUDA_ARCHITECTURES for --cuda, e.g. 90 (also KVCLI_CUDA_ARCH)")
    ap.add_argument("--sanitize", action="store_true", help="address + undefined-behaviour sanitizer build")
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    ap.add_argument("--jobs", "-j", type=int, default=None)
    ap.add_argument("--fetch-sdist", action="store_true", help="only fetch the pinned sdist and print its path")
    a = ap.parse_args(argv)
    try:
        if a.fetch_sdist:
            print(fetch_sdist())
            return 0
        build(cuda=a.cuda, sanitize=a.sanitize, force=a.force, jobs=a.jobs, cuda_arch=a.cuda_arch)
    except BuildError as e:
        print(f"kvcli build: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
